"""Cosine dispersion: mean pairwise cosine distance, via the O(N·d) sum identity (docs/metrics.md#cosine-dispersion).

With u_i = x_i / max(‖x_i‖, 1e-12), S = Σ u_i and Q = Σ ‖u_i‖²::

    D = 1 − (‖S‖² − Q) / (N(N−1))

Q (not N) keeps zero rows exact: a zero vector has cosine 0 with everything. All sums run in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .tokens import TokenBlock

EPS = 1e-12  # torch.nn.functional.normalize's default


def unit(x: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Rows scaled to unit length; zero rows stay zero."""
    return F.normalize(x, p=2, dim=-1, eps=eps)


def dispersion_from_sums(s: torch.Tensor, q: torch.Tensor, n: torch.Tensor | int) -> torch.Tensor:
    """D from the sufficient statistics S = Σu (…, d), Q = Σ‖u‖² and n; NaN where n < 2."""
    n = torch.as_tensor(n, dtype=torch.float64, device=s.device)
    pairs = n * (n - 1)
    sq = (s.double() * s.double()).sum(-1)
    value = 1.0 - (sq - q.double()) / torch.where(pairs > 0, pairs, torch.ones_like(pairs))
    return torch.where(n >= 2, value, torch.full_like(value, float("nan")))


@dataclass(frozen=True)
class DispersionSums:
    """The sufficient statistics of a set of unit vectors — S = Σu (float64), Q = Σ‖u‖², n — which add across
    batches, shards and ranks; :meth:`dispersion` is D over the set (the one type for them, on NumPy)."""

    s: np.ndarray
    q: float
    n: float

    @classmethod
    def of(cls, u: np.ndarray) -> "DispersionSums":
        """The sums of the rows of ``u`` (already unit vectors)."""
        u = np.asarray(u, dtype=np.float64)
        return cls(u.sum(0), float(np.einsum("ij,ij->", u, u)), float(u.shape[0]))

    def __add__(self, other: "DispersionSums") -> "DispersionSums":
        return DispersionSums(self.s + other.s, self.q + other.q, self.n + other.n)

    merge = __add__

    def dispersion(self) -> float:
        """D over the set (docs/metrics.md#cosine-dispersion); NaN with fewer than 2 vectors."""
        if self.n < 2:
            return float("nan")
        return float(1.0 - (self.s @ self.s - self.q) / (self.n * (self.n - 1)))

    def pack(self) -> np.ndarray:
        """One flat array (for an all-gather): S, then Q and n."""
        return np.concatenate([self.s, [self.q, self.n]])

    @classmethod
    def unpack(cls, packed: np.ndarray) -> "DispersionSums":
        return cls(packed[:-2], float(packed[-2]), float(packed[-1]))


def dispersion(x: torch.Tensor) -> torch.Tensor:
    """Mean pairwise cosine distance of the rows of ``x`` [N, d] (NaN if N < 2)."""
    u = unit(x.double())
    return dispersion_from_sums(u.sum(0), (u * u).sum(), u.shape[0])


def pairwise_dispersion(x: torch.Tensor) -> torch.Tensor:
    """Brute-force reference: builds the N×N cosine matrix. For tests and benchmarks only."""
    u = unit(x.double())
    n = u.shape[0]
    if n < 2:
        return torch.tensor(float("nan"), dtype=torch.float64)
    cos = u @ u.T
    off = ~torch.eye(n, dtype=torch.bool, device=u.device)
    return (1.0 - cos[off]).mean()


def cross_dispersion(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Mean cosine distance over all pairs (i ∈ A, j ∈ B): 1 − S_A·S_B / (|A||B|)
    (docs/metrics.md#cross-set-dispersion)."""
    ua, ub = unit(a.double()), unit(b.double())
    return 1.0 - ua.sum(0) @ ub.sum(0) / (ua.shape[0] * ub.shape[0])


def per_sample_scores(x: torch.Tensor) -> torch.Tensor:
    """c_i = mean_{j≠i} (1 − u_i·u_j) = 1 − (u_i·S − ‖u_i‖²)/(N−1); mean(c) = D
    (docs/metrics.md#per-text-scores)."""
    u = unit(x.double())
    n = u.shape[0]
    if n < 2:
        return torch.full((n,), float("nan"), dtype=torch.float64)
    return 1.0 - (u @ u.sum(0) - (u * u).sum(-1)) / (n - 1)


def leave_one_out_dispersion(x: torch.Tensor) -> torch.Tensor:
    """D without sample i, for every i (N ≥ 3; NaN otherwise)."""
    u = unit(x.double())
    n = u.shape[0]
    if n < 3:
        return torch.full((n,), float("nan"), dtype=torch.float64)
    s, norms = u.sum(0), (u * u).sum(-1)
    rest = s.unsqueeze(0) - u
    return 1.0 - ((rest * rest).sum(-1) - (norms.sum() - norms)) / ((n - 1) * (n - 2))


def leave_one_out_influence(x: torch.Tensor) -> torch.Tensor:
    """Δ_i = D − D_{−i} = 2(c_i − D)/(N − 2); positive when sample i raises dispersion."""
    return dispersion(x) - leave_one_out_dispersion(x)


def token_dispersion(hidden: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence dispersion of the non-pad token vectors.

    Args:
        hidden: [B, T, d] token vectors (any float dtype; the sums run in float64, one text at a time, see
            :class:`~repgeom_eval.functional.tokens.TokenBlock`).
        mask: [B, T] bool, True at real tokens.
    Returns:
        (values [B] float64, NaN for sequences with fewer than 2 tokens; n_tokens [B]).
    """
    return token_dispersion_block(TokenBlock(hidden, mask))


def token_dispersion_block(block: TokenBlock) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_dispersion` of a :class:`~repgeom_eval.functional.tokens.TokenBlock` (its unit sums are cached
    on the block, so metrics that share them compute them once)."""
    s, q = block.unit_sums()
    n = block.mask.sum(1)
    return dispersion_from_sums(s, q, n), n
