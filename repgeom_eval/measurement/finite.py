"""The checks of a batch's captured hidden states: a NaN or inf at a real (non-pad) token is an error naming the
address and the text, and real tokens whose vector is zero are counted for the warning at the end of the passes;
at once on the CPU, or on the device and read every few batches where reading would make a GPU wait."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from repgeom_eval.modeling.addresses import Address
from repgeom_eval.spec.errors import NonFiniteError


def check_finite(addr: Address | str, h: torch.Tensor, mask: torch.Tensor | None, ids: Sequence[Any],
                 computed_in: torch.dtype | None = None) -> None:
    """Raise :class:`NonFiniteError` naming the address and the first affected text if a real token's vector holds a
    NaN or inf (pad positions may legitimately hold anything). ``computed_in``: the dtype the model ran in (the cause
    named differs: an overflow in half precision, the model's own code in float32/float64)."""
    # The common case costs one reduction with no temporary: a sum is finite only if every term is (a NaN or an inf
    # anywhere makes it NaN or inf). A finite-valued tensor whose sum overflows, or a NaN at a pad position, falls
    # through to the exact check below, which decides.
    if bool(torch.isfinite(h.sum())):
        return
    bad = (~torch.isfinite(h)).any(-1)
    if mask is not None:
        bad &= mask.to(bad.device)
    if bool(bad.any()):
        rows = bad.any(1).nonzero().flatten().tolist()
        raise non_finite_error(addr, ids[rows[0]], len(rows), computed_in or h.dtype)


def non_finite_error(addr: Address | str, text_id: Any, n_rows: int, dtype: torch.dtype) -> NonFiniteError:
    """The error of :func:`check_finite`: the address, the first affected text, and the likely cause."""
    if dtype in (torch.float16, torch.bfloat16):
        cause = f"a {str(dtype).removeprefix('torch.')} overflow is the usual cause: try --dtype float32"
    else:
        cause = (f"in {str(dtype).removeprefix('torch.')} this is no overflow but the model's own code (some "
                 "attention and expert kernels go wrong in float64, or with padding): try --dtype float32, "
                 "--batch-size 1, or --model-arg attn_implementation=eager")
    return NonFiniteError(f"NaN or inf in the hidden states at address {addr} for text id {text_id!r}"
                          f" ({n_rows} text(s) of this batch affected); {cause}")


class DeferredChecks:
    """The checks of every batch's hidden states (a NaN or inf at a real token; real tokens whose vector is zero),
    computed on the device and read on the host only every :attr:`EVERY` batches and when asked (:meth:`read_flags`), so
    that a GPU never waits for the host in between (docs/how-to/large-models.md#host-synchronisations). On the CPU,
    where reading costs no wait, :class:`Forward` checks every batch at once instead."""

    EVERY = 64

    def __init__(self) -> None:
        self._pending: list[tuple[Address, torch.Tensor, list[Any], torch.dtype]] = []
        self._zeros: dict[Address, torch.Tensor] = {}
        self._batches = 0

    def add(self, addr: Address, h: torch.Tensor, real: torch.Tensor, names: list[Any], computed_in: torch.dtype):
        if h.dtype != torch.float64:
            # one reduction for both checks: a token's float64 norm is NaN/inf exactly when its vector holds one
            # (finite float32/16 values cannot overflow it), and zero exactly when the vector is
            norms = torch.linalg.vector_norm(h, dim=-1, dtype=torch.float64)
            bad_rows = (~torch.isfinite(norms) & real).any(1)
            zero = ((norms == 0) & real).sum()
        else:  # float64 values can overflow a norm: a sum is NaN/inf only where a value is
            bad_rows = ((~torch.isfinite(h.sum(-1))) & real).any(1)
            zero = ((torch.linalg.vector_norm(h, dim=-1) == 0) & real).sum()
        self._pending.append((addr, bad_rows, names, computed_in))
        self._zeros[addr] = zero if addr not in self._zeros else self._zeros[addr] + zero

    def batch_done(self) -> None:
        self._batches += 1
        if self._batches % self.EVERY == 0:
            self.read_flags()

    def read_flags(self) -> None:
        """Raise :class:`NonFiniteError` for the first pending batch with a NaN or inf at a real token (one
        transfer for all of them)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        home = pending[0][1].device
        counts = torch.stack([b.sum().to(home) for _, b, _, _ in pending]).tolist()
        for (addr, bad, names, dtype), n_bad in zip(pending, counts):
            if n_bad:
                first = int(bad.nonzero().flatten()[0])
                raise non_finite_error(addr, names[first], int(n_bad), dtype)

    def zero_counts(self) -> dict[Address, int]:
        """Real tokens whose vector is zero, per address, since the start."""
        return {addr: int(z) for addr, z in self._zeros.items()}
