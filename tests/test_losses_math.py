"""Auxiliary losses against oracles #6, #22–#26 of docs/metrics.md#oracle-values, brute-force references and
gradcheck."""

import math
import time

import pytest
import torch

from repgeom_eval.functional.losses import (
    angular_spread,
    decorrelation,
    l2_repel,
    orthogonalization,
    perplexity_entropy,
    push_away,
    push_away_pairwise,
    subsample_tokens,
)

T = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731

H6 = T([[(1, 0), (0, 1)], [(1, 1), (-1, 0)]])  # oracle #6: B = 2, T = 2, d = 2
Z22 = T([[(1, 0), (0, 1), (-1, 0)]])  # input #22 (also #25, #26)
Z_COLLAPSED = T([[(1, 0), (1, 0), (1, 0)]])
Z_PAIR = T([[(1, 0), (1, 0.1)]])  # input #23


# -- push-away (paper A) ---------------------------------------------------------------------------------------------

def test_push_away_oracle_6_single_domain():
    closed = 1 - (math.sqrt(2) - 2) / 12  # ‖S‖² = 2 + √2, Q = 4, N = 4
    assert push_away(H6).item() == pytest.approx(closed, abs=1e-12)
    assert push_away(H6).item() == pytest.approx(1.048816, abs=1e-6)
    assert push_away_pairwise(H6).item() == pytest.approx(closed, abs=1e-12)


def test_push_away_oracle_6_cross_domain():
    closed = 1 - (math.sqrt(2) / 2 + 0 + math.sqrt(2) / 2 - 1) / 4
    for labels in (["a", "b"], [0, 1], torch.tensor([5, 2])):
        assert push_away(H6, domains=labels).item() == pytest.approx(closed, abs=1e-12)
    assert push_away(H6, domains=["a", "b"]).item() == pytest.approx(0.896447, abs=1e-6)
    assert push_away_pairwise(H6, domains=["a", "b"]).item() == pytest.approx(closed, abs=1e-12)


