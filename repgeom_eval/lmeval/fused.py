"""Hidden states from the forward pass lm-eval's HFLM already makes ("fused capture"), with an extra-pass fallback.

HFLM scores requests inside ``_loglikelihood_tokens``: ``_model_call`` runs a batch of rows
(:class:`~repgeom_eval.lmeval.scored.ScoredRow`), then ``_select_cont_toks`` is called once per row, in row order,
with the row's ``contlen`` and ``inplen`` (lm-eval 0.4.13). While a run has repgeom tasks, :class:`HiddenStates`
shadows those methods on the HFLM *instance*: ``_model_call`` runs under
:class:`~repgeom_eval.modeling.hooks.Capture` hooks at the requested addresses, ``_select_cont_toks`` reads its
row, and ``_loglikelihood_tokens`` returns lm-eval's own results as :class:`~repgeom_eval.lmeval.scored.Scored`
tuples that also carry what each task reads. Log-likelihoods are never touched.

What a task reads is an (address, pooling) pair: a :class:`~repgeom_eval.modeling.addresses.Address` and a pooling of
:mod:`repgeom_eval.measurement.pooling` (``last``/``mean`` for a hardness query's context, ``tokens`` for the scored
tokens of a rolling window). Values are matched to requests by the token keys of the rows they depend on; a request
whose value did not arrive (lm-eval changed its private call order) comes from an extra forward pass
(:mod:`~repgeom_eval.lmeval.extra_pass`), with a warning. ``method="extra"`` computes every value that way: the
fallback, about +100% compute on MMLU. The registered metrics (``repgeom_metrics``) are fed from the same rows
(:mod:`~repgeom_eval.lmeval.feeding`).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.functional.dispersion import DispersionSums
from repgeom_eval.lmeval.extra_pass import ExtraPass
from repgeom_eval.lmeval.feeding import BankFeeder
from repgeom_eval.lmeval.scored import PromptScore, RollingScore, Scored, ScoredRow, prompt_score, read, rolling_windows
from repgeom_eval.spec.options.lmeval import CAPTURES
from repgeom_eval.measurement.forward import check_finite
from repgeom_eval.modeling.addresses import Address, resolve, resolve_request
from repgeom_eval.modeling.hooks import Capture

# The private HFLM methods fused capture relies on, with the parameters it passes (lm-eval 0.4.13).
_FUSED_SIGNATURES = {
    "_model_call": ("inps", "attn_mask", "labels"),
    "_select_cont_toks": ("logits", "contlen", "inplen"),
    "_loglikelihood_tokens": ("requests", "disable_tqdm", "override_bs"),
    "loglikelihood_rolling": ("requests", "disable_tqdm"),
}


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


def resolve_layer(layer: str, loaded: Any) -> Address:
    """The one address ``repgeom_layer`` names on the run's model."""
    found = resolve_request(layer, loaded).addresses
    if len(found) != 1:
        raise RepgeomError(f"repgeom_layer {layer!r} names {len(found)} layers; lm-eval tasks read one (e.g. final, "
                           "resid_post:-1, mlp_in:12)")
    return found[0]


class _Batch:
    """The forward pass lm-eval just made: its input tokens and the captured tensors; rows are read in order."""

    def __init__(self, inps: torch.Tensor, hidden: dict[Address, torch.Tensor]):
        self.width = int(inps.shape[1])
        self.tokens = inps.detach().cpu().numpy()
        self.hidden = hidden
        self.next_row = 0


