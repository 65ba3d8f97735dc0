"""Dispersion math against oracles #1–#5 of docs/metrics.md#oracle-values and a brute-force reference."""

import math

import pytest
import torch

from repgeom_eval.functional import (
    cross_dispersion,
    dispersion,
    leave_one_out_dispersion,
    leave_one_out_influence,
    pairwise_dispersion,
    per_sample_scores,
    token_dispersion,
)

T = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731

X1 = T([(1, 0), (0, 1), (-1, 0)])
X2 = T([(3, 4), (1, 0), (0, 2)])


@pytest.mark.parametrize(
    "x, expected",
    [
        (X1, 4 / 3),  # oracle #1
        (X2, 0.533333333333),  # oracle #2
        (T([(1, 0), (0, 0), (0, 1)]), 1.0),  # oracle #3: zero row, Q form (naive N form gives 1.1667)
        (T([(1, 0), (2, 0), (0, 1)]), 0.666666666667),  # duplicates count with distance 0
    ],
)
def test_dispersion_oracles(x, expected):
    assert dispersion(x).item() == pytest.approx(expected, abs=1e-9)
    assert pairwise_dispersion(x).item() == pytest.approx(expected, abs=1e-9)


def test_zero_row_differs_from_naive_form():
    x = T([(1, 0), (0, 0), (0, 1)])
    u = torch.nn.functional.normalize(x, dim=-1)
    n = 3
    naive = 1 - ((u.sum(0) ** 2).sum() - n) / (n * (n - 1))
    assert naive.item() == pytest.approx(1.166667, abs=1e-6)
    assert dispersion(x).item() == pytest.approx(1.0, abs=1e-12)


def test_cross_dispersion_oracle_4():
    a, b = T([(1, 0), (0, 1)]), T([(1, 1), (-1, 0)])
    expected = 1 - (math.sqrt(2) / 2 + 0 + math.sqrt(2) / 2 - 1) / 4
    assert cross_dispersion(a, b).item() == pytest.approx(0.896447, abs=1e-6)
    assert cross_dispersion(a, b).item() == pytest.approx(expected, abs=1e-12)


def test_per_sample_and_leave_one_out_oracles():
    assert per_sample_scores(X1).tolist() == pytest.approx([1.5, 1.0, 1.5], abs=1e-12)
    assert leave_one_out_dispersion(X1).tolist() == pytest.approx([1, 2, 1], abs=1e-12)
    # oracle #5
    assert leave_one_out_influence(X1).tolist() == pytest.approx([1 / 3, -2 / 3, 1 / 3], abs=1e-9)
    assert per_sample_scores(X2).tolist() == pytest.approx([0.3, 0.7, 0.6], abs=1e-12)
    assert leave_one_out_dispersion(X2).tolist() == pytest.approx([1.0, 0.2, 0.4], abs=1e-12)
    assert leave_one_out_influence(X2).tolist() == pytest.approx([-0.466667, 0.333333, 0.133333], abs=1e-6)


def _brute_loo(x):
    return torch.stack([pairwise_dispersion(torch.cat([x[:i], x[i + 1:]])) for i in range(len(x))])


@pytest.mark.parametrize("seed", range(5))
def test_identity_equals_brute_force_on_random_data(seed):
    g = torch.Generator().manual_seed(seed)
    n, d = 50, 16
    x = torch.randn(n, d, generator=g, dtype=torch.float64) + torch.randn(d, generator=g, dtype=torch.float64)
    x[3] = 0  # a zero row
    x[7] = x[8] * 2.5  # a duplicate direction
    assert abs(dispersion(x) - pairwise_dispersion(x)).item() < 1e-13
    u = torch.nn.functional.normalize(x, dim=-1)
    brute_c = torch.stack([(1 - u[i] @ u[j]) for i in range(n) for j in range(n) if j != i]).view(n, n - 1).mean(1)
    assert torch.allclose(per_sample_scores(x), brute_c, atol=1e-13)
    assert per_sample_scores(x).mean().item() == pytest.approx(dispersion(x).item(), abs=1e-14)
    assert torch.allclose(leave_one_out_dispersion(x), _brute_loo(x), atol=1e-13)
    a, b = x[:7], x[7:18]
    ua, ub = torch.nn.functional.normalize(a, dim=-1), torch.nn.functional.normalize(b, dim=-1)
    assert cross_dispersion(a, b).item() == pytest.approx((1 - ua @ ub.T).mean().item(), abs=1e-14)


def test_float32_input_matches_float64():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, 64, generator=g, dtype=torch.float64) + 0.3
    assert dispersion(x.float()).item() == pytest.approx(dispersion(x).item(), abs=1e-6)


def test_edge_cases():
    assert math.isnan(dispersion(T([(1, 2)])).item())  # N < 2
    assert math.isnan(dispersion(torch.zeros(0, 3, dtype=torch.float64)).item())
    assert math.isnan(dispersion(T([(1, float("nan")), (1, 0)])).item())  # NaN propagates
    assert dispersion(T([(1, 1), (1, 1), (2, 2)])).item() == pytest.approx(0.0, abs=1e-12)  # all equal
    # maximum N/(N-1) iff S = 0
    assert dispersion(T([(1, 0), (-1, 0)])).item() == pytest.approx(2.0, abs=1e-12)
    assert dispersion(torch.zeros(4, 3, dtype=torch.float64)).item() == pytest.approx(1.0)  # all-zero: cos 0


def test_token_dispersion_matches_per_sequence_brute_force():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(4, 9, 5, generator=g, dtype=torch.float64)
    lengths = torch.tensor([9, 4, 1, 2])
    mask = torch.arange(9).unsqueeze(0) < lengths.unsqueeze(1)
    hidden[~mask] = 1e6  # pad garbage must not leak in
    values, n = token_dispersion(hidden, mask)
    assert n.tolist() == [9, 4, 1, 2]
    for i in range(4):
        ref = pairwise_dispersion(hidden[i, : lengths[i]])
        if lengths[i] < 2:
            assert math.isnan(values[i].item())
        else:
            assert values[i].item() == pytest.approx(ref.item(), abs=1e-13)
