"""One forward pass per batch, every requested address captured by hooks: the only place model inputs are built.

Every command runs its batches through :class:`Forward`, whether it starts from strings (``measure``, the MTEB
sweep) or from token ids (the analyses, the lm-eval extra pass):

* eval mode for the passes (no dropout), each module's own mode restored afterwards;
* inputs: ``attention_mask`` → ``position_ids = cumsum(mask) - 1`` where the architecture table asks for it (so left
  padding does not shift positions), ``use_cache=False`` for causal models (no key/value cache is built);
* the pass stops after the deepest requested module unless logits are needed (:class:`~repgeom_eval.modeling.hooks.
  Capture`);
* float16/bfloat16 activations are upcast to float32, and a NaN or inf at a real (non-pad) token is an error that
  names the address and the text (:func:`check_finite`);
* with a consumer (``texts(..., consume=...)``), each address is handed over as the pass reaches it instead of
  being kept, so a batch holds one address's hidden states at a time (``measure`` on a GPU, the MTEB sweep);
* an address whose every real-token vector is zero (an all-zero or wiped checkpoint) is a warning naming the model
  and the addresses when the passes end: a zero vector is at cosine distance 1 from everything, so every
  dispersion there is exactly 1.0 (:mod:`repgeom_eval.measurement.degenerate`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from repgeom_eval.spec.errors import ModelForwardError, RepgeomError
from repgeom_eval.modeling.addresses import Address, HookPoint, resolve, resolve_request
from repgeom_eval.modeling.probe import build_inputs
from repgeom_eval.modeling.hooks import Capture
from repgeom_eval.modeling.loading import LoadedModel
from repgeom_eval.measurement.finite import DeferredChecks, check_finite, non_finite_error  # noqa: F401 (re-exported)


def context_length(loaded: LoadedModel, max_length: int | None) -> int:
    """Tokens per sequence: ``max_length`` if given (capped at the model's context, with a warning), else the
    model's context (the smaller of the config's positions and the tokenizer's ``model_max_length``; 512 if neither
    says)."""
    from repgeom_eval.spec.errors import RepgeomError

    limit = loaded.info.max_positions
    tok_limit = getattr(loaded.tokenizer, "model_max_length", None)
    if tok_limit and tok_limit < 10**8:
        limit = min(limit, tok_limit) if limit else tok_limit
    if max_length is None:
        return limit or 512
    if max_length < 1:
        raise RepgeomError(f"--max-length must be positive, got {max_length}")
    if limit and max_length > limit:
        warnings.warn(f"--max-length {max_length} exceeds the model context ({limit}); using {limit}", stacklevel=3)
        return limit
    return max_length


CHARS_PER_TOKEN_BOUND = 16  # first cut: no common tokenizer averages anywhere near 16 characters per token
CUT_MARGIN = 8  # tokens past the context a cut text must still have, so the cut cannot reach the kept tokens


def token_lengths(tokenizer: Any, strings: Sequence[str], context: int) -> tuple[list[str], list[int]]:
    """Token counts of ``strings``, reading no more of each than ``context`` tokens can use.

    A 20 MB line kept to 256 tokens must not be tokenized whole: each string is first cut to
    ``context × 16`` characters (at least 4096); a cut string that still yields more than ``context + 8`` tokens
    is certainly truncated, and its first ``context`` tokens are those of the full string (tokenization only
    changes near the cut). Otherwise the cut doubles until that holds or the whole string is read. Returns the
    strings to run (cut where that was safe) and their token counts (of the cut string: above ``context`` exactly
    when the original is truncated).
    """
    limit = max(context * CHARS_PER_TOKEN_BOUND, 4096)
    out = list(strings)
    todo = list(range(len(out)))
    lengths = [0] * len(out)
    while todo:
        cut = [strings[i][:limit] for i in todo]
        counts = [len(x) for x in tokenizer(cut, add_special_tokens=True, verbose=False)["input_ids"]]
        again = []
        for i, text, n in zip(todo, cut, counts):
            whole = len(text) == len(strings[i])
            if whole or n > context + CUT_MARGIN:
                out[i], lengths[i] = text, n
            else:
                again.append(i)
        todo, limit = again, limit * 4
    return out, lengths


def pad_token_ids(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` [B, T] and ``attention_mask`` [B, T] (long)."""
    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), t), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def model_inputs(loaded: LoadedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 **extra: torch.Tensor) -> dict[str, Any]:
    """The keyword arguments of one forward pass, on the model's device (see
    :func:`~repgeom_eval.modeling.discovery.build_inputs`: position ids from the mask where the load check showed
    they reproduce the model's own, ``use_cache=False``, only inputs the forward accepts).

    Without ``attention_mask`` the model sees ``input_ids`` alone, as lm-eval's HFLM calls it (right padding under
    causal attention leaves the real tokens untouched).
    """
    layout = loaded.layout
    return build_inputs(loaded.device, input_ids, attention_mask, accepted=layout.accepted_inputs,
                        position_ids=layout.position_ids, **extra)


