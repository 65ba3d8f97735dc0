"""The token vectors of one batch at one layer, read the way the token-level metrics need them.

A captured activation tensor is [B, T, D] float32 (float64 for a float64 model), with pad positions that may hold
anything. The pipeline used to give every kind of metric its own float64 copy of the whole tensor (``h.double()`` for
the token metrics, again for each pooling, again for the energy diagnostic) and then normalise, mask and sum it in
several more full-size passes, and the per-text metrics ran a dozen small operations per text. A :class:`TokenBlock`
is shared by every metric of one address and batch instead:

* one float64 copy of the batch (:attr:`TokenBlock.x64`; none for a float64 input whose pads are already zero),
  with the pads zeroed only when they hold a non-finite value;
* the per-token float64 norms, computed once (:meth:`TokenBlock.norms`);
* float64 sums over each text's real tokens as one batched matrix product with per-token weights (zero at the
  pads): the sums of the unit vectors and of their squared norms for ``token_dispersion`` and ``condensation``
  (:meth:`TokenBlock.unit_sums`), the plain sums for mean pooling and the energy diagnostic (:meth:`TokenBlock.mean`);
* each text's Gram of centred tokens from one batched product (:meth:`TokenBlock.centered_gram`), which gives both
  ``prompt_entropy``'s Gram and the raw cosines of the condensation histogram, and the centred unit vectors
  (:meth:`TokenBlock.centered_units`) for the ``information_flow`` curvature.

Everything stays float64 and the formulas are those of the per-text functions; only the order of some additions
differs, so the numbers agree with the per-text computation to rounding (~1e-15 relative). Callers bound the size
of a block with :func:`row_chunks` (the pipeline keeps a block's float64 copy to ~32 MB on the CPU, 512 MB
on a GPU: :func:`block_limit`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

#: float64 elements of one block's copy on the CPU (32 MB, cache-friendly); :func:`row_chunks` splits a batch into
#: blocks below it
BLOCK_ELEMENTS = 1 << 22
#: the same on a GPU (512 MB): there every operation of a block is a kernel launched from the host, so smaller blocks
#: multiply the host's work per address (an 8B model's batch of 8 × 512 tokens would be four blocks at the CPU's limit)
DEVICE_BLOCK_ELEMENTS = 1 << 26


def block_limit(device: torch.device) -> int:
    """The float64 elements of one block's copy on ``device`` (:data:`BLOCK_ELEMENTS` on the CPU, else
    :data:`DEVICE_BLOCK_ELEMENTS`)."""
    return BLOCK_ELEMENTS if device.type == "cpu" else DEVICE_BLOCK_ELEMENTS


def row_chunks(n_rows: int, row_elements: int, limit: int = BLOCK_ELEMENTS) -> Iterator[slice]:
    """Consecutive row slices of a batch whose float64 copies stay below ``limit`` elements (at least 1 row)."""
    step = max(1, limit // max(1, row_elements))
    for lo in range(0, n_rows, step):
        yield slice(lo, min(n_rows, lo + step))


def _wait_for(rows: torch.Tensor) -> list:
    """``rows`` read from the block's device into Python: on a GPU the host waits for the device here (one transfer
    a batch). Only a block built without the host's copy of its mask (``TokenBlock(host_mask=...)``) reads its
    layout this way."""
    return rows.tolist()


class _Layout:
    """Where each text's real tokens are, read from the mask on the host once, when first asked (shared by the
    blocks of every address of a batch)."""

    def __init__(self, mask: torch.Tensor, n: torch.Tensor, host_copy: bool = False):
        """``host_copy``: ``mask`` is the host's own copy of the block's mask (the tokenizer's): reading it waits
        for nothing. Otherwise it is the block's mask, on the model's device."""
        self.mask, self.n, self.host_copy = mask, n, host_copy
        self._host: tuple[list[int], list[tuple[int, int] | None], tuple[int, int]] | None = None

    def host(self) -> tuple[list[int], list[tuple[int, int] | None], tuple[int, int]]:
        """(lengths, each text's ``(start, stop)`` or None where its positions are not consecutive, the span any
        text uses)."""
        if self._host is None:
            mask, n = self.mask, self.n
            b, t = mask.shape
            pos = torch.arange(t, device=mask.device)
            empty = torch.zeros(b, dtype=torch.long, device=mask.device)
            lo = torch.where(mask, pos, t).min(1).values if t else empty
            hi = torch.where(mask, pos, -1).max(1).values + 1 if t else empty
            contiguous = (hi - lo == n) | (n == 0)
            rows = torch.stack([n, lo.to(n.device), hi.to(n.device), contiguous.to(n.dtype)])
            lengths, lo_, hi_, ok_ = rows.tolist() if self.host_copy else _wait_for(rows)
            spans = [(a, z) if ok else None for a, z, ok in zip(lo_, hi_, ok_)]
            real = [s for s, k in zip(spans, lengths) if k]
            span = (min(s[0] for s in real), max(s[1] for s in real)) if real and None not in real else (0, t)
            self._host = (lengths, spans, span)
        return self._host


class TokenBlock:
    """The real tokens of the B texts of ``hidden`` [B, T, D] under ``mask`` [B, T] (bool, True at real tokens).

    Rows with no real token are empty: their sums and mean are zero.
    """

    def __init__(self, hidden: torch.Tensor, mask: torch.Tensor, like: "TokenBlock | None" = None,
                 host_mask: torch.Tensor | None = None):
        """``like``: a block over the same mask (another address of the same batch), whose layout is reused.
        ``host_mask``: the same mask in host memory, if the caller has it: the layout is read from it."""
        if like is not None and like.mask.shape == mask.shape[:2]:
            self.hidden, self.mask, self.n, self._layout = hidden, like.mask, like.n, like._layout
        else:
            mask = mask.to(hidden.device).bool()
            self.hidden, self.mask = hidden, mask
            self.n = mask.sum(1)  # [B] long, on the device
            if host_mask is not None and host_mask.device.type == "cpu" and host_mask.shape == mask.shape:
                host_mask = host_mask.bool()
                self._layout = _Layout(host_mask, host_mask.sum(1), host_copy=True)
            else:
                self._layout = _Layout(mask, self.n)
        self._x64: torch.Tensor | None = None
        self._norms: torch.Tensor | None = None
        self._cache: dict[object, object] = {}

    def layout_only(self) -> "TokenBlock":
        """A block with this one's mask and per-text layout and no values: what the other addresses of a batch
        reuse (``like=``). Keeping this block itself for them would keep its hidden states and float64 copy alive
        until the batch ends."""
        bare = TokenBlock.__new__(TokenBlock)
        bare.hidden = self.hidden.new_empty((0, *self.hidden.shape[1:]))
        bare.mask, bare.n, bare._layout = self.mask, self.n, self._layout
        bare._x64, bare._norms, bare._cache = None, None, {}
        return bare

    # The per-text layout is read on the host, so on a GPU it costs a synchronisation: it is built on first use
    # (the per-text metrics), never for pooled metrics (docs/how-to/large-models.md#host-synchronisations).
    @property
    def lengths(self) -> list[int]:
        """Each text's number of real tokens."""
        return self._layout.host()[0]

    @property
    def _spans(self) -> list[tuple[int, int] | None]:
        return self._layout.host()[1]

    @property
    def span(self) -> tuple[int, int]:
        """The positions any text uses, ``[lo, hi)``: Grams run over these only (right padding: ``[0, longest)``)."""
        return self._layout.host()[2]

    @classmethod
    def padded(cls, hidden: torch.Tensor, mask: torch.Tensor) -> "TokenBlock":
        """A block over a padded batch as :class:`~repgeom_eval.spec.metric.LayerBatch` carries it."""
        return cls(hidden, mask)

    def __len__(self) -> int:
        return int(self.mask.shape[0])

    @property
    def dim(self) -> int:
        return int(self.hidden.shape[-1])

    @property
    def contiguous(self) -> bool:
        """Whether every text's real tokens are consecutive positions (right or left padding)."""
        return None not in self._spans

    def local_spans(self) -> list[tuple[int, int] | None]:
        """Each text's real positions as ``(start, stop)`` relative to :attr:`span` (None where not consecutive)."""
        lo = self.span[0]
        return [None if s is None else (s[0] - lo, s[1] - lo) if n else (0, 0)
                for s, n in zip(self._spans, self.lengths)]

    # -- per text ------------------------------------------------------------------------------------------------------
    def row(self, b: int) -> torch.Tensor:
        """Text ``b``'s real token vectors [n_b, D], in the captured dtype (a view when they are contiguous)."""
        span = self._spans[b]
        if span is None:
            return self.hidden[b][self.mask[b]]
        return self.hidden[b, span[0]:span[1]] if self.lengths[b] else self.hidden[b, :0]

    def rows(self) -> Iterator[torch.Tensor]:
        """Every text's real token vectors, in batch order (see :meth:`row`)."""
        for b in range(len(self)):
            yield self.row(b)

    # -- shared float64 quantities -----------------------------------------------------------------------------------
    @property
    def x64(self) -> torch.Tensor:
        """[B, T, D] float64: the captured values (exact), pads finite (zeroed where they were not)."""
        if self._x64 is None:
            x = self.hidden
            # the norms read the captured values, promoted inside the reduction (no float64 copy to read back)
            norms = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float64)
            # A NaN/inf at a pad is zeroed (a real token's stays: the forward pass names it). Done without asking
            # whether there is one, which on a GPU would wait for the device on every batch; the copy and the
            # zeroing are one pass (a float64 zero of shape [1] makes the result float64).
            fill = (~self.mask & ~torch.isfinite(norms)).unsqueeze(-1)
            self._x64 = torch.where(fill, x.new_zeros(1, dtype=torch.float64), x)
            self._norms = norms.masked_fill(~self.mask, 0.0)
        return self._x64

    def norms(self) -> torch.Tensor:
        """[B, T] float64 token norms, zero at the pads."""
        if self._norms is None:
            self.x64  # noqa: B018  (computes both)
        return self._norms  # type: ignore[return-value]

    def weighted_sums(self, weights: torch.Tensor) -> torch.Tensor:
        """Σ_t w[b, k, t] · x[b, t] for weights [B, K, T] (zero at the pads): [B, K, D] float64, one batched product."""
        return torch.bmm(weights, self.x64)

    def unit_sums(self, eps: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
        """``(S [B, D], Q [B])`` float64: per text S = Σ u_t and Q = Σ ‖u_t‖² over its real tokens, with
        u_t = x_t / max(‖x_t‖, eps) (``F.normalize``'s rule for eps = 1e-12; paper C's max-eps for 1e-3)."""
        key = ("unit", float(eps))
        if key not in self._cache:
            norms = self.norms()
            w = torch.where(self.mask, 1.0 / norms.clamp(min=eps), torch.zeros_like(norms))
            s = self.weighted_sums(w.unsqueeze(1)).squeeze(1)
            self._cache[key] = (s, ((norms * w) ** 2).sum(1))
        return self._cache[key]  # type: ignore[return-value]

    def mean(self) -> torch.Tensor:
        """[B, D] float64: each text's mean token vector, summed in float64 (zero for an empty text)."""
        if "mean" not in self._cache:
            total = self.weighted_sums(self.mask.to(torch.float64).unsqueeze(1)).squeeze(1)
            self._cache["mean"] = total / self.n.clamp(min=1).to(torch.float64).unsqueeze(1)
        return self._cache["mean"]  # type: ignore[return-value]

    def centered_units(self, eps: float = 1e-12) -> torch.Tensor:
        """[B, T, D] float64: each text's tokens minus the text's mean, scaled to unit length
        (:func:`~repgeom_eval.functional.entropy.center_and_unit` of every text at once); zero at the pads."""
        key = ("centered", float(eps))
        if key not in self._cache:
            c = self.x64 - self.mean().unsqueeze(1)
            c = c / torch.linalg.vector_norm(c, dim=-1, keepdim=True).clamp(min=eps)
            self._cache[key] = c.masked_fill_(~self.mask.unsqueeze(-1), 0.0)
        return self._cache[key]  # type: ignore[return-value]

    def centered_gram(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(G, a, m, real)`` over the positions any text uses (:attr:`span`, length L), float64:
        G [B, L, L] = C Cᵀ of each text's centred tokens c_t = x_t − μ (one batched product), a [B, L] = c_t·μ and
        m [B] = ‖μ‖², and ``real`` [B, L], the mask over those positions. Rows and columns of G and entries of a at
        pad positions hold finite values of no meaning: scale them by a weight that is zero there.

        The centred Gram is what ``prompt_entropy`` diagonalises (scaled to unit rows); the raw Gram X Xᵀ that the
        condensation histogram needs follows without a second product as G + a_i + a_j + m (adding terms of the
        raw Gram's own size, so no precision is lost; the reverse, centring a raw Gram, would cancel digits)."""
        g, real = self.centered_gram_only()
        if "gram_terms" not in self._cache:  # a and m only where asked (condensation): a is a pass over the block
            c, mu = self._centered_tokens()  # the same values as G's (recomputed rather than kept alive)
            self._cache["gram_terms"] = ((c @ mu.unsqueeze(-1)).squeeze(-1), (mu * mu).sum(-1))
        a, m = self._cache["gram_terms"]  # type: ignore[misc]
        return g, a, m, real

    def _centered_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = self.span
        mu = self.mean()
        return self.x64[:, lo:hi] - mu.unsqueeze(1), mu

    def centered_gram_only(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(G, real)`` of :meth:`centered_gram`: what ``prompt_entropy`` needs."""
        if "gram" not in self._cache:
            lo, hi = self.span
            c, _ = self._centered_tokens()
            self._cache["gram"] = (c @ c.transpose(1, 2), self.mask[:, lo:hi])
        return self._cache["gram"]  # type: ignore[return-value]

    def padded64(self) -> torch.Tensor:
        """[B, T, D] float64 with pad positions zero: the documented ``LayerBatch.hidden`` of a TOKENS metric, for
        metrics without a :class:`TokenBlock` path (built once per block, only when one of them asks)."""
        if "padded64" not in self._cache:
            self._cache["padded64"] = self.x64.masked_fill(~self.mask.unsqueeze(-1), 0.0)
        return self._cache["padded64"]  # type: ignore[return-value]
