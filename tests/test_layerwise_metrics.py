"""Layer-by-layer metrics (paper B, Vendi) and condensation (paper C): oracles #8–#14, #21, #27 of
docs/metrics.md#oracle-values and the other checked values of its metric sections, brute-force references, edge
cases, conformance, and one run through the real pipeline checked against a hand computation from
``output_hidden_states``."""

import importlib.metadata as md
import math

import numpy as np
import pytest
import scipy.stats
import torch

from repgeom_eval import LayerBatch
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.functional.condensation import (
    condensation,
    condensation_batch,
    cosine_histogram,
    cosine_matrix,
    histogram_edges,
)
from repgeom_eval.functional.curvature import curvature
from repgeom_eval.functional.entropy import (
    center_and_unit,
    dataset_entropy,
    gram_entropy,
    gram_spectrum,
    matrix_entropy,
    prepare_pooled,
    prompt_entropy,
    renyi_entropy,
    repitl_alpha2_shortcut,
    spectrum_entropy,
)
from repgeom_eval.functional.rank import effective_rank, effective_rank_from_gram_eigenvalues, vendi_score
from repgeom_eval.functional.stats import kendall_tau_b, rankdata, spearman
from repgeom_eval.plugins import condensation as condensation_plugin
from repgeom_eval.plugins import layerwise
from repgeom_eval.plugins.condensation import Condensation
from repgeom_eval.plugins.layerwise import Curvature, DatasetEntropy, EffectiveRank, PromptEntropy, Vendi

T = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731
LOG2, LOG3, LOG4 = math.log(2), math.log(3), math.log(4)
I3 = torch.eye(3, dtype=torch.float64)
X4x4 = T([[1, 2, 0, 1], [0, 1, 3, 1], [2, 0, 1, 0], [1, 1, 1, 4]])
X_DxD = T([[1, 0], [0, 1], [1, 1], [2, -1]])
POOLED = T([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 1]])
C1 = T([(0, 0), (1, 0), (1, 1), (2, 1)])
C2 = T([(0, 0), (1, 0), (0, 1)])


def rand(*shape, seed=0, shift=0.3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) + shift


def pooled_batch(x, start=0):
    return LayerBatch("final", torch.arange(start, start + len(x)), pooled=x)


def token_batch(texts, start=0):
    """A padded [B, T, D] batch (pad positions zero) from a list of [T_i, D] token matrices."""
    t = max(len(x) for x in texts)
    d = texts[0].shape[1]
    hidden = torch.zeros(len(texts), t, d, dtype=torch.float64)
    mask = torch.zeros(len(texts), t, dtype=torch.bool)
    for i, x in enumerate(texts):
        hidden[i, :len(x)] = x
        mask[i, :len(x)] = True
    return LayerBatch("final", torch.arange(start, start + len(texts)), hidden=hidden, mask=mask)


# -- Rényi entropy (docs/metrics.md#matrix-entropy) --------------------------------------------------------------

def test_oracle_21_repitl_alpha2_shortcut():
    k = I3 / 3
    assert repitl_alpha2_shortcut(k).item() == pytest.approx(3.295837, abs=1e-6)
    assert repitl_alpha2_shortcut(k).item() == pytest.approx(math.log(27), abs=1e-12)
    assert renyi_entropy(k, 2).item() == pytest.approx(LOG3, abs=1e-12)  # the true S_2
    # On a unit-diagonal Gram the shortcut is right: normalize(I3) has Gram off-diagonals -0.5.
    z = center_and_unit(I3)
    g = z @ z.T
    assert torch.allclose(g, T([[1, -.5, -.5], [-.5, 1, -.5], [-.5, -.5, 1]]), atol=1e-12)
    assert repitl_alpha2_shortcut(g).item() == pytest.approx(0.693147, abs=1e-6)
    assert renyi_entropy(g, 2).item() == pytest.approx(LOG2, abs=1e-9)


def test_renyi_entropy_closed_forms_and_limit():
    p = T([0.5, 0.25, 0.25])
    k = torch.diag(p * 7)  # not trace-normalised: renormalisation is implicit
    assert renyi_entropy(k, 1).item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-12)
    for a in (0.5, 2.0, 3.0):
        assert renyi_entropy(k, a).item() == pytest.approx(math.log((p ** a).sum().item()) / (1 - a), abs=1e-12)
    assert renyi_entropy(k, 0).item() == pytest.approx(LOG3, abs=1e-12)  # Hartley: log rank
    # α → 1 is continuous
    assert renyi_entropy(k, 1 + 1e-7).item() == pytest.approx(renyi_entropy(k, 1).item(), abs=1e-6)
    # negative eigenvalues are dropped, as repitl's torch.gt(ek, 0)
    assert spectrum_entropy(T([-0.3, 1.0, 1.0])).item() == pytest.approx(LOG2, abs=1e-12)
    assert math.isnan(spectrum_entropy(T([0.0, -1.0])).item())
    single = spectrum_entropy(T([0.0, 0.0, 5.0])).item()  # one eigenvalue: 0 (not -0.0)
    assert single == 0.0 and math.copysign(1.0, single) == 1.0
    with pytest.raises(ValueError):
        spectrum_entropy(T([1.0]), alpha=-1)


