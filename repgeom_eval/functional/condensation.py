"""Embedding condensation (paper C; docs/metrics.md#condensation): mean token–token cosine, cosine histogram.

Per text with S token vectors x_i at one layer, paper C's code uses the *max-eps* unit vectors
``u_i = x_i / max(‖x_i‖, 1e-3)`` and the S×S matrix ``C = clip(U Uᵀ, −1, 1)``, **diagonal included**, and reports
the mean of all S² entries. That mean is computed here in O(S·d) without building C::

    m_incl = 1/S² · Σ_{i,j} u_i·u_j = ‖Σ_i u_i‖² / S²
    m_excl = (‖Σ_i u_i‖² − Σ_i ‖u_i‖²) / (S(S−1))        (the i ≠ j mean; S ≥ 2)

The clip is a no-op: ‖u_i‖ ≤ 1 for every row (= 1, or ‖x_i‖/1e-3 < 1 for a tiny row), so by Cauchy–Schwarz
|u_i·u_j| ≤ ‖u_i‖‖u_j‖ ≤ 1 already (up to one rounding step on the diagonal). With no norm below 1e-3,
m_incl = 1/S + (1 − 1/S)·m_excl.

Paper C averages the S×S matrices over texts of equal length, then takes the mean entry; since the mean entry is
linear, that equals the mean over texts of the per-text m_incl, which also covers texts of unequal length.
"""

from __future__ import annotations

import functools

import torch

from .tokens import TokenBlock

from repgeom_eval.spec.names import CONDENSATION_BINS as DEFAULT_BINS, CONDENSATION_EPS  # declared once, torch-free


def condensation_units(x: torch.Tensor, eps: float = CONDENSATION_EPS) -> torch.Tensor:
    """Rows divided by max(‖x‖, eps) (paper C's normalisation; a row shorter than eps keeps norm ‖x‖/eps < 1)."""
    x = x.double()
    return x / x.norm(dim=-1, keepdim=True).clamp(min=eps)


def condensation(tokens: torch.Tensor, eps: float = CONDENSATION_EPS) -> dict[str, float]:
    """Mean cosine of one text's token vectors ``tokens`` [S, d], O(S·d) (docs/metrics.md#condensation).

    Returns ``{"mean_cosine": m_incl (all S² entries, diagonal included — paper C's statistic),
    "mean_cosine_excl_diag": m_excl (i ≠ j only)}``. S = 0 gives NaN for both; S = 1 gives m_incl = ‖u‖² (1 for
    any vector longer than eps) and m_excl = NaN.
    """
    u = condensation_units(tokens, eps)
    s = u.shape[0]
    if s == 0:
        return {"mean_cosine": float("nan"), "mean_cosine_excl_diag": float("nan")}
    total = u.sum(0)
    sq = float(total @ total)
    q = float((u * u).sum())
    excl = (sq - q) / (s * (s - 1)) if s >= 2 else float("nan")
    return {"mean_cosine": sq / (s * s), "mean_cosine_excl_diag": excl}


