"""Seeded percentile-bootstrap intervals, and row-wise Pearson/Spearman for vectorised resampling.

Method: the **percentile bootstrap**. The ``n`` sampled units (queries, groups, chunks, task items, seeds: whatever
was drawn independently) are resampled with replacement ``n_resamples`` times; the statistic is recomputed on every
resample, and the interval at level ``1 - alpha`` is the ``alpha/2`` and ``1 - alpha/2`` quantiles (linear
interpolation, numpy's default) of the resampled values. Resamples where the statistic is undefined (NaN: a
constant resample, a resample with one class only) are dropped and counted (``n_valid``); when fewer than half are
valid the interval is NaN. The resampling indices come from ``numpy.random.default_rng(seed)``, drawn as one
``(n_resamples, n)`` matrix, so one seed gives one interval on every machine.

The percentile interval is neither bias-corrected nor accelerated (not BCa); with few units (under about 10) it is
too narrow, and with 3 units it can take only a handful of values: callers say how many units an interval rests on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

N_RESAMPLES = 2000
LEVEL = 0.95
METHOD = "percentile bootstrap"


@dataclass(frozen=True)
class Interval:
    """A statistic on the full sample, its bootstrap interval and what the interval rests on."""

    estimate: float
    low: float
    high: float
    n: int
    n_resamples: int
    n_valid: int
    level: float = LEVEL
    seed: int = 0
    method: str = METHOD

    def excludes(self, value: float) -> bool:
        """Whether ``value`` lies outside the closed interval (False when the interval is NaN)."""
        return bool(np.isfinite(self.low) and np.isfinite(self.high) and (value < self.low or value > self.high))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def bootstrap_indices(n: int, n_resamples: int = N_RESAMPLES, seed: int = 0) -> np.ndarray:
    """An ``(n_resamples, n)`` matrix of indices drawn with replacement from ``range(n)``, fixed by ``seed``."""
    if n < 1 or n_resamples < 1:
        raise ValueError(f"bootstrap needs n >= 1 and n_resamples >= 1, got {n} and {n_resamples}")
    return np.random.default_rng(seed).integers(0, n, size=(n_resamples, n))


def percentile_interval(values, level: float = LEVEL) -> tuple[float, float, int]:
    """The central ``level`` percentile interval of ``values`` (NaN dropped) and how many values were finite;
    NaN bounds when fewer than half of the values are finite."""
    v = np.asarray(values, dtype=float).ravel()
    finite = v[np.isfinite(v)]
    if finite.size == 0 or finite.size < v.size / 2:
        return float("nan"), float("nan"), int(finite.size)
    alpha = 1.0 - level
    lo, hi = np.quantile(finite, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi), int(finite.size)


def bootstrap_ci(statistic: Callable[..., Any], *samples, n_resamples: int = N_RESAMPLES, level: float = LEVEL,
                 seed: int = 0, vectorized: bool = False) -> Interval:
    """Percentile bootstrap interval of ``statistic(*samples)``; the samples are paired (unit ``i`` is
    ``samples[k][i]`` for every ``k``) and resampled together.

    ``vectorized``: ``statistic`` takes arrays of shape ``(n_resamples, n)`` and returns ``n_resamples`` values (one
    call for all resamples); otherwise it is called once per resample with 1-d arrays.
    """
    arrays = [np.asarray(s, dtype=float) for s in samples]
    if not arrays:
        raise ValueError("bootstrap_ci needs at least one sample")
    n = arrays[0].shape[0]
    if any(a.shape[0] != n for a in arrays):
        raise ValueError(f"paired samples differ in length: {[a.shape[0] for a in arrays]}")
    if vectorized:
        estimate = float(np.asarray(statistic(*[a[None, ...] for a in arrays]), dtype=float).ravel()[0])
    else:
        estimate = float(statistic(*arrays))
    idx = bootstrap_indices(n, n_resamples, seed)
    if vectorized:
        values = np.asarray(statistic(*[a[idx] for a in arrays]), dtype=float).ravel()
    else:
        values = np.array([float(statistic(*[a[i] for a in arrays])) for i in idx])
    lo, hi, n_valid = percentile_interval(values, level)
    return Interval(estimate, lo, hi, int(n), int(n_resamples), n_valid, level, seed)


# -- row-wise statistics (one value per row of a 2-d array) -----------------------------------------------------------

def rowwise_pearson(x, y) -> np.ndarray:
    """Pearson's r of every row of ``x`` with the same row of ``y``; NaN where a row is constant."""
    a, b = np.atleast_2d(np.asarray(x, dtype=float)), np.atleast_2d(np.asarray(y, dtype=float))
    a = a - a.mean(axis=-1, keepdims=True)
    b = b - b.mean(axis=-1, keepdims=True)
    den = np.sqrt((a * a).sum(-1) * (b * b).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        r = (a * b).sum(-1) / den
    r[~(den > 1e-300)] = np.nan
    return np.clip(r, -1.0, 1.0)


def rowwise_ranks(x) -> np.ndarray:
    """1-based ranks within every row, ties given the average rank they span (as ``stats.rankdata``)."""
    a = np.atleast_2d(np.asarray(x, dtype=float))
    less = (a[..., :, None] > a[..., None, :]).sum(-1)
    equal = (a[..., :, None] == a[..., None, :]).sum(-1)
    return less + (equal + 1) / 2.0


def rowwise_spearman(x, y) -> np.ndarray:
    """Spearman's ρ of every row pair: Pearson's r of the average ranks."""
    return rowwise_pearson(rowwise_ranks(x), rowwise_ranks(y))


def rowwise_mean(x) -> np.ndarray:
    return np.atleast_2d(np.asarray(x, dtype=float)).mean(axis=-1)