# -- prompt entropy (docs/metrics.md#prompt_entropy) -------------------------------------------------------------

@pytest.mark.parametrize(
    "tokens, code_raw, code_max, paper_raw, paper_max",
    [
        (I3, 1.098612, 1.000000, 0.693147, 0.630930),  # oracle #8
        (X4x4, 1.386214, 0.999942, 1.031344, 0.743957),
        (X_DxD, 0.570490, 0.823044, 0.435474, 0.435474 / LOG2),  # oracle #9, D×D branch
        (T([[1, 2, 3], [0, 1, 5]]), 0.693147, 1.000000, 0.0, 0.0),  # any 2 tokens
    ],
)
def test_prompt_entropy_oracles(tokens, code_raw, code_max, paper_raw, paper_max):
    code = prompt_entropy(tokens, variant="information_flow")
    assert code["raw"] == pytest.approx(code_raw, abs=1e-6)
    assert code["normalized"] == pytest.approx(code_max, abs=1e-6)
    paper = prompt_entropy(tokens)  # the project default: no clamp
    assert paper["raw"] == pytest.approx(paper_raw, abs=1e-6)
    assert paper["normalized"] == pytest.approx(paper_max, abs=1e-6)


def test_prompt_entropy_oracle_9_details():
    z = center_and_unit(X_DxD)
    assert torch.allclose(z, T([(0, -1), (-0.8, 0.6), (0, 1), (0.624695, -0.780869)]), atol=1e-6)
    code = prompt_entropy(X_DxD, variant="information_flow")
    assert code["logN"] == pytest.approx(0.411522, abs=1e-6)
    assert code["logD"] == pytest.approx(code["normalized"], abs=1e-12)  # D < N
    # The N×N branch with the clamp would give a different value: the clamp makes the value branch-dependent.
    assert gram_entropy(z @ z.T, variant="information_flow").item() == pytest.approx(1.116151, abs=1e-6)
    # Without the clamp both branches agree.
    assert gram_entropy(z @ z.T).item() == pytest.approx(0.435474, abs=1e-6)
    assert gram_entropy(z.T @ z).item() == pytest.approx(0.435474, abs=1e-6)


def test_prompt_entropy_closed_forms():
    # Centring gives rank ≤ N−1, so without the clamp S_1 ≤ log(N−1); a regular simplex reaches it.
    simplex = torch.eye(5, dtype=torch.float64)
    assert prompt_entropy(simplex)["raw"] == pytest.approx(math.log(4), abs=1e-9)
    assert prompt_entropy(simplex)["normalized"] == pytest.approx(math.log(4) / math.log(5), abs=1e-9)
    # Scaling and translating the tokens changes nothing (centred, unit rows).
    x = rand(7, 5, seed=3)
    a, b = prompt_entropy(x), prompt_entropy(3.5 * x + rand(5, seed=4))
    assert a["raw"] == pytest.approx(b["raw"], abs=1e-9)


@pytest.mark.parametrize("shape", [(6, 20), (20, 6), (8, 8)])
@pytest.mark.parametrize("alpha", [1.0, 2.0, 0.5])
def test_entropy_branches_agree_without_clamp_and_match_brute_force(shape, alpha):
    x = rand(*shape, seed=sum(shape))
    z = center_and_unit(x)
    via_nn, via_dd = gram_entropy(z @ z.T, alpha).item(), gram_entropy(z.T @ z, alpha).item()
    assert via_nn == pytest.approx(via_dd, abs=1e-9)
    # brute force: the trace-normalised N×N kernel, numpy eigenvalues
    k = (z @ z.T).numpy()
    lam = np.linalg.eigvalsh(k / np.trace(k))
    lam = lam[lam > 1e-12]
    lam = lam / lam.sum()
    brute = -(lam * np.log(lam)).sum() if alpha == 1 else np.log((lam ** alpha).sum()) / (1 - alpha)
    assert prompt_entropy(x, alpha=alpha)["raw"] == pytest.approx(brute, abs=1e-9)
    assert gram_spectrum(z).numel() == min(shape)


def test_prompt_entropy_short_and_degenerate_prompts():
    for variant in ("paper", "information_flow"):
        one = prompt_entropy(T([[1.0, 2.0, 3.0]]), variant=variant)  # N = 1: NaN (B's code raises)
        assert all(math.isnan(v) for v in one.values())
        empty = prompt_entropy(torch.zeros(0, 3, dtype=torch.float64), variant=variant)
        assert all(math.isnan(v) for v in empty.values())
        # identical tokens: every centred row is zero, no direction at all → NaN, not an error
        same = prompt_entropy(T([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]]), variant=variant)
        assert math.isnan(same["raw"])
    # duplicate tokens among others are fine
    dup = prompt_entropy(T([[1, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]]))
    assert math.isfinite(dup["raw"]) and 0 < dup["raw"] <= math.log(3) + 1e-12
    with pytest.raises(ValueError):
        prompt_entropy(I3, variant="nope")