def condensation_batch(hidden: torch.Tensor, mask: torch.Tensor,
                       eps: float = CONDENSATION_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`condensation` for every text of a padded batch at once.

    Args:
        hidden: [B, T, d] token vectors; mask: [B, T] bool, True at real tokens.
    Returns:
        (m_incl [B], m_excl [B]) float64; NaN where a text has too few tokens (0, resp. < 2).
    """
    return condensation_block(TokenBlock(hidden, mask), eps)


def condensation_block(block: TokenBlock, eps: float = CONDENSATION_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`condensation_batch` of a :class:`~repgeom_eval.functional.tokens.TokenBlock`: from its float64 sums of
    max-eps unit vectors, Σu and Σ‖u‖², one text at a time (no [B, T, d] float64 copy)."""
    total, q = block.unit_sums(eps)
    sq = (total * total).sum(-1)
    n = torch.tensor(block.lengths, dtype=torch.float64).to(sq.device, non_blocking=True)  # a blocking copy waits
    nan = torch.full_like(sq, float("nan"))
    incl = torch.where(n >= 1, sq / (n * n).clamp(min=1), nan)
    excl = torch.where(n >= 2, (sq - q) / (n * (n - 1)).clamp(min=1), nan)
    return incl, excl


def cosine_matrix(tokens: torch.Tensor, eps: float = CONDENSATION_EPS) -> torch.Tensor:
    """Paper C's S×S matrix ``clip(U Uᵀ, −1, 1)`` (diagonal included). O(S²·d); for the histogram and for tests."""
    u = condensation_units(tokens, eps)
    return (u @ u.T).clamp(-1.0, 1.0)


def histogram_edges(bins: int = DEFAULT_BINS) -> torch.Tensor:
    """``bins + 1`` equally spaced edges over [−1, 1] (float64)."""
    if bins < 1:
        raise ValueError(f"bins must be positive, got {bins}")
    return torch.linspace(-1.0, 1.0, bins + 1, dtype=torch.float64)


def cosine_histogram(tokens: torch.Tensor, bins: int = DEFAULT_BINS, eps: float = CONDENSATION_EPS,
                     block: int = 1024) -> torch.Tensor:
    """Counts of all S² entries of :func:`cosine_matrix` in ``bins`` equal bins over [−1, 1] (float64 [bins], on
    the tokens' device).

    Bin k holds [e_k, e_{k+1}); the last bin also holds 1.0 (numpy's convention), so the diagonal lands there.
    The matrix is built ``block`` rows at a time, so memory is O(block·S) whatever the text length.
    """
    edges = histogram_edges(bins)
    u = condensation_units(tokens, eps)
    counts = torch.zeros(bins, dtype=torch.float64, device=u.device)
    inner = edges[1:-1].to(u.device, non_blocking=True)
    for lo in range(0, u.shape[0], block):
        c = (u[lo:lo + block] @ u.T).clamp(-1.0, 1.0)
        counts += count_bins(torch.bucketize(c.flatten(), inner, right=True), bins)
    return counts


def count_bins(index: torch.Tensor, size: int, weight: float = 1.0, waitless: bool | None = None) -> torch.Tensor:
    """How many times each of ``0 … size−1`` occurs in ``index``, times ``weight`` (float64 [size], exact: whole
    numbers), where ``index`` lives. On a GPU ``bincount`` waits for the device to learn the largest index; adding
    into a fixed-size vector does not (docs/how-to/large-models.md#host-synchronisations), so off the CPU (or with
    ``waitless=True``) the counts are added; on the CPU ``bincount`` is 4× faster."""
    flat = index.flatten()
    if not (flat.device.type != "cpu" if waitless is None else waitless):
        return torch.bincount(flat, minlength=size).to(torch.float64) * weight
    return torch.zeros(size, dtype=torch.float64, device=flat.device).index_add_(
        0, flat, torch.full(flat.shape, weight, dtype=torch.float64, device=flat.device))


@functools.lru_cache(maxsize=None)
def _zero_bin(bins: int) -> int:
    """The bin of 0.0 among ``bins`` equal bins over [−1, 1] (found once per bin count, on the host)."""
    return int(bin_index(torch.zeros(1, dtype=torch.float64), histogram_edges(bins)))


def bin_index(values: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """The bin of each value in [−1, 1] (values outside are not allowed) for equal bins with these ``edges``: bin k
    holds [e_k, e_{k+1}), the last also 1.0 — what ``torch.bucketize(values, edges[1:-1], right=True)`` gives,
    without its binary search per value.

    The bin is first computed arithmetically, then moved by one where that lands on the wrong side of an actual
    edge (the arithmetic is within one bin of the truth: the edges are equally spaced to rounding)."""
    bins = edges.numel() - 1
    lower = edges.to(device=values.device, dtype=values.dtype, non_blocking=True)  # a blocking copy waits on a GPU
    upper = lower.clone()
    upper[-1] = float("inf")  # the last bin also holds 1.0
    k = ((values + 1.0) * (bins / 2.0)).floor_().clamp_(0, bins - 1).long()
    k -= (values < lower[k]).long()  # never below bin 0: values ≥ −1 = e_0
    k += (values >= upper[k + 1]).long()
    return k


def cosine_histogram_block(block: TokenBlock, bins: int = DEFAULT_BINS, eps: float = CONDENSATION_EPS,
                           max_elements: int = 1 << 22) -> torch.Tensor:
    """Σ over the texts of a :class:`~repgeom_eval.functional.tokens.TokenBlock` of :func:`cosine_histogram` / S²
    (float64 [bins], on the block's device; nothing is read back to the host): the summed per-text bin fractions
    of the condensation histogram.

    The texts' Gram matrices X Xᵀ come from the block's Gram of centred tokens (one batched product shared with
    ``prompt_entropy``, :meth:`~repgeom_eval.functional.tokens.TokenBlock.centered_gram`), scaled by
    1/max(‖x_i‖, eps) on both sides and clipped to [−1, 1]: paper C's cosine matrix. Each text's S² entries are
    counted exactly (integers: the diagonal once, the entries above it twice, the matrix being symmetric; the pad
    entries are exactly 0 and taken back out of the bin of 0) and divided by S² once, as the per-text function
    does. When the padded matrices would exceed ``max_elements`` entries each text
    is done on its own, ``block`` rows at a time (:func:`cosine_histogram`).
    """
    edges = histogram_edges(bins)
    out = torch.zeros(bins, dtype=torch.float64, device=block.hidden.device)
    live = [i for i, k in enumerate(block.lengths) if k]
    if not live:
        return out
    lo, hi = block.span
    width = hi - lo
    if len(block) * width * width > max_elements:
        for i in live:
            s = block.lengths[i]
            out += cosine_histogram(block.row(i), bins, eps) / (s * s)
        return out
    g, a, m, real = block.centered_gram()
    w = torch.where(real, 1.0 / block.norms()[:, lo:hi].clamp(min=eps), torch.zeros_like(a))
    raw = (g + a.unsqueeze(2)).add_(a.unsqueeze(1)).add_(m.reshape(-1, 1, 1))  # X Xᵀ
    cos = (raw * w.unsqueeze(2)).mul_(w.unsqueeze(1)).clamp_(-1.0, 1.0)  # exactly 0 at the pads (w = 0 there)
    # the matrix is symmetric: count the diagonal once and the entries above it twice
    upper = torch.triu_indices(width, width, offset=1, device=cos.device)
    flat = cos.reshape(len(block), -1).index_select(1, upper[0] * width + upper[1])
    offsets = torch.arange(len(block), device=cos.device).unsqueeze(1) * bins
    size = len(block) * bins
    counts = count_bins(bin_index(flat, edges) + offsets, size, 2.0)
    counts += count_bins(bin_index(cos.diagonal(dim1=1, dim2=2), edges) + offsets, size)
    counts = counts.reshape(len(block), bins)
    zero_bin = _zero_bin(bins)
    sizes = torch.tensor(block.lengths, dtype=torch.float64).to(counts.device, non_blocking=True)  # no wait
    counts[:, zero_bin] -= width * width - sizes * sizes  # the pad entries, all exactly 0
    rows = torch.tensor(live).to(counts.device, non_blocking=True)
    return out + (counts[rows] / (sizes[rows] * sizes[rows]).unsqueeze(1)).sum(0)
