"""The metrics a run asked for: looked up in the plugin host, parameters checked, pooling chosen."""

from __future__ import annotations

import types
import typing
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
        check_parameter_types(name, cls, kwargs)
        if per_text and "per_text" in accepted:
            kwargs.setdefault("per_text", True)
        try:
            cls(**kwargs)  # the metric's own checks, before the model is loaded
        except (TypeError, ValueError) as exc:
            raise RepgeomError(f"metric {name!r}: bad parameter ({exc})") from None
        if cls.consumes == Consumes.TOKENS:
            chosen = None
        else:
            chosen = check_pooling(metric_pooling or pooling or cls.default_pooling)
            if cls.consumes == Consumes.VIEWS and chosen == "tokens":
                raise RepgeomError(f"metric {name!r} compares pooled views of each text; pooling 'tokens' does not "
                                   "apply (use mean, last or first)")
        out.append(MetricSpec(name, cls, kwargs, chosen))
    return out


def check_parameter_types(name: str, cls: type[Metric], kwargs: Mapping[str, Any]) -> None:
    """Refuse a parameter whose value does not fit the simple type its constructor declares (``bool``, ``int``,
    ``float``, ``str``, a ``Literal`` or a union of these, e.g. ``per_text: bool``): ``--metric-param
    dispersion.per_text=3`` is a one-line error, not a quiet ``True``. Other annotations are left to the metric."""
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - a plugin's annotations may not resolve; then the metric checks for itself
        return
    for key, value in kwargs.items():
        hint = hints.get(key)
        if hint is not None and _fits(hint, value) is False:
            raise RepgeomError(f"metric {name!r}: parameter {key} must be {_describe(hint)}, got {value!r}")


def _fits(hint: Any, value: Any) -> bool | None:
    """True or False where the annotation says, None where it cannot tell."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        answers = [_fits(a, value) for a in typing.get_args(hint)]
        return True if True in answers else (None if None in answers else False)
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return None


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string",
            type(None): "null"}.get(hint, getattr(hint, "__name__", str(hint)))
