"""The metrics a run asked for: looked up in the plugin host, parameters checked, pooling chosen."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from repgeom_eval.errors import RepgeomError
from repgeom_eval.measurement.pooling import check_pooling
from repgeom_eval.metric import Consumes, Metric
from repgeom_eval.plugin_system.host import PluginHost


@dataclass
class MetricSpec:
    """A requested metric: its class, constructor arguments and the pooling it reads (None for token metrics)."""

    name: str
    cls: type[Metric]
    kwargs: dict[str, Any]
    pooling: str | None

    def new(self) -> Metric:
        """A fresh metric state."""
        return self.cls(**self.kwargs)

    @property
    def consumes(self) -> Consumes:
        return self.cls.consumes

    @property
    def kind(self) -> str:
        """What the metric reads, as a preprocessing-statistics kind: ``tokens``, ``views:<pooling>`` or the
        pooling."""
        if self.consumes == Consumes.TOKENS:
            return "tokens"
        if self.consumes == Consumes.VIEWS:
            return f"views:{self.pooling}"
        return str(self.pooling)

    def config(self, metric: Metric) -> dict[str, Any]:
        out = metric.config()
        if self.pooling is not None:
            out["pooling"] = self.pooling
        if self.consumes == Consumes.VIEWS:
            out["n_views"] = int(metric.n_views)  # type: ignore[attr-defined]
        return out


def instantiate_metrics(
    names: Sequence[str],
    host: PluginHost,
    params: Mapping[str, Mapping[str, Any]] | None,
    per_text: bool,
    pooling: str | None = None,
) -> list[MetricSpec]:
    """Look every metric up (unknown names fail before the model is loaded) and check its parameters.

    Pooling: ``METRIC.pooling`` if given, else the run's ``pooling``, else the metric's ``default_pooling``.
    """
    params = dict(params or {})
    unknown_params = set(params) - set(names)
    if unknown_params:
        raise RepgeomError(f"parameters given for metrics that were not requested: {sorted(unknown_params)}")
    out = []
    for name in dict.fromkeys(names):
        cls = host.metrics.get(name)
        accepted = cls.parameter_names()
        kwargs = dict(params.get(name, {}))
        metric_pooling = kwargs.pop("pooling", None) if "pooling" not in accepted else None
        bad = set(kwargs) - set(accepted)
        if bad:
            raise RepgeomError(f"metric {name!r} has no parameter(s) {sorted(bad)} "
                               f"(parameters: {', '.join(accepted + ['pooling'])})")
        if per_text and "per_text" in accepted:
            kwargs.setdefault("per_text", True)
        if cls.consumes == Consumes.TOKENS:
            chosen = None
        else:
            chosen = check_pooling(metric_pooling or pooling or cls.default_pooling)
            if cls.consumes == Consumes.VIEWS and chosen == "tokens":
                raise RepgeomError(f"metric {name!r} compares pooled views of each text; pooling 'tokens' does not "
                                   "apply (use mean, last or first)")
        out.append(MetricSpec(name, cls, kwargs, chosen))
    return out
