"""Correlations for the analyses (no scipy at run time; the tests check them against scipy)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..functional.condensation import kendall_tau_b, spearman

__all__ = ["pearson", "spearman", "kendall_tau_b", "correlations", "mean_std"]


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson's r in float64; NaN for fewer than 2 values, any NaN, or a constant input."""
    a, b = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"x and y differ in length: {a.size} vs {b.size}")
    if a.size < 2 or np.isnan(a).any() or np.isnan(b).any():
        return float("nan")
    a, b = a - a.mean(), b - b.mean()
    den = math.sqrt(float(a @ a) * float(b @ b))
    return float(a @ b) / den if den > 0 else float("nan")


def correlations(x: Sequence[float], y: Sequence[float]) -> dict[str, float]:
    return {"pearson": pearson(x, y), "spearman": spearman(x, y), "n": len(x)}


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and population standard deviation (ddof = 0, numpy's default)."""
    v = np.asarray(values, dtype=np.float64)
    return float(v.mean()), float(v.std())