class Consumer(Protocol):
    """What :meth:`Forward.texts` hands each address to, when given one: ``consume(address, hidden, mask,
    host_mask)`` with the address's hidden states (upcast and checked like :attr:`Batch.hidden`'s), the batch's
    mask on the model's device, and the same mask in host memory (or None). Where the pass can be streamed it runs
    inside the pass, as the hook of that address fires (so it must not run the model itself); where each text runs
    alone (a model whose load check refused this padding side) it runs after the pass, address after address."""

    def __call__(self, address: Address, hidden: torch.Tensor, mask: torch.Tensor,
                 host_mask: torch.Tensor | None) -> Any: ...


class _ConsumerFailed(Exception):
    """Carries an error of the consumer's own work out of the model's forward pass, so that it is not reported as
    the model's."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def _handed(consume: Consumer, addr: Address, h: torch.Tensor, mask: torch.Tensor,
            host_mask: torch.Tensor | None) -> None:
    try:
        consume(addr, h, mask, host_mask)
    except RepgeomError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever it is, it is the consumer's, not the model's
        raise _ConsumerFailed(exc) from exc


@dataclass
class Batch:
    """One forward pass: the inputs, and what it captured (hidden states upcast to float32 at least)."""

    ids: torch.Tensor  # [B, T], on the CPU
    mask: torch.Tensor  # bool [B, T], on the model's device
    hidden: dict[Address, torch.Tensor]
    logits: torch.Tensor | None
    #: the same mask in host memory, as the tokenizer made it: the per-text layout is read from it without waiting
    #: for the device (docs/how-to/large-models.md#host-synchronisations)
    host_mask: torch.Tensor | None = None


class Forward:
    """Context manager: hooks at ``points`` on ``loaded.model``; :meth:`texts` / :meth:`token_ids` run one batch.

    Example::

        plan = resolve_request("resid_post:*", loaded)
        with Forward(loaded, plan.points, logits=True) as fwd:
            batch = fwd.token_ids([[5, 6, 7], [8, 9]])
            batch.hidden[addr]   # [B, T, D]
            batch.logits         # [B, T, V]
    """

    #: check each batch's hidden states at once (True) or on the device, read every few batches (False, see
    #: :class:`DeferredChecks`); None: at once where they are on the CPU, deferred elsewhere
    check_each_batch: bool | None = None

    def __init__(self, loaded: LoadedModel, points: Mapping[Address, HookPoint], logits: bool = False):
        self.loaded = loaded
        self.addresses = list(points)
        self.need_logits = logits
        if logits:
            loaded.check_logits("this command")
        self._capture = Capture(loaded.model, points, stop_early=not logits, runner=loaded.runner)
        tok = loaded.tokenizer
        self.pad_id = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0
        self.zero_counts: dict[Address, list[int]] = {}  # address → [real tokens with a zero vector, real tokens]
        self._warned_rows = False
        self.deferred = DeferredChecks()

    @classmethod
    def at(cls, loaded: LoadedModel, addresses: Sequence[Address], logits: bool = False) -> "Forward":
        """A :class:`Forward` for canonical ``addresses`` (from :func:`~repgeom_eval.modeling.addresses.resolve_request`)."""
        return cls(loaded, resolve(list(addresses), loaded), logits=logits)

    def __enter__(self) -> "Forward":
        # measured in eval mode (no dropout), whatever mode the caller's model is in (an in-memory model is often in
        # train mode); each module's own mode comes back afterwards
        self._modes = [m for m in self.loaded.model.modules() if m.training]
        self.loaded.model.eval()
        try:
            self._capture.__enter__()
        except BaseException:
            self._restore_modes()
            raise
        return self

    def _restore_modes(self) -> None:
        for module in self._modes:
            module.training = True
        self._modes = []

    def __exit__(self, *exc: Any) -> None:
        self._capture.__exit__(*exc)
        self._restore_modes()
        if exc[0] is None:
            from repgeom_eval.measurement.degenerate import zero_vector_warning

            self.check()
            for addr, n_zero in self.deferred.zero_counts().items():
                self.zero_counts[addr][0] += n_zero

            message = zero_vector_warning(self.loaded.info.name, self.zero_counts)
            if message:
                warnings.warn(message, stacklevel=2)

    def check(self) -> None:
        """Read the deferred checks of the batches so far (:class:`DeferredChecks`): raises
        :class:`NonFiniteError` naming the first text with a NaN or inf. Call it before saving anything the batches
        fed (a checkpoint)."""
        self.deferred.read_flags()

    def texts(self, strings: Sequence[str], max_length: int, padding_side: str = "right",
              row_ids: Sequence[Any] | None = None, consume: Consumer | None = None) -> Batch:
        """Tokenize (truncating to ``max_length``, padding on ``padding_side``) and run one batch of strings.

        With ``consume``, every address's hidden states go to ``consume(address, hidden, mask, host_mask)`` instead
        of into the returned batch (whose ``hidden`` is then empty), each as soon as the pass reaches it: the pass
        holds one address's tensor at a time, not all of them (:class:`Consumer`)."""
        enc = self.loaded.tokenizer(list(strings), padding=True, truncation=True, max_length=max_length,
                                    padding_side=padding_side, return_tensors="pt", verbose=False)
        ids, mask = enc.pop("input_ids"), enc.pop("attention_mask")
        return self._run(ids, mask, row_ids, consume, **enc)

    def token_ids(self, seqs: Sequence[Sequence[int]], row_ids: Sequence[Any] | None = None) -> Batch:
        """Run one batch of token-id sequences (right-padded here)."""
        ids, mask = pad_token_ids(seqs, self.pad_id)
        return self._run(ids, mask, row_ids)

    def padded(self, ids: torch.Tensor, mask: torch.Tensor | None, row_ids: Sequence[Any] | None = None) -> Batch:
        """Run ``ids`` as given; with ``mask=None`` the model sees the ids alone (lm-eval's own call)."""
        return self._run(ids, mask, row_ids)

    def _run(self, ids: torch.Tensor, mask: torch.Tensor | None, row_ids: Sequence[Any] | None,
             consume: Consumer | None = None, **extra: torch.Tensor) -> Batch:
        # the masks first: a streamed pass hands each address over, with them, while it runs
        host_mask = (mask if mask is not None else torch.ones_like(ids)).bool()
        n_real = host_tokens(host_mask)
        # on the model's device, beside the hidden states (pooling indexes both with the same rows)
        bool_mask = host_mask.to(self.loaded.device, non_blocking=True)
        kept_mask = host_mask if host_mask.device.type == "cpu" else None
        names = list(row_ids) if row_ids is not None else list(range(len(ids)))

        def prepare(addr: Address, h: torch.Tensor) -> torch.Tensor:
            return self._prepare(addr, h, bool_mask, n_real, names)

        side = padding_side_of(mask)
        if side is not None and side not in self.loaded.layout.padding_sides:
            captured, outputs_logits = self._rows_alone(ids, mask, extra, side)  # whole rows first: never streamed
        else:
            if consume is not None:
                self._capture.consume = lambda addrs, h: [_handed(consume, a, prepare(a, h), bool_mask, kept_mask)
                                                          for a in addrs]
            try:
                captured = self._call(model_inputs(self.loaded, ids, mask, **extra))
            finally:
                self._capture.consume = None
            outputs_logits = None
        hidden = {}
        for addr in list(captured):
            h = prepare(addr, captured.pop(addr))  # a half-precision original is freed once upcast
            if consume is not None:
                consume(addr, h, bool_mask, kept_mask)
            else:
                hidden[addr] = h
        self.deferred.batch_done()
        logits = outputs_logits
        if self.need_logits and logits is None:
            logits = _logits(self._capture.outputs)
        return Batch(ids, bool_mask, hidden, logits, kept_mask)

    def _prepare(self, addr: Address, h: torch.Tensor, real_mask: torch.Tensor, n_real: int | None,
                 names: list[Any]) -> torch.Tensor:
        """One address's captured tensor as the metrics read it: upcast from half precision, checked for NaN/inf at
        real tokens (at once on the CPU, deferred on a device) and counted for the zero-vector warning."""
        computed_in = h.dtype
        if h.dtype in (torch.float16, torch.bfloat16):
            h = h.float()
        counts = self.zero_counts.setdefault(addr, [0, 0])
        real = real_mask.to(h.device, non_blocking=True)
        counts[1] += n_real if n_real is not None else int(real.sum())
        at_once = self.check_each_batch if self.check_each_batch is not None else h.device.type == "cpu"
        if at_once:
            check_finite(addr, h, real, names, computed_in)
            counts[0] += int(((torch.linalg.vector_norm(h, dim=-1) == 0) & real).sum())  # one reduction
        else:
            self.deferred.add(addr, h, real, names, computed_in)
        return h

    def _call(self, inputs: dict[str, Any]) -> dict[Address, torch.Tensor]:
        """One forward pass; a failure inside the model's own code is one line naming the model and the batch."""
        try:
            return self._capture.run(**inputs)
        except RepgeomError:
            raise
        except _ConsumerFailed as failed:  # the caller's own work inside a streamed pass: its error, as it was
            raise failed.error from failed.error.__cause__  # its own cause kept, not this wrapper
        except Exception as exc:  # noqa: BLE001 - the model's (or transformers') code: any exception type
            info = self.loaded.info
            ids = inputs["input_ids"]
            hint = "; try a smaller --batch-size" if "out of memory" in str(exc).lower() else ""
            raise ModelForwardError(
                f"model {info.name!r} ({info.model_type}) failed in its own forward pass on a batch of "
                f"{ids.shape[0]} text(s) of {ids.shape[-1]} tokens: {type(exc).__name__}: "
                f"{(str(exc).strip().splitlines() or [''])[0][:300]}{hint} (--debug shows the traceback)") from exc

    def _rows_alone(self, ids: torch.Tensor, mask: torch.Tensor, extra: dict[str, torch.Tensor],
                    side: str) -> tuple[dict[Address, torch.Tensor], torch.Tensor | None]:
        """Run each text of a padded batch on its own, for a model whose load check found that padding on this side
        changes its real tokens' hidden states; the results are laid out as the padded batch."""
        if not self._warned_rows:
            self._warned_rows = True
            warnings.warn(f"model {self.loaded.info.name!r} ({self.loaded.info.model_type}): padding on the {side} "
                          "changes its hidden states (its load check), so the texts of each batch run one at a time",
                          stacklevel=4)
        out: dict[Address, torch.Tensor] = {}
        logits = None
        for i in range(len(ids)):
            real = mask[i].bool()
            row_extra = {k: v[i:i + 1, real] if v.dim() == 2 and v.shape == ids.shape else v[i:i + 1]
                         for k, v in extra.items()}
            row = ids[i:i + 1, real]
            got = self._call(model_inputs(self.loaded, row, torch.ones_like(row), **row_extra))
            where = real.nonzero().flatten().to(self.loaded.device)
            for addr, h in got.items():
                if addr not in out:
                    out[addr] = h.new_zeros((len(ids), ids.shape[1], h.shape[-1]))
                out[addr][i, where] = h[0]
            if self.need_logits:
                row_logits = _logits(self._capture.outputs)
                if logits is None:
                    logits = row_logits.new_zeros((len(ids), ids.shape[1], row_logits.shape[-1]))
                logits[i, where] = row_logits[0]
        return out, logits


