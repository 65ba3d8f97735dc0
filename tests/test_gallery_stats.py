"""The gallery's one decision rule (experiments/gallery.py, issue 35 item 2) against scipy and brute-force references:
t-intervals, exact sign-flip and pairing permutation p values, Fisher-z intervals, the t test of a correlation,
Mann-Whitney for an AUROC, the percentile bootstrap only where it holds its own estimate, and Holm's correction
against closed testing with Bonferroni local tests."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import gallery  # noqa: E402


@pytest.mark.parametrize("n", [3, 6, 10])
def test_t_interval_and_t_p_are_scipys(n):
    x = np.random.default_rng(n).normal(0.3, 1.0, n)
    want = stats.ttest_1samp(x, 0.0)
    lo, hi = gallery.t_interval(list(x))
    ci = want.confidence_interval(0.95)
    assert lo == pytest.approx(ci.low, abs=1e-12) and hi == pytest.approx(ci.high, abs=1e-12)
    assert gallery.t_test_p(list(x)) == pytest.approx(want.pvalue, rel=1e-10)
    assert gallery.t_test_p(list(x), 0.2) == pytest.approx(stats.ttest_1samp(x, 0.2).pvalue, rel=1e-10)


@pytest.mark.parametrize("values", [[0.5, -0.1, 0.3, 0.8, 0.2, 0.4], [1.0, 2.0, 3.0], [0.2, 0.2, -0.2, 0.0, 0.7],
                                    list(np.random.default_rng(1).normal(0.4, 1, 10))])
def test_sign_flip_p_is_scipys_exact_permutation_test(values):
    want = stats.permutation_test((np.asarray(values),), np.mean, permutation_type="samples", n_resamples=np.inf,
                                  alternative="two-sided").pvalue
    assert gallery.sign_flip_p(values) == pytest.approx(want, rel=1e-12)


def test_the_smallest_exact_sign_flip_p_at_n_units_is_two_over_two_to_the_n():
    """Why six tasks or three seeds cannot decide under Holm: the exact test's floor."""
    assert gallery.sign_flip_p([1, 2, 3, 4, 5, 6]) == pytest.approx(2 / 64)
    assert gallery.sign_flip_p([1, 2, 3]) == pytest.approx(2 / 8)
    # the exact Wilcoxon signed-rank test has the same floor
    assert stats.wilcoxon([1, 2, 3, 4, 5, 6], method="exact").pvalue == pytest.approx(2 / 64)


@pytest.mark.parametrize("kind", ["pearson", "spearman"])
@pytest.mark.parametrize("n", [4, 5, 7])
def test_exact_permutation_p_of_a_correlation_is_scipys(kind, n):
    rng = np.random.default_rng(n)
    x, y = rng.normal(size=n), rng.normal(size=n)
    y = y + x
    stat = (lambda a: stats.pearsonr(a, x).statistic) if kind == "pearson" else \
        (lambda a: stats.spearmanr(a, x).statistic)
    want = stats.permutation_test((y,), stat, permutation_type="pairings", n_resamples=np.inf,
                                  alternative="two-sided").pvalue
    assert gallery.permutation_correlation_p(x, y, kind) == pytest.approx(want, rel=1e-12)
    ref = stats.pearsonr(x, y).statistic if kind == "pearson" else stats.spearmanr(x, y).statistic
    assert gallery.correlation(x, y, kind) == pytest.approx(ref, abs=1e-12)


@pytest.mark.parametrize("n", [1, 2, 5, 7])
def test_the_permutation_table_holds_every_permutation_once(n):
    table = gallery._all_permutations(n)
    assert table.shape == (math.factorial(n), n)
    assert len({tuple(row) for row in table.tolist()}) == math.factorial(n)
    assert (np.sort(table, axis=1) == np.arange(n)).all()


@pytest.mark.parametrize("kind", ["pearson", "spearman"])
def test_exact_permutation_p_with_ties_is_scipys(kind):
    x = np.array([1.0, 2, 2, 3, 5, 5, 7])
    y = np.array([2.0, 1, 3, 3, 6, 4, 6])
    stat = (lambda a: stats.pearsonr(a, x).statistic) if kind == "pearson" else \
        (lambda a: stats.spearmanr(a, x).statistic)
    want = stats.permutation_test((y,), stat, permutation_type="pairings", n_resamples=np.inf,
                                  alternative="two-sided").pvalue
    assert gallery.permutation_correlation_p(x, y, kind) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("kind", ["pearson", "spearman"])
