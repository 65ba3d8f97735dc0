"""Tiny randomly initialised models for (nearly) any architecture transformers knows, built from its own configs.

``build_tiny("mixtral")`` takes transformers' default ``MixtralConfig``, shrinks it by generic rules (width, depth,
heads, FFN, experts, rotary, MLA, SSM, windows, per-layer lists, token ids, vocabulary, positions), counts the
parameters on the meta device and returns a float32 model in eval mode, in milliseconds once transformers and the
model's module are imported. ``forward_hidden_states(model)`` runs it on random token ids; ``save_tiny(...)`` also
writes a BPE tokenizer so the directory loads offline through ``from_pretrained``.

The rules work on the config's ``to_dict()`` (recursively, into sub-configs such as ``text_config``) and the
shrunk dict is turned back into a config by the config class itself, so its own ``__post_init__`` re-derives and
re-validates whatever depends on the sizes. Hybrid models keep one layer of each kind (attention and linear
attention or mamba, dense and MoE MLPs ...), with a few more layers where needed. Per-type fixes, for what no
generic rule can know, live in the one small table :mod:`repgeom_eval.testing.tiny_overrides`.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from repgeom_eval.testing.tiny_overrides import OVERRIDES
from repgeom_eval.testing.tiny_shrink import Override, Shrinker, Sizes, TinyBuildError, is_int, is_token_key

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["CAUSAL", "ENCODER", "MAX_PARAMS", "TinyBuildError", "build_tiny", "build_tiny_with_tokenizer",
           "causal_lm_types", "encoder_types", "forward_hidden_states", "save_tiny", "special_token_ids",
           "tiny_config"]

CAUSAL = "causal"
ENCODER = "encoder"
MAX_PARAMS = 3_000_000


# -- which types ----------------------------------------------------------------------------------------------------

def causal_lm_types() -> list[str]:
    """Model types that ``AutoModelForCausalLM`` knows (sorted)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def encoder_types() -> list[str]:
    """Text encoder types loadable by ``AutoModel`` (sorted).

    Rule: the masked-LM types plus the sequence-to-sequence types (t5, bart, ...), kept when ``AutoModel`` maps
    them and the base model class declares ``input_modalities == "text"``; this drops speech recognisers, audio
    and vision-language models whose inputs are not only token ids. Decoder-only LMs are in neither mapping.
    Imports each candidate's modeling module once (a few seconds), hence cached.
    """
    return list(_encoder_types())


