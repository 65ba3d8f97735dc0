"""The options of an MTEB layer sweep (:func:`~repgeom_eval.mteb_layers.runner.run_layers`), declared and checked
once: ``repgeom mteb run`` builds one from its flags and passes it on; from Python, give one whole or its fields as
keywords."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.spec.option_fields import Options, option, positive

POOLINGS = ("auto", "st", "mean", "last", "cls", "first")
OVERWRITE_STRATEGIES = ("only-missing", "always", "never", "only-cache")  # mteb's OverwriteStrategy values
PREPROCESS_METHODS = ("none", "center", "standardize", "whiten")


@dataclass(frozen=True, kw_only=True)
class SweepConfig(Options):
    """Every option of ``run_layers``: which layers, how a layer's vectors become an embedding, the metrics beside
    each score, and mteb's cache. ``layers`` is a layer request in the one grammar (docs/metrics.md#layer-addresses),
    ``auto`` included; the other fields are documented on :func:`~repgeom_eval.mteb_layers.runner.run_layers`."""

    layers: Any = option("final")
    pooling: str = option("auto", choices=list(POOLINGS))
    normalize: bool | None = option(None)
    max_length: int | None = option(None, check=positive)
    batch_size: int = option(32, check=positive)
    dtype: Any = option("auto")
    device: Any = option("cpu")
    output_folder: Any = option("results")
    overwrite_strategy: str = option("only-missing", choices=list(OVERWRITE_STRATEGIES))
    name: str | None = option(None)
    revision: str | None = option(None)  # the revision recorded in the results (not the one loaded)
    co2_tracker: bool = option(False)
    prediction_folder: Any = option(None)
    num_proc: int | None = option(None, check=positive)
    progress: bool = option(True)
    metrics: Any = option(None)
    metric_params: Mapping[str, Mapping[str, Any]] | None = option(None)
    seed: int = option(0)
    preprocess: str = option("none", choices=list(PREPROCESS_METHODS))
    preprocess_stats: Any = option(None)
    allow_other_stats: bool = option(False)
    layer_pick: str | None = option(None)
    layer_pick_params: Mapping[str, Any] | None = option(None)

    def __post_init__(self) -> None:
        super().__post_init__()  # choices and checks of every field
        from repgeom_eval.modeling.addresses import layer_request

        request = layer_request(self.layers)  # split and checked once; "resid_post:[0,1]" is two layers
        self._set("layers", request)
        if isinstance(self.metrics, str):
            self._set("metrics", (self.metrics,))
        if (self.layer_pick or self.layer_pick_params) and not request.auto:
            raise RepgeomError("a layer-pick rule (--layer-pick, --layer-pick-param) needs --layer auto")
        if self.preprocess == "none" and self.preprocess_stats:
            raise RepgeomError("--preprocess-stats has no effect without preprocessing; add --preprocess center, "
                               "standardize or whiten")
