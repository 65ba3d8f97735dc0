"""The warnings ``repgeom measure`` gives about its numbers, for the registered metrics of an lm-eval task.

``repgeom measure`` says, once per run, when a metric's diagnostics carry a ``warning``, when one hidden dimension
carries at least half of the squared norm of the mean-pooled vectors (the energy diagnostic, the
``massive_activations`` metric), and when results are degenerate (zero vectors, NaN values):
:mod:`repgeom_eval.measurement.results` and :mod:`repgeom_eval.measurement.degenerate`. A task's
:class:`~repgeom_eval.lmeval.registered.TaskBank` computes the same lines from its merged states
(:func:`bank_warnings`); the session writes them into lm-eval's log and into the results JSON
(``repgeom_warnings``, docs/lmeval.md#warnings).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MASSIVE_SHARE = 0.5  # repgeom measure's default massive_share_warning


def bank_warnings(bank: Any, computed: Mapping[str, Mapping[str, Any]], energy: Mapping[Any, Any]) -> list[str]:
    """The lines ``repgeom measure`` would warn with for these states: ``bank`` a merged
    :class:`~repgeom_eval.measurement.bank.MetricBank`, ``computed`` its ``compute()``, ``energy`` address → the
    energy diagnostic's metric state."""
    from repgeom_eval.measurement.degenerate import degenerate_warning
    from repgeom_eval.measurement.results import address_runs, fed, massive_warning

    out: list[str] = []
    diagnostics: dict[str, dict[str, Any]] = {}
    for addr, ms in bank.states.items():
        for spec, metric in ms:
            with spec.guard("diagnostics", addr):
                diag = metric.diagnostics()
            if diag:
                diagnostics.setdefault(str(addr), {})[spec.name] = diag
    said: dict[tuple[str, str], list[str]] = {}
    for key, per_metric in diagnostics.items():
        for name, diag in per_metric.items():
            if isinstance(diag, dict) and isinstance(diag.get("warning"), str):
                said.setdefault((name, diag["warning"]), []).append(key)
    out += [f"{name}: {text} (at {address_runs(keys)})" for (name, text), keys in said.items()]  # measure's wording
    flagged, energy_values = [], {}
    for addr, metric in energy.items():
        if not fed(metric):
            continue  # no original text reached it (views-only metrics): nothing measured
        value = metric.compute()
        energy_values[str(addr)] = value
        if value["top_dimensions"] and float(value["top_shares"][0]) >= MASSIVE_SHARE:
            flagged.append((addr, int(value["top_dimensions"][0]), float(value["top_shares"][0])))
    if flagged:
        out.append(massive_warning(flagged, MASSIVE_SHARE, advice=""))  # measure's wording, layers in runs
    degenerate = degenerate_warning(None, computed, diagnostics, energy_values)
    if degenerate:
        out.append(degenerate)
    return out
