"""Making layer encoders reachable through ``mteb.get_model(name, layer=..., pooling=...)``.

mteb 2.26 has no plugin discovery: its model registry is a dict filled from mteb's own folder at import. This module
adds entries to it (``MODEL_REGISTRY``), which is what ``mteb.get_model`` reads:

* ``repgeom/layer-encoder`` is added when :mod:`repgeom_eval.mteb_layers` is imported; it takes the model as a keyword:
  ``mteb.get_model("repgeom/layer-encoder", model="path/or/hub-id", layer=12)``.
* :func:`register_model` adds a model under its own name: after
  ``register_model("path/to/model", name="me/my-model")``, ``mteb.get_model("me/my-model", layer=12)`` works.

Either way the encoder reports the model's real name and revision, so results land in the model's own cache folder.
"""

from __future__ import annotations

from typing import Any

from mteb.models.model_implementations import MODEL_REGISTRY
from mteb.models.model_meta import ModelMeta, ScoringFunction

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.mteb_layers.encoder import GENERIC_NAME, content_hash, load_layer_encoder, model_name

def _meta(name: str, model: str | None, revision: str | None) -> ModelMeta:
    return ModelMeta(
        loader=load_layer_encoder, loader_kwargs={"model": model} if model else {}, name=name, revision=revision,
        release_date=None, languages=None, n_parameters=None, memory_usage_mb=None, max_tokens=None, embed_dim=None,
        license=None, open_weights=None, public_training_code=None, public_training_data=None,
        framework=["PyTorch", "Transformers"], similarity_fn_name=ScoringFunction.COSINE, use_instructions=False,
        training_datasets=None, modalities=["text"],
    )


def register_model(model: str, name: str | None = None, revision: str | None = None,
                   replace: bool = False) -> ModelMeta:
    """Add ``model`` (hub id, local folder or .gguf) to mteb's model registry under ``name``.

    ``name`` defaults to the hub id, or ``local/<folder>`` for a local path; ``revision`` to the content hash of a
    local path (hub ids: the commit the loaded model reports). A name mteb already knows is refused unless
    ``replace=True``, because it would change what ``mteb.get_model(name)`` loads for everyone in the process.
    """
    from pathlib import Path

    name = name or model_name(model)
    if "/" not in name:
        raise RepgeomError(f"mteb model names look like 'org/name'; got {name!r}")
    existing = MODEL_REGISTRY.get(name)
    if existing is not None and existing.loader is not load_layer_encoder and not replace:
        raise RepgeomError(f"mteb already has a model called {name!r}; pass another name (e.g. 'layers/{name}') "
                           "or replace=True")
    if revision is None and Path(model).expanduser().exists():
        revision = content_hash(Path(model).expanduser())
    meta = _meta(name, model, revision)
    MODEL_REGISTRY[name] = meta
    return meta


def register_generic() -> None:
    if GENERIC_NAME not in MODEL_REGISTRY:
        MODEL_REGISTRY[GENERIC_NAME] = _meta(GENERIC_NAME, None, None)