def test_center_and_unit_is_eps_safe():
    z = center_and_unit(T([[1.0, 1.0]]))  # one row: centred to zero, stays zero (B's code gives NaN)
    assert torch.equal(z, torch.zeros(1, 2, dtype=torch.float64))


# -- dataset entropy (docs/metrics.md#dataset_entropy) -----------------------------------------------------------

def test_oracle_10_dataset_entropy_global_centring():
    for variant in ("paper", "information_flow"):
        r = dataset_entropy(POOLED, variant=variant)
        assert r["raw"] == pytest.approx(1.098612, abs=1e-6)
        assert r["normalized"] == pytest.approx(1.0, abs=1e-6)
        assert r["logN"] == pytest.approx(0.792481, abs=1e-6)
    z = prepare_pooled(POOLED, "global")
    assert torch.allclose(z.T @ z, 4 / 3 * I3, atol=1e-12)  # regular simplex
    # the N×N+clamp branch would give log 4
    assert gram_entropy(z @ z.T, variant="information_flow").item() == pytest.approx(LOG4, abs=1e-9)


def test_oracle_11_dataset_entropy_as_coded_batch_2():
    for variant in ("paper", "information_flow"):
        r = dataset_entropy(POOLED, centering="batch", batch_size=2, variant=variant)
        assert r["raw"] == pytest.approx(0.693147, abs=1e-6)
        assert r["normalized"] == pytest.approx(0.630930, abs=1e-6)
    h = math.sqrt(0.5)
    expected = T([(h, -h, 0), (-h, h, 0), (-h, -h, 0), (h, h, 0)])
    assert torch.allclose(prepare_pooled(POOLED, "batch", 2), expected, atol=1e-12)


def test_dataset_entropy_centring_options():
    x = rand(9, 4, seed=5)
    assert dataset_entropy(x, centering="batch", batch_size=9)["raw"] == pytest.approx(
        dataset_entropy(x)["raw"], abs=1e-12)  # one batch of everything = global
    none = dataset_entropy(x, centering="none")
    z = torch.nn.functional.normalize(x, dim=-1)
    assert none["raw"] == pytest.approx(matrix_entropy(z)["raw"], abs=1e-12)
    assert math.isnan(dataset_entropy(x[:1])["raw"])
    with pytest.raises(ValueError):
        dataset_entropy(x, centering="median")


# -- effective rank (docs/metrics.md#effective_rank) -------------------------------------------------------------

def test_oracle_12_effective_rank():
    z = T([[3, 0], [0, 1], [0, 0]])
    r = effective_rank(z)
    assert r["erank"] == pytest.approx(1.754765, abs=1e-6)
    assert r["rankme"] == pytest.approx(1.7547653, abs=1e-6)
    assert r["exp_entropy"] == pytest.approx(1.384145, abs=1e-6)
    p = np.array([0.75, 0.25])
    assert r["erank"] == pytest.approx(math.exp(-(p * np.log(p)).sum()), abs=1e-12)
    q = np.array([0.9, 0.1])
    assert r["exp_entropy"] == pytest.approx(math.exp(-(q * np.log(q)).sum()), abs=1e-12)
    g = effective_rank_from_gram_eigenvalues(torch.linalg.eigvalsh(z.T @ z), 3, 2)
    for k in r:
        assert g[k] == pytest.approx(r[k], abs=1e-9)


def test_effective_rank_edge_cases():
    assert effective_rank(torch.zeros(4, 3, dtype=torch.float64)) == {"rankme": 0.0, "erank": 0.0, "exp_entropy": 0.0}
    assert all(math.isnan(v) for v in effective_rank(torch.zeros(0, 3, dtype=torch.float64)).values())
    # duplicates: rank 1 → erank = exp_entropy = 1 (rankme adds ε to the zero singular value)
    r = effective_rank(T([[1, 2, 3], [1, 2, 3], [2, 4, 6]]))
    assert r["erank"] == pytest.approx(1.0, abs=1e-12) and r["exp_entropy"] == pytest.approx(1.0, abs=1e-12)
    assert r["rankme"] == pytest.approx(1.0, abs=1e-5)
    # orthogonal rows of equal norm: full effective rank
    r = effective_rank(2 * torch.eye(4, dtype=torch.float64))
    assert r["erank"] == pytest.approx(4.0, abs=1e-12) and r["exp_entropy"] == pytest.approx(4.0, abs=1e-12)


# -- curvature (docs/metrics.md#curvature) -----------------------------------------------------------------------

