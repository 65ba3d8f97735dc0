"""Shrinking transformers' default configs to tiny size by generic rules (width, depth, heads, FFN, experts, rotary,
MLA, SSM, windows, per-layer lists, token ids, vocabulary, positions), recursively into sub-configs; hybrid models
keep one layer of each kind. Used by :mod:`repgeom_eval.testing.tiny_models`; per-type fixes are in
:mod:`repgeom_eval.testing.tiny_overrides`."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

_MAX_MIX = 4  # at most this many layers are added to keep every kind of layer of a hybrid model


class TinyBuildError(Exception):
    """A model type that cannot be built tiny here; ``str(exc)`` is a one-line reason."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split())[:300])


# -- the shrinking rules --------------------------------------------------------------------------------------------

def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Fields are matched by exact name. Width- and depth-like fields of every config family we know of:
_WIDTH = _names("""hidden_size n_embd n_embed d_model dim embed_dim word_embed_proj_dim embedding_size emb_dim
    embedding_dim lru_width true_hidden_size hidden_size_global input_embedding_size output_embedding_size
    pooler_hidden_size d_latents""")
_DEPTH = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "num_decoder_layers",
          "encoder_layers", "num_encoder_layers", "num_blocks", "conf_num_hidden_layers", "speech_encoder_layers",
          "t2u_encoder_layers", "t2u_decoder_layers", "num_layers_per_stack")
_FFN = _names("""intermediate_size ffn_dim d_ff n_inner encoder_ffn_dim decoder_ffn_dim ffn_hidden_size
    feed_forward_size dim_ff dff d_inner intermediate_size_mlp dense_intermediate_size mlp_dim
    prefix_dense_intermediate_size speech_encoder_intermediate_size t2u_encoder_ffn_dim t2u_decoder_ffn_dim""")
_EXPERT_FFN = _names("""moe_intermediate_size shared_expert_intermediate_size moe_shared_expert_intermediate_size
    shared_experts_intermediate_size shared_intermediate_size expert_ffn_hidden_size""")
_HEADS = _names("""num_attention_heads n_head n_heads num_heads encoder_attention_heads decoder_attention_heads
    attention_heads num_attention_heads_per_layer swa_num_attention_heads conf_num_attention_heads
    num_cross_attention_heads num_self_attention_heads num_decoder_attention_heads num_encoder_attention_heads
    index_n_heads indexer_n_heads linear_num_heads linear_num_value_heads speech_encoder_attention_heads
    t2u_encoder_attention_heads t2u_decoder_attention_heads""")
# key/value heads and the heads count they divide
_KV_HEADS = {"num_key_value_heads": None, "num_kv_heads": None, "kv_n_heads": None, "num_query_groups": None,
             "swa_num_key_value_heads": "swa_num_attention_heads", "linear_num_key_heads": "linear_num_value_heads",
             "indexer_kv_heads": "indexer_n_heads"}
_HEAD_DIM = _names("""head_dim d_kv d_head kv_channels attention_head_size attention_head_dim v_head_dim
    linear_key_head_dim linear_value_head_dim linear_head_dim swa_head_dim index_head_dim indexer_head_dim dim_head
    global_head_dim""")
_EXPERTS = _names("num_experts num_local_experts n_routed_experts moe_num_experts")
_TOP_K = _names("""num_experts_per_tok num_experts_per_token moe_k moe_top_k moe_topk top_k_experts""")
_SHARED_EXPERTS = _names("n_shared_experts num_shared_experts moe_num_shared_experts zero_expert_num")
_EXPERT_GROUPS = _names("n_group num_expert_group")
_STATE = _names("state_size ssm_state_size mamba_d_state d_state")
_CONV = _names("""conv_kernel mamba_d_conv conv_L_cache linear_conv_kernel_dim short_conv_kernel_size conv1d_width
    ple_conv_kernel_size""")
