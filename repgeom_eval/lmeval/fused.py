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

Registered metrics (``repgeom_metrics``, :mod:`repgeom_eval.lmeval.registered`) are fed from the same rows: each
task's :class:`~repgeom_eval.lmeval.registered.TaskBank` receives the context token vectors of each of its queries
(or the scored-position vectors of each rolling window of its documents) at its addresses, once per document. Which
document a row belongs to is known from the ``Instance`` objects lm-eval hands to ``loglikelihood`` /
``loglikelihood_rolling``, matched by the same token hashes; texts whose rows were not read come from an extra pass,
and the augmented views of VIEWS metrics always do.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import warnings
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
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


@dataclass(frozen=True)
class PromptScore:
    """How well the model predicts the context (prompt) itself, read from the same forward pass: the summed
    log-probability of the context tokens after the first (each given the ones before it) and how many they are."""

    logprob: float
    n_tokens: int

    def perplexity(self) -> float:
        """exp(−logprob / n_tokens); NaN for a one-token context (nothing of it is predicted)."""
        return math.exp(-self.logprob / self.n_tokens) if self.n_tokens > 0 else float("nan")


def prompt_score(logprobs: torch.Tensor, tokens: Sequence[int] | np.ndarray, first: int, last: int) -> PromptScore:
    """The :class:`PromptScore` of context tokens ``tokens[0..last]`` from a row's log-softmaxed logits, where row
    position ``first + p`` holds the prediction made after input token ``p``."""
    if last < 1:
        return PromptScore(0.0, 0)
    positions = torch.arange(first, first + last, device=logprobs.device)
    targets = torch.as_tensor(np.asarray(tokens[1: last + 1], dtype=np.int64), device=logprobs.device)
    return PromptScore(float(logprobs[positions, targets].double().sum()), int(last))