def test_curvature_oracles():
    # C1 applied directly: π/2 for both
    assert curvature(C1)["raw"] == pytest.approx(math.pi / 2, abs=1e-9)
    assert curvature(C1, "information_flow", normalize=False)["raw"] == pytest.approx(math.pi / 2, abs=1e-9)
    # oracle #13: C2 directly, code (abs) π/4, paper 3π/4
    assert curvature(C2, "information_flow", normalize=False)["raw"] == pytest.approx(0.785398, abs=1e-6)
    assert curvature(C2)["raw"] == pytest.approx(2.356194, abs=1e-6)
    assert curvature(C2)["raw"] == pytest.approx(3 * math.pi / 4, abs=1e-12)
    # oracle #14: C1 through B's pipeline (normalize + code) and the same without abs
    assert torch.allclose(center_and_unit(C1), T([(-0.894427, -0.447214), (0, -1), (0, 1), (0.894427, 0.447214)]),
                          atol=1e-6)
    assert curvature(C1, "information_flow")["raw"] == pytest.approx(1.017222, abs=1e-6)
    assert curvature(C1, "paper", normalize=True)["raw"] == pytest.approx(2.124371, abs=1e-6)
    r = curvature(C2)
    assert r["logD"] == pytest.approx(r["raw"] / LOG2, abs=1e-12)


def test_curvature_brute_force_and_edges():
    x = rand(9, 5, seed=7)
    v = [x[k + 1] - x[k] for k in range(8)]
    angles = [math.acos(float(v[k + 1] @ v[k] / (v[k + 1].norm() * v[k].norm()))) for k in range(7)]
    assert curvature(x)["raw"] == pytest.approx(sum(angles) / 7, abs=1e-12)
    # N ≤ 2: paper NaN, code 0
    for n in (0, 1, 2):
        assert math.isnan(curvature(x[:n])["raw"])
        assert curvature(x[:n], "information_flow")["raw"] == 0.0
    # a repeated token (zero-length difference): paper skips the undefined angles, code counts them as 0
    rep = T([(0, 0), (1, 0), (1, 0), (1, 1), (2, 1)])
    assert curvature(rep)["raw"] == pytest.approx(math.pi / 2, abs=1e-12)  # only the angle at (1,0)→(1,1)→(2,1)
    assert curvature(rep, "information_flow", normalize=False)["raw"] == pytest.approx(math.pi / 2 / 3, abs=1e-12)
    assert math.isnan(curvature(T([(0, 0), (1, 0), (1, 0)]))["raw"])  # no angle defined
    # collinear back-and-forth: π in the paper, 0 with B's |cos|
    back = T([(0, 0), (1, 0), (0, 0)])
    assert curvature(back)["raw"] == pytest.approx(math.pi, abs=1e-12)
    assert curvature(back, "information_flow", normalize=False)["raw"] == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError):
        curvature(x, "nope")


# -- Vendi score -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(7, 4), (4, 9), (12, 12)])
def test_vendi_equals_explicit_kernel(shape):
    x = rand(*shape, seed=shape[0])
    u = torch.nn.functional.normalize(x, dim=-1).numpy()
    lam = np.linalg.eigvalsh(u @ u.T / shape[0])
    lam = lam[lam > 1e-15]
    assert vendi_score(x) == pytest.approx(math.exp(-(lam * np.log(lam)).sum()), abs=1e-9)


def test_vendi_closed_forms_and_edges():
    assert vendi_score(torch.eye(3, dtype=torch.float64)) == pytest.approx(3.0, abs=1e-12)
    assert vendi_score(T([[1, 0], [2, 0], [5, 0]])) == pytest.approx(1.0, abs=1e-12)
    # duplicates: K eigenvalues (2, 1, 0)/3
    assert vendi_score(T([[1, 0], [1, 0], [0, 1]])) == pytest.approx(
        math.exp(-(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))), abs=1e-12)
    # a zero row is ignored
    x = rand(5, 3, seed=1)
    with_zero = torch.cat([x, torch.zeros(1, 3, dtype=torch.float64)])
    assert vendi_score(with_zero) == pytest.approx(vendi_score(x), abs=1e-12)
    assert math.isnan(vendi_score(torch.zeros(0, 3, dtype=torch.float64)))
    assert math.isnan(vendi_score(torch.zeros(2, 3, dtype=torch.float64)))
    assert vendi_score(x[:1]) == pytest.approx(1.0, abs=1e-12)


# -- condensation (docs/metrics.md#condensation) -----------------------------------------------------------------

CONDENSATION_LAYERS = [T([(1, 0), (0, 1), (-1, 0)]), T([(1, 0), (1, 1), (0, 1)]),
                       T([(1, 0), (1, 0.1), (1, -0.1)]), T([(1, 0), (0.9, 0.1), (1, 0.2)])]


