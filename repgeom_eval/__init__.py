"""repgeom-eval: representation-geometry metrics for language models, as a plugin harness.

Quick start::

    import repgeom_eval as rg
    result = rg.measure("path/to/model", ["first text", "second text", "third"], layers="all",
                        metrics=["dispersion", "token_dispersion"])
    result.results["final"]["dispersion"]

Everything a plugin author or a user imports is a name of this package (``__all__``, pinned by
tests/test_public_api.py); the modules behind it may move, the names here do not.
"""

__version__ = "0.2.0"

# What a plugin module imports at its top. All of it is light (no torch, no transformers: the metric API binds torch
# lazily), so that `repgeom --help` and `repgeom plugins` can import every plugin cheaply; tests/test_startup.py checks.
from .spec.hookspecs import hookimpl  # noqa: E402
from .modeling.architectures import ArchitectureSpec, post_ln_encoder, pre_ln_decoder  # noqa: E402
from .modeling.hook_point import HookPoint  # noqa: E402
from .spec.errors import (ParameterError, PluginError, RepgeomError, UnknownNameError, check_param,  # noqa: E402
                          is_count, is_real)
from .spec.metric import Consumes, LayerBatch, Metric, Statistic  # noqa: E402
from .spec.statistics import PooledGram, UnitSums  # noqa: E402
from .spec.hookspecs import Command  # noqa: E402

# Heavy pieces (torch, transformers) load on first access, so `import repgeom_eval` in a plugin stays cheap.
_LAZY = {
    "RunConfig": "repgeom_eval.spec.options.measure",
    "measure": "repgeom_eval.measurement.engine",
    "MeasureResult": "repgeom_eval.measurement.engine",
    "load_model": "repgeom_eval.modeling.loading",
    "LoadedModel": "repgeom_eval.modeling.loading",
    "ModelInfo": "repgeom_eval.modeling.loading",
    "ModelOptions": "repgeom_eval.spec.options.model",
    "get_host": "repgeom_eval.plugin_system.host",
    "PluginHost": "repgeom_eval.plugin_system.host",
    "AuxLoss": "repgeom_eval.training.auxloss",
    "build_aux_loss": "repgeom_eval.training.auxloss",
    "check_metric": "repgeom_eval.testing",
    "make_tiny_model": "repgeom_eval.testing",
    "save_tiny": "repgeom_eval.testing.tiny_models",
    "load_results": "repgeom_eval.output.results_table",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'repgeom_eval' has no attribute {name!r}")


__all__ = [
    # plugin author's API (light)
    "hookimpl", "Metric", "Statistic", "UnitSums", "PooledGram", "LayerBatch", "Consumes", "Command", "ArchitectureSpec", "HookPoint", "pre_ln_decoder",
    "post_ln_encoder", "AuxLoss", "build_aux_loss",
    # errors and parameter checks
    "RepgeomError", "ParameterError", "PluginError", "UnknownNameError", "check_param", "is_real", "is_count",
    # running
    "measure", "MeasureResult", "RunConfig", "load_model", "LoadedModel", "ModelInfo", "ModelOptions", "get_host",
    "PluginHost", "load_results",
    # testing helpers (a plugin's own tests)
    "check_metric", "make_tiny_model", "save_tiny",
    "__version__",
]
