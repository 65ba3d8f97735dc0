"""Hidden states from the forward pass lm-eval's HFLM already makes ("fused capture"), with an extra-pass fallback.

HFLM scores a request ``(context, continuation)`` with one forward pass over ``(context + continuation)[:-1]``
(left-truncated to the model length) inside ``_loglikelihood_tokens``: ``_model_call`` runs a batch, then
``_select_cont_toks`` is called once per row, in row order, with the row's ``contlen`` and ``inplen``. Position
``inplen - contlen`` of a row holds the last context token, whose hidden state predicts the first continuation
token: at the requested layer it is the query's vector (docs/metrics.md#hardness-slices). Positions ``inplen - contlen … inplen - 1`` are
the ones whose predictions are scored, i.e. the tokens of a rolling-perplexity window.

While a run has repgeom tasks, :class:`HiddenStates` shadows those methods on the HFLM *instance*: ``_model_call``
runs under :class:`~repgeom_eval.modeling.hooks.Capture` hooks at the requested addresses, ``_select_cont_toks`` reads its
row, and ``_loglikelihood_tokens`` returns lm-eval's own results as :class:`Scored` tuples that also carry the
vectors. Log-likelihoods are never touched. Vectors are matched to requests by a hash of the exact tokens they
depend on, so nothing is assumed about lm-eval's reordering and batching; a request whose vector did not arrive
(lm-eval changed its private call order) is computed by an extra forward pass, with a warning. ``method="extra"``
computes every vector that way: the fallback, about +100% compute on MMLU.
"""

from __future__ import annotations

import hashlib
import inspect
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from repgeom_eval.measurement.forward import Forward, check_finite
from repgeom_eval.measurement.pooling import pool
from repgeom_eval.modeling.addresses import Address, resolve, resolve_request
from repgeom_eval.modeling.hooks import Capture
from repgeom_eval.errors import RepgeomError
from repgeom_eval.functional.dispersion import unit

POOLINGS = ("last", "mean", "tokens")
METHODS = ("fused", "extra")
# The private HFLM methods fused capture relies on, with the parameters it passes (lm-eval 0.4.13).
_FUSED_SIGNATURES = {
    "_model_call": ("inps", "attn_mask", "labels"),
    "_select_cont_toks": ("logits", "contlen", "inplen"),
    "_loglikelihood_tokens": ("requests", "disable_tqdm", "override_bs"),
    "loglikelihood_rolling": ("requests", "disable_tqdm"),
}


@dataclass(frozen=True, order=True)
class Want:
    """One representation a task needs: a layer address and how to pool it.

    ``last``: the last context token; ``mean``: the mean over the context tokens; ``tokens``: sums over the scored
    tokens of each window (:class:`TokenStats`, for within-document dispersion).
    """

    address: str
    pooling: str


@dataclass(frozen=True)
class TokenStats:
    """Sufficient statistics of unit token vectors: S = Σu (float64), Q = Σ‖u‖², n."""

    s: np.ndarray
    q: float
    n: int

    def merge(self, other: "TokenStats") -> "TokenStats":
        return TokenStats(self.s + other.s, self.q + other.q, self.n + other.n)

    def dispersion(self) -> float:
        """D over the tokens (docs/metrics.md#cosine-dispersion); NaN with fewer than 2 tokens."""
        if self.n < 2:
            return float("nan")
        return float(1.0 - (self.s @ self.s - self.q) / (self.n * (self.n - 1)))


class Scored(tuple):
    """``(loglikelihood, is_greedy)`` exactly as lm-eval computed it, plus ``geometry`` ({Want: vector or
    TokenStats}) and ``n_tokens`` (continuation length). Unpacking, indexing and pickling work as for the tuple."""

    def __new__(cls, result: Iterable[Any], geometry: dict | None = None, n_tokens: int | None = None):
        obj = super().__new__(cls, result)
        obj.geometry = geometry if geometry is not None else {}
        obj.n_tokens = n_tokens
        return obj


class RollingScore(float):
    """A document's rolling log-likelihood exactly as lm-eval computed it, plus ``geometry`` ({Want: TokenStats}
    merged over its windows) and ``n_tokens`` (tokens scored)."""

    def __new__(cls, value: float, geometry: dict | None = None, n_tokens: int | None = None):
        obj = super().__new__(cls, value)
        obj.geometry = geometry if geometry is not None else {}
        obj.n_tokens = n_tokens
        return obj


def _digest(tokens: Sequence[int] | np.ndarray) -> bytes:
    return hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


def context_key(inp: Sequence[int] | np.ndarray, last: int) -> tuple:
    """Key of a vector that depends on the context tokens ``inp[:last + 1]`` only (causal attention)."""
    return ("ctx", _digest(inp[: last + 1]))