def test_condensation_oracle():
    got = [condensation(x) for x in CONDENSATION_LAYERS]
    m_incl = [g["mean_cosine"] for g in got]
    m_excl = [g["mean_cosine_excl_diag"] for g in got]
    assert m_incl == pytest.approx([0.111111, 0.647603, 0.993394, 0.993490], abs=1e-6)
    assert m_excl == pytest.approx([-0.333333, 0.471405, 0.990091, 0.990235], abs=1e-6)
    for i, e in zip(m_incl, m_excl):
        assert i == pytest.approx(1 / 3 + (1 - 1 / 3) * e, abs=1e-12)
    assert spearman(m_incl, range(4)) == pytest.approx(1.0, abs=1e-12)
    assert kendall_tau_b(m_incl, range(4)) == pytest.approx(1.0, abs=1e-12)
    summary = Condensation.across_layers({str(k): g for k, g in enumerate(got)}, [0, 1, 2, 3])
    assert summary["spearman"] == pytest.approx(1.0) and summary["kendall"] == pytest.approx(1.0)
    assert summary["mean_last_n"] == pytest.approx([np.mean(m_incl[-n:]) for n in range(1, 5)], abs=1e-12)
    assert Condensation.across_layers({"0": got[0], "1": got[1]}, [0, 1]) is None


def test_oracle_27_rank_correlations_with_ties():
    m = [0.1, 0.3, 0.3, 0.5]
    assert spearman(m, range(4)) == pytest.approx(0.948683, abs=1e-6)
    assert kendall_tau_b(m, range(4)) == pytest.approx(0.912871, abs=1e-6)
    assert rankdata(m).tolist() == [1.0, 2.5, 2.5, 4.0]


@pytest.mark.parametrize("seed", range(4))
def test_rank_correlations_equal_scipy_on_random_data_with_ties(seed):
    rng = np.random.default_rng(seed)
    n = 37
    x = rng.integers(0, 6, n).astype(float)
    y = rng.integers(0, 4, n) + 0.5 * x
    assert spearman(x, y) == pytest.approx(scipy.stats.spearmanr(x, y).statistic, abs=1e-12)
    assert kendall_tau_b(x, y) == pytest.approx(scipy.stats.kendalltau(x, y).statistic, abs=1e-12)
    assert kendall_tau_b(x, y, block=5) == pytest.approx(kendall_tau_b(x, y), abs=1e-12)
    assert rankdata(x).numpy() == pytest.approx(scipy.stats.rankdata(x))
    z = rng.normal(size=n)
    assert spearman(z, y) == pytest.approx(scipy.stats.spearmanr(z, y).statistic, abs=1e-12)
    assert kendall_tau_b(z, y) == pytest.approx(scipy.stats.kendalltau(z, y).statistic, abs=1e-12)


def test_rank_correlation_degenerate_inputs():
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    assert math.isnan(kendall_tau_b([1, 1, 1], [1, 2, 3]))
    assert math.isnan(spearman([1, float("nan"), 3], [1, 2, 3]))
    assert math.isnan(kendall_tau_b([1], [1]))
    with pytest.raises(ValueError):
        spearman([1, 2], [1, 2, 3])


def test_condensation_identity_equals_explicit_matrix():
    x = rand(11, 6, seed=9)
    x[2] = 0.0  # zero row
    x[5] = x[5] * 1e-5  # a row shorter than the 1e-3 max-eps
    x[7] = x[8]  # duplicate
    c = cosine_matrix(x)
    assert c.shape == (11, 11)
    r = condensation(x)
    assert r["mean_cosine"] == pytest.approx(c.mean().item(), abs=1e-14)
    off = ~torch.eye(11, dtype=torch.bool)
    assert r["mean_cosine_excl_diag"] == pytest.approx(c[off].mean().item(), abs=1e-14)
    # the clip is a no-op: the unclipped matrix has the same mean
    u = x / x.norm(dim=-1, keepdim=True).clamp(min=1e-3)
    assert (u @ u.T).abs().max().item() <= 1 + 1e-15
    assert (u @ u.T).mean().item() == pytest.approx(c.mean().item(), abs=1e-15)


def test_condensation_edges_and_batch_form():
    one = condensation(T([[3.0, 4.0]]))
    assert one["mean_cosine"] == pytest.approx(1.0, abs=1e-15) and math.isnan(one["mean_cosine_excl_diag"])
    tiny = condensation(T([[3e-4, 4e-4]]))  # norm 5e-4 < 1e-3: ‖u‖ = 0.5
    assert tiny["mean_cosine"] == pytest.approx(0.25, abs=1e-12)
    assert all(math.isnan(v) for v in condensation(torch.zeros(0, 2, dtype=torch.float64)).values())
    texts = [rand(5, 4, seed=1), rand(1, 4, seed=2), rand(8, 4, seed=3)]
    b = token_batch(texts)
    incl, excl = condensation_batch(b.hidden, b.mask)
    for i, x in enumerate(texts):
        r = condensation(x)
        assert incl[i].item() == pytest.approx(r["mean_cosine"], abs=1e-14)
        assert (math.isnan(excl[i].item()) and math.isnan(r["mean_cosine_excl_diag"])) or \
            excl[i].item() == pytest.approx(r["mean_cosine_excl_diag"], abs=1e-14)


