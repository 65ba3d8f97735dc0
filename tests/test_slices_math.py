"""Hardness analysis math (repgeom_eval.analyses.slices, lm-eval aggregations) against brute force and the oracles of
docs/metrics.md#oracle-values."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from repgeom_eval.analyses import slices
from repgeom_eval.functional.dispersion import pairwise_dispersion
from repgeom_eval.functional.stats import auroc
from repgeom_eval.analyses.queries import decode_vector, encode_vector

import torch  # noqa: E402


def brute_c(x: np.ndarray, members: np.ndarray) -> np.ndarray:
    """Mean cosine distance of each row to the member rows, itself excluded: the N×N way."""
    u = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    dist = 1.0 - u @ u.T
    out = []
    for i in range(len(x)):
        others = [j for j in np.flatnonzero(members) if j != i]
        out.append(dist[i, others].mean() if others else np.nan)
    return np.asarray(out)


def brute_d(x: np.ndarray) -> float:
    return float(pairwise_dispersion(torch.as_tensor(x)))


def test_oracle_per_sample_scores():
    x1 = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])  # oracle #1: c = (1.5, 1.0, 1.5), D = 4/3
    got = slices.query_scores(x1, np.array([1, 1, 1]))
    np.testing.assert_allclose(got["c"], [1.5, 1.0, 1.5], atol=1e-12)
    assert got["c"].mean() == pytest.approx(4 / 3, abs=1e-12)
    x2 = np.array([[3.0, 4.0], [1.0, 0.0], [0.0, 2.0]])  # c = (0.3, 0.7, 0.6)
    np.testing.assert_allclose(slices.query_scores(x2, np.array([0, 1, 0]))["c"], [0.3, 0.7, 0.6], atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_query_scores_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(37, 9)) + rng.normal(size=9)
    x[5] = 0.0  # a zero row: cosine 0 with everything (the Q form, docs/metrics.md#cosine-dispersion)
    ok = rng.random(37) < 0.4
    got = slices.query_scores(x, ok)
    np.testing.assert_allclose(got["c"], brute_c(x, np.ones(37, bool)), atol=1e-12)
    np.testing.assert_allclose(got["c_correct"], brute_c(x, ok), atol=1e-12)
    np.testing.assert_allclose(got["c_incorrect"], brute_c(x, ~ok), atol=1e-12)
    # mean of c over a set = D of that set
    assert got["c"].mean() == pytest.approx(brute_d(x), abs=1e-12)
    assert got["c_correct"][ok].mean() == pytest.approx(brute_d(x[ok]), abs=1e-12)
    assert got["c_incorrect"][~ok].mean() == pytest.approx(brute_d(x[~ok]), abs=1e-12)


def test_shard_sums_add_up_to_the_whole():
    """What task.apply_filters does across ranks: per-rank SetSums, added, give every rank the global c_i."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(30, 5)) + 0.3
    u = slices.unit_rows(x)
    shards = [np.arange(0, 30, 3), np.arange(1, 30, 3), np.arange(2, 30, 3)]
    total = sum(slices.SetSums.of(u[s]).pack() for s in shards)
    whole = slices.SetSums.unpack(total)
    everyone = np.ones(30, bool)
    for s in shards:
        np.testing.assert_allclose(slices.scores_against(u[s], everyone[s], whole),
                                   slices.query_scores(x, everyone)["c"][s], atol=1e-12)


def test_singleton_set_gives_nan():
    x = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    got = slices.query_scores(x, np.array([1, 0, 0]))
    assert math.isnan(got["c_correct"][0])  # the only correct query has no other correct query


def test_auroc_matches_sklearn_with_ties():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(0)
    s = np.round(rng.normal(size=200), 1)  # many ties
    y = (rng.random(200) < 0.5 + 0.2 * np.tanh(s)).astype(float)
    assert auroc(s, y) == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    assert auroc([0.1, 0.9, 0.5], [0, 1, 1]) == 1.0
    assert math.isnan(auroc([0.1, 0.2], [1, 1]))


def test_decile_accuracy():
    scores = np.arange(50, dtype=float)[::-1]
    correct = (np.arange(50) % 2 == 0).astype(float)  # correct at even positions
    low, high, k = slices.decile_accuracy(scores, correct)
    assert k == 5
    order = np.argsort(scores)
    assert low == correct[order[:5]].mean() and high == correct[order[-5:]].mean()
    assert slices.decile_accuracy([0.3, 0.1], [1, 0]) == (0.0, 1.0, 1)
    # ties: incorrect first, whatever the input order
    assert slices.decile_accuracy([0.5, 0.5], [1, 0]) == slices.decile_accuracy([0.5, 0.5], [0, 1]) == (0.0, 1.0, 1)