_SSM_GROUPS = _names("n_groups mamba_n_groups mamba_ngroups")
_SSM_HEAD_DIM = _names("mamba_head_dim mamba_headdim mamba_d_head")
_SSM_HEADS = _names("mamba_n_heads mamba_num_heads n_mamba_heads")
_WINDOWS = _names("""sliding_window sliding_window_size attention_window attention_window_size window_size
    local_attention_window_len attention_chunk_size local_attn_chunk_length lsh_attn_chunk_length block_size""")
_POSITIONS = _names("""max_position_embeddings n_positions n_ctx max_seq_len max_source_positions max_target_positions
    max_encoder_position_embeddings max_decoder_position_embeddings max_2d_position_embeddings max_pos_emb
    context_length seq_length max_sequence_length t2u_max_position_embeddings""")
_ID_NAMES = _names("pad_index unk_index mask_index bos_index eos_index")
# "every k-th layer" fields and the "from layer k on" fields that go with them
_PERIODS = _names("""attn_layer_period expert_layer_period sliding_window_pattern global_attn_every_n_layers
    moe_layer_interval no_rope_layer_interval cross_attention_frequency decoder_sparse_step encoder_sparse_step
    interleave_moe_layer_step layer_group_size""")
_FIRST_K = _names("""attn_layer_offset expert_layer_offset first_k_dense_replace moe_layer_start_index
    num_dense_layers max_window_layers num_kv_shared_layers""")
# counts that only need to stay small: each capped (the sets are disjoint)
_CAPS = ((_EXPERTS, 4), (_TOP_K, 2), (_SHARED_EXPERTS, 1), (_EXPERT_GROUPS, 2), (frozenset({"topk_group"}), 1),
         (_STATE, 8), (_CONV, 4), (_SSM_HEAD_DIM, 8), (_PERIODS, 2))
# lists whose length may equal the depth by chance but that are no per-layer lists
_NOT_PER_LAYER = _names("""time_step_limit eos_token_id begin_suppress_tokens suppress_tokens label_names langs
    languages upsampling_ratios target_bandwidths axial_pos_shape axial_pos_embds_dim""")
_SIZE_NAME = re.compile(r"size|dim|hidden|channel|width")
_NOT_SIZE = re.compile(r"image|patch|crop|chunk|window|kernel|stride|vocab|position|max_|sampl|seq|length|bucket"
                       r"|frame|codebook|rate|scale|merge|token|spatial|temporal|mel|cache")
_SKIP = _names("id2label label2id architectures transformers_version model_type _name_or_path")


class Sizes:
    def __init__(self, n_layers: int, width: int, vocab_size: int, max_positions: int):
        if min(n_layers, width, vocab_size, max_positions) < 1:
            raise TinyBuildError("sizes must be positive")
        self.n_layers, self.width, self.vocab, self.positions = n_layers, width, vocab_size, max_positions
        self.heads = 4 if width % 4 == 0 and width >= 16 else 2 if width % 2 == 0 else 1
        self.head_dim = width // self.heads


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_token_key(key: Any) -> bool:
    return isinstance(key, str) and (key.endswith(("_token_id", "_token_ids", "_token_index")) or key in _ID_NAMES)


def _depth_of(d: dict) -> tuple[str | None, int | None]:
    for key in _DEPTH:
        if is_int(d.get(key)) and d[key] > 0:
            return key, d[key]
    # nemotron_h-like configs derive the depth from their block-type list
    for key in ("layers_block_type", "layer_types", "block_types"):
        if isinstance(d.get(key), list) and d[key]:
            return None, len(d[key])
    return None, None


def _is_index_list(key: str, v: Any, depth: int) -> bool:
    """Sorted unique layer indices such as ``full_attn_idxs`` or ``cross_attention_layers``."""
    return (isinstance(v, list) and bool(v) and all(is_int(i) and 0 <= i < depth for i in v)
            and all(a < b for a, b in zip(v, v[1:]))
            and re.search(r"layers|idx|ids|index|indices|indexes", key) is not None)