def window_key(inp: Sequence[int] | np.ndarray, contlen: int) -> tuple:
    """Key of the token statistics of one scored window."""
    return ("win", _digest(inp), contlen)


def fused_capture_problem(lm: Any) -> str | None:
    """Why fused capture cannot be trusted on ``lm`` (None when it can)."""
    from importlib.metadata import version

    from repgeom_eval.lmeval import SUPPORTED_LM_EVAL

    try:
        found = tuple(int(x) for x in version("lm_eval").split(".")[:3])
    except (ValueError, Exception):  # noqa: BLE001 - unparsable or missing metadata: treat as untested
        found = None
    low, high = SUPPORTED_LM_EVAL
    if found is None or not low <= found < high:
        return (f"lm-eval {'.'.join(map(str, found)) if found else '?'} is outside the tested range "
                f"{'.'.join(map(str, low))} to <{'.'.join(map(str, high))}")
    for name, params in _FUSED_SIGNATURES.items():
        method = getattr(lm, name, None)
        if method is None:
            return f"{type(lm).__name__} has no method {name}"
        have = list(inspect.signature(method).parameters)
        if list(params) != have[: len(params)]:
            return f"{type(lm).__name__}.{name}{tuple(have)} does not have the parameters {params}"
    return None


class _Batch:
    """The forward pass lm-eval just made: its input tokens and the captured tensors; rows are read in order."""

    def __init__(self, inps: torch.Tensor, hidden: dict[Address, torch.Tensor]):
        self.width = int(inps.shape[1])
        self.tokens = inps.detach().cpu().numpy()
        self.hidden = hidden
        self.next_row = 0