def test_controlled_slices_match_brute_force_draws():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(60, 6)) + 0.5
    ok = np.arange(60) < 25
    ppl = rng.uniform(2, 9, size=60)
    curve = slices.controlled_slices(x, ok, ppl, size=20, seeds=3, seed=7)
    assert curve.size == 20 and len(curve.dispersion) == 11
    pos, neg = np.flatnonzero(ok), np.flatnonzero(~ok)
    for s in range(3):  # redraw the same slices and compute D the N×N way
        r = np.random.default_rng([7, s])
        for i, f in enumerate(slices.FRACTIONS):
            k = round(20 * f)
            idx = np.concatenate([r.choice(pos, k, replace=False), r.choice(neg, 20 - k, replace=False)])
            assert curve.dispersion[i][s] == pytest.approx(brute_d(x[idx]), abs=1e-12)
            assert curve.perplexity[i][s] == pytest.approx(ppl[idx].mean(), abs=1e-12)
    assert curve.dispersion_mean[3] == pytest.approx(np.mean(curve.dispersion[3]))
    assert curve.dispersion_se[3] == pytest.approx(np.std(curve.dispersion[3], ddof=1) / math.sqrt(3))


@pytest.mark.parametrize("spread_correct", [True, False])
def test_planted_geometry_gives_the_expected_sign(spread_correct):
    """Correct queries spread over all directions, incorrect ones clustered: dispersion rises with accuracy."""
    rng = np.random.default_rng(4)
    spread = rng.normal(size=(150, 16))
    clustered = np.ones((150, 16)) + 0.2 * rng.normal(size=(150, 16))
    x = np.concatenate([spread, clustered]) if spread_correct else np.concatenate([clustered, spread])
    ok = np.arange(300) < 150
    curve = slices.controlled_slices(x, ok, size=100, seeds=10)
    assert curve.spearman == pytest.approx(1.0 if spread_correct else -1.0)
    assert curve.perplexity is None


def test_small_pool_shrinks_slices_with_a_warning():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(30, 4))
    ok = np.arange(30) < 12
    with pytest.warns(RuntimeWarning, match="using slices of 12"):
        curve = slices.controlled_slices(x, ok, size=100, seeds=2)
    assert curve.size == 12 and curve.requested_size == 100
    assert slices.slice_size(12, 18, slices.FRACTIONS, 100) == 12
    assert slices.slice_size(1, 50, slices.FRACTIONS, 100) == 1


