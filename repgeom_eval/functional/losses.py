"""Differentiable auxiliary losses: paper A's push-away (docs/metrics.md#push_away-and-squeeze) and paper C's
dispersion family (docs/metrics.md#paper-c-losses-common-settings).

All functions are plain torch, work in any floating dtype and keep the autograd graph. Half-precision inputs
(fp16/bf16) are promoted to float32 for the reductions (the sum identities need it, docs/metrics.md#cosine-dispersion);
float32 and float64 stay as they are.
The returned scalar has that working dtype.

Paper C's losses take one layer's hidden states ``z`` [B, L, F] (no attention mask: the reference trains on packed
blocks). ``variant="paper"`` is the paper's formula (no clamp, no additive ε); ``variant="reference"`` reproduces
the LM-Dispersion code (cosine of z/(‖z‖+ε), cosines clamped to [−1+t, 1−t] in the forward value with a
straight-through gradient, +ε inside the logsumexp). ``clamp`` (t) and ``eps`` (ε) default to ``None`` = the
variant's value (paper: t = 0, ε = 0; reference: t = 0.25, ε = 0.01); passing a number overrides it, e.g.
``variant="paper", clamp=0.1`` is the paper formula with the clamp t = 0.1 (docs/metrics.md#angular_spread).
The GPT-2 script of the reference uses t = 0.1. Sub-sample long sequences with :func:`subsample_tokens` first
(reference: 256 tokens).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from repgeom_eval.spec.names import LOSS_VARIANTS  # declared once, torch-free
_VARIANT_DEFAULTS = {"paper": (0.0, 0.0), "reference": (0.25, 0.01)}


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _nan(like: torch.Tensor) -> torch.Tensor:
    """A NaN scalar that stays connected to the graph (its gradient is NaN, which is the honest answer)."""
    return like.sum() * float("nan")


# -- push-away (paper A) -------------------------------------------------------------------------------------------

def _domain_ids(domains, b: int, device) -> torch.Tensor:
    if isinstance(domains, torch.Tensor):
        labels = domains.reshape(-1).tolist()
    else:
        labels = list(domains)
    if len(labels) != b:
        raise ValueError(f"domains must give one label per sequence: got {len(labels)} labels for {b} sequences")
    codes: dict = {}
    return torch.tensor([codes.setdefault(x, len(codes)) for x in labels], dtype=torch.long, device=device)


def _token_units(h: torch.Tensor, mask: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit token vectors [B, T, d] with pad positions zeroed, and the real-token mask [B, T] in the work dtype."""
    if h.dim() == 2:  # [N, d]: one vector per "sequence" (e.g. sequence-level granularity)
        h = h.unsqueeze(1)
        mask = None if mask is None else mask.reshape(-1, 1)
    if h.dim() != 3:
        raise ValueError(f"push_away needs hidden states [B, T, d] or vectors [N, d], got {tuple(h.shape)}")
    dt = _work_dtype(h)
    u = F.normalize(h.to(dt), p=2, dim=-1, eps=eps)
    m = torch.ones(h.shape[:2], dtype=dt, device=h.device) if mask is None else mask.to(device=h.device, dtype=dt)
    return u * m.unsqueeze(-1), m


def _one_minus_ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """1 − num/den, NaN where den ≤ 0 (no pair), without a host sync and with a finite gradient."""
    ok = den > 0
    value = 1.0 - num / torch.where(ok, den, torch.ones_like(den))
    return torch.where(ok, value, torch.full_like(value, float("nan")))


