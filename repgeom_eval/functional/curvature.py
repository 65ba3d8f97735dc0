"""Curvature of a prompt's token trajectory (paper B, docs/metrics.md#curvature; Hosseini & Fedorenko 2023).

With token vectors z_1..z_N and differences v_k = z_{k+1} − z_k (k = 1..N−1)::

    C̄ = 1/(N−2) · Σ_{k=1}^{N−2} arccos( v_{k+1}·v_k / (‖v_{k+1}‖ ‖v_k‖) )        angles in [0, π]

``variant="paper"`` (the project default) is this formula on the raw token vectors.
``variant="information_flow"`` reproduces paper B's public code: the tokens are first centred and unit-normalised
(:func:`~repgeom_eval.functional.entropy.center_and_unit`), the cosine takes an **absolute value** (angles in
[0, π/2]), an angle whose difference vector has zero length counts as 0, and a prompt with N ≤ 2 gives 0.
"""

from __future__ import annotations

import math

import torch

from .entropy import center_and_unit

from repgeom_eval.spec.names import CURVATURE_VARIANTS as VARIANTS  # declared once, torch-free


def turning_angles(tokens: torch.Tensor, absolute: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The N−2 angles between consecutive difference vectors of ``tokens`` [N, D], and which are defined.

    Returns ``(angles [N−2] float64, defined [N−2] bool)``. An angle is undefined when one of its two difference
    vectors has zero length (two consecutive identical tokens); its entry in ``angles`` is 0. The cosine is clamped
    to [−1, 1] before ``arccos``; ``absolute=True`` takes ``|cos|`` first (B's code).
    """
    z = tokens.double()
    if z.shape[0] < 3:
        empty = torch.zeros(0, dtype=torch.float64, device=z.device)
        return empty, empty.bool()
    v = z[1:] - z[:-1]
    a, b = v[1:], v[:-1]
    na, nb = a.norm(dim=-1), b.norm(dim=-1)
    defined = (na > 0) & (nb > 0)
    denom = torch.where(defined, na * nb, torch.ones_like(na))
    cos = (a * b).sum(-1) / denom
    if absolute:
        cos = cos.abs()
    angles = torch.arccos(cos.clamp(-1.0, 1.0))
    return torch.where(defined, angles, torch.zeros_like(angles)), defined


def curvature(tokens: torch.Tensor, variant: str = "paper", normalize: bool | None = None) -> dict[str, float]:
    """Mean turning angle of one prompt's token trajectory ``tokens`` [N, D] (docs/metrics.md#curvature).

    Args:
        tokens: the N non-pad token vectors of one prompt at one layer.
        variant: ``"paper"`` (default): angles in [0, π], no absolute value, mean over the *defined* angles only
            (an angle next to a zero-length difference, i.e. a repeated token, is skipped); NaN when N ≤ 2 or no
            angle is defined. ``"information_flow"``: B's code, |cos| (angles in [0, π/2]), undefined angles count
            as 0 and are averaged in, N ≤ 2 gives 0.
        normalize: centre and unit-normalise the tokens first. Default: ``False`` for ``paper`` (raw token vectors),
            ``True`` for ``information_flow`` (as B's code). Set it explicitly to mix, e.g. the paper's angles on
            B's normalised tokens.

    Returns ``{"raw": C̄, "logD": C̄ / log D}`` (B reports ``raw``).
    Oracles: [(0,0),(1,0),(0,1)] unnormalised: paper 3π/4, information_flow π/4.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    z = tokens.double()
    n, d = z.shape
    log_d = math.log(d) if d > 1 else float("nan")
    if normalize is None:
        normalize = variant == "information_flow"
    if n <= 2:
        raw = 0.0 if variant == "information_flow" else float("nan")
        return {"raw": raw, "logD": raw / log_d}
    if normalize:
        z = center_and_unit(z)
    angles, defined = turning_angles(z, absolute=variant == "information_flow")
    if variant == "information_flow":
        raw = float(angles.mean())
    else:
        raw = float(angles[defined].mean()) if bool(defined.any()) else float("nan")
    return {"raw": raw, "logD": raw / log_d}


def curvature_block(block, variant: str = "paper") -> torch.Tensor:
    """:func:`curvature` (default ``normalize``) of every text of a :class:`~repgeom_eval.functional.tokens.TokenBlock`
    at once: float64 [B, 2] on the block's device (nothing is read back to the host), columns ``raw`` and ``logD``.

    The differences, their norms and the cosines of all texts are a few batched float64 operations over the padded
    block (the angles whose three tokens are not all real are masked out); a text whose real tokens are not
    consecutive positions (neither right nor left padding) is computed on its own.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    b, d = len(block), block.dim
    info = variant == "information_flow"
    log_d = math.log(d) if d > 1 else float("nan")
    dev = block.hidden.device
    out = torch.full((b, 2), float("nan"), dtype=torch.float64, device=dev)
    short = torch.tensor([k <= 2 for k in block.lengths]).to(dev, non_blocking=True)
    if block.hidden.shape[1] >= 3 and any(k >= 3 for k in block.lengths):
        lo, hi = block.span
        z = (block.centered_units() if info else block.x64)[:, lo:hi]
        mask = block.mask[:, lo:hi]
        v = z[:, 1:] - z[:, :-1]
        nv = torch.linalg.vector_norm(v, dim=-1)
        a, c = v[:, 1:], v[:, :-1]
        na, nc = nv[:, 1:], nv[:, :-1]
        real = mask[:, 2:] & mask[:, 1:-1] & mask[:, :-2]  # the angle at each interior position of a text
        defined = real & (na > 0) & (nc > 0)
        cos = (a * c).sum(-1) / torch.where(defined, na * nc, torch.ones_like(na))
        if info:
            cos = cos.abs()
        angles = torch.where(defined, torch.arccos(cos.clamp(-1.0, 1.0)), torch.zeros_like(cos))
        total = angles.sum(1)
        count = (real if info else defined).sum(1).to(torch.float64)
        raw = torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, float("nan")))
        out[:, 0] = raw
    out[:, 0] = torch.where(short, torch.full_like(out[:, 0], 0.0 if info else float("nan")), out[:, 0])
    for i, span in enumerate(block._spans):
        if span is None and block.lengths[i] >= 3:  # not consecutive positions: its own computation
            out[i, 0] = curvature(block.row(i), variant)["raw"]
    out[:, 1] = out[:, 0] / log_d
    return out
