"""Multi-view metrics (InfoNCE, LiDAR, DiME) against oracles #15–#20 of docs/metrics.md#oracle-values, brute-force
references, and the metric conformance check."""

import itertools
import math

import pytest
import torch

from repgeom_eval.spec.errors import RepgeomError

from repgeom_eval import Consumes, LayerBatch
from repgeom_eval.functional.contrastive import (
    _matrix_entropy,
    dime,
    dime_exact,
    infonce,
    lidar,
    lidar_from_stats,
    lidar_stats,
)
from repgeom_eval.functional.dispersion import unit
from repgeom_eval.plugins import views_metrics
from repgeom_eval.plugins.views_metrics import DiME, InfoNCE, LiDAR

T = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731

I2 = T([(1, 0), (0, 1)])
A3 = unit(T([(1, 0), (0.6, 0.8), (-1, 0.2)]))
B3 = unit(T([(0.9, 0.1), (0.5, 0.9), (-1, -0.1)]))
X17 = T([[(1, 0.2), (1, -0.2)], [(-1, 0), (-1, 0.4)], [(0, 1), (0.2, 1)]])
X_DEGENERATE = T([[(1, 0), (1, 0)], [(-1, 0), (-1, 0)]])
K_A = T([[1, 0.6, 0], [0.6, 1, 0], [0, 0, 1]])
K_B_MOVED = T([[1, 0, 0.6], [0, 1, 0], [0.6, 0, 1]])


# -- InfoNCE -------------------------------------------------------------------------------------------------------

def test_infonce_oracle_15_identical_views():
    out = infonce(I2, I2)
    assert out["raw"] == pytest.approx(math.log1p(math.exp(-10)), abs=1e-12)
    assert out["raw"] == pytest.approx(4.539890e-5, abs=1e-10)
    assert out["mi_lower_bound"] == pytest.approx(0.999935, abs=1e-6)
    assert out["mi_lower_bound"] == pytest.approx(1 - math.log1p(math.exp(-10)) / math.log(2), abs=1e-12)


def test_infonce_swapped_rows():
    out = infonce(I2, I2.flip(0))
    assert out["raw"] == pytest.approx(10 + math.log1p(math.exp(-10)), abs=1e-9)
    assert out["raw"] == pytest.approx(10.0000454, abs=1e-6)
    assert out["mi_lower_bound"] == pytest.approx(-13.427016, abs=1e-6)


def test_infonce_oracle_16_and_simclr_form():
    out = infonce(A3, B3)
    assert out["raw"] == pytest.approx(0.0173316, abs=1e-7)
    assert out["mi_lower_bound"] == pytest.approx(0.984224, abs=1e-6)
    assert infonce(A3, B3, variant="simclr")["raw"] == pytest.approx(0.028680, abs=1e-6)


def test_infonce_brute_force_and_normalization():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(9, 5, generator=g, dtype=torch.float64), torch.randn(9, 5, generator=g, dtype=torch.float64)
    ua, ub = unit(a), unit(b)
    brute = -sum(math.log(math.exp(ua[i] @ ub[i] / 0.1) / sum(math.exp(ua[i] @ ub[j] / 0.1) for j in range(9)))
                 for i in range(9)) / 9
    assert infonce(a, b)["raw"] == pytest.approx(brute, abs=1e-12)
    assert infonce(3 * a, b)["raw"] == pytest.approx(brute, abs=1e-12)  # rows are unit-normalized by default
    assert infonce(3 * a, b, normalize=False)["raw"] != pytest.approx(brute, abs=1e-3)


def test_infonce_edge_cases():
    one = infonce(I2[:1], I2[:1])
    assert one["raw"] == 0.0 and math.isnan(one["mi_lower_bound"])
    with pytest.raises(ValueError):
        infonce(I2, A3)
    with pytest.raises(ValueError):
        infonce(I2, I2, variant="nope")


# -- LiDAR ---------------------------------------------------------------------------------------------------------

def _lidar_direct(x, delta=1e-4, eps=1e-7, variant="thilak"):
    """Direct formula with explicit centring (docs/metrics.md#lidar): the reference for lidar_from_stats."""
    n, q, d = x.shape
    mu_i = x.mean(1)
    mu = x.reshape(-1, d).mean(0)
    cb = mu_i - mu
    cw = (x - mu_i.unsqueeze(1)).reshape(-1, d)
    nb, nw = (n - 1, n * (q - 1)) if variant == "thilak" else (n, n * q)
    s_b = cb.T @ cb / nb
    s_w = cw.T @ cw / nw + delta * torch.eye(d, dtype=torch.float64)
    w, v = torch.linalg.eigh(s_w)
    r = v @ torch.diag(w ** -0.5) @ v.T
    lam = torch.linalg.eigvalsh(r @ s_b @ r)
    if variant == "thilak":
        p = lam.clamp_min(0) / lam.clamp_min(0).sum() + eps
        h = float(-(p * p.log()).sum())
        return {"lidar": math.exp(h), "log": h}, lam
    pos = lam[lam > 0]
    p = pos / pos.sum()
    raw = float(-(p * p.log()).sum())
    return {"raw": raw, "normalized": raw / min(math.log(n), math.log(d))}, lam


