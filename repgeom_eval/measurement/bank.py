"""Registered metrics at several addresses, fed from hidden states that someone else's forward pass captured.

``measure`` owns its forward passes; the lm-eval tasks and the MTEB sweep read the passes lm-eval and mteb make. Both
hand each address's captured tensor to a :class:`MetricBank`, which feeds the same metric states through the same
pooling and preprocessing code as ``measure`` (:class:`~repgeom_eval.measurement.feed.Feeder`), so a value reported
inside lm-eval or MTEB equals ``repgeom measure`` on the same texts, address and pooling.

Flat names: a metric's result may be a number or a dict of numbers; :func:`flatten_result` turns it into
``{"metric": x}`` or ``{"metric.sub": x, ...}`` (lists and strings are left out), the form tables and score files
take. Per-text scores are keyed by :func:`per_text_key`: a metric's own scores keep their names, any other score is
``metric.score``, so two plugins cannot overwrite each other's scores (:func:`per_text_table`, shared with
``measure``; docs/plugins.md#parameters-per-text-results-and-diagnostics).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.measurement.feed import Feeder
from repgeom_eval.measurement.metric_specs import MetricSpec, fresh_metrics, instantiate_metrics
from repgeom_eval.measurement.plan import Item
from repgeom_eval.measurement.preprocess import Preprocessor
from repgeom_eval.spec.metric import Consumes, Metric
from repgeom_eval.modeling.addresses import Address


def per_text_key(metric: str, score: str) -> str:
    """The name of a per-text score: a metric's own scores keep their names (the metric's name itself, or the name
    followed by ``_`` and a suffix, as ``prompt_entropy_normalized``); any other score is ``metric.score``."""
    return score if score == metric or score.startswith(metric + "_") else f"{metric}.{score}"


def per_text_table(address: str, metrics: Sequence[tuple[MetricSpec, Metric]]) -> dict[int, dict[str, float]]:
    """``{text index: {per_text_key: value}}`` of the metrics at one address that report per-text scores.

    Several values for one text (one per token with ``tokens`` pooling) are averaged: a text's score is the mean over
    its vectors. Where two metrics would still claim one name (a metric ``a`` with a score ``a_b`` next to a metric
    ``a_b``), the score that is not the metric's own name is written ``metric.score``.
    """
    scores: list[tuple[str, str, torch.Tensor, torch.Tensor]] = []
    for spec, metric in metrics:
        results = None  # stays None when an isolated metric raises (the guard then drops it)
        with spec.guard("per_text_results", address):
            results = metric.per_text_results()
        for score, (idx, values) in (results or {}).items():
            scores.append((spec.name, score, torch.as_tensor(idx).reshape(-1).long(),
                           torch.as_tensor(values, dtype=torch.float64).reshape(-1)))
    keys = [per_text_key(name, score) for name, score, _, _ in scores]
    claims: dict[str, int] = {}
    for key in keys:
        claims[key] = claims.get(key, 0) + 1
    keys = [f"{name}.{score}" if claims[key] > 1 and score != name else key
            for key, (name, score, _, _) in zip(keys, scores)]
    owner: dict[str, str] = {}
    for key, (name, _, _, _) in zip(keys, scores):
        if owner.setdefault(key, name) != name:
            raise RepgeomError(f"metrics {owner[key]!r} and {name!r} both report a per-text score {key!r} at "
                               f"{address}; rename a score of one of them")
    out: dict[int, dict[str, float]] = {}
    for key, (name, score, idx, values) in zip(keys, scores):
        if idx.numel() != values.numel():
            raise RepgeomError(f"metric {name!r}: per-text score {score!r} has {idx.numel()} text indices but "
                               f"{values.numel()} values; per_text_results() must return two 1-D tensors of one length")
        texts, inverse = torch.unique(idx, return_inverse=True)
        if texts.numel() != idx.numel():  # several vectors per text: the mean over them
            total = torch.zeros(texts.numel(), dtype=torch.float64).index_add_(0, inverse, values)
            count = torch.zeros(texts.numel(), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(values))
            idx, values = texts, total / count
        for i, v in zip(idx.tolist(), values.tolist()):
            out.setdefault(int(i), {})[key] = v
    return out


def flatten_result(metric: str, value: Any) -> dict[str, float]:
    """``{"metric": x}`` for a number, ``{"metric.sub": x, ...}`` for a dict of numbers (nested dicts joined by
    dots); booleans, lists and strings are left out."""
    if isinstance(value, bool):
        return {}
    if isinstance(value, (int, float)):
        return {metric: float(value)}
    if isinstance(value, Mapping):
        out: dict[str, float] = {}
        for key, sub in value.items():
            out.update(flatten_result(f"{metric}.{key}", sub))
        return out
    return {}


class MetricBank:
    """Metric states for ``names`` at every address in ``addresses``.

    Args:
        names: registered metric names.
        addresses: canonical addresses (see :func:`~repgeom_eval.modeling.addresses.resolve_request`).
        params: ``{metric: {parameter: value}}`` as in ``--metric-param`` (``pooling`` included).
        pooling: the pooling of every metric that does not set its own (None: each metric's default).
        per_text: ask metrics that can for per-text scores.
        host: the plugin host (default: the installed plugins).
    """

    def __init__(self, names: Sequence[str], addresses: Sequence[Address], *,
                 params: Mapping[str, Mapping[str, Any]] | None = None, pooling: str | None = None,
                 per_text: bool = False, host: Any = None, prep: Preprocessor | None = None):
        from repgeom_eval.plugin_system.host import get_host

        self.host = host or get_host()
        self.specs: list[MetricSpec] = instantiate_metrics(list(names), self.host, params, per_text, pooling)
        self.addresses = list(addresses)
        self.per_text = per_text
        self.states: dict[Address, list[tuple[MetricSpec, Metric]]] = {
            a: fresh_metrics(self.specs, a) for a in self.addresses}
        first = next(iter(self.states.values()), [])
        self.n_views = max([int(m.n_views) for s, m in first if s.consumes == Consumes.VIEWS] or [0])  # type: ignore
        self.feeder = Feeder(self.specs, self.n_views, prep or Preprocessor())

    @property
    def needs_views(self) -> bool:
        """True when a requested metric reads augmented views (they need forward passes of their own)."""
        return self.n_views > 0

    def update(self, addr: Address, hidden: torch.Tensor, mask: torch.Tensor, texts: Sequence[int],
               views: Sequence[int] | None = None, host_mask: torch.Tensor | None = None) -> None:
        """Feed one address's captured batch: ``hidden`` [B, T, D], ``mask`` [B, T] (True at the tokens the texts
        are made of), ``texts`` the index of each row's text, ``views`` each row's view number (-1: the original);
        ``host_mask``, the same mask in host memory if the caller has it (the token metrics read their layout from
        it without waiting for the device)."""
        views = list(views) if views is not None else [-1] * len(texts)
        items = [Item(int(t), int(v)) for t, v in zip(texts, views)]
        self.feeder.feed(addr, hidden, mask.bool(), items, self.states[addr], host_mask=host_mask)

    # -- merging ---------------------------------------------------------------------------------------------------------
    def state(self) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
        return {str(a): {spec.name: m.state_dict() for spec, m in ms} for a, ms in self.states.items()}

    def merge_state(self, state: Mapping[str, Mapping[str, Mapping[str, torch.Tensor]]]) -> None:
        """Fold another process's :meth:`state` into this bank."""
        for addr, ms in self.states.items():
            for (spec, m), (_, other) in zip(ms, fresh_metrics(self.specs, addr)):
                with spec.guard("merge", addr):
                    other.load_state_dict(dict(state[str(addr)][spec.name]))
                    m.merge(other)

    # -- results ---------------------------------------------------------------------------------------------------------
    def configs(self) -> dict[str, dict[str, Any]]:
        first = next(iter(self.states.values()), [])
        return {spec.name: spec.config(m) for spec, m in first}

    def provenance(self) -> dict[str, dict[str, str | None]]:
        """``{metric: {"plugin", "distribution", "version"}}``: what every output records beside the values."""
        return {spec.name: {"plugin": spec.plugin, "distribution": spec.distribution, "version": spec.version}
                for spec in self.specs}

    def compute(self) -> dict[str, dict[str, Any]]:
        """``{address: {metric: compute()}}``."""
        out: dict[str, dict[str, Any]] = {}
        for a, ms in self.states.items():
            out[str(a)] = {}
            for spec, m in ms:
                with spec.guard("compute", a):
                    out[str(a)][spec.name] = m.compute()
        return out

    def flat(self) -> dict[str, dict[str, float]]:
        """``{address: {"metric" or "metric.sub": number}}`` (see :func:`flatten_result`)."""
        out: dict[str, dict[str, float]] = {}
        for addr, results in self.compute().items():
            out[addr] = {}
            for metric, value in results.items():
                out[addr].update(flatten_result(metric, value))
        return out

    def per_text_scores(self) -> dict[int, dict[str, dict[str, float]]]:
        """``{text index: {address: {per_text_key: value}}}`` for the metrics that track per-text scores."""
        out: dict[int, dict[str, dict[str, float]]] = {}
        for addr, ms in self.states.items():
            for i, row in per_text_table(str(addr), ms).items():
                out.setdefault(i, {})[str(addr)] = {
                    key: float(v) if math.isfinite(v) else float("nan") for key, v in row.items()}
        return out