def _random_batch(seed, b=6, t=9, d=5):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, t, d, generator=g, dtype=torch.float64) + torch.randn(d, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    h = h + 100 * (~mask).unsqueeze(-1)  # garbage at pad positions must not leak in
    return h, mask


@pytest.mark.parametrize("seed", range(4))
def test_push_away_identity_equals_pairwise_with_padding_and_three_domains(seed):
    h, mask = _random_batch(seed)
    h[0, 0] = 0  # a zero vector at a real position: cosine 0 with everything (Q form)
    assert push_away(h, mask).item() == pytest.approx(push_away_pairwise(h, mask).item(), abs=1e-13)
    domains = ["x", "y", "z", "x", "x", "y"]  # domains of different sizes
    fast = push_away(h, mask, domains=domains).item()
    brute = push_away_pairwise(h, mask, domains=domains).item()
    assert fast == pytest.approx(brute, abs=1e-13)
    # explicit Σ_{a<b} S_a·S_b / Σ_{a<b} n_a n_b
    u = torch.nn.functional.normalize(h, dim=-1) * mask.unsqueeze(-1)
    groups = {k: [i for i, x in enumerate(domains) if x == k] for k in "xyz"}
    s = {k: u[v].sum((0, 1)) for k, v in groups.items()}
    n = {k: int(mask[v].sum()) for k, v in groups.items()}
    pairs = [("x", "y"), ("x", "z"), ("y", "z")]
    closed = 1 - sum(float(s[a] @ s[b]) for a, b in pairs) / sum(n[a] * n[b] for a, b in pairs)
    assert fast == pytest.approx(closed, abs=1e-13)


def test_push_away_accepts_vectors_and_reduces_to_cross_dispersion():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(7, 4, generator=g, dtype=torch.float64)
    assert push_away(x).item() == pytest.approx(push_away_pairwise(x).item(), abs=1e-13)
    labels = [0, 0, 0, 1, 1, 1, 1]
    u = torch.nn.functional.normalize(x, dim=-1)
    assert push_away(x, domains=labels).item() == pytest.approx(1 - float(u[:3].mean(0) @ u[3:].mean(0)), abs=1e-13)


def test_push_away_edge_cases():
    one = T([[(1, 0), (5, 5)]])
    assert math.isnan(push_away(one, torch.tensor([[True, False]])).item())  # N < 2
    assert math.isnan(push_away(H6, torch.zeros(2, 2, dtype=torch.bool)).item())
    assert math.isnan(push_away(H6, domains=["a", "a"]).item())  # no cross-domain pair
    assert math.isnan(push_away_pairwise(H6, domains=["a", "a"]).item())
    zeros = torch.zeros(1, 3, 2, dtype=torch.float64, requires_grad=True)
    value = push_away(zeros)
    assert value.item() == pytest.approx(1.0, abs=1e-12)  # all cosines 0
    value.backward()
    assert torch.isfinite(zeros.grad).all()
    with pytest.raises(ValueError):
        push_away(H6, domains=["a"])


def test_push_away_nan_case_keeps_a_finite_gradient_graph():
    h = T([[(1.0, 2.0)]]).requires_grad_()
    value = push_away(h)
    assert math.isnan(value.item())
    value.backward()
    assert torch.isfinite(h.grad).all()


def test_push_away_low_precision_accumulates_in_float32():
    h, mask = _random_batch(2)
    ref = push_away(h, mask).item()
    for dtype in (torch.float32, torch.bfloat16):
        out = push_away(h.to(dtype), mask)
        assert out.dtype == torch.float32
        assert out.item() == pytest.approx(ref, abs=2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_push_away_is_linear_memory_on_64x512_tokens():
    g = torch.Generator().manual_seed(0)
    b, t, d = 64, 512, 64
    n = b * t  # 32768 tokens: an N×N float32 matrix would be 4.3 GB
    h = torch.randn(b, t, d, generator=g, requires_grad=True)
    mask = torch.ones(b, t, dtype=torch.bool)
    domains = torch.arange(b) % 3
    start = time.perf_counter()
    single = push_away(h, mask)
    cross = push_away(h, mask, domains=domains)
    (single + cross).backward()
    assert time.perf_counter() - start < 15.0  # ~0.4 s; generous for loaded CI machines
    assert torch.isfinite(h.grad).all()
    # the same numbers as the brute force on a subset small enough for the N×N form
    sub = h[:4, :64].detach().double()
    assert push_away(sub).item() == pytest.approx(push_away_pairwise(sub).item(), abs=1e-12)
    assert push_away(sub, domains=[0, 1, 2, 0]).item() == pytest.approx(
        push_away_pairwise(sub, domains=[0, 1, 2, 0]).item(), abs=1e-12)
    # no allocation anywhere near N²: the profiler's per-operator totals (summed over every call of the forward
    # and backward passes of both modes) stay far below the 4.3 GB one N×N float32 matrix would take
    from torch.profiler import ProfilerActivity, profile

    h.grad = None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        (push_away(h, mask) + push_away(h, mask, domains=domains)).backward()
    per_op = [max(e.self_cpu_memory_usage, 0) for e in prof.key_averages()]
    assert sum(per_op) < 32 * n * d * 4 <= n * n * 4 / 16, f"{sum(per_op)} bytes allocated for {n} tokens"
    assert max(per_op) < n * n * 4 / 20  # summed over calls, still far below one N×N matrix


@pytest.mark.parametrize("domains", [None, [0, 1, 0], ["a", "b", "c"]])
def test_push_away_gradcheck(domains):
    g = torch.Generator().manual_seed(5)
    h = torch.randn(3, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.autograd.gradcheck(lambda x: push_away(x, mask, domains=domains), (h,))


# -- paper C losses: oracles -----------------------------------------------------------------------------------------

def test_angular_spread_oracle_22_table():
    ideal = math.log((4 * math.exp(-0.5) + 2 * math.exp(-1)) / 6)
    assert angular_spread(Z22).item() == pytest.approx(ideal, abs=1e-12)
    assert angular_spread(Z22).item() == pytest.approx(-0.640592, abs=1e-6)
    assert angular_spread(Z22, variant="reference", clamp=0).item() == pytest.approx(-0.615502, abs=1e-6)
    assert angular_spread(Z22, variant="reference", clamp=0.1).item() == pytest.approx(-0.595298, abs=1e-6)
    assert angular_spread(Z22, variant="paper", clamp=0.1).item() == pytest.approx(-0.605298, abs=1e-6)
    assert angular_spread(Z22, variant="reference").item() == pytest.approx(-0.572143, abs=1e-6)  # t = 0.25
    assert angular_spread(Z22, variant="paper", clamp=0.25).item() == pytest.approx(-0.582143, abs=1e-6)
    assert angular_spread(Z_COLLAPSED, variant="reference", clamp=0.1).item() == pytest.approx(-0.133566, abs=1e-6)
    assert angular_spread(Z_COLLAPSED).item() == pytest.approx(0.0, abs=1e-7)
    both = torch.cat([Z22, Z_COLLAPSED])
    assert angular_spread(both, variant="reference", clamp=0.1).item() == pytest.approx(-0.364432, abs=1e-6)


def test_angular_spread_bounds_and_epsilon_offset():
    g = torch.Generator().manual_seed(2)
    z = torch.randn(3, 8, 4, generator=g, dtype=torch.float64)
    for tau in (0.5, 1.0, 2.0):
        assert -1 / tau <= angular_spread(z, tau=tau).item() <= 0
    # ε adds exactly ε inside the logsumexp when the cosine itself is unchanged (paper cosine, ε only in lse)
    unit = torch.nn.functional.normalize(z, dim=-1)
    shifted = angular_spread(unit * 1e6, variant="reference", clamp=0).item()
    assert shifted == pytest.approx(angular_spread(unit).item() + 0.01, abs=1e-6)


def test_orthogonalization_oracle_23_all_variants():
    ideal = (0.5 - math.acos(1 / math.sqrt(1.01)) / math.pi) ** 2
    assert orthogonalization(Z_PAIR).item() == pytest.approx(ideal, abs=1e-12)
    assert orthogonalization(Z_PAIR).item() == pytest.approx(0.219281, abs=1e-6)
    assert orthogonalization(Z_PAIR, variant="reference", clamp=0).item() == pytest.approx(0.184353, abs=1e-6)
    assert orthogonalization(Z_PAIR, variant="reference", clamp=0.1).item() == pytest.approx(0.127045, abs=1e-6)
    assert orthogonalization(Z_PAIR, variant="reference").item() == pytest.approx(0.072871, abs=1e-6)
    per_pair_max = (0.5 - math.acos(0.75) / math.pi) ** 2
    assert orthogonalization(Z_PAIR, variant="reference").item() == pytest.approx(per_pair_max, abs=1e-12)
    for variant in ("paper", "reference"):
        assert orthogonalization(Z22, variant=variant).item() == pytest.approx(0.0, abs=1e-12)


def test_decorrelation_oracle_24():
    assert decorrelation(T([[(1, 0, 0), (0, 1, 0), (1, 1, 0)]])).item() == pytest.approx(0.25, abs=1e-12)
    g = torch.Generator().manual_seed(4)
    two_features = torch.randn(2, 5, 2, generator=g, dtype=torch.float64)
    assert decorrelation(two_features).item() == pytest.approx(1.0, abs=1e-12)  # F = 2: always ±(1, −1)/√2
    # brute force: Pearson correlation between tokens, mean of squares over i ≠ j
    z = torch.randn(2, 6, 7, generator=g, dtype=torch.float64)
    corr = torch.stack([torch.corrcoef(zb) for zb in z])
    off = ~torch.eye(6, dtype=torch.bool)
    assert decorrelation(z).item() == pytest.approx((corr ** 2)[:, off].mean().item(), abs=1e-12)


def test_l2_repel_oracle_25():
    closed = math.log((3 + 4 * math.exp(-2) + 2 * math.exp(-4)) / 9) + 0.01 + 0.05
    assert l2_repel(Z22).item() == pytest.approx(closed, abs=1e-12)
    assert l2_repel(Z22).item() == pytest.approx(-0.862428, abs=1e-6)
    assert l2_repel(Z22, eps=0.0, norm_weight=0.0).item() == pytest.approx(closed - 0.06, abs=1e-12)


def test_perplexity_entropy_oracle_26():
    assert perplexity_entropy(Z22).item() == pytest.approx(-0.656388, abs=1e-6)  # ε = 0.01
    p = 1 / (1 + math.exp(-2))
    neg_entropy = (2 * (p * math.log2(p) + (1 - p) * math.log2(1 - p)) + 2 * 0.5 * math.log2(0.5)) / 3
    assert perplexity_entropy(Z22, eps=0.0).item() == pytest.approx(neg_entropy, abs=1e-12)
    assert perplexity_entropy(Z22, eps=0.0).item() == pytest.approx(-0.684710, abs=1e-6)


# -- paper C losses: gradients and edge cases --------------------------------------------------------------------------

def _general_position(seed, b=2, length=5, f=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, length, f, generator=g, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("fn", [
    lambda z: angular_spread(z),
    lambda z: angular_spread(z, tau=0.5),
    decorrelation,
    l2_repel,
    lambda z: orthogonalization(z, margin=0.9),  # margin 0.9 keeps every pair inside the hinge
    perplexity_entropy,
], ids=["angular_spread", "angular_spread_tau", "decorrelation", "l2_repel", "orthogonalization",
        "perplexity_entropy"])
def test_gradcheck_paper_losses(fn):
    assert torch.autograd.gradcheck(fn, (_general_position(6),))


def test_reference_clamp_uses_a_straight_through_gradient():
    z = T([[(1, 0), (1, 0.01)]]).requires_grad_()
    loss = orthogonalization(z, variant="reference")  # cosine 0.98 > 1 − t: clamped to 0.75 in value
    loss.backward()
    c_cl = 0.75
    d = math.acos(c_cl) / math.pi
    dloss_dc = 2 * (0.5 - d) * (1 / (math.pi * math.sqrt(1 - c_cl ** 2)))
    zz = z.detach().clone().requires_grad_()
    zh = zz / (zz.norm(dim=-1, keepdim=True) + 0.01)
    (zh[0, 0] @ zh[0, 1]).backward()
    assert torch.allclose(z.grad, dloss_dc * zz.grad, atol=1e-12)
    assert z.grad.abs().sum() > 0  # a hard clamp would give zero
    collapsed = Z_COLLAPSED.clone().requires_grad_()
    angular_spread(collapsed, variant="reference").backward()
    assert torch.isfinite(collapsed.grad).all()


def test_paper_c_edge_cases():
    short = T([[(1, 0)]])
    for fn in (angular_spread, decorrelation, orthogonalization, perplexity_entropy):
        assert math.isnan(fn(short).item())
    assert math.isnan(decorrelation(T([[(1, 1, 1), (1, 0, 0)]])).item())  # constant token: std 0
    with pytest.raises(ValueError):
        angular_spread(T([(1, 0), (0, 1)]))  # 2-D input
    with pytest.raises(ValueError):
        orthogonalization(Z22, variant="code")
    zero = T([[(0, 0), (1, 0), (0, 1)]])
    for variant in ("paper", "reference"):
        assert math.isfinite(angular_spread(zero, variant=variant).item())
    for fn in (angular_spread, decorrelation, l2_repel, orthogonalization, perplexity_entropy):
        out = fn(Z22.float())
        assert out.dtype == torch.float32 and math.isfinite(out.item())


def test_subsample_tokens():
    z = torch.arange(2 * 300 * 2, dtype=torch.float64).view(2, 300, 2)
    assert subsample_tokens(z[:, :200]) is not None and subsample_tokens(z[:, :200]).shape == (2, 200, 2)
    a = subsample_tokens(z, 256, torch.Generator().manual_seed(1))
    b = subsample_tokens(z, 256, torch.Generator().manual_seed(1))
    assert a.shape == (2, 256, 2) and torch.equal(a, b)
    assert torch.equal(a[1] - a[0], torch.full_like(a[0], 600.0))  # the same positions for every sequence
