"""MTEB at any layer: an mteb encoder per layer address, layer sweeps from one forward pass, geometry next to the
scores (and any registered metric: ``run_layers(..., metrics=[...])``), local tasks from JSONL, and per-layer
summaries built from mteb's cache.

Python use::

    import mteb
    from repgeom_eval.mteb_layers import layer_encoder, make_task, run_layers

    encoder = layer_encoder("path/to/model", layer=3, pooling="mean")        # an mteb AbsEncoder
    mteb.evaluate(encoder, [make_task({...})], cache=mteb.ResultCache("results"))

    # or through mteb's registry (importing this package registers "repgeom/layer-encoder"):
    encoder = mteb.get_model("repgeom/layer-encoder", model="path/to/model", layer=3)

Importing this package imports mteb (a few seconds), adds "repgeom/layer-encoder" to mteb's model registry and wraps
the ``evaluate`` method of mteb's task classes so that a layer encoder's results carry the ``repgeom_*`` geometry
(:func:`install_geometry_hook`; other models are untouched). Each layer and embedding recipe is its own mteb model
name (``org/model@layer=...,pooling=...,normalize=...``), in every mteb cache and results table.
"""

from .embedder import POOLING_CHOICES, LayerEmbedder
from .encoder import LayerEncoder, LayerSweep, content_hash, layer_encoder
from .geometry import attach_geometry, geometry_scores, install_geometry_hook
from repgeom_eval.mteb_layers.encoder import GENERIC_NAME, load_layer_encoder
from repgeom_eval.mteb_layers.model_meta import register_generic, register_model
from .metrics import SweepMetrics
from .runner import SweepResult, resolve_tasks, run_layers
from repgeom_eval.spec.options.mteb import SweepConfig
from .summary import summarize, write_summary
from .tasks import load_tasks_file, make_task

register_generic()
install_geometry_hook()  # plain mteb.evaluate / mteb.MTEB(...).run of a layer encoder get the repgeom_* keys too

__all__ = [
    "GENERIC_NAME", "POOLING_CHOICES", "LayerEmbedder", "LayerEncoder", "LayerSweep", "SweepConfig", "SweepMetrics", "SweepResult",
    "attach_geometry", "content_hash", "geometry_scores", "install_geometry_hook", "layer_encoder", "load_layer_encoder", "load_tasks_file",
    "make_task", "register_generic", "register_model", "resolve_tasks", "run_layers", "summarize", "write_summary",
]