def _logits(outputs: Any) -> torch.Tensor:
    return outputs.logits if hasattr(outputs, "logits") else outputs[0]


def host_tokens(mask: torch.Tensor) -> int | None:
    """The real tokens of a mask held on the host (the tokenizer's, read without waiting for any device); None for
    a mask on a device."""
    return int(mask.sum()) if mask.device.type == "cpu" else None


def padding_side_of(mask: torch.Tensor | None) -> str | None:
    """``"right"``, ``"left"`` or ``"mixed"`` for a padded mask; None when nothing is padded."""
    if mask is None or bool(mask.bool().all()):
        return None
    m = mask.long()
    if bool((m[:, 1:] <= m[:, :-1]).all()):
        return "right"
    if bool((m[:, 1:] >= m[:, :-1]).all()):
        return "left"
    return "mixed"


def next_token_logprobs(logits: torch.Tensor, ids: torch.Tensor,
                        mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(token t+1 | tokens ≤ t) for every position of every row, and where it is defined.

    Returns ``(logprob [B, T-1] float64, valid [B, T-1] bool)``; valid where both t and t+1 are real tokens. The
    log-softmax runs one row at a time in float32, so memory stays at one [T, V] copy beyond the logits.
    """
    b, t = ids.shape
    out = torch.zeros((b, max(t - 1, 0)), dtype=torch.float64)
    for i in range(b):
        lp = torch.log_softmax(logits[i, :-1].float(), dim=-1)
        target = ids[i, 1:].to(lp.device)
        out[i] = lp.gather(-1, target.unsqueeze(-1)).squeeze(-1).double().cpu()
    valid = (mask[:, 1:] & mask[:, :-1]).cpu()
    return out.masked_fill(~valid, 0.0), valid


def batches(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for lo in range(0, len(items), size):
        yield items[lo:lo + size]