def test_exact_permutation_p_of_many_series_at_once_is_each_series_alone(kind):
    rng = np.random.default_rng(11)
    x = rng.normal(size=8)
    ys = np.column_stack([x + rng.normal(size=8) * s for s in (0.2, 1.0, 5.0)] + [np.round(x), np.ones(8)])
    many = gallery.permutation_correlation_p(x, ys, kind)
    for j in range(ys.shape[1]):
        alone = gallery.permutation_correlation_p(x, ys[:, j], kind)
        assert (math.isnan(alone) and math.isnan(many[j])) or many[j] == alone, j
    assert math.isnan(many[-1])  # a constant series has no correlation
    t = gallery.correlation_test("t", x, ys[:, 1], kind, exact_p=float(many[1]))
    assert t.p == gallery.correlation_test("t", x, ys[:, 1], kind).p


def test_fisher_z_interval_is_scipys_for_pearson_and_widened_for_spearman():
    rng = np.random.default_rng(3)
    for n in (5, 12, 40):
        x = rng.normal(size=n)
        y = x + rng.normal(size=n)
        res = stats.pearsonr(x, y)
        ci = res.confidence_interval(0.95)
        lo, hi = gallery.fisher_z_interval(res.statistic, n, "pearson")
        assert lo == pytest.approx(ci.low, abs=1e-12) and hi == pytest.approx(ci.high, abs=1e-12)
        rho = stats.spearmanr(x, y).statistic
        se = math.sqrt(1.06 / (n - 3))
        q = stats.norm.ppf(0.975)
        lo, hi = gallery.fisher_z_interval(rho, n, "spearman")
        assert lo == pytest.approx(math.tanh(math.atanh(rho) - q * se), abs=1e-12)
        assert hi == pytest.approx(math.tanh(math.atanh(rho) + q * se), abs=1e-12)
        assert lo <= rho <= hi
    assert all(math.isnan(v) for v in gallery.fisher_z_interval(1.0, 10))
    assert all(math.isnan(v) for v in gallery.fisher_z_interval(0.5, 3))


def test_t_test_of_a_correlation_is_scipys_pearsonr_and_spearmanr_p():
    rng = np.random.default_rng(4)
    x = rng.normal(size=17)
    y = 0.4 * x + rng.normal(size=17)
    r, rho = stats.pearsonr(x, y), stats.spearmanr(x, y)
    assert gallery.correlation_t_p(r.statistic, 17) == pytest.approx(r.pvalue, rel=1e-9)
    assert gallery.correlation_t_p(rho.statistic, 17) == pytest.approx(rho.pvalue, rel=1e-9)


def test_small_samples_get_no_bootstrap():
    t = gallery.mean_test("m", [0.1, -0.3, -0.2, -0.4, -0.1, -0.2], expect="below")
    assert t.interval.startswith("t-interval") and t.test.startswith("exact sign-flip") and t.n == 6
    c = gallery.correlation_test("c", [1, 2, 3, 4, 5], [5, 3, 4, 1, 2], "pearson")
    assert c.interval.startswith("Fisher z") and c.test.startswith("exact permutation (120")
    ci = stats.pearsonr([1, 2, 3, 4, 5], [5, 3, 4, 1, 2]).confidence_interval(0.95)
    assert (c.low, c.high) == pytest.approx((ci.low, ci.high), abs=1e-12)


def test_a_bootstrap_that_leaves_out_its_own_estimate_is_replaced():
    rng = np.random.default_rng(5)
    x = rng.normal(size=20)
    y = -0.9 * x + 0.3 * rng.normal(size=20)
    est = gallery.correlation(x, y, "spearman")
    shifted = np.linspace(est + 0.05, est + 0.5, 2000)  # resamples biased toward 0: all above the estimate
    t = gallery.correlation_test("c", x, y, "spearman", draws=shifted)
    assert t.interval.startswith("Fisher z") and t.low <= est <= t.high
    assert (t.low, t.high) == pytest.approx(gallery.fisher_z_interval(est, 20, "spearman"))
    ok = gallery.correlation_test("c", x, y, "spearman", draws=np.linspace(est - 0.1, est + 0.1, 2001))
    assert ok.interval.startswith("percentile bootstrap") and ok.low <= est <= ok.high
    assert ok.p == pytest.approx(stats.spearmanr(x, y).pvalue, rel=1e-9)
    m = gallery.mean_test("m", list(x), draws=np.linspace(5, 6, 100))
    assert m.interval.startswith("t-interval") and m.p == pytest.approx(stats.ttest_1samp(x, 0).pvalue)
    s = gallery.statistic_test("s", "V-measure difference", 0.1, np.linspace(0.15, 0.3, 500), 96)
    assert s.interval.startswith("normal") and s.low <= 0.1 <= s.high


