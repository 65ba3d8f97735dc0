"""Turning a run's merged states into results: compute() every metric, diagnostics, summaries, per-text rows.

Per-text rows are keyed by metric as in :func:`~repgeom_eval.measurement.bank.per_text_key` (a metric's own scores
keep their names, others are ``metric.score``), and a text with several vectors (``tokens`` pooling) gets the mean of
its values (docs/plugins.md#parameters-per-text-results-and-diagnostics).
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from repgeom_eval.measurement.bank import per_text_table
from repgeom_eval.measurement.degenerate import degenerate_warning
from repgeom_eval.measurement.metric_specs import MetricSpec
from repgeom_eval.measurement.states import RunState
from repgeom_eval.modeling.addresses import Address
from repgeom_eval.output.files import write_json, write_jsonl


@dataclass
class MeasureResult:
    """Everything one run produced; ``to_dict()`` is the results-file schema."""

    model: dict[str, Any]
    data: dict[str, Any]
    config: dict[str, Any]
    results: dict[str, dict[str, Any]]
    diagnostics: dict[str, dict[str, Any]]
    timings: dict[str, float]
    per_text: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)  # metric → result of Metric.across_layers
    is_main: bool = True  # False on ranks > 0 of a distributed run: their results are merged into rank 0's
    warnings: list[str] = field(default_factory=list)  # what the run warned about, kept in the results file
    #: plugin metrics dropped after raising (metric → the one-line error); their results are left out
    failed_metrics: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {"model": self.model, "data": self.data, "config": self.config, "results": self.results,
               "summary": self.summary, "diagnostics": self.diagnostics, "timings": self.timings}
        if self.warnings:
            out["warnings"] = list(self.warnings)
        if self.failed_metrics:
            out["failed_metrics"] = dict(self.failed_metrics)
        return out

    def write(self, path: str | Path, per_text_path: str | Path | None = None) -> None:
        write_json(path, self.to_dict())
        if per_text_path is not None:
            write_jsonl(per_text_path, self.per_text)


@dataclass
class Report:
    """What :func:`report` computes from the merged states (rank 0)."""

    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    diagnostics: dict[str, dict[str, Any]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    per_text: list[dict[str, Any]] = field(default_factory=list)


def report(run: RunState, specs: list[MetricSpec], per_text: bool, massive_share_warning: float,
           model_name: str | None = None) -> Report:
    """compute() every metric; diagnostics, the massive-dimension warning, summaries and per-text rows."""
    out = Report()
    per_text_cols: dict[int, dict[str, Any]] = {}
    for addr, metric_list in run.states.items():
        key = str(addr)
        out.results[key] = {}
        for spec, metric in metric_list:
            if spec.failure is not None:  # dropped (an isolated metric that raised): no results
                continue
            with spec.guard("compute", key):
                out.results[key][spec.name] = metric.compute()
            diag = None
            with spec.guard("diagnostics", key):
                diag = metric.diagnostics()
            if diag and spec.failure is None:
                out.diagnostics.setdefault(key, {})[spec.name] = diag
        if per_text:  # scores keyed by metric (per_text_key), a text's several values averaged
            alive = [(spec, m) for spec, m in metric_list if spec.failure is None]
            for i, row in per_text_table(key, alive).items():
                per_text_cols.setdefault(i, {})[key] = row
    _leave_out_failed(specs, out, per_text_cols)
    # a metric's diagnostics "warning" (a parameter it could not honour as given ...) is shown, once per text
    said: dict[tuple[str, str], list[str]] = {}
    for key, per_metric in out.diagnostics.items():
        for name, diag in per_metric.items():
            if isinstance(diag, dict) and isinstance(diag.get("warning"), str):
                said.setdefault((name, diag["warning"]), []).append(key)
    for (name, text), keys in said.items():
        warnings.warn(f"{name}: {text} (at {address_runs(keys)})", stacklevel=4)
    flagged = _energy_diagnostics(run, out.diagnostics, massive_share_warning)
    if flagged:  # one warning for the whole run, not one line per layer
        warnings.warn(massive_warning(flagged, massive_share_warning), stacklevel=4)
    degenerate = degenerate_warning(model_name, out.results, out.diagnostics,
                                    {str(a): m.compute() for a, m in run.energy.items() if fed(m)})
    if degenerate:  # zero vectors or NaN results: correct numbers that carry no geometry, said once
        warnings.warn(degenerate, stacklevel=4)
    for spec in specs:
        if spec.failure is not None:
            continue
        across = None
        with spec.guard("across_layers"):
            across = spec.cls.across_layers({k: out.results[k][spec.name] for k in out.results},
                                            list(range(len(out.results))))
        if across is not None and spec.failure is None:
            out.summary[spec.name] = across
    _leave_out_failed(specs, out, per_text_cols)
    if per_text:
        for i in sorted(run.text_info):
            rid, n_tok = run.text_info[i]
            out.per_text.append({"index": i, "id": rid,
                                 "n_tokens": None if n_tok is None else min(n_tok, run.context),
                                 "truncated": None if n_tok is None else n_tok > run.context,
                                 "scores": per_text_cols.get(i, {})})
    return out


def _leave_out_failed(specs: list[MetricSpec], out: Report, per_text_cols: dict[int, dict[str, Any]]) -> None:
    """Take a metric that failed at some address out of every address's results, diagnostics and per-text scores:
    its numbers are reported whole or not at all."""
    failed = {spec.name for spec in specs if spec.failure is not None}
    if not failed:
        return
    for table in (out.results, out.diagnostics):
        for per_metric in table.values():
            for name in failed:
                per_metric.pop(name, None)
    for by_address in per_text_cols.values():
        for row in by_address.values():
            for k in [k for k in row if k in failed or k.split(".", 1)[0] in failed]:
                del row[k]


def fed(energy: Any) -> bool:
    """Whether the energy diagnostic saw any vector (it sees the original texts: none when only views-only metrics
    such as infonce or lidar run, and then no energy means nothing measured, not zero vectors)."""
    return float(getattr(energy, "n", 1)) > 0


def massive_warning(flagged: list[tuple[Address, int, float]], threshold: float, advice: str | None = None) -> str:
    """The one line that says where one hidden dimension dominates (``flagged``: what the energy diagnostic found
    over ``threshold``); ``advice``: what the caller can offer besides the massive_activations metric."""
    advice = ", or try --preprocess standardize" if advice is None else advice
    return (f"one hidden dimension carries at least {_percent(threshold)} of the squared norm of the mean-pooled "
            f"vectors at {len(flagged)} address(es): {compact(flagged)}; cosine-based metrics there mostly measure "
            f"that dimension. See the massive_activations metric{advice}")


def _energy_diagnostics(run: RunState, diagnostics: dict[str, dict[str, Any]],
                        threshold: float) -> list[tuple[Address, int, float]]:
    """``diagnostics[address]["energy"]`` from the massive_activations states; the addresses over ``threshold``."""
    flagged = []
    for addr, metric in run.energy.items():
        if not fed(metric):
            continue  # no original text ran (views-only metrics): nothing measured, nothing to say
        value = metric.compute()
        if not value["top_dimensions"]:
            continue  # no energy at all (zero vectors): nothing to say
        dims, shares = value["top_dimensions"], value["top_shares"]
        diagnostics.setdefault(str(addr), {})["energy"] = {
            "pooling": "mean", "top_dimensions": dims, "top_shares": [round(float(s), 6) for s in shares]}
        if float(shares[0]) >= threshold:
            flagged.append((addr, int(dims[0]), float(shares[0])))
    return flagged


def compact(flagged: list[tuple[Address, int, float]]) -> str:
    """``resid_post:1..27 (dim 507: 53-98%), final (dim 17: 76%)``: runs of consecutive layers of one site with the
    same dominant dimension are merged, so a 30-layer model gives one short line. It words a warning, so it never
    raises: an item that is not an (address, dimension, share) triple, a share that is no number, NaN or inf are
    written as they are."""
    items = [_triple(item) for item in flagged]
    runs: list[list[tuple[Any, Any, Any]]] = []
    for item in items:
        last = runs[-1][-1] if runs else None
        layer, before = _layer(item[0]), _layer(last[0]) if last is not None else None
        if (last is not None and layer is not None and before is not None and layer == before + 1
                and getattr(item[0], "site", None) == getattr(last[0], "site", None) and item[1] == last[1]):
            runs[-1].append(item)
        else:
            runs.append([item])
    parts = []
    for run in runs:
        labels = [_percent(r[2]) for r in run]
        numbers = [float(r[2]) for r in run if _real(r[2])]
        if len(set(labels)) == 1:
            share = labels[0]
        elif len(numbers) == len(run):
            share = f"{_percent(min(numbers))}-{_percent(max(numbers))}"
        else:
            share = f"{labels[0]}-{labels[-1]}"
        name = str(run[0][0]) if len(run) == 1 else f"{run[0][0]}..{_layer(run[-1][0])}"
        parts.append(f"{name} (dim {run[0][1]}: {share})")
    return ", ".join(parts)


def _triple(item: Any) -> tuple[Any, Any, Any]:
    parts = tuple(item)[:3] if isinstance(item, (tuple, list)) else (item,)
    return (*parts, *[None] * (3 - len(parts)))  # type: ignore[return-value]


def _layer(address: Any) -> int | None:
    layer = getattr(address, "layer", None)
    return layer if isinstance(layer, int) and not isinstance(layer, bool) else None


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _percent(value: Any) -> str:
    """``53%`` for a share; anything else (NaN, inf, None, a string) as it is."""
    return f"{value:.0%}" if _real(value) else str(value)


def address_runs(names: list[str]) -> str:
    """``resid_post:0..27, final``: consecutive layers of one site merged (any other name is kept as it is)."""
    runs: list[list[tuple[str, int | None, str]]] = []
    for name in names:
        site, _, layer = str(name).partition(":")
        index = int(layer) if re.fullmatch(r"-?[0-9]+", layer) else None
        last = runs[-1][-1] if runs else None
        if last is not None and index is not None and last[1] is not None and last[0] == site \
                and index == last[1] + 1:
            runs[-1].append((site, index, str(name)))
        else:
            runs.append([(site, index, str(name))])
    return ", ".join(run[0][2] if len(run) == 1 else f"{run[0][2]}..{run[-1][1]}" for run in runs)


@contextmanager
def kept_warnings(into: list[str]) -> Iterator[None]:
    """The warnings raised in the block, appended to ``into`` (each message once) and shown as usual afterwards:
    how a run's warnings reach its results file (and ``repgeom report``), not only the terminal."""
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            yield
    finally:
        for w in caught:
            text = str(w.message)
            if text not in into:
                into.append(text)
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
