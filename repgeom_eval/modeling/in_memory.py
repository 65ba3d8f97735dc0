"""Models as users hold them: a transformers model in memory (with its tokenizer), a PEFT model or a
sentence-transformers ``SentenceTransformer``, as a :class:`~repgeom_eval.modeling.loading.LoadedModel`."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.modeling.loading import LoadedModel, wrap_model
from repgeom_eval.spec.options.model import ModelOptions


def as_loaded(model: Any, tokenizer: Any = None, *, name: str | None = None, host: Any = None,
              options: ModelOptions | None = None) -> LoadedModel:
    """Whatever a user holds, as a :class:`LoadedModel`: a path, hub id or ``.gguf`` file (loaded with ``options``), a
    :class:`LoadedModel`, a transformers model in memory (with its ``tokenizer``), a PEFT model, or a
    sentence-transformers ``SentenceTransformer`` (its transformer and tokenizer; :func:`st_pooling` reads its
    pooling)."""
    if isinstance(model, LoadedModel):
        return model
    if isinstance(model, (str, os.PathLike)):
        from repgeom_eval.modeling.loading import load_model

        return load_model(str(model), host=host, options=options)
    inner = transformer_of(model)
    if inner is not None:  # a SentenceTransformer: its first module holds the transformers model and tokenizer
        hf, tok = inner
        return wrap_model(hf, tokenizer or tok, name=name or _st_name(model), source="memory", host=host)
    if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):  # a PeftModel: the adapted base model
        from repgeom_eval.modeling.adapters import adapted_base_model

        model = adapted_base_model(model, f"the {type(model).__name__} given")
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise RepgeomError(f"cannot measure a {type(model).__name__}: pass a model path or hub id, a transformers "
                           "model (with tokenizer=...), a PEFT model or a SentenceTransformer")
    if tokenizer is None:
        raise RepgeomError(f"an in-memory {type(model).__name__} needs its tokenizer: pass tokenizer=... beside it")
    if getattr(tokenizer, "pad_token", "x") is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token or tokenizer.bos_token
    return wrap_model(model, tokenizer, name=name, source="memory", host=host)


def transformer_of(model: Any) -> tuple[Any, Any] | None:
    """``(transformers model, tokenizer)`` inside a sentence-transformers ``SentenceTransformer``, else None."""
    if type(model).__name__ != "SentenceTransformer" or not hasattr(model, "_first_module"):
        return None
    first = model._first_module()
    hf = getattr(first, "auto_model", None)
    if hf is None:
        raise RepgeomError(f"the SentenceTransformer's first module ({type(first).__name__}) holds no transformers "
                           "model; only transformer-based sentence-transformers models can be measured")
    return hf, getattr(first, "tokenizer", None) or getattr(model, "tokenizer", None)


def _st_name(model: Any) -> str:
    card = getattr(model, "model_card_data", None)
    return getattr(card, "base_model", None) or getattr(model[0].auto_model.config, "_name_or_path", "") \
        or "SentenceTransformer"


def weights_hash(model: Any) -> str:
    """First 16 hex digits of a SHA-256 over a model's parameters and buffers (names, shapes, dtypes, bytes)."""
    import torch

    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]