def test_calibration_recovers_a_planted_relation():
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.normal(size=(900, 12)), np.ones((900, 12)) + 0.3 * rng.normal(size=(900, 12))])
    ok = np.arange(1800) < 900
    with pytest.warns(RuntimeWarning, match="using slices of"):
        result = slices.calibrate(x, ok, seeds=3)
    assert len(result.test_mae) == 3 and set(result.chosen) <= set(slices.REGRESSORS)
    assert result.mae_mean < 0.08  # dispersion determines the fraction correct closely here
    with pytest.raises(ValueError, match="splits"):
        slices.calibrate(x, ok, splits=(0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match="too few"):
        slices.calibrate(x[:20], ok[:20])


def test_vector_encoding_round_trip():
    v = np.random.default_rng(0).normal(size=33).astype(np.float32)
    np.testing.assert_array_equal(decode_vector(encode_vector(v)), v)


def test_aggregations_from_items_match_direct_computation_in_any_order():
    import repgeom_eval.lmeval.metrics as metrics
    rng = np.random.default_rng(6)
    x = rng.normal(size=(40, 8)) + 0.4
    ok = rng.random(40) < 0.5
    ppl = rng.uniform(1, 5, size=40)
    sc = slices.query_scores(x, ok)
    items = [metrics.query_items(sc["c"][i], sc["c_correct"][i], sc["c_incorrect"][i], bool(ok[i]), ppl[i], x[i], i)
             for i in range(40)]
    random.Random(0).shuffle(items)  # lm-eval hands items over in rank order, not document order

    def column(name):
        return [item[name] for item in items]

    assert metrics.mean_of_defined(column("repgeom_dispersion")) == pytest.approx(brute_d(x), abs=1e-12)
    assert metrics.mean_of_defined(column("repgeom_dispersion_correct")) == pytest.approx(brute_d(x[ok]), abs=1e-12)
    assert metrics.mean_of_defined(column("repgeom_dispersion_incorrect")) == pytest.approx(brute_d(x[~ok]),
                                                                                            abs=1e-12)
    assert metrics.auroc(column("repgeom_auroc")) == pytest.approx(auroc(sc["c"], ok), abs=1e-12)
    low, high, _ = slices.decile_accuracy(sc["c"], ok)
    assert metrics.accuracy_low_c(column("repgeom_acc_low_c")) == low
    assert metrics.accuracy_high_c(column("repgeom_acc_high_c")) == high
    with pytest.warns(RuntimeWarning):
        got = metrics.slice_spearman(column("repgeom_slice_spearman"), size=100, seeds=4)
    with pytest.warns(RuntimeWarning):
        want = slices.controlled_slices(x.astype(np.float32), ok, ppl, size=100, seeds=4).spearman
    assert got == pytest.approx(want, abs=1e-9) or (math.isnan(got) and math.isnan(want))
    assert math.isnan(metrics.mean_of_defined([None, None]))


def test_document_items_and_correlations():
    import repgeom_eval.lmeval.metrics as metrics
    items = [metrics.document_items(p, d) for p, d in [(2.0, 0.5), (3.0, 0.6), (4.0, 0.55), (5.0, float("nan"))]]
    assert items[3]["repgeom_token_dispersion"] is None
    pairs = [i["repgeom_ppl_spearman"] for i in items]
    assert metrics.spearman(pairs) == pytest.approx(0.5)
    assert metrics.pearson(pairs) == pytest.approx(np.corrcoef([2, 3, 4], [0.5, 0.6, 0.55])[0, 1])


def test_prompt_perplexity_slices_are_slice_means_and_change_nothing_else():
    """The prompt's perplexity is averaged over the same slices as the answer's; adding it changes no other number."""
    rng = np.random.default_rng(8)
    x = rng.normal(size=(240, 6))
    ok = np.arange(240) < 120
    ppl = rng.uniform(1, 9, size=240)
    prompt = np.where(ok, 20.0, 40.0) + rng.random(240)  # planted: harder queries have worse-predicted prompts
    plain = slices.controlled_slices(x, ok, ppl, size=50, seeds=3)
    both = slices.controlled_slices(x, ok, ppl, size=50, seeds=3, prompt_ppl=prompt)
    assert both.dispersion == plain.dispersion and both.perplexity == plain.perplexity
    assert plain.prompt_perplexity is None and math.isnan(plain.spearman_prompt_perplexity)
    for i, f in enumerate(both.fractions):  # a slice with k correct of 50: mean prompt ppl ≈ 20 + 20·(1 − f)
        for s in range(3):
            assert 20 + 20 * (1 - f) <= both.prompt_perplexity[i][s] <= 21 + 20 * (1 - f)
    assert both.prompt_perplexity_mean == pytest.approx(np.mean(both.prompt_perplexity, axis=1).tolist())
    assert both.spearman_prompt_perplexity == pytest.approx(-1.0)
    only_prompt = slices.controlled_slices(x, ok, None, size=50, seeds=3, prompt_ppl=prompt)
    assert only_prompt.perplexity is None and only_prompt.prompt_perplexity == both.prompt_perplexity
    with pytest.raises(ValueError, match="prompt perplexities"):
        slices.controlled_slices(x, ok, ppl, size=50, seeds=3, prompt_ppl=prompt[:10])


def test_query_items_carry_both_perplexities():
    import repgeom_eval.lmeval.metrics as metrics
    item = metrics.query_items(0.3, 0.2, float("nan"), True, 4.5, np.ones(3), 7, 12.0)["repgeom_slice_spearman"]
    assert item["ppl"] == 4.5 and item["prompt_ppl"] == 12.0 and item["doc_id"] == 7
    item = metrics.query_items(0.3, 0.2, float("nan"), True, 4.5, np.ones(3), 7)["repgeom_slice_spearman"]
    assert item["prompt_ppl"] is None  # unknown (a one-token context): null, not NaN, in the samples JSON


def test_calibration_keeps_its_test_slices():
    """The test slices behind the MAE (dispersion, true and predicted accuracy), for a calibration plot."""
    rng = np.random.default_rng(9)
    x = np.concatenate([rng.normal(size=(300, 8)), 2 + 0.3 * rng.normal(size=(300, 8))])
    ok = np.arange(600) < 300
    with pytest.warns(RuntimeWarning):
        cal = slices.calibrate(x, ok, size=100, seeds=3)
    assert len(cal.test_slices) == 3
    for seed, points in enumerate(cal.test_slices):
        assert len(points["dispersion"]) == len(points["accuracy"]) == len(points["predicted"]) == 51
        mae = np.mean(np.abs(np.asarray(points["predicted"]) - np.asarray(points["accuracy"])))
        assert mae == pytest.approx(cal.test_mae[seed], abs=1e-12)