@functools.cache
def _encoder_types() -> tuple[str, ...]:
    import transformers
    from transformers.models.auto import modeling_auto as auto

    out = []
    candidates = set(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES) | set(auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    for model_type in candidates:
        name = auto.MODEL_MAPPING_NAMES.get(model_type)
        if name is None:
            continue
        name = name[0] if isinstance(name, (tuple, list)) else name
        try:
            cls = getattr(transformers, name)
        except Exception:  # noqa: BLE001 - a model whose module does not import is not buildable anyway
            continue
        modalities = cls.input_modalities
        if ((modalities,) if isinstance(modalities, str) else tuple(modalities)) == ("text",):
            out.append(model_type)
    return tuple(sorted(out))


def tiny_config(model_type: str, *, n_layers: int = 2, width: int = 32, vocab_size: int = 400,
                max_positions: int = 128) -> PretrainedConfig:
    """transformers' default config of ``model_type``, shrunk: ``n_layers`` blocks (a few more where a hybrid needs
    them to keep one layer of each kind), hidden width ``width``, ``vocab_size`` tokens, ``max_positions``."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise TinyBuildError(f"unknown model type {model_type!r}")
    cls = CONFIG_MAPPING[model_type]
    sizes = Sizes(n_layers, width, vocab_size, max_positions)
    override = OVERRIDES.get(model_type, Override())
    try:
        base = cls(**(override.init or {}))
    except Exception as exc:  # noqa: BLE001
        raise TinyBuildError(f"default config does not build: {type(exc).__name__}: {exc}") from exc
    root = base.to_dict()
    shrunk = Shrinker(sizes, root, OVERRIDES).shrink(root)
    for key in ("transformers_version", "model_type", "_name_or_path"):
        shrunk.pop(key, None)
    shrunk["dtype"] = None
    try:
        return cls.from_dict(shrunk)
    except Exception as exc:  # noqa: BLE001
        raise TinyBuildError(f"config cannot be shrunk: {type(exc).__name__}: {exc}") from exc


# -- building -------------------------------------------------------------------------------------------------------

def _auto_class(kind: str):
    import transformers

    if kind == CAUSAL:
        return transformers.AutoModelForCausalLM
    if kind == ENCODER:
        return transformers.AutoModel
    raise TinyBuildError(f"kind must be {CAUSAL!r} or {ENCODER!r}, not {kind!r}")


def _missing_package(exc: BaseException) -> str | None:
    text = str(exc)
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return exc.name.split(".")[0]
    m = re.search(r"requires the (\S+) librar", text) or re.search(r"`?pip install (\S+?)`?[ .,]", text)
    return m.group(1).strip("`'\"") if m else None


def _reason(exc: BaseException) -> str:
    package = _missing_package(exc)
    if package:
        return f"needs the {package} package"
    return f"{type(exc).__name__}: {exc}"


def _prepare(config: PretrainedConfig, kind: str) -> None:
    if kind == CAUSAL and hasattr(config, "is_decoder") and not getattr(config, "is_encoder_decoder", False):
        config.is_decoder = True  # BERT-likes and reformer only predict the next token as decoders


def _model_class(config: PretrainedConfig, kind: str):
    """The class ``Auto*.from_config`` would pick, and the configs to try it with: the config itself, then the
    sub-config of the class's own config type where there is one (musicgen's causal LM is its decoder alone)."""
    auto = _auto_class(kind)
    try:
        cls = auto._model_mapping[type(config)]
    except KeyError as exc:
        raise TinyBuildError(f"{auto.__name__} does not know {type(config).__name__}") from exc
    except Exception as exc:  # noqa: BLE001 - the modeling module does not import
        raise TinyBuildError(_reason(exc)) from exc
    if isinstance(cls, (tuple, list)):  # funnel: (FunnelModel, FunnelBaseModel)
        cls = cls[0]
    configs = [config]
    wanted = getattr(cls, "config_class", None)
    if wanted is not None and not isinstance(config, wanted):
        subs = [getattr(config, k) for k in config.sub_configs if isinstance(getattr(config, k, None), wanted)]
        # like Auto*.from_config, a model class of the text sub-config gets that sub-config first
        configs = subs + configs if "text_config" in config.sub_configs and subs else configs + subs
    return cls, configs


def _instantiate(config: PretrainedConfig, kind: str):
    """``(model, config it was built from)``: float32, in eval mode, parameters counted on the meta device first."""
    cls, configs = _model_class(config, kind)
    for i, cfg in enumerate(configs):
        try:
            with torch.device("meta"):
                meta = cls._from_config(cfg)
            break
        except Exception as exc:  # noqa: BLE001
            if i == len(configs) - 1:
                raise TinyBuildError(_reason(exc)) from exc
    count = sum(p.numel() for p in meta.parameters())
    del meta
    if count > MAX_PARAMS:
        raise TinyBuildError(f"config cannot be shrunk: {count:,} parameters (> {MAX_PARAMS:,})")
    try:
        model = cls._from_config(cfg, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001
        raise TinyBuildError(_reason(exc)) from exc
    return model.float().eval(), cfg


def build_tiny(model_type: str, kind: str = CAUSAL, *, seed: int = 0, **sizes: int) -> PreTrainedModel:
    """A tiny randomly initialised ``model_type`` model (eval mode, float32): ``AutoModelForCausalLM`` for
    ``kind=CAUSAL``, ``AutoModel`` for ``kind=ENCODER``. ``sizes`` go to :func:`tiny_config`."""
    _auto_class(kind)
    config = tiny_config(model_type, **sizes)
    _prepare(config, kind)
    torch.manual_seed(seed)
    return _instantiate(config, kind)[0]


MASSIVE_DIM = 0  # the hidden dimension :func:`make_realistic` makes massive


def make_realistic(model: PreTrainedModel, seed: int = 0) -> PreTrainedModel:
    """Give a tiny random model two statistics of trained ones, where shortcuts go wrong: norm gains spread over about
    0.4–2.5 with non-zero biases (a unit-gain RMSNorm changes no cosine, so a tensor read before or after it would
    measure the same), and one *massive* hidden dimension, :data:`MASSIVE_DIM`, as SmolLM2 and most trained LMs have:
    on a quarter of the tokens (every text has some) its embedding is raised by 20, and every norm's gain there is
    30, so those tokens carry 10²–10³ times the other dimensions in the residual stream, which is what swamps a
    half-precision tolerance. Changes ``model`` in place."""
    width = model.get_input_embeddings().weight.shape[-1]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        massive_rows = torch.rand(emb.shape[0], generator=g) < 0.25
        emb[massive_rows, MASSIVE_DIM] += 20.0
        for module in model.modules():
            if not re.search(r"Norm(alization)?\d*d?$", type(module).__name__):
                continue
            weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
            if isinstance(weight, torch.Tensor) and tuple(weight.shape) == (width,):
                weight.copy_(torch.exp(0.4 * torch.randn(width, generator=g)))
                weight[MASSIVE_DIM] = 30.0
            if isinstance(bias, torch.Tensor) and tuple(bias.shape) == (width,):
                bias.copy_(0.1 * torch.randn(width, generator=g))
    return model


def special_token_ids(config: Any) -> set[int]:
    """Every ``*_token_id`` / ``*_token_index`` of the config and its sub-configs."""
    out: set[int] = set()

    def walk(d: dict) -> None:
        for key, v in d.items():
            if isinstance(v, dict):
                walk(v)
            elif is_token_key(key):
                for x in v if isinstance(v, list) else [v]:
                    if is_int(x):
                        out.add(x)

    walk(config.to_dict())
    return out


def forward_hidden_states(model: PreTrainedModel, input_ids: torch.Tensor | None = None,
                          seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Run ``model`` on token ids (random ones avoiding special ids when none are given, batch 2, length 7) and
    return its ``hidden_states``; for encoder-decoder models, those of the encoder."""
    config = model.config
    if input_ids is None:
        emb = model.get_input_embeddings()
        vocab = getattr(emb, "num_embeddings", None) or config.get_text_config().vocab_size
        special = special_token_ids(config)
        allowed = torch.tensor([i for i in range(vocab) if i not in special])
        g = torch.Generator().manual_seed(seed)
        rows = OVERRIDES.get(config.model_type, Override()).rows
        input_ids = allowed[torch.randint(len(allowed), (2 * (getattr(config, rows) if rows else 1), 7), generator=g)]
    from repgeom_eval.modeling.probe import accepted_inputs, build_inputs

    runner = model.get_encoder() if getattr(config, "is_encoder_decoder", False) else model
    # use_cache=False where the forward takes it: linear-attention hybrids need a special cache object otherwise
    kwargs: dict[str, Any] = build_inputs(input_ids.device, input_ids, torch.ones_like(input_ids),
                                          accepted=accepted_inputs(runner))
    kwargs["output_hidden_states"] = True
    with torch.no_grad():
        while True:
            try:
                out = runner(**kwargs)
                break
            except TypeError as exc:  # a keyword this model does not take: drop it (only the optional ones)
                bad = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
                if not bad or bad.group(1) != "attention_mask":
                    raise TinyBuildError(f"forward fails: {_reason(exc)}") from exc
                kwargs.pop(bad.group(1))
            except Exception as exc:  # noqa: BLE001 - e.g. assistant models that need their backbone's states
                raise TinyBuildError(f"forward fails: {_reason(exc)}") from exc
    hidden = getattr(out, "hidden_states", None)
    if hidden is None and getattr(out, "encoder_hidden_states", None) is not None:
        hidden = out.encoder_hidden_states
    if not hidden:
        raise TinyBuildError(f"{type(model).__name__} returned no hidden_states")
    # pegasus_x's last entry is (token states, global-token states)
    return tuple(h[0] if isinstance(h, (tuple, list)) else h for h in hidden)


