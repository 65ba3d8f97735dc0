"""repgeom_eval.functional.bootstrap: seeded percentile-bootstrap intervals and row-wise correlations."""

from __future__ import annotations

import numpy as np
import pytest

from repgeom_eval.functional.bootstrap import (
    bootstrap_ci,
    bootstrap_indices,
    percentile_interval,
    rowwise_mean,
    rowwise_pearson,
    rowwise_spearman,
)
from repgeom_eval.functional.stats import pearson, spearman


def test_rowwise_correlations_match_the_library_statistics():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(7, 12))
    y = x + rng.normal(size=(7, 12))
    y[0, :4] = y[0, 4]  # ties
    for i in range(7):
        assert rowwise_pearson(x, y)[i] == pytest.approx(pearson(x[i], y[i]), abs=1e-12)
        assert rowwise_spearman(x, y)[i] == pytest.approx(spearman(x[i], y[i]), abs=1e-12)
    assert np.isnan(rowwise_pearson(np.ones((1, 5)), np.arange(5.0)))[0]


def test_the_same_seed_gives_the_same_interval_and_another_seed_another():
    rng = np.random.default_rng(2)
    x = rng.normal(size=30)
    y = 0.5 * x + rng.normal(size=30)
    a = bootstrap_ci(rowwise_pearson, x, y, vectorized=True, seed=3)
    b = bootstrap_ci(rowwise_pearson, x, y, vectorized=True, seed=3)
    c = bootstrap_ci(rowwise_pearson, x, y, vectorized=True, seed=4)
    assert a == b and (a.low, a.high) != (c.low, c.high)
    assert a.estimate == pytest.approx(pearson(x, y)) and a.low < a.estimate < a.high
    # the per-resample path gives the same numbers as the vectorised one
    d = bootstrap_ci(lambda u, v: pearson(u, v), x, y, seed=3, n_resamples=300)
    e = bootstrap_ci(rowwise_pearson, x, y, vectorized=True, seed=3, n_resamples=300)
    assert (d.low, d.high) == pytest.approx((e.low, e.high), abs=1e-12)
    assert bootstrap_indices(5, 4, seed=0).shape == (4, 5)


def test_the_interval_of_a_mean_is_close_to_the_normal_one():
    x = np.random.default_rng(5).normal(loc=2.0, size=400)
    ci = bootstrap_ci(rowwise_mean, x, vectorized=True, n_resamples=4000)
    se = x.std(ddof=1) / np.sqrt(x.size)
    assert ci.low == pytest.approx(x.mean() - 1.96 * se, abs=0.25 * se)
    assert ci.high == pytest.approx(x.mean() + 1.96 * se, abs=0.25 * se)
    assert ci.excludes(0.0) and not ci.excludes(2.0) and ci.method == "percentile bootstrap"


def test_undefined_resamples_are_dropped_and_too_many_give_nan():
    lo, hi, n = percentile_interval([1.0, 2.0, float("nan"), 3.0])
    assert n == 3 and 1.0 <= lo < hi <= 3.0
    assert np.isnan(percentile_interval([1.0, float("nan"), float("nan")])[0])
    ci = bootstrap_ci(rowwise_pearson, [1.0, 1.0, 1.0], [1.0, 2.0, 3.0], vectorized=True)
    assert np.isnan(ci.low) and not ci.excludes(0.0)
    with pytest.raises(ValueError):
        bootstrap_ci(rowwise_pearson, [1.0, 2.0], [1.0, 2.0, 3.0], vectorized=True)