def test_cosine_histogram_equals_numpy():
    x = rand(13, 5, seed=11, shift=0.0)
    c = cosine_matrix(x).numpy().ravel()
    for bins in (1, 7, 50):
        expected, edges = np.histogram(c, bins=bins, range=(-1.0, 1.0))
        got = cosine_histogram(x, bins=bins, block=4)
        assert got.numpy() == pytest.approx(expected)
        assert histogram_edges(bins).numpy() == pytest.approx(edges, abs=1e-15)
    h = cosine_histogram(CONDENSATION_LAYERS[0], bins=4)  # cosines -1 (×2), 0 (×4), 1 (×3)
    assert h.tolist() == [2.0, 0.0, 4.0, 3.0]


# -- metric classes ----------------------------------------------------------------------------------------------

def test_registration_and_defaults():
    class Reg:
        def __init__(self):
            self.added = []

        def add(self, cls):
            self.added.append(cls)

    reg = Reg()
    layerwise.repgeom_register_metrics(reg)
    condensation_plugin.repgeom_register_metrics(reg)
    names = {c.name: c for c in reg.added}
    assert set(names) == {"prompt_entropy", "dataset_entropy", "effective_rank", "curvature", "vendi", "condensation"}
    assert DatasetEntropy.default_pooling == "mean" and EffectiveRank.default_pooling == "mean"
    assert Vendi.default_pooling == "last"
    assert PromptEntropy().config() == {"alpha": 1.0, "variant": "paper", "per_text": False, "spectra": "auto"}
    assert DatasetEntropy().config() == {"alpha": 1.0, "variant": "paper", "centering": "global", "batch_size": 2}


@pytest.mark.parametrize("cls, kwargs", [
    (PromptEntropy, {"variant": "clamp"}), (PromptEntropy, {"alpha": -1}), (DatasetEntropy, {"centering": "x"}),
    (DatasetEntropy, {"batch_size": 0}), (Curvature, {"variant": "abs"}), (Condensation, {"bins": -1}),
    (Condensation, {"eps": 0}),
])
def test_bad_parameters_are_user_errors(cls, kwargs):
    with pytest.raises(RepgeomError):
        cls(**kwargs)


def test_token_metrics_average_per_text_values_and_skip_short_texts():
    texts = [rand(6, 4, seed=1), rand(1, 4, seed=2), rand(2, 4, seed=3), rand(9, 4, seed=4)]
    b = token_batch(texts)
    pe = PromptEntropy(per_text=True)
    pe.update(b)
    vals = [prompt_entropy(x) for x in texts]
    ok = [v for v in vals if not math.isnan(v["raw"])]
    assert len(ok) == 3
    out = pe.compute()
    for k in ("raw", "normalized", "logN", "logD"):
        assert out[k] == pytest.approx(np.mean([v[k] for v in ok]), abs=1e-12)
    assert pe.diagnostics() == {"n_texts": 3, "n_skipped": 1}
    idx, per = pe.per_text_results()["prompt_entropy"]
    assert idx.tolist() == [0, 1, 2, 3] and math.isnan(per[1].item())

    cu = Curvature()
    cu.update(b)
    assert cu.compute()["raw"] == pytest.approx(np.mean([curvature(texts[0])["raw"], curvature(texts[3])["raw"]]))
    assert cu.diagnostics() == {"n_texts": 2, "n_skipped_short": 2}
    code = Curvature(variant="information_flow")
    code.update(b)  # B's code averages the 0 of short prompts in
    assert code.compute()["raw"] == pytest.approx(np.mean([curvature(x, "information_flow")["raw"] for x in texts]))

    co = Condensation(bins=10)
    co.update(b)
    out = co.compute()
    assert out["mean_cosine"] == pytest.approx(np.mean([condensation(x)["mean_cosine"] for x in texts]), abs=1e-12)
    assert out["mean_cosine_excl_diag"] == pytest.approx(
        np.mean([condensation(x)["mean_cosine_excl_diag"] for x in texts if len(x) > 1]), abs=1e-12)
    dens = np.array(out["histogram"]["density"])
    assert len(out["histogram"]["edges"]) == 11 and (dens * 0.2).sum() == pytest.approx(1.0, abs=1e-12)
    # each text weighs 1: the histogram mean is close to the mean cosine (within half a bin)
    centers = np.array(out["histogram"]["edges"][:-1]) + 0.1
    assert (dens * 0.2 * centers).sum() == pytest.approx(out["mean_cosine"], abs=0.1)