# -- saving ---------------------------------------------------------------------------------------------------------

def _set_ids(config: Any, ids: dict[str, int]) -> None:
    """Point the standard special ids of the config (and its text sub-configs) at the tokenizer's."""
    configs = [config]
    for key in getattr(config, "sub_configs", {}):
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            configs.append(sub)
    for cfg in configs:
        for name, value in ids.items():
            if getattr(cfg, name, None) is not None or name in ("pad_token_id", "decoder_start_token_id") \
                    and hasattr(cfg, name):
                try:
                    setattr(cfg, name, value)
                except Exception:  # noqa: BLE001 - read-only property in some configs
                    pass


def build_tiny_with_tokenizer(model_type: str, kind: str = CAUSAL, *, seed: int = 0, **sizes: int):
    """``(model, tokenizer)``: a tiny model as :func:`build_tiny` builds it, but with a vocabulary covering a BPE
    tokenizer (``repgeom_eval.testing.make_tokenizer``, with [CLS]/[SEP] for ``kind=ENCODER``) plus 16 ids of
    head-room, and the config's pad/bos/eos/unk/decoder_start/cls/sep/mask ids set to the tokenizer's."""
    model, tokenizer, _ = _build_with_tokenizer(model_type, kind, seed, sizes)
    return model, tokenizer


