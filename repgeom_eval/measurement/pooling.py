"""Turning token vectors into one vector per text, honouring the attention mask (left or right padding)."""

from __future__ import annotations

import torch

from repgeom_eval.spec.poolings import check_pooling
from repgeom_eval.functional.tokens import TokenBlock

def pool(hidden: torch.Tensor, mask: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool [B, T, D] token vectors with a [B, T] bool mask.

    Returns ``(vectors, owner)``: for ``last``/``mean``/``first`` one vector per text and ``owner = arange(B)``;
    for ``tokens`` every non-pad token vector, flattened, and the batch row each one came from.
    """
    method = check_pooling(method)
    b, t, _ = hidden.shape
    positions = torch.arange(t, device=hidden.device).expand(b, t)
    rows = torch.arange(b, device=hidden.device)
    if method == "last":
        idx = torch.where(mask, positions, -1).max(1).values
        return hidden[rows, idx.clamp(min=0)], rows
    if method == "first":
        idx = torch.where(mask, positions, t).min(1).values
        return hidden[rows, idx.clamp(max=t - 1)], rows
    if method == "mean":
        m = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1), rows
    owner = rows.unsqueeze(1).expand(b, t)[mask]
    return hidden[mask], owner


def pool64(hidden: torch.Tensor, mask: torch.Tensor, method: str,
           block: TokenBlock | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pool` of ``hidden.double()``, without converting the whole [B, T, D] tensor to float64.

    ``last``/``first``/``tokens`` pick the vectors first and convert only those (exactly the same numbers);
    ``mean`` sums each text's real tokens in float64, one text at a time (:meth:`TokenBlock.mean`; the same numbers
    up to the order of the additions). Pass the ``block`` of ``hidden``/``mask`` to share its cached mean.
    """
    method = check_pooling(method)
    if method == "mean":
        block = block if block is not None else TokenBlock(hidden, mask)
        return block.mean(), torch.arange(hidden.shape[0], device=hidden.device)
    vecs, owner = pool(hidden, mask, method)
    return vecs.to(torch.float64), owner