def _is_per_layer(key: str, v: Any, depth: int) -> bool:
    return isinstance(v, list) and len(v) == depth and depth > 1 and key not in _NOT_PER_LAYER


def _per_layer_dict(key: str, v: Any) -> bool:
    """``per_layer_config``-like: a mapping from layer index (int or digit string) to overrides."""
    return (isinstance(v, dict) and bool(v) and "layer" in key
            and all(str(k).isdigit() for k in v))


def _freeze(v: Any) -> Any:
    if isinstance(v, dict):
        return tuple(sorted((str(k), _freeze(x)) for k, x in v.items()))
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    return v


def _choose_layers(d: dict, depth: int, want: int) -> list[int]:
    """Which original layers the tiny model keeps: the first ``want``, then, for every other kind of layer (by its
    entries in all per-layer lists, index lists and per-layer configs), one layer of that kind in place of a
    repeated kind, adding layers up to ``_MAX_MIX`` more when needed. Keeps hybrid models hybrid."""
    def signature(j: int) -> tuple:
        sig = []
        for key, v in sorted(d.items()):
            if key in _SKIP:
                continue
            if _is_index_list(key, v, depth):
                sig.append((key, j in v))
            elif _is_per_layer(key, v, depth):
                sig.append((key, _freeze(v[j])))
            elif _per_layer_dict(key, v):
                sig.append((key, _freeze([x for k, x in v.items() if int(k) == j])))
        return tuple(sig)

    sigs = [signature(j) for j in range(depth)]
    kinds: dict[tuple, int] = {}
    for j, s in enumerate(sigs):
        kinds.setdefault(s, j)
    n = min(depth, max(want, min(len(kinds), want + _MAX_MIX)))
    chosen = list(range(n))
    missing = [j for s, j in kinds.items() if s not in {sigs[i] for i in chosen}]
    for j in missing:
        seen: dict[tuple, int] = {}
        for pos, i in enumerate(chosen):
            seen[sigs[i]] = seen.get(sigs[i], 0) + 1
        # replace the last layer whose kind is represented more than once
        for pos in range(len(chosen) - 1, -1, -1):
            if seen[sigs[chosen[pos]]] > 1:
                chosen[pos] = j
                break
        else:
            break
    return sorted(chosen)


class Override(NamedTuple):
    init: dict | None = None  # keyword arguments for the default config (when it does not build as it is)
    min_layers: int = 0  # at least this many layers
    fix: Callable[[dict, Sizes], None] | None = None  # edits the shrunk dict of this (sub-)config type
    rows: str | None = None  # config field: input_ids rows per text (one per audio codebook for musicgen)


_UNSET = object()


