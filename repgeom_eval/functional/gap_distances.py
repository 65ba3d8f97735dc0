"""The dispersion gap G of a matrix's rows (paper A §3.2; docs/metrics.md#dispersion-gap).

For a domain token set T and a general reference set T̄ over the rows of a matrix W (in ``repgeom gap``, the output
projection)::

    G = within(T) + between(T, T̄)        (paper A §3.2; sign "+")

within(T) is the mean pairwise distance over i ≠ j inside T, between(T, T̄) the mean distance over all pairs
(i ∈ T, j ∈ T̄). Cosine distance by default, through the O(N·d) sum identities of
:mod:`repgeom_eval.functional.dispersion` (docs/metrics.md#dispersion); Euclidean distance as an option (paper A
Tables 9–12), by row chunks in O(chunk·N) memory. within(T̄) is reported too. Everything runs in float64.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..spec.errors import RepgeomError
from .dispersion import cross_dispersion, dispersion

from repgeom_eval.spec.options.analyses import GAP_DISTANCES as DISTANCES  # noqa: F401 - declared with --distance
SIGN = "G = within(T) + between(T, T̄)"


def _chunk_rows(n_cols: int, budget: int = 1 << 22) -> int:
    """Rows per block so that a block of distances to ``n_cols`` points holds about ``budget`` values."""
    return max(1, budget // max(1, n_cols))


def mean_pairwise_euclidean(x: torch.Tensor) -> float:
    """Mean Euclidean distance over the N(N−1) ordered pairs i ≠ j (NaN if N < 2); O(chunk·N) memory."""
    x = x.double()
    n = x.shape[0]
    if n < 2:
        return float("nan")
    total = torch.zeros((), dtype=torch.float64)
    step = _chunk_rows(n)
    for lo in range(0, n, step):
        block = torch.cdist(x[lo:lo + step], x)
        rows = torch.arange(block.shape[0])
        block[rows, rows + lo] = 0.0  # the self-distance (exactly 0; the matmul form may leave rounding)
        total += block.sum()
    return float(total / (n * (n - 1)))


def mean_cross_euclidean(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean Euclidean distance over all pairs (i ∈ A, j ∈ B)."""
    a, b = a.double(), b.double()
    if a.shape[0] == 0 or b.shape[0] == 0:
        return float("nan")
    total = torch.zeros((), dtype=torch.float64)
    step = _chunk_rows(b.shape[0])
    for lo in range(0, a.shape[0], step):
        total += torch.cdist(a[lo:lo + step], b).sum()
    return float(total / (a.shape[0] * b.shape[0]))


def _rows(W: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    idx = torch.as_tensor(list(ids), dtype=torch.long)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= W.shape[0]):
        raise RepgeomError(f"token id {int(idx.max()) if int(idx.max()) >= W.shape[0] else int(idx.min())} is out "
                           f"of range for an output embedding with {W.shape[0]} rows")
    return W.index_select(0, idx).double()


def dispersion_gap(W: torch.Tensor, T_ids: Sequence[int], Tbar_ids: Sequence[int],
                   distance: str = "cosine") -> dict[str, float]:
    """within(T), within(T̄), between(T, T̄) and G = within(T) + between(T, T̄) over the rows of ``W`` (float64).

    Cosine: the O(N·d) identities (zero rows have cosine 0 to everything). Euclidean: mean pairwise distance over
    i ≠ j and mean cross distance, by row chunks. within is NaN for a set of fewer than 2 tokens
    (docs/metrics.md#dispersion-gap).
    """
    if distance not in DISTANCES:
        raise RepgeomError(f"unknown distance {distance!r} (valid: {', '.join(DISTANCES)})")
    if len(T_ids) == 0 or len(Tbar_ids) == 0:
        raise RepgeomError("the dispersion gap needs a non-empty domain set T and reference set T̄")
    A, B = _rows(W, T_ids), _rows(W, Tbar_ids)
    if distance == "cosine":
        within_T, within_Tbar, between = float(dispersion(A)), float(dispersion(B)), float(cross_dispersion(A, B))
    else:
        within_T, within_Tbar = mean_pairwise_euclidean(A), mean_pairwise_euclidean(B)
        between = mean_cross_euclidean(A, B)
    return {"within_T": within_T, "within_Tbar": within_Tbar, "between": between, "G": within_T + between}