class Scored(tuple):
    """``(loglikelihood, is_greedy)`` exactly as lm-eval computed it, plus ``geometry`` ({Want: vector or
    TokenStats}), ``n_tokens`` (continuation length) and ``prompt`` (the context's :class:`PromptScore`, for
    requests read as contexts; None otherwise). Unpacking, indexing and pickling work as for the tuple."""

    def __new__(cls, result: Iterable[Any], geometry: dict | None = None, n_tokens: int | None = None,
                prompt: PromptScore | None = None):
        obj = super().__new__(cls, result)
        obj.geometry = geometry if geometry is not None else {}
        obj.n_tokens = n_tokens
        obj.prompt = prompt
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

    def __init__(self, lm: Any, wants: Iterable[Want], method: str = "fused", banks: Mapping[str, Any] | None = None):
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
        self.banks = dict(banks or {})  # task name -> TaskBank (registered metrics)
        for bank in self.banks.values():
            bank.resolve(self.loaded)
            self.points.update(bank.points)
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
        self._prompts: dict[tuple, PromptScore] = {}  # context key -> the context's own log-likelihood
        self._scoring = False
        self._rolling = False
        self._windows: dict[tuple, dict[Want, TokenStats]] = {}
        self._warned_missing = False
        # registered metrics: which documents a context / window key belongs to, and the rows read, not yet fed
        self._instances: list | None = None
        self._contexts: dict[tuple, set[tuple[str, int]]] = {}
        self._context_tokens: dict[tuple, list[int]] = {}
        self._doc_windows: dict[tuple, set[tuple[str, int, int]]] = {}
        self._window_tokens: dict[tuple, tuple[list[int], int]] = {}
        self._pending: list[tuple[Any, int, _Batch, int, int, int]] = []
        self.extra_texts = 0  # texts of registered metrics whose vectors came from an extra pass

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
        if any(bank.kind == "context" for bank in self.banks.values()):
            names.append("loglikelihood")
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
        self._prompts = {}
        self._windows = {}
        self._pending, self._contexts, self._doc_windows = [], {}, {}

    # -- the methods that shadow HFLM's ----------------------------------------------------------------------------

    def _model_call(self, inps: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._flush()  # the rows read from the previous batch go to the metric states before it is replaced
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
            self._read_row(self._batch, int(logits.shape[0]), int(contlen), int(inplen), logits)
        return out

    def loglikelihood(self, requests: list, *args: Any, **kwargs: Any):
        """Only with registered metrics: remembers the ``Instance`` of each request (its task and document)."""
        self._instances = list(requests)
        try:
            results = self._originals["loglikelihood"](requests, *args, **kwargs)
        finally:
            self._instances = None
        self._views_pass(requests, "context")
        return results

    def _loglikelihood_tokens(self, *args: Any, **kwargs: Any):
        requests = kwargs["requests"] if "requests" in kwargs else args[0]
        if not self._rolling and self._instances is not None:
            self._register_contexts(self._instances, requests)
        self._scoring, self._store, self._prompts = True, {}, {}
        try:
            results = self._originals["_loglikelihood_tokens"](*args, **kwargs)
            self._flush()
        finally:
            self._scoring, self._batch, self._pending = False, None, []
        if not self._rolling:
            self._fill_contexts()
        try:
            return self._attach(requests, results)
        finally:
            self._store, self._prompts = {}, {}

    def loglikelihood_rolling(self, requests: list, *args: Any, **kwargs: Any):
        self._register_documents(requests)
        self._rolling, self._windows = True, {}
        try:
            totals = self._originals["loglikelihood_rolling"](requests, *args, **kwargs)
        finally:
            self._rolling = False
        self._fill_documents()
        self._views_pass(requests, "document")
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

    def _read_row(self, batch: _Batch, seq_len: int, contlen: int, inplen: int,
                  logprobs: torch.Tensor | None = None) -> None:
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
        if not self._rolling and logprobs is not None and self._wants_now():
            key = context_key(row, last)
            if key not in self._prompts:  # the choices of a query share its context: read it once
                self._prompts[key] = prompt_score(logprobs, row, virtual, last)
        for want in self._wants_now():
            h = batch.hidden[self.addresses[want]][i]
            key = window_key(row, contlen) if want.pooling == "tokens" else context_key(row, last)
            self._store.setdefault(key, {})[want] = self._values(h, virtual, last + virtual, inplen, want)
        if self._rolling:
            for task, doc_id, w in self._doc_windows.get(window_key(row, contlen), ()):
                bank = self.banks[task]
                if bank.needs_window(doc_id, w):
                    bank.add_window(doc_id, w, {a: batch.hidden[a][i, last + virtual: inplen].clone()
                                                for a in bank.addresses})
        else:
            for task, doc_id in self._contexts.get(context_key(row, last), ()):
                bank = self.banks[task]
                if bank.needs_originals and bank.claim(doc_id):
                    self._pending.append((bank, doc_id, batch, i, virtual, last + virtual))

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
            prompt = None
            if wants and not self._rolling:
                prompt = self._prompts.get(context_key(inp, last))
                if prompt is None and len(geometry) == len(wants):
                    todo.append((j, None, inp, last, len(cont)))  # vectors read, prompt not: the pass adds it
            out.append(Scored(result, geometry, len(cont), prompt))
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
            if want is not None and want.pooling == "tokens":
                key, tokens = window_key(inp, contlen), inp
            else:
                key, tokens = context_key(inp, last), inp[: last + 1]
            job = jobs.setdefault(key, {"tokens": tokens, "last": last, "wants": set(), "targets": []})
            if want is not None:
                job["wants"].add(want)
            job["targets"].append((j, want))
        self.extra_requests += len({j for j, *_ in todo})
        device = next(self.model.parameters()).device
        dtype = getattr(self.lm, "mixed_precision_dtype", None)
        batch_size = self.lm.batch_size if isinstance(self.lm.batch_size, int) and self.lm.batch_size > 0 else 16
        ordered = sorted(jobs.values(), key=lambda jb: -len(jb["tokens"]))
        contexts = not self._rolling  # a context's own log-likelihood comes with its vectors: logits are needed
        with Forward(self.loaded, self.points, logits=contexts) as fwd:
            for start in range(0, len(ordered), batch_size):
                chunk = ordered[start: start + batch_size]
                width = len(chunk[0]["tokens"])
                ids = torch.zeros((len(chunk), width), dtype=torch.long)
                for r, job in enumerate(chunk):  # right padding, no mask: the same inputs HFLM's _model_call sees
                    ids[r, : len(job["tokens"])] = torch.tensor(job["tokens"], dtype=torch.long)
                with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype is not None):
                    batch = fwd.padded(ids, None, row_ids=[f"request {job['targets'][0][0]}" for job in chunk])
                hidden = batch.hidden
                for r, job in enumerate(chunk):
                    n = len(job["tokens"])
                    values = {}
                    for want in job["wants"]:
                        h = hidden[self.addresses[want]][r]
                        values[want] = self._values(h, 0, job["last"] if want.pooling == "tokens" else n - 1, n,
                                                    want)
                    prompt = None
                    if contexts and batch.logits is not None:
                        logprobs = torch.log_softmax(batch.logits[r, :n].float(), dim=-1)
                        prompt = prompt_score(logprobs, job["tokens"], 0, n - 1)
                    for j, want in job["targets"]:
                        if want is not None:
                            out[j].geometry[want] = values[want]
                        if prompt is not None and out[j].prompt is None:
                            out[j].prompt = prompt

    # -- registered metrics (repgeom_metrics) --------------------------------------------------------------------------

    def _flush(self) -> None:
        """Feed the context rows read from the current batch to their tasks' metric states, one call per task."""
        pending, self._pending = self._pending, []
        by_bank: dict[int, list] = defaultdict(list)
        for entry in pending:
            by_bank[id(entry[0])].append(entry)
        for entries in by_bank.values():
            bank, batch = entries[0][0], entries[0][2]
            rows = [e[3] for e in entries]
            self._feed_rows(bank, {a: batch.hidden[a] for a in bank.addresses}, rows,
                            [(e[4], e[5]) for e in entries], [e[1] for e in entries])

    @staticmethod
    def _feed_rows(bank: Any, hidden: Mapping[Address, torch.Tensor], rows: Sequence[int],
                   spans: Sequence[tuple[int, int]], doc_ids: Sequence[int]) -> None:
        """Feed rows ``rows`` of a [B, T, D] batch, each text being positions ``first..last`` of its row."""
        first = hidden[bank.addresses[0]]
        index = torch.as_tensor(list(rows), dtype=torch.long, device=first.device)
        positions = torch.arange(first.shape[1])
        mask = torch.stack([(positions >= a) & (positions <= b) for a, b in spans])
        bank.feed({a: hidden[a].index_select(0, index) for a in bank.addresses}, mask, doc_ids)

    def _register_contexts(self, instances: Sequence[Any], requests: Sequence[Any]) -> None:
        """Map the context key of every request of a task with registered metrics to its (task, document)."""
        if len(instances) != len(requests):
            return  # not the call loglikelihood made: nothing to attribute (the fill pass reports missing texts)
        max_len = self.lm.max_length
        for inst, (strings, ctx, cont) in zip(instances, requests):
            bank = self.banks.get(getattr(inst, "task_name", None))
            if bank is None or bank.kind != "context" or not bank.needs_originals:
                continue
            if tuple(strings) != tuple(inst.args):
                continue  # not in the order of the instances: unattributed, reported as missing by the task
            inp = list((ctx + cont)[-(max_len + 1):][:-1])
            last = len(inp) - len(cont)
            if last < 0:
                raise RepgeomError(f"task {bank.task}, document {inst.doc_id}: the continuation fills the whole "
                                   f"model length ({max_len} tokens), so no context token is left to measure")
            key = context_key(inp, last)
            self._contexts.setdefault(key, set()).add((bank.task, int(inst.doc_id)))
            self._context_tokens[key] = inp[: last + 1]

    def _fill_contexts(self) -> None:
        """Texts of registered metrics whose rows were not read (extra capture, or a changed call order)."""
        jobs = []
        for key, owners in self._contexts.items():
            targets = [(self.banks[t], d) for t, d in sorted(owners) if self.banks[t].claim(d)]
            if targets:
                jobs.append((self._context_tokens[key], targets))
        self._contexts, self._context_tokens = {}, {}
        if not jobs:
            return
        self._note_extra(sum(len(t) for _, t in jobs), "contexts")
        for chunk, hidden in self._run_sequences([tokens for tokens, _ in jobs]):
            by_bank: dict[int, list] = defaultdict(list)
            for r, job in enumerate(chunk):
                tokens, targets = jobs[job]
                for bank, doc_id in targets:
                    by_bank[id(bank)].append((bank, r, len(tokens), doc_id))
            for entries in by_bank.values():
                bank = entries[0][0]
                self._feed_rows(bank, hidden, [e[1] for e in entries], [(0, e[2] - 1) for e in entries],
                                [e[3] for e in entries])

    def _register_documents(self, requests: Sequence[Any]) -> None:
        """Map every rolling window of a document of a task with registered metrics to (task, document, window)."""
        max_len = self.lm.max_length
        for inst in requests:
            bank = self.banks.get(getattr(inst, "task_name", None))
            if bank is None or bank.kind != "document" or not bank.needs_originals:
                continue
            windows = self._rolling_windows(inst.args[0])
            if not bank.expect(int(inst.doc_id), len(windows)):
                continue  # lm-eval's padding repeats a request on ranks with fewer documents
            for w, (ctx, cont) in enumerate(windows):
                inp = list((ctx + cont)[-(max_len + 1):][:-1])
                key = window_key(inp, len(cont))
                self._doc_windows.setdefault(key, set()).add((bank.task, int(inst.doc_id), w))
                self._window_tokens[key] = (inp, len(inp) - len(cont))

    def _fill_documents(self) -> None:
        jobs = []
        for key, owners in self._doc_windows.items():
            targets = [(self.banks[t], d, w) for t, d, w in sorted(owners) if self.banks[t].needs_window(d, w)]
            if targets:
                jobs.append((*self._window_tokens[key], targets))
        self._doc_windows, self._window_tokens = {}, {}
        if jobs:
            self._note_extra(len(jobs), "rolling windows")
            for chunk, hidden in self._run_sequences([tokens for tokens, _, _ in jobs]):
                for r, job in enumerate(chunk):
                    tokens, last, targets = jobs[job]
                    for bank, doc_id, w in targets:
                        bank.add_window(doc_id, w, {a: hidden[a][r, last: len(tokens)].clone()
                                                    for a in bank.addresses})
        for bank in self.banks.values():
            if bank.kind == "document" and bank.incomplete():
                raise RepgeomError(f"task {bank.task}: documents {bank.incomplete()[:5]} are missing rolling "
                                   "windows after the extra pass")

    def _note_extra(self, n: int, what: str) -> None:
        self.extra_texts += n
        if self.method == "fused" and not self._warned_missing:
            self._warned_missing = True
            warnings.warn(f"repgeom: fused capture missed the {what} of {n} texts of repgeom_metrics (lm-eval's "
                          "private call order differs from the tested one); computing them with an extra forward "
                          "pass", RuntimeWarning, stacklevel=3)

    @torch.no_grad()
    def _run_sequences(self, seqs: Sequence[Sequence[int]]) -> Iterator[tuple[list[int], dict[Address, torch.Tensor]]]:
        """Run token sequences (longest first, right-padded, no mask: the inputs HFLM's ``_model_call`` sees) in
        batches of lm-eval's batch size; yields (indices into ``seqs``, {address: [B, T, D]})."""
        device = next(self.model.parameters()).device
        dtype = getattr(self.lm, "mixed_precision_dtype", None)
        batch_size = self.lm.batch_size if isinstance(self.lm.batch_size, int) and self.lm.batch_size > 0 else 16
        order = sorted(range(len(seqs)), key=lambda k: -len(seqs[k]))
        with Forward(self.loaded, self.points) as fwd:
            for start in range(0, len(order), batch_size):
                chunk = order[start: start + batch_size]
                ids = torch.zeros((len(chunk), len(seqs[chunk[0]])), dtype=torch.long)
                for r, k in enumerate(chunk):
                    ids[r, : len(seqs[k])] = torch.as_tensor(list(seqs[k]), dtype=torch.long)
                with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype is not None):
                    hidden = fwd.padded(ids, None, row_ids=[f"sequence {k}" for k in chunk]).hidden
                yield chunk, hidden

    @torch.no_grad()
    def _views_pass(self, requests: Sequence[Any], kind: str) -> None:
        """VIEWS metrics: ``n_views`` augmented views of every text (docs/metrics.md#augmented-views), one extra
        forward pass (lm-eval never runs them), tokenized as lm-eval tokenizes a context and left-truncated to the
        model length like one."""
        max_len = self.lm.max_length
        for bank in self.banks.values():
            if bank.kind != kind or not bank.n_views:
                continue
            texts: dict[int, str] = {}
            for inst in requests:
                if getattr(inst, "task_name", None) == bank.task and bank.claim_views(int(inst.doc_id)):
                    text = inst.args[0]
                    texts[int(inst.doc_id)] = text[: len(text.rstrip())] if kind == "context" else text
            if not texts:
                continue
            n_views = bank.n_views
            warnings.warn(f"repgeom: {', '.join(bank.view_metrics())} (task {bank.task}) compare augmented views "
                          f"that lm-eval does not run: one extra forward pass over {len(texts) * n_views} augmented "
                          f"{kind}s ({n_views} per text)", RuntimeWarning, stacklevel=3)
            docs = sorted(texts)
            per_batch = max(1, (self.lm.batch_size if isinstance(self.lm.batch_size, int) else 16) // n_views)
            dtype = getattr(self.lm, "mixed_precision_dtype", None)
            device = next(self.model.parameters()).device
            with Forward(self.loaded, bank.points) as fwd:
                for start in range(0, len(docs), per_batch):
                    seqs, owners, views = [], [], []
                    for doc_id in docs[start: start + per_batch]:
                        for v in range(n_views):
                            augmented = bank.augmenter.view(texts[doc_id], doc_id, v)
                            tokens = self.lm.tok_encode(augmented)[-max_len:] or [self.lm.prefix_token_id]
                            seqs.append(tokens)
                            owners.append(doc_id)
                            views.append(v)
                    with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype is not None):
                        batch = fwd.token_ids(seqs, row_ids=[f"view {v} of document {d}"
                                                             for d, v in zip(owners, views)])
                    bank.feed(batch.hidden, batch.mask, owners, views)
