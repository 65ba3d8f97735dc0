"""Per-type fixes for tiny models, where no generic shrinking rule can know the constraint, keyed by the (sub-)config's
model_type (:mod:`repgeom_eval.testing.tiny_shrink` applies them)."""

from __future__ import annotations

from repgeom_eval.testing.tiny_shrink import Override, Sizes


def _gpt_neo(d: dict, s: Sizes) -> None:
    # attention_layers is re-expanded from its run-length code attention_types when the config is loaded again
    d["attention_types"] = [[["global", "local"], max(1, d["num_layers"] // 2)]]
    d["num_layers"] = 2 * max(1, d["num_layers"] // 2)
    d.pop("attention_layers", None)


def _reformer(d: dict, s: Sizes) -> None:
    # axial position embeddings factor the sequence length and split the width
    d["axial_pos_shape"] = [8, s.positions // 8]
    d["axial_pos_embds_dim"] = [s.width // 2, s.width - s.width // 2]
    d["local_attn_chunk_length"] = d["lsh_attn_chunk_length"] = 4
    d["num_buckets"] = 2
    d["hash_seed"] = 0  # LSH draws random rotations at every forward unless seeded


def _xmod(d: dict, s: Sizes) -> None:
    # its adapters are per language: without lang_ids a forward needs a default language, which the default lacks
    d["default_language"] = d.get("default_language") or (d.get("languages") or ["en_XX"])[0]


def _dbrx(d: dict, s: Sizes) -> None:
    # the attention reads attn_config.rope_theta, which DbrxAttentionConfig no longer defines, and clamps q/k/v
    # with clip_qkv, which defaults to None
    d["attn_config"].setdefault("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    d["attn_config"]["clip_qkv"] = d["attn_config"].get("clip_qkv") or 8.0


def _dory(d: dict, s: Sizes) -> None:
    # to_dict() writes layer_types with an "mlp" entry after each block and doubled layer counts, which loading
    # halves again; input, recurrent and output layers must add up to the depth: one each
    d.update(num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1, n_output_layers=1,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def _rope_per_layer_type(d: dict, s: Sizes) -> None:
    # the default leaves rope_parameters empty although the rotary embedding is looked up per layer type
    if not d.get("rope_parameters"):
        types = d.get("layer_types") or ["full_attention"]
        d["rope_parameters"] = {t: {"rope_type": "default", "rope_theta": 10000.0} for t in set(types)}


def _zamba(d: dict, s: Sizes) -> None:
    # its one shared attention block is tied across the hybrid layers, so it needs two of them: let the config
    # derive the layer list from the shrunk period (hybrid, mamba, hybrid, mamba)
    d.pop("layers_block_type", None)


def _esm(d: dict, s: Sizes) -> None:
    # the default has no pad/mask ids although the embeddings mask padding; ESM's own vocabulary order
    d["pad_token_id"] = 1 if d.get("pad_token_id") is None else d["pad_token_id"]
    d["mask_token_id"] = 32 if d.get("mask_token_id") is None else d["mask_token_id"]


def _lfm2_moe(d: dict, s: Sizes) -> None:
    # the default has no layer_types at all; alternate short-convolution and attention blocks
    if d.get("layer_types") is None:
        d["layer_types"] = ["conv" if i % 2 == 0 else "full_attention" for i in range(d["num_hidden_layers"])]


def _qwen4_exp_text(d: dict, s: Sizes) -> None:
    # "indexed_attention" layers need the token indexer the default leaves unset
    if "indexed_attention" in (d.get("layer_types") or []) and d.get("indexer_n_heads") is None:
        d.update(indexer_n_heads=s.heads, indexer_kv_heads=1, indexer_head_dim=s.head_dim, indexer_budget=4,
                 indexer_compress_ratio=2)


OVERRIDES: dict[str, Override] = {
    "gpt_neo": Override(fix=_gpt_neo),
    "reformer": Override(fix=_reformer),
    "xmod": Override(fix=_xmod),
    "dbrx": Override(fix=_dbrx),
    "dory": Override(fix=_dory),
    "cohere_compass_text": Override(fix=_rope_per_layer_type),
    "lfm2_moe": Override(fix=_lfm2_moe),
    "esm": Override(fix=_esm),
    "qwen4_exp_text": Override(fix=_qwen4_exp_text),
    "zamba": Override(min_layers=4, fix=_zamba),
    "musicgen_decoder": Override(rows="num_codebooks"),
    "musicgen_melody_decoder": Override(rows="num_codebooks"),
    # the default fails its own check (an assistant has no per-layer inputs)
    "gemma4_assistant": Override(init={"text_config": {"hidden_size_per_layer_input": 0,
                                                        "vocab_size_per_layer_input": 0}}),
}
