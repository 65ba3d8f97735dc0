"""repgeom-eval: representation-geometry metrics for language models, as a plugin harness.

Quick start::

    import repgeom_eval as rg
    result = rg.measure("path/to/model", ["first text", "second text", "third"], layers="all",
                        metrics=["dispersion", "token_dispersion"])
    result.results["final"]["dispersion"]
"""

__version__ = "0.1.0"

# What a plugin module imports at its top. All of it is light (no torch, no transformers: the metric API binds torch
# lazily), so that `repgeom --help` and `repgeom plugins` can import every plugin cheaply; tests/test_startup.py checks.
from .hookspecs import hookimpl  # noqa: E402
from .modeling.architectures import ArchitectureSpec, SiteHook, post_ln_encoder, pre_ln_decoder  # noqa: E402
from .errors import ParameterError, PluginError, RepgeomError, UnknownNameError  # noqa: E402
from .metric import Consumes, LayerBatch, Metric  # noqa: E402
from .plugin_system.kinds import Command  # noqa: E402


def __getattr__(name: str):
    # Heavy pieces (torch, transformers) load on first access, so `import repgeom_eval` in a plugin stays cheap.
    if name == "RunConfig":
        from .measurement.config import RunConfig

        return RunConfig
    if name in {"measure", "MeasureResult"}:
        from .measurement import engine as _m

        return getattr(_m, name)
    if name in {"load_model", "LoadedModel", "ModelInfo"}:
        from .modeling import loading as _models

        return getattr(_models, name)
    if name in {"get_host", "PluginHost"}:
        from .plugin_system import host

        return getattr(host, name)
    raise AttributeError(f"module 'repgeom_eval' has no attribute {name!r}")


__all__ = [
    "ArchitectureSpec", "Command", "Consumes", "LayerBatch", "Metric", "ParameterError", "PluginError",
    "RepgeomError", "SiteHook",
    "UnknownNameError", "hookimpl", "measure", "MeasureResult", "RunConfig", "load_model", "LoadedModel", "ModelInfo",
    "get_host", "PluginHost", "post_ln_encoder", "pre_ln_decoder", "__version__",
]
