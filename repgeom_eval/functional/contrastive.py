"""Multi-view metrics of paper B (Layer by Layer): InfoNCE, LiDAR and DiME (docs/metrics.md#infonce,
docs/metrics.md#lidar, docs/metrics.md#dime).

Every function takes the *pooled* views of N texts and computes in float64. What each one normalizes:

* :func:`infonce` and :func:`dime` unit-normalize the rows by default (``normalize=True``), as the project's
  default treatment of pooled views (docs/metrics.md#augmented-views): each view vector is scaled to unit length,
  with no centring.
  Pass ``normalize=False`` to use the rows exactly as given (the scale then matters).
* :func:`lidar` uses the vectors as given (LiDAR is a ratio of scatters; the metric class normalizes first).

Matrix entropies use only the strictly positive eigenvalues, renormalized to sum to one (as repitl does,
docs/metrics.md#matrix-entropy); the small helper here is private on purpose.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from .dispersion import unit

from repgeom_eval.spec.names import INFONCE_VARIANTS, LIDAR_VARIANTS  # declared once, torch-free


# -- matrix entropy ----------------------------------------------------------------------------------------------

def _entropy_of_eigenvalues(lam: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """Rényi entropy (natural log) of the distribution p = λ⁺/Σλ⁺ over the strictly positive eigenvalues λ⁺.

    α = 1 is the von Neumann (Shannon) limit −Σ p log p; otherwise 1/(1−α)·log Σ p^α. No positive eigenvalue → NaN.
    """
    lam = lam[lam > 0]
    if lam.numel() == 0:
        return torch.tensor(float("nan"), dtype=torch.float64)
    p = lam / lam.sum()
    if alpha == 1:
        return -(p * torch.log(p)).sum()
    return torch.log((p ** alpha).sum()) / (1.0 - alpha)


def _matrix_entropy(k: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """Matrix-based Rényi entropy S_α(K) of a symmetric matrix (docs/metrics.md#matrix-entropy): eigenvalues, then
    the helper above."""
    k = k.double()
    return _entropy_of_eigenvalues(torch.linalg.eigvalsh((k + k.T) / 2), alpha)


# -- InfoNCE ------------------------------------------------------------------------------------------------------

def infonce(a: torch.Tensor, b: torch.Tensor, tau: float = 0.1, variant: str = "one_directional",
            normalize: bool = True) -> dict[str, float]:
    """InfoNCE loss between two views of N texts, and the mutual-information bound (docs/metrics.md#infonce).

    Default ``variant="one_directional"`` (paper B code from 2025-01-29)::

        logits = A Bᵀ / τ,      L = mean_i −log softmax_j(logits)_{i,i}        (A → B only)

    Positives are the diagonal; the other texts' B-views are the negatives (no in-view negatives).
    ``variant="simclr"`` is B's older 2N×2N form: Z = [A; B], logits = Z Zᵀ/τ with the self-pairs removed, and
    row i's positive is its other view; L is the mean over all 2N rows.

    Args:
        a, b: [N, D] pooled views (row i of both = text i).
        tau: temperature, default 0.1.
        normalize: unit-normalize the rows first (default; the project's treatment of pooled views).
    Returns:
        ``{"raw": L, "mi_lower_bound": 1 − L/log N}``. The bound is NaN for N = 1 (log 1 = 0); L is 0 there.
        A lower L / higher bound means the two views of a text are easier to match.
    Complexity O(N²·D) time, O(N²) memory.
    """
    if variant not in INFONCE_VARIANTS:
        raise ValueError(f"variant must be one of {INFONCE_VARIANTS}, got {variant!r}")
    a, b = a.double(), b.double()
    if a.shape != b.shape or a.dim() != 2:
        raise ValueError(f"infonce needs two [N, D] views of the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    n = a.shape[0]
    if n == 0:
        return {"raw": float("nan"), "mi_lower_bound": float("nan")}
    if normalize:
        a, b = unit(a), unit(b)
    if variant == "one_directional":
        loss = F.cross_entropy(a @ b.T / tau, torch.arange(n, device=a.device))
    else:
        z = torch.cat([a, b])
        logits = (z @ z.T / tau).fill_diagonal_(float("-inf"))
        target = torch.cat([torch.arange(n, 2 * n), torch.arange(n)]).to(a.device, non_blocking=True)
        loss = F.cross_entropy(logits, target)
    raw = float(loss)
    bound = 1.0 - raw / math.log(n) if n > 1 else float("nan")
    return {"raw": raw, "mi_lower_bound": bound}


# -- LiDAR ---------------------------------------------------------------------------------------------------------

def lidar_stats(x: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """The sufficient statistics of LiDAR for views ``x`` [n, q, D] (n classes = texts, q views each).

    With μ_i = mean_j x_ij::

        n, q,   sum_mean = Σ_i μ_i  [D],   sum_outer_mean = Σ_i μ_i μ_iᵀ  [D, D],   scatter = Σ_ij x_ij x_ijᵀ  [D, D]

    All are sums over texts, so the statistics of disjoint sets of texts add up (the LiDAR metric keeps them).
    """
    x = x.double()
    if x.dim() != 3:
        raise ValueError(f"lidar needs views of shape [n, q, D], got {tuple(x.shape)}")
    n, q, d = x.shape
    mu = x.mean(1)
    flat = x.reshape(n * q, d)
    return {"n": n, "q": q, "sum_mean": mu.sum(0), "sum_outer_mean": mu.T @ mu, "scatter": flat.T @ flat}


def lidar_from_stats(n: int | torch.Tensor, q: int, sum_mean: torch.Tensor, sum_outer_mean: torch.Tensor,
                     scatter: torch.Tensor, delta: float = 1e-4, eps: float = 1e-7,
                     variant: str = "thilak") -> dict[str, float]:
    """LiDAR from the statistics of :func:`lidar_stats` (q views for every one of n texts).

    Derivation (μ = Σ_i μ_i / n is the mean of all n·q views, since every class has q views)::

        Σ_i (μ_i−μ)(μ_i−μ)ᵀ      = Σ_i μ_i μ_iᵀ − n μ μᵀ            =: B
        Σ_ij (x_ij−μ_i)(x_ij−μ_i)ᵀ = Σ_ij x_ij x_ijᵀ − q Σ_i μ_i μ_iᵀ =: W

    ``variant="thilak"`` (default, the original LiDAR of Thilak et al. 2024, docs/metrics.md#lidar)::

        S_b = B/(n−1),   S_w = W/(n(q−1)) + δI,   Σ = S_w^{−½} S_b S_w^{−½}
        p = λ(Σ)/‖λ(Σ)‖₁ + ε,   LiDAR = exp(−Σ p log p)      → {"lidar": LiDAR, "log": −Σ p log p}

    (eigenvalues below zero from round-off are set to 0 first). Needs n ≥ 2 and q ≥ 2, otherwise NaN.

    ``variant="information_flow"`` (paper B's code, docs/metrics.md#reference-code-variants)::

        S_b = B/n,   S_w = W/(nq) + δI,   raw = S_1(Σ) on the positive eigenvalues, no ε, not exponentiated
        → {"raw": raw, "normalized": raw / min(log n, log D)}          (``normalized`` is B's ``maxEntropy``)

    Args:
        delta: ridge δ added to S_w (default 1e-4). eps: ε added to p (Thilak only; default 1e-7).
    Cost O(D³) (two symmetric eigendecompositions of D×D matrices), memory O(D²).
    """
    if variant not in LIDAR_VARIANTS:
        raise ValueError(f"variant must be one of {LIDAR_VARIANTS}, got {variant!r}")
    n = int(n)
    q = int(q)
    sum_mean, sum_outer_mean, scatter = sum_mean.double(), sum_outer_mean.double(), scatter.double()
    d = sum_mean.shape[-1]
    nan = float("nan")
    if variant == "thilak":
        if n < 2 or q < 2:
            return {"lidar": nan, "log": nan}
        norm_b, norm_w = n - 1, n * (q - 1)
    else:
        if n < 1 or q < 1:
            return {"raw": nan, "normalized": nan}
        norm_b, norm_w = n, n * q
    mu = sum_mean / n
    between = sum_outer_mean - n * torch.outer(mu, mu)
    within = scatter - q * sum_outer_mean
    s_b = between / norm_b
    s_w = within / norm_w + delta * torch.eye(d, dtype=torch.float64, device=scatter.device)
    s_w = (s_w + s_w.T) / 2
    w, v = torch.linalg.eigh(s_w)
    inv_sqrt = (v * w.rsqrt()) @ v.T
    sigma = inv_sqrt @ s_b @ inv_sqrt
    lam = torch.linalg.eigvalsh((sigma + sigma.T) / 2)
    if variant == "thilak":
        lam = lam.clamp_min(0)
        p = lam / lam.sum() + eps
        entropy = float(-(p * torch.log(p)).sum())
        return {"lidar": math.exp(entropy), "log": entropy}
    raw = float(_entropy_of_eigenvalues(lam)) + 0.0  # + 0.0 turns −0.0 into 0.0
    scale = min(math.log(n), math.log(d))
    return {"raw": raw, "normalized": raw / scale if scale > 0 else nan}


def lidar(x: torch.Tensor, delta: float = 1e-4, eps: float = 1e-7, variant: str = "thilak") -> dict[str, float]:
    """LiDAR of views ``x`` [n texts, q views, D], used as given (see :func:`lidar_from_stats` for the formulas).

    Goes through the O(n·D + D²) statistics of :func:`lidar_stats`, exactly as the streaming metric does.
    """
    return lidar_from_stats(**lidar_stats(x), delta=delta, eps=eps, variant=variant)


# -- DiME ----------------------------------------------------------------------------------------------------------

def _dime_terms(ka: torch.Tensor, kb: torch.Tensor, perms, alpha: float) -> tuple[float, float]:
    joint = float(_matrix_entropy(ka * kb, alpha))
    shuffled = [float(_matrix_entropy(ka * kb[p][:, p], alpha)) for p in perms]
    return sum(shuffled) / len(shuffled), joint


def _normalized(raw: float, n: int, d: int) -> float:
    scale = min(math.log(n), math.log(d)) if n > 0 and d > 0 else 0.0
    return raw / scale if scale > 0 else float("nan")


def dime(za: torch.Tensor, zb: torch.Tensor, n_iters: int = 10, seed: int = 0, alpha: float = 1.0,
         normalize: bool = True) -> dict[str, float]:
    """DiME (difference of matrix entropies) between two views of N texts (docs/metrics.md#dime)::

        K_A = Z_A Z_Aᵀ,  K_B = Z_B Z_Bᵀ          (always the N×N Gram, linear kernel)
        DiME = (1/T) Σ_t S_α(K_A ∘ P_t K_B P_tᵀ) − S_α(K_A ∘ K_B)

    ∘ is the Hadamard product and S_α the matrix Rényi entropy on positive eigenvalues (α = 1: von Neumann).
    P_1..P_T (T = ``n_iters``, default 10) are uniform random permutations drawn from a ``torch.Generator``
    seeded with ``seed`` (default 0), so the value is reproducible; paper B's code leaves them unseeded and
    switches to D×D feature covariances when N > D, which this function never does. DiME can be negative.

    Args:
        za, zb: [N, D] pooled views. normalize: unit-normalize the rows first (default).
    Returns:
        ``{"raw": DiME, "normalized": DiME / min(log N, log D)}`` (``normalized`` is B's ``maxEntropy``); NaN for
        N < 2.
    Cost O((T+1)·N³).
    """
    za, zb = za.double(), zb.double()
    if za.shape != zb.shape or za.dim() != 2:
        raise ValueError(f"dime needs two [N, D] views of the same shape, got {tuple(za.shape)} and {tuple(zb.shape)}")
    n, d = za.shape
    if n < 2 or n_iters < 1:
        return {"raw": float("nan"), "normalized": float("nan")}
    if normalize:
        za, zb = unit(za), unit(zb)
    g = torch.Generator().manual_seed(int(seed))
    perms = [torch.randperm(n, generator=g) for _ in range(n_iters)]
    shuffled, joint = _dime_terms(za @ za.T, zb @ zb.T, perms, alpha)
    raw = shuffled - joint
    return {"raw": raw, "normalized": _normalized(raw, n, d)}


def dime_exact(ka: torch.Tensor, kb: torch.Tensor, alpha: float = 1.0, max_n: int = 8) -> float:
    """DiME with the exact expectation over all N! permutations, from two N×N kernels (test oracle, small N)::

        E_P[S_α(K_A ∘ P K_B Pᵀ)] − S_α(K_A ∘ K_B)

    Refuses N > ``max_n`` (8! = 40320 eigendecompositions).
    """
    ka, kb = ka.double(), kb.double()
    n = ka.shape[0]
    if n > max_n:
        raise ValueError(f"dime_exact enumerates N! permutations; N = {n} exceeds max_n = {max_n}")
    perms = [torch.tensor(p) for p in itertools.permutations(range(n))]
    shuffled, joint = _dime_terms(ka, kb, perms, alpha)
    return shuffled - joint