def test_empty_metrics_give_nan():
    assert all(math.isnan(v) for v in PromptEntropy().compute().values())
    assert all(math.isnan(v) for v in DatasetEntropy().compute().values())
    assert all(math.isnan(v) for v in DatasetEntropy(centering="none").compute().values())
    assert all(math.isnan(v) for v in EffectiveRank().compute().values())
    assert all(math.isnan(v) for v in Curvature().compute().values())
    assert math.isnan(Vendi().compute())
    out = Condensation().compute()
    assert math.isnan(out["mean_cosine"]) and all(math.isnan(v) for v in out["histogram"]["density"])


@pytest.mark.parametrize("n, d", [(5, 12), (30, 6), (12, 12)])
def test_pooled_metrics_equal_functional(n, d):
    x = rand(n, d, seed=n + d)
    x[3] = x[1] * 2.0  # a duplicate direction
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    for kwargs in ({}, {"centering": "batch"}, {"centering": "batch", "batch_size": 4}, {"centering": "none"},
                   {"centering": "none", "variant": "information_flow"}, {"variant": "information_flow"}):
        m = DatasetEntropy(**kwargs)
        for lo in range(0, n, 4):  # fed in a shuffled order: the text index restores the input order
            rows = perm[lo:lo + 4]
            m.update(LayerBatch("final", rows, pooled=x[rows]))
        fn = dataset_entropy(x, **kwargs)
        for k, v in m.compute().items():
            assert v == pytest.approx(fn[k], abs=1e-9), (kwargs, k)
    er = EffectiveRank()
    ve = Vendi()
    for lo in range(0, n, 4):
        er.update(pooled_batch(x[lo:lo + 4], lo))
        ve.update(pooled_batch(x[lo:lo + 4], lo))
    for k, v in er.compute().items():
        assert v == pytest.approx(effective_rank(x)[k], abs=1e-9), k
    assert ve.compute() == pytest.approx(vendi_score(x), abs=1e-9)


def test_rank_deficient_pooled_matrix_through_the_streamed_gram():
    base = rand(3, 8, seed=2)
    x = torch.cat([base, 2 * base, -base, base[:1] + base[1:2]])  # 10 rows of rank 3 in 8 dims
    er = EffectiveRank()
    for lo in range(0, 10, 3):
        er.update(pooled_batch(x[lo:lo + 3], lo))
    fn = effective_rank(x)
    for k, v in er.compute().items():
        assert v == pytest.approx(fn[k], abs=1e-6), k
    assert er.compute()["erank"] <= 3.0


def test_merge_of_gram_and_row_shards_equals_single_pass():
    x = rand(20, 6, seed=8)
    for cls, kwargs in ((EffectiveRank, {}), (Vendi, {}), (DatasetEntropy, {"centering": "none"}),
                        (DatasetEntropy, {"centering": "none", "variant": "information_flow"})):
        whole = cls(**kwargs)
        whole.update(pooled_batch(x))
        a, b, c = cls(**kwargs), cls(**kwargs), cls(**kwargs)
        a.update(pooled_batch(x[:10]))  # 10 > 6 rows: folded into the Gram
        b.update(pooled_batch(x[10:13], 10))  # 3 rows: kept
        c.update(pooled_batch(x[13:], 13))  # 7 rows: folded
        assert a.stat("gram").grams.shape == (7, 6) and b.stat("gram").grams.numel() == 0
        assert len(b.stat("gram").rows) == 1
        merged = b.merge(a).merge(c)
        expected, got = whole.compute(), merged.compute()
        if isinstance(expected, dict):
            for k in expected:
                assert got[k] == pytest.approx(expected[k], abs=1e-9), (cls.name, k)
        else:
            assert got == pytest.approx(expected, abs=1e-9)
        # a merge of two row shards that together exceed D still picks the D×D form
        p, q = cls(**kwargs), cls(**kwargs)
        p.update(pooled_batch(x[:5]))
        q.update(pooled_batch(x[5:9], 5))
        ref = cls(**kwargs)
        ref.update(pooled_batch(x[:9]))
        r1, r2 = p.merge(q).compute(), ref.compute()
        if isinstance(r1, dict):
            for k in r1:
                assert r1[k] == pytest.approx(r2[k], abs=1e-9)
        else:
            assert r1 == pytest.approx(r2, abs=1e-9)


def test_information_flow_dataset_entropy_follows_the_code_branch_in_the_streamed_path():
    # N > D: the code takes ZᵀZ then clamps; the streamed Gram must give exactly that, not the clamped ZZᵀ.
    x = rand(8, 3, seed=6, shift=0.0)  # mixed signs, so the clamp acts on both branches
    m = DatasetEntropy(centering="none", variant="information_flow")
    m.update(pooled_batch(x))
    z = torch.nn.functional.normalize(x, dim=-1)
    assert m.compute()["raw"] == pytest.approx(gram_entropy(z.T @ z, variant="information_flow").item(), abs=1e-12)
    assert m.compute()["raw"] != pytest.approx(gram_entropy(z @ z.T, variant="information_flow").item(), abs=1e-3)


# -- through the real pipeline -----------------------------------------------------------------------------------