class HiddenStates:
    """Attach the hidden states a run's repgeom tasks need to the results of an HFLM instance.

    Use as a context manager around the evaluation; on exit the instance is as it was.
    """

    def __init__(self, lm: Any, wants: Iterable[Want], method: str = "fused"):
        if method not in METHODS:
            raise RepgeomError(f"unknown capture method {method!r} (valid: {', '.join(METHODS)})")
        self.lm = lm
        self.model = lm.model
        self.wants = tuple(sorted(set(wants)))
        bad = [w.pooling for w in self.wants if w.pooling not in POOLINGS]
        if bad:
            raise RepgeomError(f"unknown pooling {bad[0]!r} for lm-eval tasks (valid: last, mean)")
        self.loaded = self._loaded_view()
        self.addresses = self._resolve_addresses()
        self.points = resolve(sorted(set(self.addresses.values()), key=str), self.loaded)
        self.method = method
        self.reason = None
        if method == "fused":
            self.reason = fused_capture_problem(lm)
            if self.reason:
                warnings.warn(f"repgeom: fused capture disabled ({self.reason}); hidden states come from an extra "
                              "forward pass per context (about twice the compute)", RuntimeWarning, stacklevel=3)
                self.method = "extra"
        self.extra_requests = 0  # requests whose vectors came from an extra pass
        self._originals: dict[str, Any] = {}
        self._capture: Capture | None = None
        self._batch: _Batch | None = None
        self._store: dict[tuple, dict[Want, Any]] = {}
        self._scoring = False
        self._rolling = False
        self._windows: dict[tuple, dict[Want, TokenStats]] = {}
        self._warned_missing = False

    # -- set-up ---------------------------------------------------------------------------------------------------

    def _loaded_view(self):
        from repgeom_eval.modeling.loading import wrap_model

        return wrap_model(self.model, getattr(self.lm, "tokenizer", None), source="lm-eval")

    def _resolve_addresses(self) -> dict[Want, Address]:
        out = {}
        for want in self.wants:
            found = resolve_request(want.address, self.loaded).addresses
            if len(found) != 1:
                raise RepgeomError(f"repgeom_layer {want.address!r} names {len(found)} layers; lm-eval tasks read "
                                   "one (e.g. final, resid_post:-1, mlp_in:12)")
            out[want] = found[0]
        return out

    def __enter__(self) -> "HiddenStates":
        names = ["_loglikelihood_tokens", "loglikelihood_rolling"]
        if self.method == "fused":
            names += ["_model_call", "_select_cont_toks"]
            self._capture = Capture(self.model, self.points, stop_early=False).__enter__()
        for name in names:
            self._originals[name] = getattr(self.lm, name)
            setattr(self.lm, name, getattr(self, name))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name in self._originals:
            self.lm.__dict__.pop(name, None)  # the class's own method shows through again
        self._originals.clear()
        if self._capture is not None:
            self._capture.__exit__(None, None, None)
            self._capture = None
        self._batch = None
        self._store = {}
        self._windows = {}

    # -- the methods that shadow HFLM's ----------------------------------------------------------------------------

    def _model_call(self, inps: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        logits = self._originals["_model_call"](inps, *args, **kwargs)
        assert self._capture is not None
        hidden = self._capture.take()
        for addr, h in hidden.items():
            check_finite(addr, h, None, [f"row {i} of an lm-eval batch" for i in range(len(h))])
        self._batch = _Batch(inps, hidden)
        return logits

    def _select_cont_toks(self, logits: torch.Tensor, contlen: int | None = None, inplen: int | None = None):
        out = self._originals["_select_cont_toks"](logits, contlen=contlen, inplen=inplen)
        if self._scoring and self._batch is not None and contlen and inplen:
            self._read_row(self._batch, int(logits.shape[0]), int(contlen), int(inplen))
        return out

    def _loglikelihood_tokens(self, *args: Any, **kwargs: Any):
        requests = kwargs["requests"] if "requests" in kwargs else args[0]
        self._scoring, self._store = True, {}
        try:
            results = self._originals["_loglikelihood_tokens"](*args, **kwargs)
        finally:
            self._scoring, self._batch = False, None
        try:
            return self._attach(requests, results)
        finally:
            self._store = {}

    def loglikelihood_rolling(self, requests: list, *args: Any, **kwargs: Any):
        self._rolling, self._windows = True, {}
        try:
            totals = self._originals["loglikelihood_rolling"](requests, *args, **kwargs)
        finally:
            self._rolling = False
        try:
            return self._rolling_results(requests, totals)
        finally:
            self._windows = {}

    # -- reading vectors --------------------------------------------------------------------------------------------

    def _wants_now(self) -> list[Want]:
        """Token statistics for rolling windows, context vectors for everything else."""
        return [w for w in self.wants if (w.pooling == "tokens") == self._rolling]

    def _values(self, h: torch.Tensor, first: int, last: int, end: int, want: Want) -> Any:
        """The value ``want`` reads from one sequence's [T, D] tensor: context ``first..last``, scored tokens
        ``last..end-1`` (pooled by the project's one :func:`~repgeom_eval.measurement.pooling.pool`)."""
        positions = torch.arange(h.shape[0], device=h.device)
        if want.pooling == "tokens":
            mask = (positions >= last) & (positions < end)
            u = unit(pool(h[None].double(), mask[None], "tokens")[0])
            return TokenStats(u.sum(0).cpu().numpy(), float((u * u).sum()), int(u.shape[0]))
        mask = (positions >= first) & (positions <= last)
        return pool(h[None].double(), mask[None], want.pooling)[0][0].float().cpu().numpy()

    def _read_row(self, batch: _Batch, seq_len: int, contlen: int, inplen: int) -> None:
        i = batch.next_row
        batch.next_row += 1
        if i >= batch.tokens.shape[0]:
            return  # more rows than the batch has: lm-eval changed its call order; _attach falls back
        virtual = seq_len - batch.width  # prompt-tuning tokens that precede the input in the model's sequence
        n_in = inplen - virtual
        last = n_in - contlen  # input position of the last context token
        if n_in <= 0 or last < 0:
            return
        row = batch.tokens[i, :n_in]
        for want in self._wants_now():
            h = batch.hidden[self.addresses[want]][i]
            key = window_key(row, contlen) if want.pooling == "tokens" else context_key(row, last)
            self._store.setdefault(key, {})[want] = self._values(h, virtual, last + virtual, inplen, want)

    def _attach(self, requests: Sequence, results: Sequence) -> list[Scored]:
        max_len = self.lm.max_length
        out: list[Scored] = []
        todo: list[tuple[int, Want, list[int], int, int]] = []
        wants = self._wants_now()
        for j, (request, result) in enumerate(zip(requests, results)):
            _, ctx, cont = request
            inp = list((ctx + cont)[-(max_len + 1):][:-1])
            last = len(inp) - len(cont)
            geometry = {}
            for want in wants:
                key = window_key(inp, len(cont)) if want.pooling == "tokens" else context_key(inp, last)
                value = self._store.get(key, {}).get(want)
                if value is None:
                    todo.append((j, want, inp, last, len(cont)))
                else:
                    geometry[want] = value
            out.append(Scored(result, geometry, len(cont)))
        if todo:
            if self.method == "fused" and not self._warned_missing:
                self._warned_missing = True
                warnings.warn(f"repgeom: fused capture missed {len(todo)} of {len(requests) * len(wants)} vectors "
                              "(lm-eval's private call order differs from the tested one); computing them with an "
                              "extra forward pass", RuntimeWarning, stacklevel=2)
            self._extra_pass(todo, out)
        if self._rolling:
            for (_, ctx, cont), scored in zip(requests, out):
                inp = list((ctx + cont)[-(max_len + 1):][:-1])
                self._windows[window_key(inp, len(cont))] = scored.geometry
        return out

    def _rolling_windows(self, text: str) -> list[tuple[list[int], list[int]]]:
        """The (context, continuation) windows HFLM.loglikelihood_rolling scores for ``text``."""
        from lm_eval import utils

        lm = self.lm
        windows = utils.get_rolling_token_windows(token_list=lm.tok_encode(text), prefix_token=lm.prefix_token_id,
                                                  max_seq_len=lm.max_length, context_len=1)
        return [utils.make_disjoint_window(w) for w in windows]

    def _rolling_results(self, requests: Sequence, totals: Sequence[float]) -> list[RollingScore]:
        max_len = self.lm.max_length
        wants = [w for w in self.wants if w.pooling == "tokens"]
        if not wants:
            return [RollingScore(float(total)) for total in totals]
        out = []
        missing: list[tuple[list[int], list[int]]] = []
        per_doc = []
        for request in requests:
            (text,) = request.args
            windows = self._rolling_windows(text)
            per_doc.append(windows)
            missing += [w for w in windows if window_key(list((w[0] + w[1])[-(max_len + 1):][:-1]), len(w[1]))
                        not in self._windows]
        if missing:
            if not self._warned_missing:
                self._warned_missing = True
                warnings.warn(f"repgeom: {len(missing)} rolling windows had no captured hidden states; computing "
                              "them with an extra forward pass", RuntimeWarning, stacklevel=2)
            self._rolling = True
            try:
                self._attach([(None, c, x) for c, x in missing], [(float("nan"), False)] * len(missing))
            finally:
                self._rolling = False
        for total, windows in zip(totals, per_doc):
            geometry: dict[Want, TokenStats] = {}
            n_tokens = 0
            for ctx, cont in windows:
                inp = list((ctx + cont)[-(max_len + 1):][:-1])
                found = self._windows.get(window_key(inp, len(cont)), {})
                for want in wants:
                    stats = found.get(want)
                    if stats is not None:
                        geometry[want] = geometry[want].merge(stats) if want in geometry else stats
                n_tokens += len(cont)
            out.append(RollingScore(float(total), geometry, n_tokens))
        return out

    # -- the fallback: an extra forward pass -----------------------------------------------------------------------

    @torch.no_grad()
    def _extra_pass(self, todo: list[tuple[int, Want, list[int], int, int]], out: list[Scored]) -> None:
        """Compute the missing values by running each needed token sequence once more (deduplicated)."""
        jobs: dict[tuple, dict[str, Any]] = {}
        for j, want, inp, last, contlen in todo:
            if want.pooling == "tokens":
                key, tokens = window_key(inp, contlen), inp
            else:
                key, tokens = context_key(inp, last), inp[: last + 1]
            job = jobs.setdefault(key, {"tokens": tokens, "last": last, "wants": set(), "targets": []})
            job["wants"].add(want)
            job["targets"].append((j, want))
        self.extra_requests += len({j for j, *_ in todo})
        device = next(self.model.parameters()).device
        dtype = getattr(self.lm, "mixed_precision_dtype", None)
        batch_size = self.lm.batch_size if isinstance(self.lm.batch_size, int) and self.lm.batch_size > 0 else 16
        ordered = sorted(jobs.values(), key=lambda jb: -len(jb["tokens"]))
        with Forward(self.loaded, self.points) as fwd:
            for start in range(0, len(ordered), batch_size):
                chunk = ordered[start: start + batch_size]
                width = len(chunk[0]["tokens"])
                ids = torch.zeros((len(chunk), width), dtype=torch.long)
                for r, job in enumerate(chunk):  # right padding, no mask: the same inputs HFLM's _model_call sees
                    ids[r, : len(job["tokens"])] = torch.tensor(job["tokens"], dtype=torch.long)
                with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype is not None):
                    hidden = fwd.padded(ids, None, row_ids=[f"request {job['targets'][0][0]}" for job in chunk]).hidden
                for r, job in enumerate(chunk):
                    n = len(job["tokens"])
                    values = {}
                    for want in job["wants"]:
                        h = hidden[self.addresses[want]][r]
                        values[want] = self._values(h, 0, job["last"] if want.pooling == "tokens" else n - 1, n,
                                                    want)
                    for j, want in job["targets"]:
                        out[j].geometry[want] = values[want]