class HiddenStates:
    """Attach what a run's repgeom tasks read (``reads``: (address, pooling) pairs) to the results of an HFLM
    instance, and feed the registered-metric ``banks`` (task name → TaskBank) from the same rows.

    Use as a context manager around the evaluation; on exit the instance is as it was.
    """

    def __init__(self, lm: Any, loaded: Any, reads: Iterable[tuple[Address, str]], method: str = "fused",
                 banks: Mapping[str, Any] | None = None):
        if method not in CAPTURES:
            raise RepgeomError(f"unknown capture method {method!r} (valid: {', '.join(CAPTURES)})")
        self.lm = lm
        self.model = lm.model
        self.reads = tuple(sorted(set(reads), key=lambda r: (str(r[0]), r[1])))
        self.extra = ExtraPass(lm, loaded)
        self.read_points = resolve(sorted({address for address, _ in self.reads}, key=str), loaded)
        self.feeder = BankFeeder(lm, loaded, banks or {}, self.extra, self._missed)
        self.points = {**self.read_points, **self.feeder.points}
        self.method = method
        self.reason = None
        if method == "fused":
            self.reason = fused_capture_problem(lm)
            if self.reason:
                warnings.warn(f"repgeom: fused capture disabled ({self.reason}); hidden states come from an extra "
                              "forward pass per context (about twice the compute)", RuntimeWarning, stacklevel=3)
                self.method = "extra"
        self.extra_requests = 0  # requests whose values came from an extra pass
        self._originals: dict[str, Any] = {}
        self._capture: Capture | None = None
        self._batch: _Batch | None = None
        self._instances: list | None = None  # the Instances of the loglikelihood call under way
        self._scoring = False
        self._rolling = False
        self._store: dict[tuple, dict[tuple[Address, str], Any]] = {}  # row key -> the values read from it
        self._prompts: dict[tuple, PromptScore] = {}  # context key -> the context's own log-likelihood
        self._windows: dict[tuple, dict[tuple[Address, str], DispersionSums]] = {}  # window key -> its values
        self._warned_missing = False

    def __enter__(self) -> "HiddenStates":
        names = ["_loglikelihood_tokens", "loglikelihood_rolling"]
        if self.feeder.reads_contexts:
            names.append("loglikelihood")
        if self.feeder.reads_prompts:
            names.append("generate_until")
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
        self._store, self._prompts, self._windows = {}, {}, {}
        self.feeder.clear()

    def _missed(self, message: str) -> None:
        """Fused capture did not read some rows (they come from the extra pass): said once per run."""
        if self.method == "fused" and not self._warned_missing:
            self._warned_missing = True
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    # -- the methods that shadow HFLM's, in the order lm-eval calls them -------------------------------------------

    def loglikelihood(self, requests: list, *args: Any, **kwargs: Any):
        """Only with registered metrics: remembers the ``Instance`` of each request (its task and document)."""
        self._instances = list(requests)
        try:
            results = self._originals["loglikelihood"](requests, *args, **kwargs)
        finally:
            self._instances = None
        self.feeder.feed_views(requests, "context")
        return results

    def generate_until(self, requests: list, *args: Any, **kwargs: Any):
        """Only with registered metrics in a generation task: lm-eval generates, then each prompt gets one forward
        pass of its own (generation runs the prompt with left padding, batched by length; see
        :meth:`~repgeom_eval.lmeval.feeding.BankFeeder.feed_prompts`)."""
        results = self._originals["generate_until"](requests, *args, **kwargs)
        self.feeder.feed_prompts(requests)
        self.feeder.feed_views(requests, "context")
        return results

    def loglikelihood_rolling(self, requests: list, *args: Any, **kwargs: Any):
        self.feeder.register_documents(requests)
        self._rolling, self._windows = True, {}
        try:
            totals = self._originals["loglikelihood_rolling"](requests, *args, **kwargs)
        finally:
            self._rolling = False
        self.feeder.fill_documents()
        self.feeder.feed_views(requests, "document")
        try:
            return self._rolling_results(requests, totals)
        finally:
            self._windows = {}

    def _loglikelihood_tokens(self, *args: Any, **kwargs: Any):
        requests = kwargs["requests"] if "requests" in kwargs else args[0]
        if not self._rolling and self._instances is not None:
            self.feeder.register_contexts(self._instances, requests)
        self._scoring, self._store, self._prompts = True, {}, {}
        try:
            results = self._originals["_loglikelihood_tokens"](*args, **kwargs)
            self.feeder.flush()
        finally:
            self._scoring, self._batch = False, None
        if not self._rolling:
            self.feeder.fill_contexts()
        try:
            return self._attach(requests, results)
        finally:
            self._store, self._prompts = {}, {}

    def _model_call(self, inps: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.feeder.flush()  # the rows read from the previous batch go to the metric states before it is replaced
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

    # -- reading a row ------------------------------------------------------------------------------------------------

    def _reads_now(self) -> list[tuple[Address, str]]:
        """The scored tokens for rolling windows, the context for everything else."""
        return [r for r in self.reads if (r[1] == "tokens") == self._rolling]

    def _read_row(self, batch: _Batch, seq_len: int, contlen: int, inplen: int,
                  logprobs: torch.Tensor | None = None) -> None:
        i = batch.next_row
        batch.next_row += 1
        if i >= batch.tokens.shape[0]:
            return  # more rows than the batch has: lm-eval changed its call order; _attach falls back
        offset = seq_len - batch.width  # prompt-tuning tokens that precede the input in the model's sequence
        n_in = inplen - offset
        if n_in <= 0 or n_in - contlen < 0:
            return
        row = ScoredRow(batch.tokens[i, :n_in], n_in - contlen)
        reads = self._reads_now()
        if not self._rolling and logprobs is not None and reads:
            key = row.context_key()
            if key not in self._prompts:  # the choices of a query share its context: read it once
                self._prompts[key] = prompt_score(logprobs, row, offset)
        for address, pooling in reads:
            value = read(batch.hidden[address][i], row.positions(pooling, offset), pooling)
            self._store.setdefault(row.key(pooling), {})[(address, pooling)] = value
        self.feeder.take(batch.hidden, i, row, offset, self._rolling)

    # -- the results lm-eval gets back ------------------------------------------------------------------------------

    def _attach(self, requests: Sequence, results: Sequence) -> list[Scored]:
        rows = [ScoredRow.of(ctx, cont, self.lm.max_length) for _, ctx, cont in requests]
        out: list[Scored] = []
        todo: list[tuple[int, tuple[Address, str] | None, ScoredRow]] = []
        reads = self._reads_now()
        for j, (row, (_, _, cont), result) in enumerate(zip(rows, requests, results)):
            geometry = {}
            for r in reads:
                value = self._store.get(row.key(r[1]), {}).get(r)
                if value is None:
                    todo.append((j, r, row))
                else:
                    geometry[r] = value
            prompt = None
            if reads and not self._rolling:
                prompt = self._prompts.get(row.context_key())
                if prompt is None and len(geometry) == len(reads):
                    todo.append((j, None, row))  # values read, prompt not: the pass adds it
            out.append(Scored(result, geometry, len(cont), prompt))
        if todo:
            self._missed(f"repgeom: fused capture missed {len(todo)} of {len(requests) * len(reads)} vectors "
                         "(lm-eval's private call order differs from the tested one); computing them with an extra "
                         "forward pass")
            self._extra_pass(todo, out)
        if self._rolling:
            for row, scored in zip(rows, out):
                self._windows[row.window_key()] = scored.geometry
        return out

    def _rolling_results(self, requests: Sequence, totals: Sequence[float]) -> list[RollingScore]:
        reads = [r for r in self.reads if r[1] == "tokens"]
        if not reads:
            return [RollingScore(float(total)) for total in totals]
        max_len = self.lm.max_length
        per_doc = [rolling_windows(self.lm, request.args[0]) for request in requests]
        missing = [(ctx, cont) for windows in per_doc for ctx, cont in windows
                   if ScoredRow.of(ctx, cont, max_len).window_key() not in self._windows]
        if missing:
            self._missed(f"repgeom: {len(missing)} rolling windows had no captured hidden states; computing them "
                         "with an extra forward pass")
            self._rolling = True
            try:
                self._attach([(None, c, x) for c, x in missing], [(float("nan"), False)] * len(missing))
            finally:
                self._rolling = False
        out = []
        for total, windows in zip(totals, per_doc):
            geometry: dict[tuple[Address, str], DispersionSums] = {}
            for ctx, cont in windows:
                found = self._windows.get(ScoredRow.of(ctx, cont, max_len).window_key(), {})
                for r in reads:
                    sums = found.get(r)
                    if sums is not None:
                        geometry[r] = geometry[r] + sums if r in geometry else sums
            out.append(RollingScore(float(total), geometry, sum(len(cont) for _, cont in windows)))
        return out

    # -- the fallback -------------------------------------------------------------------------------------------------

    def _extra_pass(self, todo: list[tuple[int, tuple[Address, str] | None, ScoredRow]], out: list[Scored]) -> None:
        """Compute the missing values by running each needed token sequence once more (deduplicated): a window's
        whole row for ``tokens``, the context alone otherwise (a missing prompt score included)."""
        jobs: dict[tuple, dict[str, Any]] = {}
        for j, r, row in todo:
            pooling = r[1] if r is not None else "last"
            run = row if pooling == "tokens" else row.context()
            job = jobs.setdefault(row.key(pooling), {"row": run, "reads": set(), "targets": []})
            if r is not None:
                job["reads"].add(r)
            job["targets"].append((j, r))
        self.extra_requests += len({j for j, *_ in todo})
        ordered = list(jobs.values())
        contexts = not self._rolling  # a context's own log-likelihood comes with its values: logits are needed
        names = [f"request {job['targets'][0][0]}" for job in ordered]
        for chunk, batch in self.extra.run([job["row"].tokens for job in ordered], self.read_points, names,
                                           logits=contexts):
            for b, k in enumerate(chunk):
                job = ordered[k]
                row = job["row"]
                values = {r: read(batch.hidden[r[0]][b], row.positions(r[1]), r[1]) for r in job["reads"]}
                prompt = None
                if contexts and batch.logits is not None:
                    prompt = prompt_score(torch.log_softmax(batch.logits[b, : len(row.tokens)].float(), dim=-1), row)
                for j, r in job["targets"]:
                    if r is not None:
                        out[j].geometry[r] = values[r]
                    if prompt is not None and out[j].prompt is None:
                        out[j].prompt = prompt