def test_lidar_oracle_17_information_flow():
    out = lidar(X17, variant="information_flow")
    assert out["raw"] == pytest.approx(0.148162, abs=1e-6)
    assert out["normalized"] == pytest.approx(0.213753, abs=1e-6)
    _, lam = _lidar_direct(X17, variant="information_flow")
    assert lam.tolist() == pytest.approx([6.847780, 194.948075], abs=1e-6)


def test_lidar_oracle_18_thilak():
    out = lidar(X17)
    assert out["lidar"] == pytest.approx(1.158082, abs=1e-6)
    assert out["log"] == pytest.approx(math.log(1.158082), abs=1e-6)
    assert out["log"] == pytest.approx(0.1468, abs=1e-4)


def test_lidar_degenerate_case():
    # Σ = diag(1e4, 0) in B's scaling (diag(2e4, 0) in Thilak's): a single positive eigenvalue.
    assert lidar(X_DEGENERATE, variant="information_flow")["raw"] == pytest.approx(0.0, abs=1e-9)
    eps = 1e-7
    closed = -(1 + eps) * math.log(1 + eps) - eps * math.log(eps)
    out = lidar(X_DEGENERATE)
    assert out["lidar"] == pytest.approx(1.0000015, abs=1e-7)
    assert out["log"] == pytest.approx(closed, abs=1e-9)


@pytest.mark.parametrize("variant", ["thilak", "information_flow"])
@pytest.mark.parametrize("shape", [(7, 5, 4), (5, 3, 9), (12, 16, 6)])
def test_lidar_from_stats_equals_direct_formula(variant, shape):
    g = torch.Generator().manual_seed(sum(shape))
    n, q, d = shape
    centres = 2 * torch.randn(n, 1, d, generator=g, dtype=torch.float64)
    x = centres + 0.5 * torch.randn(n, q, d, generator=g, dtype=torch.float64) + 1.0
    expected, _ = _lidar_direct(x, variant=variant)
    got = lidar(x, variant=variant)
    for key in expected:
        assert got[key] == pytest.approx(expected[key], abs=1e-8, rel=1e-8)
    # statistics of disjoint sets of texts add up
    s1, s2 = lidar_stats(x[:4]), lidar_stats(x[4:])
    merged = {k: s1[k] + s2[k] for k in ("n", "sum_mean", "sum_outer_mean", "scatter")}
    again = lidar_from_stats(q=q, variant=variant, **merged)
    for key in expected:
        assert again[key] == pytest.approx(expected[key], abs=1e-8, rel=1e-8)


def test_lidar_thilak_range_and_edge_cases():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 4, 5, generator=g, dtype=torch.float64)
    value = lidar(x)["lidar"]
    assert 1.0 <= value <= min(5, 19) + 1e-6
    assert all(math.isnan(v) for v in lidar(x[:1]).values())  # one class: no between-class scatter
    assert all(math.isnan(v) for v in lidar(x[:, :1]).values())  # one view: n(q−1) = 0
    assert lidar(x[:, :1], variant="information_flow")["raw"] >= 0  # B's code: S_w = δI
    with pytest.raises(ValueError):
        lidar(x, variant="nope")
    with pytest.raises(ValueError):
        lidar(x[0])


# -- DiME ----------------------------------------------------------------------------------------------------------

def test_dime_oracle_19_and_20():
    joint = float(_matrix_entropy(K_A * K_A))
    assert joint == pytest.approx(1.054427, abs=1e-6)
    assert dime_exact(K_A, K_A) == pytest.approx(0.029457, abs=1e-6)
    assert dime_exact(K_A, K_A) == pytest.approx((4 / 6) * (math.log(3) - joint), abs=1e-9)
    assert dime_exact(K_A, K_A) + joint == pytest.approx(1.083884, abs=1e-6)  # E_perm
    assert float(_matrix_entropy(K_A * K_B_MOVED)) == pytest.approx(math.log(3), abs=1e-9)
    assert dime_exact(K_A, K_B_MOVED) == pytest.approx(-0.014728, abs=1e-6)