def test_auroc_p_is_mann_whitney():
    rng = np.random.default_rng(6)
    y = rng.integers(0, 2, 200)
    s = rng.normal(size=200) + 0.3 * y
    u = stats.mannwhitneyu(s[y == 1], s[y == 0], alternative="two-sided")
    t = gallery.auroc_test("a", s, y, draws=rng.normal(0.58, 0.02, 2000))
    from sklearn.metrics import roc_auc_score

    assert t.estimate == pytest.approx(roc_auc_score(y, s)) and t.p == pytest.approx(u.pvalue)


def _holm_by_closed_testing(p):
    """Closed testing with Bonferroni local tests: the adjusted p of H_i is the largest, over every intersection
    containing i, of |S| · min_{j in S} p_j (capped at 1)."""
    m = len(p)
    out = []
    for i in range(m):
        worst = 0.0
        for k in range(1, m + 1):
            for s in itertools.combinations(range(m), k):
                if i in s:
                    worst = max(worst, min(1.0, k * min(p[j] for j in s)))
        out.append(worst)
    return out


@pytest.mark.parametrize("seed", range(8))
def test_holm_equals_closed_testing_with_bonferroni(seed):
    rng = np.random.default_rng(seed)
    p = list(rng.uniform(0, 0.2, int(rng.integers(1, 7))))
    if seed % 2:
        p[0] = p[-1]  # a tie
    assert gallery.holm(p) == pytest.approx(_holm_by_closed_testing(p), abs=1e-15)


def test_holm_keeps_an_undefined_test_in_the_family():
    got = gallery.holm([0.01, float("nan"), 0.04])
    assert got[0] == pytest.approx(0.03) and math.isnan(got[1]) and got[2] == pytest.approx(0.08)


def test_decide_gives_verdicts_from_holm_adjusted_p_and_the_side_of_the_estimate():
    mk = lambda name, est, p: gallery.StatTest(name, "mean", est, est - 1, est + 1, p, 20, "t", "t")  # noqa: E731
    f = gallery.decide([mk("a", -0.5, 0.004), mk("b", 0.4, 0.01), mk("c", -0.2, 0.03)], "a", "demo")
    t = f["tests"]
    assert f["verdict"] == gallery.FOLLOWS and t["a"]["role"] == gallery.PRIMARY and t["b"]["role"] == gallery.FAMILY
    assert t["a"]["p_holm"] == pytest.approx(0.012) and t["b"]["p_holm"] == pytest.approx(0.02)
    assert t["b"]["verdict"] == gallery.OPPOSITE  # significant after Holm, on the other side
    assert t["c"]["p_holm"] == pytest.approx(0.03) and t["c"]["verdict"] == gallery.FOLLOWS
    f = gallery.decide([mk("a", -0.5, 0.02), mk("b", 0.4, 0.02), mk("c", -0.2, 0.02)], "a", "demo")
    assert f["verdict"] == gallery.CANNOT_TELL  # 0.02 alone would pass; three tests at 0.02 do not
    e = gallery.explore(mk("x", -0.5, 0.02))
    assert e.role == gallery.EXPLORATORY and e.verdict == gallery.FOLLOWS and e.p_holm is None
    with pytest.raises(ValueError):
        gallery.decide([mk("a", 1, 0.1)], "b", "demo")


def test_six_units_under_holm_over_four_settings_cannot_decide():
    """The which_layer_embeds case: every task lower than the last layer still leaves p ≥ 1/32 per setting, and
    Holm over four settings needs 0.0125."""
    family = [gallery.mean_test(f"s{i}", [-0.1, -0.2, -0.05, -0.3, -0.15, -0.12], expect="above") for i in range(4)]
    f = gallery.decide(family, "s0", "middle layer")
    assert family[0].p == pytest.approx(2 / 64)
    assert all(t["verdict"] == gallery.CANNOT_TELL for t in f["tests"].values())