def push_away(h: torch.Tensor, mask: torch.Tensor | None = None, domains: Sequence | torch.Tensor | None = None,
              eps: float = 1e-12) -> torch.Tensor:
    """Mean pairwise cosine distance of all non-pad token vectors of a batch, in O(N·d)
    (docs/metrics.md#push_away-and-squeeze).

    The vectors of every sequence are pooled together (flattened across batch and sequence, so cross-sequence
    pairs count). With u = h/max(‖h‖, eps), S = Σ u, Q = Σ ‖u‖² and N real tokens::

        single-domain:  d = mean_{i≠j} (1 − u_i·u_j) = 1 − (‖S‖² − Q) / (N(N−1))

    With ``domains`` (one label per sequence, any hashables or an int tensor), only pairs from different domains
    count. With S_a, n_a the sum and count of domain a::

        cross-domain:   d = 1 − Σ_{a<b} S_a·S_b / Σ_{a<b} n_a n_b

    i.e. the mean over all cross-domain vector pairs; for two domains this is 1 − ū_A·ū_B. Only a K×K matrix of
    domain sums is formed (K = number of domains); never an N×N (or B×B) one.

    This returns the *distance* d ∈ [0, 2]. Push-away training minimizes ``L_CE − λ·d`` (paper default λ = 0.1
    single-domain, 0.01 cross-domain); the squeeze ablation minimizes ``L_CE + λ·d``. For the sequence-level
    granularity pass one pooled vector per sequence as ``h`` [B, d].

    Args:
        h: [B, T, d] hidden states (or [N, d] vectors).
        mask: [B, T] (or [N]) bool/0-1, true at real tokens; ``None`` = all real.
        domains: per-sequence domain labels, length B.
    Returns:
        A scalar in the working dtype; NaN when fewer than 2 tokens (single) or no cross-domain pair exists.
    """
    u, m = _token_units(h, mask, eps)
    if domains is None:
        s = u.sum((0, 1))
        q = (u * u).sum()
        n = m.sum()
        return _one_minus_ratio(s @ s - q, n * (n - 1))
    ids = _domain_ids(domains, u.shape[0], u.device)
    k = int(ids.max()) + 1 if ids.numel() else 0
    s_dom = torch.zeros(k, u.shape[-1], dtype=u.dtype, device=u.device).index_add(0, ids, u.sum(1))
    n_dom = torch.zeros(k, dtype=u.dtype, device=u.device).index_add(0, ids, m.sum(1))
    upper = torch.ones(k, k, dtype=torch.bool, device=u.device).triu(1)
    cross_dot = (s_dom @ s_dom.T)[upper].sum()
    cross_pairs = torch.outer(n_dom, n_dom)[upper].sum()
    return _one_minus_ratio(cross_dot, cross_pairs)


def push_away_pairwise(h: torch.Tensor, mask: torch.Tensor | None = None,
                       domains: Sequence | torch.Tensor | None = None, eps: float = 1e-12) -> torch.Tensor:
    """Brute-force reference of :func:`push_away`: builds the N×N cosine matrix. For tests only."""
    u, m = _token_units(h, mask, eps)
    keep = m.reshape(-1) > 0
    flat = u.reshape(-1, u.shape[-1])[keep]
    n = flat.shape[0]
    pair = ~torch.eye(n, dtype=torch.bool, device=u.device)
    if domains is not None:
        ids = _domain_ids(domains, u.shape[0], u.device)
        tok_dom = ids.unsqueeze(1).expand(u.shape[:2]).reshape(-1)[keep]
        pair = tok_dom.unsqueeze(0) != tok_dom.unsqueeze(1)
    if not bool(pair.any()):
        return _nan(u)
    return (1.0 - flat @ flat.T)[pair].mean()


# -- paper C: shared pieces ----------------------------------------------------------------------------------------

def subsample_tokens(z: torch.Tensor, max_tokens: int = 256, generator: torch.Generator | None = None) -> torch.Tensor:
    """One random subset of ``max_tokens`` positions, shared by all batch elements; z if L ≤ max_tokens
    (docs/metrics.md#paper-c-losses-common-settings).

    Pass a seeded ``torch.Generator`` for reproducibility (the reference code draws unseeded, per call).
    """
    length = z.shape[1]
    if length <= max_tokens:
        return z
    idx = torch.randperm(length, generator=generator)[:max_tokens].sort().values
    return z[:, idx.to(z.device)]