class Shrinker:
    """Shrinks a config dict (recursively into sub-configs) by the rules above and the per-type ``overrides``."""

    def __init__(self, sizes: Sizes, root: dict, overrides: dict[str, "Override"]):
        self.s = sizes
        self.overrides = overrides
        self.id_map: dict[int, int] = {}
        # widths anywhere in the tree, for fields that must equal another part's width (projectors, adapters)
        self.global_widths: set[int] = set()
        self.kept_ids: set[int] = set()  # token ids already inside the new vocabulary

        def walk(d: dict) -> None:
            for key, v in d.items():
                if isinstance(v, dict):
                    walk(v)
                elif key in _WIDTH and is_int(v):
                    self.global_widths.add(v)
                elif is_token_key(key):
                    self.kept_ids.update(x for x in (v if isinstance(v, list) else [v])
                                         if is_int(x) and 0 <= x < sizes.vocab)

        walk(root)

    def token_id(self, v: Any) -> Any:
        """Token ids beyond the vocabulary go to its top, distinct ids to distinct free slots (they stay distinct
        from each other and from the ids that were already inside)."""
        if isinstance(v, list):
            return [self.token_id(x) for x in v]
        if not is_int(v) or 0 <= v < self.s.vocab or v < 0:
            return v
        if v not in self.id_map:
            taken = self.kept_ids | set(self.id_map.values())
            self.id_map[v] = next((i for i in range(self.s.vocab - 1, -1, -1) if i not in taken), self.s.vocab - 1)
        return self.id_map[v]

    def shrink(self, d: dict, parents: tuple[dict, ...] = ()) -> dict:
        s = self.s
        orig = dict(d)
        ctx: dict = {}
        for p in (*parents, orig):  # nested plain dicts (dbrx attn_config) read their parent's sizes
            ctx.update(p)
        override = self.overrides.get(orig.get("model_type") or "", Override())
        depth_key, depth = _depth_of(orig)
        want = max(s.n_layers, override.min_layers)
        chosen = _choose_layers(orig, depth, want) if depth else []
        out: dict = {}
        for key, v in orig.items():
            out[key] = self.resolve(key, v, orig, ctx, parents, depth, chosen)
        if depth:
            for key in _DEPTH:
                if is_int(orig.get(key)) and orig[key] > 0:
                    out[key] = len(chosen) if key == depth_key else min(orig[key], want)
        self.fill_missing(out, orig)
        self.consistency(out, orig, depth, chosen)
        if override.fix is not None:
            override.fix(out, s)
        return out

    def resolve(self, key: str, v: Any, orig: dict, ctx: dict, parents: tuple[dict, ...], depth: int | None,
                chosen: list[int]) -> Any:
        new = self.value(key, v, orig, ctx, parents, depth, chosen)
        return self.fallback(key, v, orig) if new is _UNSET else new

    def value(self, key: str, v: Any, orig: dict, ctx: dict, parents: tuple[dict, ...], depth: int | None,
              chosen: list[int]) -> Any:
        """The shrunk value of field ``key``, or ``_UNSET`` when no rule names it."""
        s = self.s
        if key in _SKIP or v is None or isinstance(v, (bool, float, str)):
            return v
        if isinstance(v, dict):
            if depth and _per_layer_dict(key, v):
                pad = len(next(iter(v))) if all(isinstance(k, str) for k in v) else 0
                return {(str(i).zfill(pad) if pad else i): self.layer_override(dict(v[k]), orig, parents)
                        for i, j in enumerate(chosen) for k in v if int(k) == j}
            if key == "rope_parameters" or key.endswith("rope_scaling"):
                return self.rope(v)
            return self.shrink(v, (*parents, orig))
        if isinstance(v, list):
            if depth and _is_index_list(key, v, depth):
                return [i for i, j in enumerate(chosen) if j in v]
            if depth and _is_per_layer(key, v, depth):
                return [self.resolve(key, v[j], orig, ctx, parents, None, []) for j in chosen]
            if key.endswith(("token_id", "token_ids")):
                return self.token_id(v)
            if key in ("block_sizes", "block_repeats", "depths"):  # layers per stage (funnel, vision stages)
                return [min(x, 1) if is_int(x) else x for x in v]
            if v and all(is_int(x) for x in v) and (key in _FFN or key in _WIDTH or key in _HEADS):
                return [self.resolve(key, x, orig, ctx, parents, None, []) for x in v]
            return v
        if not is_int(v):
            return v
        # -- integers, by name
        if is_token_key(key):
            return self.token_id(v)
        if key == "vocab_size":  # exactly: a tokenizer of that size must fit (blt has 260 byte ids, reformer 320)
            return s.vocab
        if "vocab" in key and "type_vocab" not in key and key != "make_ngram_vocab_size_divisible_by":
            return min(v, s.vocab)
        if key in _WIDTH:
            return s.width
        if key in _FFN:
            return 2 * s.width
        if key in _EXPERT_FFN:
            return s.width
        if key in _HEADS:
            return min(v, s.heads)
        if key in _KV_HEADS:
            of = _KV_HEADS[key]
            h0 = ctx.get(of) if of else next((ctx[k] for k in ("num_attention_heads", "n_head", "n_heads",
                                                                 "num_heads", "encoder_attention_heads")
                                               if is_int(ctx.get(k))), None)
            h = min(h0, s.heads) if is_int(h0) else s.heads
            if not is_int(h0) or v >= h0:
                return h
            return max(1, h // max(1, h0 // max(v, 1)))  # keep grouped-query attention grouped
        if key in _HEAD_DIM:
            return s.head_dim
        if key in ("qk_rope_head_dim", "qk_nope_head_dim"):
            return s.head_dim // 2
        if key == "qk_head_dim":
            return s.head_dim
        if key == "rotary_dim":
            return max(2, s.head_dim // 2)
        if key in ("time_step_rank", "mamba_dt_rank"):
            return max(1, math.ceil(s.width / 16))
        if key.endswith("_rank") or key == "hc_lowrank":
            return min(v, 16)
        cap = next((c for names, c in _CAPS if key in names), None)
        if cap is not None:
            return min(v, cap)
        if key in _SSM_GROUPS:
            return 1
        if key in _WINDOWS:
            return min(v, 4) if v > 0 else v
        if key in _POSITIONS:
            return min(v, s.positions)
        if key.endswith("_offset") and is_int(orig.get(key[:-len("offset")] + "period")):
            return v % min(orig[key[:-len("offset")] + "period"], 2)  # the same phase of the shrunk period
        if key in _FIRST_K:
            return min(v, max(0, len(chosen) - 1)) if chosen else min(v, 1)
        if key.endswith("_layers") and key.startswith(("num_", "n_")):  # num_global_layers, num_mtp_layers ...
            return min(v, 1)
        return _UNSET

    def layer_override(self, d: dict, base: dict, parents: tuple[dict, ...]) -> dict:
        """One layer's entry of a per_layer_config: a multiple (or fraction) of the base value stays that multiple
        of the shrunk base value, so layers that differ still differ (gemma4's wider full-attention heads)."""
        out = self.shrink(d, (*parents, base))
        shrunk_base = self.shrink({k: base[k] for k in d if k in base}, parents)
        for key, v in d.items():
            b, nb = base.get(key), shrunk_base.get(key)
            if not (is_int(v) and is_int(b) and is_int(nb)) or v == b or min(v, b, nb) <= 0:
                continue
            if v % b == 0:
                out[key] = nb * (v // b)
            elif b % v == 0:
                out[key] = max(1, nb // (b // v))
        return out

    def fallback(self, key: str, v: Any, orig: dict) -> Any:
        """A size-like integer no rule names: it follows the width when it equals (a small multiple of) a width of
        its config or any width in the tree, and the FFN size when it equals this config's FFN size."""
        if not is_int(v) or v < 16 or not _SIZE_NAME.search(key) or _NOT_SIZE.search(key):
            return v
        widths = [orig[k] for k in _WIDTH if is_int(orig.get(k)) and orig[k] > 0]
        if v in widths or v in self.global_widths:
            return self.s.width
        if any(is_int(orig.get(k)) and orig[k] == v for k in _FFN):
            return 2 * self.s.width
        for w in widths:
            if v % w == 0 and v // w <= 8:
                return v // w * self.s.width
        return v

    def fill_missing(self, out: dict, orig: dict) -> None:
        """Some default configs leave sizes at None that their model needs (derived values, in effect)."""
        s = self.s
        heads_key = next((k for k in ("num_attention_heads", "n_head", "n_heads", "num_heads") if k in out), None)
        if heads_key and is_int(out[heads_key]):
            if "head_dim" in out and out["head_dim"] is None:
                out["head_dim"] = s.width // out[heads_key]
            if "num_key_value_heads" in out and out["num_key_value_heads"] is None:
                out["num_key_value_heads"] = out[heads_key]
        if "vocab_size" in out and out["vocab_size"] is None:
            out["vocab_size"] = s.vocab
        moe = any(orig.get(k) is not None for k in _EXPERT_FFN | _EXPERTS)
        if moe:
            for names, value in ((_EXPERTS, 4), (_TOP_K, 2), (_SHARED_EXPERTS - {"zero_expert_num"}, 1)):
                for k in names:
                    if k in out and out[k] is None:
                        out[k] = value

    def rope(self, v: dict) -> dict:
        out = {}
        for key, x in v.items():
            if isinstance(x, dict):
                out[key] = self.rope(x)
            elif key == "mrope_section" and isinstance(x, list) and x:
                # the sections split head_dim / 2 rotary frequencies; keep their proportions
                half, total = self.s.head_dim // 2, sum(x)
                sec = [max(1, round(i * half / total)) for i in x]
                sec[0] += half - sum(sec)
                out[key] = sec
            elif key == "original_max_position_embeddings" and is_int(x):
                out[key] = min(x, self.s.positions)
            else:
                out[key] = x
        return out

    def consistency(self, out: dict, orig: dict, depth: int | None, chosen: list[int]) -> None:
        s = self.s
        heads = [k for k in _HEADS if is_int(orig.get(k)) and orig[k] > 0 and is_int(out.get(k))]
        sizes = [k for k in orig if is_int(orig.get(k)) and is_int(out.get(k)) and k not in _HEAD_DIM
                 and (k in _WIDTH or _SIZE_NAME.search(k) and not _NOT_SIZE.search(k)) and out[k] != orig[k]]
        # a head size that was (some width) / (some head count) stays so: zamba's attention_head_dim, kv_channels
        for key in _HEAD_DIM:
            v = orig.get(key)
            if not is_int(v) or v <= 0:
                continue
            for w in sizes:
                h = next((h for h in heads if orig[w] == v * orig[h] and out[w] % out[h] == 0), None)
                if h is not None:
                    out[key] = out[w] // out[h]
                    break
        # MLA: the rotary head size is the model's head_dim where they were equal, and the query/key head is the
        # no-rope part plus the rotary part
        if is_int(orig.get("qk_rope_head_dim")):
            if orig.get("head_dim") == orig["qk_rope_head_dim"]:
                out["head_dim"] = out["qk_rope_head_dim"]
            if is_int(out.get("qk_nope_head_dim")) and "qk_head_dim" in out:
                out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
        # Mamba-2 style blocks: heads x head_dim == expand x hidden (or the explicit d_ssm)
        expand = next((orig[k] for k in ("mamba_expand", "expand") if is_int(orig.get(k))), None)
        if expand is not None:
            inner = expand * s.width
            if is_int(orig.get("mamba_d_ssm")):
                out["mamba_d_ssm"] = inner
            hd_key = next((k for k in _SSM_HEAD_DIM if k in orig), None)
            h_key = next((k for k in _SSM_HEADS if k in orig), None)
            if hd_key is None and h_key is None and "num_heads" in orig and "head_dim" in orig \
                    and "num_attention_heads" not in orig:  # mamba2 names them plainly
                hd_key, h_key = "head_dim", "num_heads"
            if hd_key and h_key and is_int(orig.get(h_key)):
                out[hd_key] = min(8, inner)
                out[h_key] = inner // out[hd_key]
        # layers that reuse the KV cache of earlier ones (gemma3n): the same share of the (new) depth, leaving
        # at least two producing layers
        v, d0 = orig.get("num_kv_shared_layers"), depth
        if is_int(v) and d0 and v > 0:
            n = len(chosen)
            out["num_kv_shared_layers"] = n if v >= d0 else max(0, min(round(v * n / d0), n - 2))
