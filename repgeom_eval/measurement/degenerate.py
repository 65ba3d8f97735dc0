"""Degenerate numbers: results that are computed correctly from vectors that carry no geometry.

A zero vector has cosine 0 with everything, so it sits at cosine distance 1 from every other vector
(docs/metrics.md#conventions): a layer whose pooled vectors are all zero gets dispersion exactly 1.0, and an all-zero
checkpoint gets 1.0 at every layer, a plausible-looking number that says nothing. NaN results are likewise possible
without any error (docs/metrics.md#conventions, "Undefined" values). This module finds both in a finished
``measure`` report, so that the run says so in one warning instead of exiting 0 with a quiet number.

It reads only what a report already holds: ``diagnostics[address]["dispersion"]`` (``n_vectors``,
``n_zero_vectors``), the energy diagnostic of each address (the ``massive_activations`` value: no energy at all
means every mean-pooled vector is zero) and the metric values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ZERO_NOTE = ("a zero vector is at cosine distance 1 from every other, so dispersion there reflects the zeros "
             "(an all-zero model gives exactly 1.0), not the geometry")


@dataclass
class Degenerate:
    """What is wrong at one address."""

    address: str
    n_vectors: int | None = None
    n_zero: int | None = None  # None: not counted (no dispersion metric); see ``all_zero``
    all_zero: bool = False
    nan_metrics: list[str] = field(default_factory=list)

    def describe(self) -> str:
        parts = []
        if self.all_zero:
            parts.append(f"all {self.n_vectors} vectors zero" if self.n_vectors else "all vectors zero")
        elif self.n_zero:
            parts.append(f"{self.n_zero} of {self.n_vectors} vectors zero")
        if self.nan_metrics:
            parts.append("NaN " + ", ".join(self.nan_metrics))
        return f"{self.address} ({'; '.join(parts)})"


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _mapping(value: Any) -> Mapping[Any, Any]:
    return value if isinstance(value, Mapping) else {}


def _count(value: Any) -> int | None:
    """A vector count read from diagnostics (a score dict read back may hold anything): an int, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return int(value)


def find_degenerate(results: Mapping[str, Mapping[str, Any]], diagnostics: Mapping[str, Mapping[str, Any]],
                    energy: Mapping[str, Mapping[str, Any]] | None = None) -> list[Degenerate]:
    """Addresses with zero vectors or NaN results, in the order of ``results``.

    ``results``: address → metric → value (a report's ``results``); ``diagnostics``: address → metric → its
    diagnostics (``n_vectors``/``n_zero_vectors`` from ``dispersion``); ``energy``: address → the
    ``massive_activations`` value of the energy diagnostic (an empty ``top_dimensions`` means no energy at all).
    """
    found = []
    for address, per_metric in results.items():
        item = Degenerate(address)
        counts = _mapping(_mapping(diagnostics.get(address)).get("dispersion"))
        n, zero = _count(counts.get("n_vectors")), _count(counts.get("n_zero_vectors"))
        if n:
            item.n_vectors, item.n_zero = n, zero or 0
            item.all_zero = item.n_zero == item.n_vectors
        e = (energy or {}).get(address)
        if isinstance(e, Mapping) and not e.get("top_dimensions") and not item.n_vectors:
            item.all_zero = True  # the mean-pooled vectors hold no energy at all
        item.nan_metrics = [str(m) for m, v in _mapping(per_metric).items() if _is_nan(v)]
        if item.all_zero or item.n_zero or item.nan_metrics:
            found.append(item)
    return found


def degenerate_warning(model: str | None, results: Mapping[str, Mapping[str, Any]],
                       diagnostics: Mapping[str, Mapping[str, Any]],
                       energy: Mapping[str, Mapping[str, Any]] | None = None) -> str | None:
    """One line for the whole run naming the model and every degenerate address, or None if there is none."""
    found = find_degenerate(results, diagnostics, energy)
    if not found:
        return None
    who = f"model {model!r}" if model else "the model"
    if len(found) == len(results) and all(d.all_zero for d in found):
        return (f"{who}: every vector at every measured address is zero (an all-zero or untrained checkpoint?); "
                f"{ZERO_NOTE}")
    shown = ", ".join(d.describe() for d in found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
    note = f"; {ZERO_NOTE}" if any(d.all_zero or d.n_zero for d in found) else ""
    return f"{who}: degenerate results at {len(found)} address(es): {shown}{note}"


def degenerate_diagnostics(found: list[Degenerate]) -> dict[str, dict[str, Any]]:
    """address → ``{"zero_vectors": k, "all_zero": bool, "nan_metrics": [...]}``, for a report's diagnostics."""
    return {d.address: {"zero_vectors": d.n_zero, "all_zero": d.all_zero, "nan_metrics": d.nan_metrics}
            for d in found}


def zero_vector_warning(model: str | None, counts: Mapping[Any, Sequence[int]]) -> str | None:
    """One line naming the model and the addresses whose every real-token vector was zero, from
    ``address → (zero vectors, vectors)`` counted over a run's forward passes
    (:class:`repgeom_eval.measurement.forward.Forward` counts them); None when there is none."""
    dead = [str(a) for a, pair in counts.items() if _dead(pair)]
    if not dead:
        return None
    who = f"model {model!r}" if model else "the model"
    if len(dead) == len(counts):
        return f"{who}: every token vector at every address is zero (an all-zero or untrained checkpoint?); {ZERO_NOTE}"
    shown = ", ".join(dead[:8]) + (f" and {len(dead) - 8} more" if len(dead) > 8 else "")
    return f"{who}: every token vector is zero at {len(dead)} address(es): {shown}; {ZERO_NOTE}"


def _dead(pair: Any) -> bool:
    """Whether ``(zero vectors, vectors)`` says every vector was zero (anything else: no)."""
    try:
        zero, total = pair
    except (TypeError, ValueError):
        return False
    return bool(_count(total)) and _count(zero) == _count(total)
