"""The statistics module (repgeom_eval.functional.stats): Pearson, Spearman, Kendall τ_b and AUROC against scipy and
sklearn on random data with ties, NaN and ±inf, every rule of its missing-value policy, and the commands that
changed when their own copies were merged into it."""

import math

import numpy as np
import pytest
import scipy.stats
import torch
from sklearn.metrics import roc_auc_score

from repgeom_eval.functional.stats import (
    MIN_PAIRS,
    auroc,
    complete_pairs,
    kendall_tau_b,
    pearson,
    rankdata,
    spearman,
)

NAN, INF = float("nan"), float("inf")
CORRELATIONS = (pearson, spearman, kendall_tau_b)


def _with_missing(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """x with many ties, y correlated with x and rounded (ties too); NaN and ±inf sprinkled over both."""
    x = rng.integers(0, 6, n).astype(float)
    y = np.round(0.4 * x + rng.normal(size=n), 1)
    x[rng.choice(n, 4, replace=False)] = NAN
    y[rng.choice(n, 3, replace=False)] = rng.choice([NAN, INF, -INF], 3)
    return x, y


@pytest.mark.parametrize("seed", range(6))
def test_equal_scipy_over_the_complete_pairs(seed):
    rng = np.random.default_rng(seed)
    x, y = _with_missing(rng, 41)
    keep = np.isfinite(x) & np.isfinite(y)
    assert complete_pairs(x, y).n_dropped == int((~keep).sum()) > 0
    xs, ys = x[keep], y[keep]
    assert pearson(x, y) == pytest.approx(scipy.stats.pearsonr(xs, ys).statistic, abs=1e-12)
    assert spearman(x, y) == pytest.approx(scipy.stats.spearmanr(xs, ys).statistic, abs=1e-12)
    assert kendall_tau_b(x, y) == pytest.approx(scipy.stats.kendalltau(xs, ys).statistic, abs=1e-12)
    assert kendall_tau_b(x, y, block=4) == pytest.approx(kendall_tau_b(x, y), abs=1e-12)
    assert rankdata(xs).numpy() == pytest.approx(scipy.stats.rankdata(xs))


@pytest.mark.parametrize("seed", range(6))
def test_auroc_equals_sklearn_over_the_complete_pairs(seed):
    rng = np.random.default_rng(seed)
    scores = np.round(rng.normal(size=120), 1)  # many ties
    labels = (rng.random(120) < 0.5 + 0.3 * np.tanh(scores)).astype(float)
    scores[rng.choice(120, 5, replace=False)] = rng.choice([NAN, INF, -INF], 5)
    labels[rng.choice(120, 2, replace=False)] = NAN  # a missing label drops its pair too
    keep = np.isfinite(scores) & np.isfinite(labels)
    assert auroc(scores, labels) == pytest.approx(roc_auc_score(labels[keep], scores[keep]), abs=1e-12)


def test_complete_pairs_keeps_the_order_and_counts_the_dropped():
    pairs = complete_pairs([1.0, NAN, 3.0, INF, 5.0, 6.0], [6.0, 5.0, -INF, 3.0, 2.0, NAN])
    assert pairs.x.tolist() == [1.0, 5.0] and pairs.y.tolist() == [6.0, 2.0]
    assert pairs.n == 2 and pairs.n_dropped == 4
    assert complete_pairs([], []).n == 0


@pytest.mark.parametrize("stat", [*CORRELATIONS, auroc])
def test_unequal_lengths_raise(stat):
    with pytest.raises(ValueError, match="differ in length: 2 vs 3"):
        stat([1, 0], [1, 0, 1])


@pytest.mark.parametrize("stat", CORRELATIONS)
def test_fewer_than_three_complete_pairs_give_nan(stat):
    assert MIN_PAIRS == 3
    assert math.isnan(stat([1, 2], [3, 5]))  # two points: ±1 whatever the data, so no information
    assert math.isnan(stat([1, 2, NAN, 4], [3, 5, 6, INF]))  # four pairs, two complete
    assert math.isnan(stat([NAN, NAN, NAN], [1, 2, 3]))
    assert math.isnan(stat([], []))
    want = {pearson: 0.5, spearman: 0.5, kendall_tau_b: 1 / 3}[stat]  # three pairs are enough
    assert stat([1, 2, 3], [2, 1, 3]) == pytest.approx(want, abs=1e-15)


@pytest.mark.parametrize("stat", CORRELATIONS)
def test_a_constant_variable_gives_nan(stat):
    assert math.isnan(stat([1, 1, 1, 1], [1, 2, 3, 4]))
    assert math.isnan(stat([1, 2, 3, 4], [7, 7, 7, 7]))
    assert math.isnan(stat([0.1] * 5, [1, 2, 3, 4, 5]))  # mean(0.1, …) ≠ 0.1 in float: still no variance
    assert math.isnan(stat([1, 2, 3, 9], [5, 5, 5, NAN]))  # constant over the complete pairs


@pytest.mark.parametrize("stat", CORRELATIONS)
def test_infinities_are_missing_not_extreme_ranks(stat):
    # As an extreme rank, inf would make these discordant; as a missing value it leaves a perfect trend.
    assert stat([1, 2, 3, 4, INF], [1, 2, 3, 4, -5]) == pytest.approx(1.0)
    assert stat([1, 2, 3, 4, -INF], [1, 2, 3, 4, 5]) == pytest.approx(1.0)


def test_perfect_trends_and_the_clip():
    x = np.linspace(0.1, 0.7, 7) * 3
    for stat in CORRELATIONS:
        assert stat(x, 1e-3 * x + 0.1) == pytest.approx(1.0, abs=1e-15)
        assert stat(x, -x) == pytest.approx(-1.0, abs=1e-15)
        assert -1.0 <= stat(x, 1e-3 * x + 0.1) <= 1.0
    rng = np.random.default_rng(3)
    for _ in range(200):
        a = rng.normal(size=5)
        assert -1.0 <= pearson(a, 7.3 * a + 0.2) <= 1.0


def test_oracles_with_ties():
    m = [0.1, 0.3, 0.3, 0.5]
    assert spearman(m, range(4)) == pytest.approx(0.948683, abs=1e-6)
    assert kendall_tau_b(m, range(4)) == pytest.approx(0.912871, abs=1e-6)
    assert pearson([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


def test_inputs_of_every_kind_give_one_answer():
    x, y = [3.0, 1.0, 2.0, 5.0, 4.0], [2.0, 1.0, 4.0, 3.0, 5.0]
    want = spearman(x, y)
    grad = torch.tensor(x, requires_grad=True)
    for xs in (x, np.asarray(x), np.asarray(x, dtype=np.float32), torch.tensor(x), torch.tensor(x).float(), grad,
               np.asarray(x).reshape(5, 1)):
        assert spearman(xs, y) == want
    assert spearman(range(5), range(5)) == 1.0
    assert isinstance(pearson(x, y), float) and isinstance(auroc(x, [0, 1, 0, 1, 1]), float)


def test_rankdata():
    assert rankdata([0.1, 0.3, 0.3, 0.5]).tolist() == [1.0, 2.5, 2.5, 4.0]
    assert rankdata([2, 2, 2]).tolist() == [2.0, 2.0, 2.0]
    assert rankdata([INF, -INF, 0.0]).tolist() == [3.0, 1.0, 2.0]  # ±inf rank as the extremes
    assert rankdata([]).numel() == 0
    with pytest.raises(ValueError, match="NaN has no rank"):
        rankdata([1.0, NAN])


def test_auroc_edge_cases():
    assert auroc([0.1, 0.9, 0.5], [0, 1, 1]) == 1.0
    assert auroc([0.1, 0.9, 0.5], [1, 0, 0]) == 0.0
    assert auroc([0.4, 0.4, 0.4, 0.4], [0, 1, 0, 1]) == 0.5  # every pair tied: one half each
    assert auroc([0.2, 0.8], [False, True]) == 1.0  # one of each class is enough; bool labels
    assert math.isnan(auroc([0.1, 0.2], [1, 1]))  # no negative
    assert math.isnan(auroc([0.1, 0.2], [0, 0]))  # no positive
    assert math.isnan(auroc([0.1, NAN, 0.3], [1, 0, 1]))  # the only negative is missing
    assert math.isnan(auroc([], []))
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        auroc([0.1, 0.2, 0.3], [0, 1, 2])
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        auroc([0.1, 0.2], [0, 0.5])


# -- the outputs that changed when the copies were merged --------------------------------------------------------

def test_condensation_trend_leaves_a_nan_layer_out():
    """Before: a NaN layer made the depth trend NaN (scipy's propagate). Now the layer is left out."""
    from repgeom_eval.plugins.condensation import Condensation

    m = [0.2, NAN, 0.5, 0.4, 0.9]
    summary = Condensation.across_layers({str(k): {"mean_cosine": v} for k, v in enumerate(m)}, list(range(5)))
    finite = [0.2, 0.5, 0.4, 0.9]
    assert summary["spearman"] == pytest.approx(scipy.stats.spearmanr(finite, [0, 2, 3, 4]).statistic, abs=1e-12)
    assert summary["kendall"] == pytest.approx(scipy.stats.kendalltau(finite, [0, 2, 3, 4]).statistic, abs=1e-12)
    two_left = {str(k): {"mean_cosine": v} for k, v in enumerate([0.2, NAN, NAN, 0.9])}
    assert math.isnan(Condensation.across_layers(two_left, list(range(4)))["spearman"])


def test_ppl_bins_correlations_count_the_complete_pairs():
    """Before: an infinite group perplexity made both correlations NaN and ``n`` counted every group."""
    from repgeom_eval.analyses.ppl_bins import correlations

    ppl, disp = [2.0, 3.0, 4.0, INF, 6.0], [0.50, 0.52, 0.55, 0.56, 0.61]
    got = correlations(ppl, disp)
    assert got["n"] == 4
    assert got["pearson"] == pytest.approx(scipy.stats.pearsonr([2, 3, 4, 6], [0.50, 0.52, 0.55, 0.61]).statistic,
                                           abs=1e-12)
    assert got["spearman"] == pytest.approx(1.0)
    assert correlations([2.0, 3.0, 4.0], [0.5, 0.6, 0.55]) == {
        "pearson": pytest.approx(scipy.stats.pearsonr([2, 3, 4], [0.5, 0.6, 0.55]).statistic, abs=1e-12),
        "spearman": pytest.approx(0.5), "n": 3}