def _views(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, d, generator=g, dtype=torch.float64)
    return base + 0.3 * torch.randn(n, d, generator=g, dtype=torch.float64), \
        base + 0.3 * torch.randn(n, d, generator=g, dtype=torch.float64)


def test_dime_seeded_is_reproducible_and_matches_a_manual_computation():
    za, zb = _views(6, 3, 0)  # N > D: still the N×N Gram
    assert dime(za, zb, seed=5) == dime(za, zb, seed=5)
    assert dime(za, zb, seed=5)["raw"] != dime(za, zb, seed=6)["raw"]
    ua, ub = unit(za), unit(zb)
    ka, kb = ua @ ua.T, ub @ ub.T
    assert ka.shape == (6, 6)
    g = torch.Generator().manual_seed(5)
    perms = [torch.randperm(6, generator=g) for _ in range(10)]
    manual = sum(float(_matrix_entropy(ka * kb[p][:, p])) for p in perms) / 10 - float(_matrix_entropy(ka * kb))
    out = dime(za, zb, seed=5)
    assert out["raw"] == pytest.approx(manual, abs=1e-12)
    assert out["normalized"] == pytest.approx(manual / math.log(3), abs=1e-12)


def test_dime_mean_over_seeds_approaches_exact_expectation():
    za, zb = _views(4, 3, 1)
    ua, ub = unit(za), unit(zb)
    exact = dime_exact(ua @ ua.T, ub @ ub.T)
    ka, kb = ua @ ua.T, ub @ ub.T
    spread = torch.tensor([float(_matrix_entropy(ka * kb[list(p)][:, list(p)]))
                           for p in itertools.permutations(range(4))]).std().item()
    seeds = 100
    mean = sum(dime(za, zb, n_iters=10, seed=s)["raw"] for s in range(seeds)) / seeds
    assert abs(mean - exact) < 5 * spread / math.sqrt(10 * seeds) + 1e-12


def test_dime_edge_cases():
    za, zb = _views(4, 3, 2)
    assert math.isnan(dime(za[:1], zb[:1])["raw"])
    with pytest.raises(ValueError):
        dime(za, zb[:3])
    with pytest.raises(ValueError):
        dime_exact(torch.eye(9), torch.eye(9))
    # zero rows (unit() keeps them zero) still give a finite number
    za[0] = 0
    assert math.isfinite(dime(za, zb)["raw"])


# -- metric classes --------------------------------------------------------------------------------------------------

def _batch(views, lo=0):
    return LayerBatch("test", torch.arange(lo, lo + views.shape[0]), views=views)


def test_metric_classes_declare_views():
    for cls in (InfoNCE, DiME, LiDAR):
        assert cls.consumes == Consumes.VIEWS and cls.default_pooling == "mean"
    assert InfoNCE().n_views == 2 and DiME().n_views == 2 and LiDAR().n_views == 16
    assert LiDAR().config() == {"n_views": 16, "delta": 1e-4, "eps": 1e-7, "variant": "thilak"}
    assert InfoNCE().config() == {"n_views": 2, "tau": 0.1, "variant": "one_directional"}
    assert DiME().config() == {"n_views": 2, "n_iters": 10, "seed": 0, "alpha": 1.0}


def test_plugin_registers_the_three_metrics():
    from repgeom_eval.plugin_system.host import PluginHost

    host = PluginHost(entry_points=[], strict=True, extra_plugins=[("views", views_metrics)])
    assert host.metrics.names() == ["dime", "infonce", "lidar"]
    assert host.metrics.get("lidar") is LiDAR and host.metrics.get("infonce") is InfoNCE
    assert host.metrics.get("dime") is DiME
    assert not host.failures


def test_metrics_equal_functional_values_on_unit_views():
    g = torch.Generator().manual_seed(7)
    v = torch.randn(10, 2, 5, generator=g, dtype=torch.float64) + 0.5
    u = unit(v)
    m = InfoNCE()
    m.update(_batch(v))
    assert m.compute() == pytest.approx(infonce(u[:, 0], u[:, 1]), abs=1e-12)
    m = DiME(seed=3)
    m.update(_batch(v))
    assert m.compute() == pytest.approx(dime(u[:, 0], u[:, 1], seed=3), abs=1e-12)
    assert m.diagnostics() == {"n_texts": 10}