def test_pipeline_matches_hand_computation(tiny_model_dir, texts):
    import transformers

    from repgeom_eval.measurement.engine import measure
    from repgeom_eval.plugin_system.host import PluginHost

    host = PluginHost(entry_points=list(md.entry_points(group="repgeom_eval")))  # registered as built-ins
    assert not host.failures
    assert host.metrics.entry("prompt_entropy").plugin == "layerwise"
    assert host.metrics.entry("condensation").plugin == "condensation"
    model_dir = tiny_model_dir("llama")
    sample = texts[:12] + ["a"]
    metrics = ["prompt_entropy", "dataset_entropy", "effective_rank", "curvature", "vendi", "condensation"]
    result = measure(model_dir, sample, layers="all", metrics=metrics, host=host, progress=False, batch_size=5)
    assert list(result.results) == ["embed", "resid_post:0", "final"]

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    per_layer = {name: [] for name in ("embed", "final")}
    with torch.no_grad():
        for t in sample:
            hs = model(**tok(t, return_tensors="pt"), output_hidden_states=True).hidden_states
            per_layer["embed"].append(hs[0][0].double())
            per_layer["final"].append(hs[-1][0].double())

    final = per_layer["final"]
    pe = [prompt_entropy(x) for x in final]
    pe = [v for v in pe if not math.isnan(v["raw"])]
    got = result.results["final"]
    assert got["prompt_entropy"]["raw"] == pytest.approx(np.mean([v["raw"] for v in pe]), rel=1e-5)
    assert got["prompt_entropy"]["normalized"] == pytest.approx(np.mean([v["normalized"] for v in pe]), rel=1e-5)
    assert result.diagnostics["final"]["prompt_entropy"]["n_texts"] == len(pe)
    cu = [curvature(x)["raw"] for x in final]
    assert got["curvature"]["raw"] == pytest.approx(np.nanmean(cu), rel=1e-5)
    # each metric's default pooling: mean for dataset entropy and effective rank, last token for Vendi
    mean_pooled = torch.stack([x.mean(0) for x in final])
    de = dataset_entropy(mean_pooled)
    assert got["dataset_entropy"]["raw"] == pytest.approx(de["raw"], rel=1e-5)
    assert got["dataset_entropy"]["normalized"] == pytest.approx(de["normalized"], rel=1e-5)
    for k, v in effective_rank(mean_pooled).items():
        assert got["effective_rank"][k] == pytest.approx(v, rel=1e-5)
    assert got["vendi"] == pytest.approx(vendi_score(torch.stack([x[-1] for x in final])), rel=1e-5)
    assert result.config["metrics"]["dataset_entropy"]["centering"] == "global"

    emb = result.results["embed"]["condensation"]
    assert emb["mean_cosine"] == pytest.approx(np.mean([condensation(x)["mean_cosine"] for x in per_layer["embed"]]),
                                               rel=1e-5)
    summary = result.summary["condensation"]
    m = [result.results[a]["condensation"]["mean_cosine"] for a in result.results]
    assert summary["spearman"] == pytest.approx(spearman(m, range(3)))
    assert summary["kendall"] == pytest.approx(kendall_tau_b(m, range(3)))
    assert summary["mean_last_n"] == pytest.approx([np.mean(m[-n:]) for n in (1, 2, 3)])


def _effective_rank_numpy(z: np.ndarray) -> dict[str, float]:
    """Brute force with numpy's SVD, straight from the definitions (docs/metrics.md#effective_rank)."""
    s = np.linalg.svd(z, compute_uv=False)
    s = np.where(s > s.max() * max(z.shape) * np.finfo(np.float64).eps, s, 0.0)
    p = s / s.sum() + 1e-7
    rankme = math.exp(-(p * np.log(p)).sum())
    q = s[s > 0] / s.sum()
    erank = math.exp(-(q * np.log(q)).sum())
    lam = s[s > 0] ** 2 / (s[s > 0] ** 2).sum()
    return {"rankme": rankme, "erank": erank, "exp_entropy": math.exp(-(lam * np.log(lam)).sum())}


@pytest.mark.parametrize("n, d, rank", [(9, 4, 4), (4, 9, 4), (20, 12, 5), (16, 16, 16), (3, 30, 2)])
def test_effective_rank_equals_numpy_svd_on_random_inputs(n, d, rank):
    g = np.random.default_rng(n * 100 + d)
    z = g.standard_normal((n, rank)) @ g.standard_normal((rank, d)) * g.uniform(0.1, 5.0, size=(1, d))
    want = _effective_rank_numpy(z)
    got = effective_rank(torch.from_numpy(z))
    streamed = EffectiveRank()  # the D×D (or N×N) Gram accumulator, fed in shards
    for lo in range(0, n, 3):
        streamed.update(pooled_batch(torch.from_numpy(z[lo:lo + 3]), lo))
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key
        assert streamed.compute()[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key
    assert got["erank"] <= rank + 1e-9
