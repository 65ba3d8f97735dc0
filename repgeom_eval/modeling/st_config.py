"""What a sentence-transformers model folder says about turning token vectors into one embedding.

A sentence-transformers (ST) model is a Hugging Face model plus a few small JSON files: ``modules.json`` (the module
chain, e.g. Transformer → Pooling → Normalize), the Pooling module's ``config.json``, ``sentence_bert_config.json``
(``max_seq_length``, ``do_lower_case``) and ``config_sentence_transformers.json`` (prompts). Reading them lets the layer
encoder reproduce the model's own recipe at any layer without loading sentence-transformers itself.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from repgeom_eval.spec.errors import RepgeomError

#: ST pooling modes this project reproduces, and the repgeom pooling each one is.
ST_POOLINGS = {"mean": "mean", "cls": "first", "lasttoken": "last"}
_LEGACY_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


@dataclass
class STConfig:
    """The parts of an ST model folder that decide its embeddings."""

    pooling: str  # repgeom pooling name: mean, first or last
    normalize: bool  # a Normalize module follows the pooling
    max_seq_length: int | None
    lowercase: bool
    transformer_path: str  # sub-folder holding the Hugging Face model ("" = the folder itself)
    prompts: dict[str, str] = field(default_factory=dict)
    skipped_modules: list[str] = field(default_factory=list)  # e.g. Dense: not applied to intermediate layers


def _read_json(read, name: str) -> Any:
    text = read(name)
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise RepgeomError(f"sentence-transformers file {name!r} is not valid JSON: {exc}") from None


def _pooling_mode(cfg: dict[str, Any]) -> str:
    mode = cfg.get("pooling_mode")
    if mode is None:
        active = [m for key, m in _LEGACY_KEYS.items() if cfg.get(key)]
        mode = active[0] if len(active) == 1 else active
    if isinstance(mode, list):
        mode = mode[0] if len(mode) == 1 else "+".join(mode)
    return str(mode)


def read_st_config(read) -> STConfig | None:
    """Parse an ST model through ``read(relative_path) -> str | None``; ``None`` if it is not an ST model."""
    modules = _read_json(read, "modules.json")
    if not modules:
        return None
    transformer_path, pooling_path, normalize, skipped = None, None, False, []
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer" and transformer_path is None:
            transformer_path = module.get("path", "")
        elif kind == "Pooling" and pooling_path is None:
            pooling_path = module.get("path", "")
        elif kind == "Normalize":
            normalize = True
        else:
            skipped.append(kind)
    if transformer_path is None or pooling_path is None:
        return None  # not a plain Transformer + Pooling chain (e.g. a CLIP model): treat as a Hugging Face model
    pool_cfg = _read_json(read, f"{pooling_path}/config.json" if pooling_path else "config.json") or {}
    mode = _pooling_mode(pool_cfg)
    if mode not in ST_POOLINGS:
        raise RepgeomError(
            f"this sentence-transformers model pools with {mode!r}, which the layer encoder does not reproduce "
            f"(supported: {', '.join(ST_POOLINGS)}); choose --pooling mean, last or cls")
    if pool_cfg.get("include_prompt") is False:
        warnings.warn("the model's Pooling excludes prompt tokens (include_prompt=false); the layer encoder pools "
                      "over every token, prompt included", stacklevel=3)
    prefix = f"{transformer_path}/" if transformer_path else ""
    sbert = _read_json(read, f"{prefix}sentence_bert_config.json") or {}
    st_cfg = _read_json(read, "config_sentence_transformers.json") or {}
    prompts = {k: v for k, v in (st_cfg.get("prompts") or {}).items() if v}
    return STConfig(pooling=ST_POOLINGS[mode], normalize=normalize, max_seq_length=sbert.get("max_seq_length"),
                    lowercase=bool(sbert.get("do_lower_case", False)), transformer_path=transformer_path,
                    prompts=prompts, skipped_modules=skipped)


def st_config_for(model: str) -> STConfig | None:
    """The ST recipe of a local folder or a Hugging Face Hub id (from the local Hub cache when offline)."""
    path = Path(model).expanduser()
    if path.is_dir():
        def read(name: str) -> str | None:
            f = path / name
            return f.read_text(encoding="utf-8") if f.is_file() else None
    elif path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        return None  # a .gguf file, or a path that load_model will report
    else:
        def read(name: str) -> str | None:
            from huggingface_hub import hf_hub_download

            try:
                return Path(hf_hub_download(model, name)).read_text(encoding="utf-8")
            except Exception:  # noqa: BLE001 - missing file, offline, gated: all mean "not available"
                return None
    return read_st_config(read)


def st_config_of(model: Any) -> STConfig | None:
    """The recipe of a ``SentenceTransformer`` object in memory (None for anything else): its Pooling module's mode,
    a Normalize module, ``max_seq_length``, lower-casing and prompts, as :func:`read_st_config` reads them from a
    folder."""
    if type(model).__name__ != "SentenceTransformer":
        return None
    modules = list(model)
    kinds = [type(m).__name__ for m in modules]
    if "Pooling" not in kinds or not kinds or kinds[0] != "Transformer":
        return None
    pooling = modules[kinds.index("Pooling")]
    mode = _pooling_mode(pooling.get_config_dict())
    if mode not in ST_POOLINGS:
        raise RepgeomError(f"this SentenceTransformer pools with {mode!r}, which the layer encoder does not reproduce "
                           f"(supported: {', '.join(ST_POOLINGS)}); choose pooling mean, last or cls")
    first = modules[0]
    return STConfig(pooling=ST_POOLINGS[mode], normalize="Normalize" in kinds,
                    max_seq_length=getattr(model, "max_seq_length", None),
                    lowercase=bool(getattr(first, "do_lower_case", False)), transformer_path="",
                    prompts={k: v for k, v in (getattr(model, "prompts", None) or {}).items() if v},
                    skipped_modules=[k for k in kinds[1:] if k not in ("Pooling", "Normalize")])