def test_lidar_metric_with_16_views_streams_and_merges():
    g = torch.Generator().manual_seed(8)
    v = torch.randn(13, 1, 6, generator=g, dtype=torch.float64) + 0.3 * torch.randn(13, 16, 6, generator=g,
                                                                                      dtype=torch.float64)
    expected = lidar(unit(v))
    whole = LiDAR()
    whole.update(_batch(v))
    assert whole.compute() == pytest.approx(expected, abs=1e-9)
    a, b = LiDAR(), LiDAR()
    for lo in range(0, 13, 4):
        (a if lo < 8 else b).update(_batch(v[lo:lo + 4], lo))
    assert a.merge(b).compute() == pytest.approx(expected, abs=1e-9)
    assert whole.state_dict()["scatter"].shape == (6, 6)  # O(D²), not all views
    assert whole.diagnostics() == {"n_texts": 13}
    flow = LiDAR(variant="information_flow")
    flow.update(_batch(v))
    assert flow.compute() == pytest.approx(lidar(unit(v), variant="information_flow"), abs=1e-9)


def test_two_view_metrics_do_not_depend_on_shard_order():
    g = torch.Generator().manual_seed(9)
    v = torch.randn(12, 2, 4, generator=g, dtype=torch.float64)
    for cls in (DiME, InfoNCE):
        one = cls()
        one.update(_batch(v))
        first, second = cls(), cls()
        first.update(_batch(v[:5], 0))
        second.update(_batch(v[5:], 5))
        assert second.merge(first).compute() == pytest.approx(one.compute(), abs=1e-12)


def test_metrics_reject_wrong_number_of_views_and_empty_state():
    v = torch.ones(3, 3, 4, dtype=torch.float64)
    for metric in (InfoNCE(), DiME(), LiDAR()):
        with pytest.raises(ValueError, match="n_views"):
            metric.update(_batch(v))
        assert all(math.isnan(x) for x in metric.compute().values())
    with pytest.raises(RepgeomError):
        InfoNCE(n_views=3)
    with pytest.raises(RepgeomError, match="variant must be one of"):
        LiDAR(variant="nope")
    with pytest.raises(RepgeomError, match="≥ 2 for the thilak variant"):
        LiDAR(n_views=1)
    with pytest.raises(RepgeomError, match="variant must be one of"):
        InfoNCE(variant="nope")


# -- zero and duplicate rows ---------------------------------------------------------------------------------------

def _infonce_by_hand(a, b, tau=0.1):
    """-mean_i log softmax_j(a_i·b_j/τ)[i], written out with plain loops."""
    n = a.shape[0]
    total = 0.0
    for i in range(n):
        logits = [float(a[i] @ b[j]) / tau for j in range(n)]
        top = max(logits)
        log_z = top + math.log(sum(math.exp(v - top) for v in logits))
        total += log_z - logits[i]
    return total / n


def test_infonce_with_zero_and_duplicate_rows():
    g = torch.Generator().manual_seed(11)
    a, b = unit(torch.randn(6, 5, generator=g, dtype=torch.float64)), unit(torch.randn(6, 5, generator=g,
                                                                                     dtype=torch.float64))
    zero = torch.zeros(6, 5, dtype=torch.float64)
    out = infonce(zero, zero)  # every logit 0: the loss is log N and the bound is 0, not NaN
    assert out["raw"] == pytest.approx(math.log(6), abs=1e-12) and out["mi_lower_bound"] == pytest.approx(0, abs=1e-12)
    a[1], b[1] = a[0], b[0]  # two texts with identical views: ties in the logits, still the plain formula
    assert infonce(a, b)["raw"] == pytest.approx(_infonce_by_hand(a, b), abs=1e-9)
    a[4] = 0.0  # one all-zero view
    assert infonce(a, b)["raw"] == pytest.approx(_infonce_by_hand(a, b), abs=1e-9)


def test_lidar_with_zero_and_duplicate_classes():
    g = torch.Generator().manual_seed(12)
    x = torch.randn(8, 4, 5, generator=g, dtype=torch.float64)
    for variant in ("thilak", "information_flow"):
        dup = x.clone()
        dup[1] = dup[0]  # a duplicated text: still a valid class, the direct formula agrees
        zero_class = x.clone()
        zero_class[2] = 0.0  # a text whose views are all zero vectors
        for case in (dup, zero_class):
            got = lidar(case, variant=variant)
            want = _lidar_direct(case, variant=variant)[0]
            for key, value in got.items():
                assert math.isfinite(value) and value == pytest.approx(want[key], abs=1e-9), (variant, key)
        # every view zero: no spread between or within classes, Σ = 0, the spectrum has no distribution → NaN
        assert all(math.isnan(v) for v in lidar(torch.zeros(8, 4, 5, dtype=torch.float64), variant=variant).values())
    assert 1.0 <= lidar(dup)["lidar"] <= min(5, 7) + 1e-6
