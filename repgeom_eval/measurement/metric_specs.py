"""The metrics a run asked for: looked up in the plugin host, parameters checked, pooling chosen.

Every call into a metric's own code goes through :meth:`MetricSpec.guard`, so that an exception raised inside a
third-party plugin's ``__init__``/``update``/``compute`` is one line naming the metric, the plugin and its
distribution (docs/plugins.md#when-something-goes-wrong). A metric the run marked ``isolate`` (``repgeom measure``:
a third-party metric no other metric reads a statistic from) is then dropped and the run goes on without it; any
other such exception ends the run. A built-in metric's exception is a bug in repgeom-eval and keeps its traceback.
"""

from __future__ import annotations

import os
import types
import typing
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from repgeom_eval.spec.errors import ParameterError, PluginError, RepgeomError
from repgeom_eval.spec.poolings import check_pooling
from repgeom_eval.spec.metric import Consumes, Metric
from repgeom_eval.plugin_system.host import BUILTIN_DISTRIBUTION, PluginHost, origin


class _Guard:
    """``with spec.guard(stage, address):`` around a call into the metric's code (a class: it runs per batch)."""

    __slots__ = ("spec", "stage", "address")

    def __init__(self, spec: "MetricSpec", stage: str, address: object):
        self.spec, self.stage, self.address = spec, stage, address

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False
        spec = self.spec
        if isinstance(exc, ParameterError) and not exc.metric:
            exc.metric = spec.name  # the plugin raised ParameterError(param, value, expected): name the metric
        if isinstance(exc, RepgeomError) or spec.distribution == BUILTIN_DISTRIBUTION:
            return False  # already one line, or a bug in repgeom-eval (keeps its traceback)
        where = f" at {self.address}" if self.address is not None else ""
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())
        message = f"metric {spec.name!r} of {spec.origin} raised in {self.stage}{where}: {detail}"
        others_run = any(p is not spec and p.failure is None for p in spec.peers)
        if spec.isolate and others_run and self.stage in ISOLATED_STAGES and not os.environ.get("REPGEOM_DEBUG"):
            if spec.failure is None:  # said once; the run stops feeding it and leaves its results out
                spec.failure = message
                warnings.warn(f"{message}; the run goes on without it, and its results are left out "
                              "(REPGEOM_DEBUG=1 stops at the failure with its traceback)", stacklevel=3)
            return True
        raise PluginError(f"{message} (repgeom --debug shows the traceback)") from exc


#: the stages of a run whose failure an isolated metric survives (set-up, resume and merge errors still stop it)
ISOLATED_STAGES = frozenset({"update", "compute", "diagnostics", "per_text_results", "across_layers"})


@dataclass
class MetricSpec:
    """A requested metric: its class, constructor arguments and the pooling it reads (None for token metrics), and
    the plugin that registered it."""

    name: str
    cls: type[Metric]
    kwargs: dict[str, Any]
    pooling: str | None
    plugin: str | None = None
    distribution: str | None = None
    version: str | None = None
    #: the run goes on without this metric when its code raises (see the module docstring), as long as another of
    #: its ``peers`` (the run's metrics) is still running; ``failure`` says why it was dropped
    isolate: bool = False
    failure: str | None = None
    peers: list["MetricSpec"] = field(default_factory=list, repr=False, compare=False)

    @property
    def origin(self) -> str:
        return origin(self.plugin or "?", self.distribution, self.version)

    def guard(self, stage: str, address: object = None) -> _Guard:
        """A context manager for a call into the metric's code (``stage``: ``update``, ``compute`` ...)."""
        return _Guard(self, stage, address)

    def new(self) -> Metric:
        """A fresh metric state."""
        with self.guard("__init__"):
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
        if cls.consumes == Consumes.TOKENS:
            chosen = None
        else:
            chosen = check_pooling(metric_pooling or pooling or cls.default_pooling)
            if cls.consumes == Consumes.VIEWS and chosen == "tokens":
                raise RepgeomError(f"metric {name!r} compares pooled views of each text; pooling 'tokens' does not "
                                   "apply (use mean, last or first)")
        entry = host.metrics.entry(name)
        version = host.provenance("metric", [name])[name]["version"]
        spec = MetricSpec(name, cls, kwargs, chosen, entry.plugin, entry.distribution, version)
        spec.new()  # a parameter value the metric rejects fails here, before the model is loaded
        out.append(spec)
    return out


def fresh_metrics(specs: Sequence[MetricSpec], address: object = None) -> list[tuple[MetricSpec, Metric]]:
    """A fresh state of every requested metric for one address, where metrics that read the same statistic of the
    same vectors share one (:func:`share_statistics`)."""
    pairs = [(spec, spec.new()) for spec in specs]
    share_statistics(pairs, address)
    return pairs


def share_statistics(pairs: Sequence[tuple[MetricSpec, Metric]], address: object = None) -> dict[str, str]:
    """Bind the statistics of ``pairs`` (the metrics of one address) so that each distinct one is kept once: two
    pooled metrics whose ``statistics()`` hold statistics of the same class and parameters, read with the same
    pooling, read the first metric's (docs/plugins.md#shared-statistics). The same binding is made for every
    address, process and resumed state, so states save and merge alike. Returns ``{"metric.slot": owner metric}``
    for the statistics shared."""
    owners: dict[tuple, tuple[str, Any]] = {}
    shared: dict[str, str] = {}
    for spec, metric in pairs:
        if spec.consumes != Consumes.POOLED:
            continue
        with spec.guard("statistics", address):
            slots = dict(metric.owned_statistics())
            keys = {slot: (spec.pooling, st.key()) for slot, st in slots.items()}
        for slot, key in keys.items():
            try:
                hash(key)
            except TypeError:  # parameters that cannot be compared: kept apart
                continue
            if key in owners:
                owner, statistic = owners[key]
                metric.share(slot, statistic)
                shared[f"{spec.name}.{slot}"] = owner
            else:
                owners[key] = (spec.name, slots[slot])
    return shared


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


def isolate_third_party(specs: Sequence[MetricSpec]) -> None:
    """Mark the third-party metrics a run may drop when their code raises (docs/plugins.md#when-something-goes-wrong):
    those no other metric reads a statistic from, since a lender's failure would leave a borrower's statistic
    half-fed."""
    lenders = set(share_statistics([(spec, spec.new()) for spec in specs]).values())
    for spec in specs:
        spec.isolate = spec.distribution != BUILTIN_DISTRIBUTION and spec.name not in lenders
        spec.peers = list(specs)