def _resolve(variant: str, clamp: float | None, eps: float | None) -> tuple[float, float]:
    if variant not in LOSS_VARIANTS:
        raise ValueError(f"variant must be one of {LOSS_VARIANTS}, got {variant!r}")
    t0, e0 = _VARIANT_DEFAULTS[variant]
    return (t0 if clamp is None else float(clamp)), (e0 if eps is None else float(eps))


def _check_z(z: torch.Tensor) -> torch.Tensor:
    if z.dim() != 3:
        raise ValueError(f"expected hidden states of shape [B, L, F], got {tuple(z.shape)}")
    return z.to(_work_dtype(z))


def _angular_distance(z: torch.Tensor, clamp: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """D_ij = arccos(c_ij)/π [B, L, L] and the diagonal mask (docs/metrics.md#paper-c-losses-common-settings).

    c = ẑ ẑᵀ with ẑ = z/(‖z‖+ε) if ε > 0, else the true cosine (z/max(‖z‖, 1e-12)); then clamped to [−1+t, 1−t]
    in value with a straight-through gradient. With t = 0 the clamp only removes round-off beyond ±1; the
    gradient of arccos is then unbounded at exactly parallel or antipodal pairs (use t > 0 to train on those).
    The diagonal is set to 0 before arccos (it is never used) so it contributes no inf/NaN gradient.
    """
    if eps > 0:
        zh = z / (torch.linalg.vector_norm(z, dim=-1, keepdim=True) + eps)
    else:
        zh = F.normalize(z, p=2, dim=-1, eps=1e-12)
    c = zh @ zh.transpose(-1, -2)
    c = c + (c.clamp(-1.0 + clamp, 1.0 - clamp) - c).detach()
    eye = torch.eye(z.shape[1], dtype=torch.bool, device=z.device)
    c = c.masked_fill(eye, 0.0)
    return torch.arccos(c) / math.pi, eye


def _sq_distances(z: torch.Tensor) -> torch.Tensor:
    """‖z_i − z_j‖² [B, L, L] via ‖z_i‖² + ‖z_j‖² − 2 z_i·z_j (no [B, L, L, F] tensor), floored at 0."""
    sq = (z * z).sum(-1)
    return (sq.unsqueeze(-1) + sq.unsqueeze(-2) - 2.0 * z @ z.transpose(-1, -2)).clamp_min(0.0)


# -- paper C: the four losses and the extra one ------------------------------------------------------------------

def angular_spread(z: torch.Tensor, tau: float = 1.0, variant: str = "paper", clamp: float | None = None,
                   eps: float | None = None) -> torch.Tensor:
    """Angular-spread ("dispersion") loss of paper C (docs/metrics.md#angular_spread); lower = more dispersed.

    Per sequence, with D_ij = arccos(cos(z_i, z_j))/π::

        paper:      ℓ_b = log Σ_{i≠j} exp(−D_ij/τ) − log(L(L−1))            ∈ [−1/τ, 0]
        reference:  ℓ_b = logsumexp_{i≠j}(−D_ij/τ + ε) − log(L(L−1))        (= paper + ε, with the clamped D)

    Loss = mean_b ℓ_b. Defaults: τ = 1, variant ``paper`` (t = 0, ε = 0); ``reference`` uses t = 0.25, ε = 0.01
    (see the module docstring for overriding them). NaN if L < 2.
    """
    z = _check_z(z)
    t, e = _resolve(variant, clamp, eps)
    if z.shape[1] < 2:
        return _nan(z)
    length = z.shape[1]
    dist, eye = _angular_distance(z, t, e)
    logits = (-dist / tau + e).masked_fill(eye, float("-inf"))
    per_seq = torch.logsumexp(logits.flatten(1), dim=1) - math.log(length * (length - 1))
    return per_seq.mean()


def decorrelation(z: torch.Tensor) -> torch.Tensor:
    """Token–token decorrelation loss of paper C (docs/metrics.md#decorrelation).

    Each token is standardized across its F features (mean 0, *unbiased* std 1), C_b = ẑ_b ẑ_bᵀ/(F−1) is the
    L×L Pearson correlation between tokens, and Loss = mean over b and i≠j of C_b,ij² (a mean, although the
    reference docstring says "sum"). No clamp or ε: a constant token gives NaN; with F = 2 the loss is always 1.
    NaN if L < 2.
    """
    z = _check_z(z)
    length, feats = z.shape[1], z.shape[2]
    if length < 2 or feats < 2:
        return _nan(z)
    zc = z - z.mean(-1, keepdim=True)
    zs = zc / zc.std(-1, unbiased=True, keepdim=True)
    corr = zs @ zs.transpose(-1, -2) / (feats - 1)
    off = ~torch.eye(length, dtype=torch.bool, device=z.device)
    return (corr * corr)[:, off].mean()


def l2_repel(z: torch.Tensor, tau: float = 1.0, eps: float = 0.01, norm_weight: float = 0.1) -> torch.Tensor:
    """ℓ2-repel loss of paper C, in the reference code's form (docs/metrics.md#l2_repel)::

        ℓ_b  = logsumexp_{all i,j}(−‖z_i − z_j‖²/τ + ε) − log(L²)      (diagonal i = j included)
        Loss = mean_b ℓ_b + norm_weight · mean(z²)                        (mean over all B·L·F entries)

    Defaults τ = 1, ε = 0.01 (adds exactly ε), norm_weight = 0.1, all as in the code; ε = 0 removes the offset.
    """
    z = _check_z(z)
    length = z.shape[1]
    if length < 1:
        return _nan(z)
    logits = -_sq_distances(z) / tau + eps
    per_seq = torch.logsumexp(logits.flatten(1), dim=1) - math.log(length * length)
    return per_seq.mean() + norm_weight * (z * z).mean()


def orthogonalization(z: torch.Tensor, margin: float = 0.5, variant: str = "paper", clamp: float | None = None,
                      eps: float | None = None) -> torch.Tensor:
    """Orthogonalization loss of paper C (docs/metrics.md#orthogonalization):
    Loss = mean_{b, i≠j} max(0, margin − D_ij)².

    D_ij = arccos(c_ij)/π as in :func:`angular_spread` (angular distance 0.5 = orthogonal, so the default
    margin 0.5 pushes every pair to at least orthogonal). ``reference`` uses the code's clamp t = 0.25 and
    ε = 0.01 cosine; with t the per-pair maximum is (margin − arccos(1−t)/π)². NaN if L < 2.
    """
    z = _check_z(z)
    clamp_eps = _resolve(variant, clamp, eps)  # a bad variant is refused whatever the length
    if z.shape[1] < 2:
        return _nan(z)
    dist, eye = _angular_distance(z, *clamp_eps)
    hinge = torch.relu(margin - dist) ** 2
    return hinge[:, ~eye].mean()


def perplexity_entropy(z: torch.Tensor, tau: float = 1.0, eps: float = 0.01) -> torch.Tensor:
    """Perplexity-entropy loss (the extra variant of paper C's code, docs/metrics.md#perplexity_entropy), in bits::

        P_{j|i} = softmax_{j≠i}(−‖z_i − z_j‖²/τ)                 (τ plays σ²; default 1)
        Loss    = mean_{b,i} Σ_{j≠i} P_{j|i} · log₂(P_{j|i} + ε)  ≈ −(mean neighbour entropy)

    ε = 0.01 reproduces oracle 26 of docs/metrics.md#oracle-values (−0.656388 on [(1,0),(0,1),(−1,0)]; with ε = 0
    it is −0.684710).
    The sign is that of the oracle: minimizing the loss *raises* the entropy of each token's neighbour
    distribution. NaN if L < 2.
    """
    z = _check_z(z)
    length = z.shape[1]
    if length < 2:
        return _nan(z)
    eye = torch.eye(length, dtype=torch.bool, device=z.device)
    p = torch.softmax((-_sq_distances(z) / tau).masked_fill(eye, float("-inf")), dim=-1)
    safe = p.masked_fill(eye, 1.0)  # P_ii = 0 contributes 0; log₂(1 + ε) keeps it finite in both passes
    return (p * torch.log2(safe + eps)).sum(-1).mean()
