"""Effective rank and Vendi score of a set of vectors (docs/metrics.md#effective_rank, docs/metrics.md#vendi): how
many directions the vectors spread over, read from the spectrum of their Gram (the matrix entropies are in
:mod:`repgeom_eval.functional.entropy`)."""

from __future__ import annotations

import torch

from .dispersion import unit
from .entropy import gram_spectrum, spectrum_entropy

RANKME_EPS = 1e-7  # Garrido et al. (2023), float32 value
_NAN = float("nan")


def effective_rank_from_singular_values(sigma: torch.Tensor, rank_tol: float | None = None) -> dict[str, float]:
    """RankMe, erank and exp(S_1(ZZᵀ)) from the min(N, D) singular values σ of Z (docs/metrics.md#effective_rank).

    * ``rankme`` (Garrido et al. 2023): p_k = σ_k / ‖σ‖₁ + 1e-7 over **all** min(N, D) singular values,
      RankMe = exp(−Σ p_k log p_k).
    * ``erank`` (Roy & Vetterli 2007): the same with no ε, over σ > 0 only.
    * ``exp_entropy``: exp(S_1) of the Gram eigenvalues σ², i.e. exp of paper B's von Neumann entropy of Z Zᵀ;
      it is *not* erank (σ² vs σ).

    Singular values ≤ ``rank_tol`` count as exactly zero (``None`` keeps every σ > 0; :func:`default_rank_tol`
    gives numpy's ``matrix_rank`` tolerance, which :func:`effective_rank` uses). A zero matrix (all σ = 0) has no
    distribution (0/0): every value is returned as 0.0, its rank, not NaN, so a collapsed layer still plots.
    """
    s = sigma.double().flatten().clamp(min=0)
    if rank_tol is not None:
        s = torch.where(s > rank_tol, s, torch.zeros_like(s))
    total = s.sum()
    if not total > 0:
        return {"rankme": 0.0, "erank": 0.0, "exp_entropy": 0.0}
    p = s / total + RANKME_EPS
    rankme = torch.exp(-(p * torch.log(p)).sum())
    pos = s[s > 0] / total
    erank = torch.exp(-(pos * torch.log(pos)).sum())
    exp_entropy = torch.exp(spectrum_entropy(s * s, 1.0))
    return {"rankme": float(rankme), "erank": float(erank), "exp_entropy": float(exp_entropy)}


def default_rank_tol(sigma_max: float, n: int, d: int) -> float:
    """numpy ``matrix_rank``'s tolerance: σ_max · max(N, D) · float64 machine epsilon."""
    return float(sigma_max) * max(n, d) * torch.finfo(torch.float64).eps


def effective_rank_from_gram_eigenvalues(eigenvalues: torch.Tensor, n: int, d: int) -> dict[str, float]:
    """:func:`effective_rank` from the eigenvalues of Z Zᵀ or Zᵀ Z (σ² = eigenvalues) of an N×D matrix Z.

    This is what a streaming metric can do: accumulate the D×D Gram Σ z zᵀ and diagonalise it once. The largest
    min(N, D) eigenvalues are kept (a D×D Gram of N < D rows has D − N structural zeros); eigenvalues at or below
    the eigen-solver's round-off floor λ_max · max(N, D) · eps count as zero, then σ = √λ.
    """
    if n == 0:
        return {"rankme": _NAN, "erank": _NAN, "exp_entropy": _NAN}
    lam = torch.sort(eigenvalues.double().flatten(), descending=True).values[: min(n, d)]
    top = float(lam[0]) if lam.numel() else 0.0
    lam = torch.where(lam > top * max(n, d) * torch.finfo(torch.float64).eps, lam, torch.zeros_like(lam))
    return effective_rank_from_singular_values(lam.sqrt())


def effective_rank(Z: torch.Tensor) -> dict[str, float]:
    """RankMe, erank and exp(S_1(ZZᵀ)) of the rows of ``Z`` [N, D], no centring (docs/metrics.md#effective_rank).

    Singular values come from ``torch.linalg.svdvals``; those below numpy's ``matrix_rank`` tolerance
    (σ_max · max(N, D) · eps) count as zero. See :func:`effective_rank_from_singular_values` for the formulas.
    Oracle: Z = [[3,0],[0,1],[0,0]] (σ = 3, 1) → rankme ≈ erank = 1.754765, exp_entropy = 1.384145.
    A zero matrix gives 0.0 for all three (its rank); an empty one (N = 0, nothing measured) gives NaN.
    """
    Z = Z.double()
    n, d = Z.shape
    if n == 0 or d == 0:
        return {"rankme": _NAN, "erank": _NAN, "exp_entropy": _NAN}
    sigma = torch.linalg.svdvals(Z)
    return effective_rank_from_singular_values(sigma, default_rank_tol(sigma.max(), n, d))


def vendi_score(Z: torch.Tensor) -> float:
    """Vendi score (Friedman & Dieng 2023; paper A appendix A.5) of the rows of ``Z`` [N, D] with cosine similarity.

    U = unit rows of Z, K = U Uᵀ (unit diagonal), Vendi = exp(−Σ λ_i log λ_i) over the eigenvalues λ of K/N,
    i.e. exp(S_1(K)). The spectrum comes from the smaller of U Uᵀ and Uᵀ U. It lies in [1, min(N, D)]: 1 when all
    vectors are parallel, N when they are orthogonal. A zero row has no direction; since only the positive
    eigenvalues are renormalised, zero rows are simply ignored (the value is that of the non-zero rows).
    N = 0 or all rows zero gives NaN.
    """
    U = unit(Z.double())
    if U.shape[0] == 0:
        return _NAN
    return float(torch.exp(spectrum_entropy(gram_spectrum(U), 1.0)))