def _config_with_tokenizer(model_type: str, kind: str, sizes: dict):
    from .tiny_tokenizer import make_tokenizer

    _auto_class(kind)
    tokenizer = make_tokenizer(encoder=(kind == ENCODER))
    # AutoTokenizer classes of some types add a token on load: leave head-room in the vocabulary
    sizes.setdefault("vocab_size", len(tokenizer) + 16)
    if sizes["vocab_size"] < len(tokenizer):
        raise TinyBuildError(f"vocab_size {sizes['vocab_size']} < the tokenizer's {len(tokenizer)} tokens")
    config = tiny_config(model_type, **sizes)
    vocab = tokenizer.get_vocab()
    pad, bos = vocab["<pad>"], vocab["<s>"]
    _set_ids(config, {"pad_token_id": pad, "bos_token_id": bos, "eos_token_id": vocab["</s>"],
                      "unk_token_id": vocab["<unk>"], "decoder_start_token_id": pad if kind == ENCODER else bos,
                      "cls_token_id": vocab["[CLS]"], "sep_token_id": vocab["[SEP]"], "mask_token_id": vocab["[MASK]"]})
    _prepare(config, kind)
    return config, tokenizer


def _build_with_tokenizer(model_type: str, kind: str, seed: int, sizes: dict):
    config, tokenizer = _config_with_tokenizer(model_type, kind, sizes)
    torch.manual_seed(seed)
    return _instantiate(config, kind)[0], tokenizer, config


def save_tiny(model_type: str, path: str | Path, kind: str = CAUSAL, *, seed: int = 0, realistic: bool = False,
              **sizes: int) -> Path:
    """Build a tiny ``model_type`` model (:func:`build_tiny_with_tokenizer`; with ``realistic``, also
    :func:`make_realistic`) and save it with its tokenizer to ``path`` (returned), loadable offline with
    ``AutoTokenizer`` and ``AutoModelForCausalLM`` (``kind=CAUSAL``) or ``AutoModel`` (``kind=ENCODER``)
    ``.from_pretrained(path)``."""
    config, tokenizer = _config_with_tokenizer(model_type, kind, sizes)
    return save_built(config, tokenizer, path, kind, seed=seed, realistic=realistic)


def save_built(config: PretrainedConfig, tokenizer: Any, path: str | Path, kind: str = CAUSAL, *, seed: int = 0,
               realistic: bool = False) -> Path:
    """The one builder of a saved tiny model: ``config``'s model (``torch.manual_seed(seed)`` then
    :func:`_instantiate`; with ``realistic``, also :func:`make_realistic`) saved with ``tokenizer`` to ``path``
    (returned). :func:`save_tiny` gives it a shrunk default config, ``repgeom_eval.testing.make_tiny_model`` one of
    its hand-written configs."""
    import transformers as tf

    torch.manual_seed(seed)
    model = _instantiate(config, kind)[0]
    if realistic:
        make_realistic(model, seed)
    path = Path(path)
    enabled = tf.utils.logging.is_progress_bar_enabled()
    tf.utils.logging.disable_progress_bar()  # no "Writing model shards" bar on stderr
    try:
        model.save_pretrained(path)
    finally:
        if enabled:
            tf.utils.logging.enable_progress_bar()
    text = getattr(config, "text_config", None)
    if model.config is not config and text is not None and type(model.config) is type(text):
        # mllama/emu3's causal LM keeps only the text sub-config, whose type the Auto classes do not map; from the
        # whole config they pick that sub-config again (musicgen's causal LM is its "decoder" sub-config, which
        # they do not: it reloads through MusicgenForCausalLM only)
        config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
