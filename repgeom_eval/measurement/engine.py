"""The measurement pipeline, top to bottom:

load model → resolve layer addresses → capture (hooks, one forward per batch, early stop) → pool → update metric
states → compute → results.
"""

from __future__ import annotations

import platform
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from repgeom_eval import __version__
from repgeom_eval.modeling.addresses import Address, HookPoint, parse_layers, resolve
from repgeom_eval.modeling.hooks import Capture
from repgeom_eval.measurement.texts import Record, TextSet, TextSource, open_source
from repgeom_eval.measurement.distributed import Distributed
from repgeom_eval.errors import NonFiniteError, RepgeomError
from repgeom_eval.output.files import write_json, write_jsonl
from repgeom_eval.metric import Consumes, LayerBatch, Metric
from repgeom_eval.modeling.loading import LoadedModel, load_model
from repgeom_eval.plugin_system.host import PluginHost, get_host
from repgeom_eval.measurement.pooling import check_pooling, pool
from repgeom_eval.measurement.preprocess import METHODS as PREPROCESS_METHODS
from repgeom_eval.measurement.preprocess import Preprocessor, VectorStats
from repgeom_eval.measurement.checkpoint import RunDir, model_fingerprint

DEFAULT_SHARD_SIZE = 1024  # texts read, batched and checkpointed together


@dataclass
class MeasureResult:
    """Everything one run produced; ``to_dict()`` is the results-file schema."""

    model: dict[str, Any]
    data: dict[str, Any]
    config: dict[str, Any]
    results: dict[str, dict[str, Any]]
    diagnostics: dict[str, dict[str, Any]]
    timings: dict[str, float]
    per_text: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)  # metric → result of Metric.across_layers
    is_main: bool = True  # False on ranks > 0 of a distributed run: their results are merged into rank 0's

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "data": self.data, "config": self.config, "results": self.results,
                "summary": self.summary, "diagnostics": self.diagnostics, "timings": self.timings}

    def write(self, path: str | Path, per_text_path: str | Path | None = None) -> None:
        write_json(path, self.to_dict())
        if per_text_path is not None:
            write_jsonl(per_text_path, self.per_text)


@dataclass
class MetricSpec:
    """A requested metric: its class, constructor arguments and the pooling it reads (None for token metrics)."""

    name: str
    cls: type[Metric]
    kwargs: dict[str, Any]
    pooling: str | None

    def config(self, metric: Metric) -> dict[str, Any]:
        out = metric.config()
        if self.pooling is not None:
            out["pooling"] = self.pooling
        if self.cls.consumes == Consumes.VIEWS:
            out["n_views"] = int(metric.n_views)  # type: ignore[attr-defined]
        return out


def instantiate_metrics(
    names: Sequence[str],
    host: PluginHost,
    params: Mapping[str, Mapping[str, Any]] | None,
    per_text: bool,
    pooling: str | None = None,
) -> list[MetricSpec]:
    """Look every metric up (unknown names fail before the model is loaded) and check its parameters.

    Pooling: ``METRIC.pooling`` if given, else the run's ``pooling``, else the metric's ``default_pooling``.
    """
    params = dict(params or {})
    unknown_params = set(params) - set(names)
    if unknown_params:
        raise RepgeomError(f"parameters given for metrics that were not requested: {sorted(unknown_params)}")
    out = []
    for name in dict.fromkeys(names):
        cls = host.metrics.get(name)
        accepted = cls.parameter_names()
        kwargs = dict(params.get(name, {}))
        metric_pooling = kwargs.pop("pooling", None) if "pooling" not in accepted else None
        bad = set(kwargs) - set(accepted)
        if bad:
            raise RepgeomError(f"metric {name!r} has no parameter(s) {sorted(bad)} "
                               f"(parameters: {', '.join(accepted + ['pooling'])})")
        if per_text and "per_text" in accepted:
            kwargs.setdefault("per_text", True)
        if cls.consumes == Consumes.TOKENS:
            chosen = None
        else:
            chosen = check_pooling(metric_pooling or pooling or cls.default_pooling)
            if cls.consumes == Consumes.VIEWS and chosen == "tokens":
                raise RepgeomError(f"metric {name!r} compares pooled views of each text; pooling 'tokens' does not "
                                   "apply (use mean, last or first)")
        out.append(MetricSpec(name, cls, kwargs, chosen))
    return out


@dataclass(frozen=True)
class _Item:
    """One sequence to run through the model: an original text (view = -1) or one of its augmented views."""

    text: int
    view: int


class _ViewBuffer:
    """Collects the pooled views of each text (they may arrive in different batches) until all are there."""

    def __init__(self, n_views: int):
        self.n_views = n_views
        self._slots: dict[int, list[torch.Tensor | None]] = {}

    def add(self, text: int, view: int, vector: torch.Tensor) -> None:
        self._slots.setdefault(text, [None] * self.n_views)[view] = vector

    def pop_complete(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        done = [t for t, slots in self._slots.items() if all(v is not None for v in slots)]
        if not done:
            return None
        views = torch.stack([torch.stack(self._slots.pop(t)) for t in done])  # type: ignore[arg-type]
        return torch.tensor(done, dtype=torch.long), views

    def __len__(self) -> int:
        return len(self._slots)


def _context_length(loaded: LoadedModel, max_length: int | None) -> int:
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


def _check_finite(addr: Address, h: torch.Tensor, mask: torch.Tensor, ids: list[Any]) -> None:
    bad = (~torch.isfinite(h)).any(-1) & mask
    if bool(bad.any()):
        rows = bad.any(1).nonzero().flatten().tolist()
        raise NonFiniteError(
            f"NaN or inf in the hidden states at address {addr} for text id {ids[rows[0]]!r}"
            f" ({len(rows)} text(s) of this batch affected); a float16/bfloat16 overflow is the usual cause: "
            "try --dtype float32"
        )


def measure(
    model: str | LoadedModel,
    data: str | Path | Sequence[str] | TextSet | TextSource,
    *,
    layers: str | Sequence[str] = "final",
    metrics: Sequence[str] = ("dispersion",),
    pooling: str | None = None,
    batch_size: int = 16,
    max_length: int | None = None,
    padding_side: str = "right",
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device | None = "cpu",
    per_text: bool = False,
    metric_params: Mapping[str, Mapping[str, Any]] | None = None,
    text_field: str = "text",
    seed: int = 0,
    preprocess: str = "none",
    preprocess_stats: str | Path | None = None,
    save_preprocess_stats: str | Path | None = None,
    massive_share_warning: float = 0.5,
    shard_size: int = DEFAULT_SHARD_SIZE,
    run_dir: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    host: PluginHost | None = None,
) -> MeasureResult:
    """Measure ``metrics`` at every address in ``layers`` over ``data`` with one forward pass per batch.

    ``model`` is a hub id, a local directory, a ``.gguf`` file or an already loaded :class:`LoadedModel`;
    ``data`` is a ``.jsonl``/``.txt`` path, an ``hf:NAME?split=...`` dataset stream, a list of strings or a
    :class:`TextSet`. ``pooling`` overrides every metric's default pooling (``None``: each metric's own, e.g.
    ``last`` for dispersion). ``seed`` drives the augmented views of the multi-view metrics, which run in the same
    forward passes as the originals.

    ``preprocess`` (``none``, ``center``, ``standardize``, ``whiten``) transforms every vector a metric sees, with
    statistics from ``preprocess_stats`` (a file written through ``save_preprocess_stats``) or, if none is given,
    from the same data in an extra forward pass. A warning names each address where one hidden dimension carries
    at least ``massive_share_warning`` of the squared norm of the mean-pooled vectors.

    Texts are read and processed ``shard_size`` at a time (memory: one shard plus the metric states). With
    ``run_dir`` the states are checkpointed after every shard, and ``resume=True`` continues a killed run. Under
    ``torchrun``/``accelerate launch`` the batches of each shard are spread over the processes and the states are
    merged on rank 0, which alone gets the results (other ranks get ``results == {}``).
    """
    t_start = time.perf_counter()
    host = host or get_host()
    if pooling is not None:
        pooling = check_pooling(pooling)
    if padding_side not in ("left", "right"):
        raise RepgeomError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    if batch_size < 1:
        raise RepgeomError(f"batch size must be positive, got {batch_size}")
    if shard_size < 1:
        raise RepgeomError(f"shard size must be positive, got {shard_size}")
    if resume and not run_dir:
        raise RepgeomError("resume needs the run directory of the run to continue (--run-dir DIR)")
    if isinstance(metrics, str):
        metrics = [m.strip() for m in metrics.split(",") if m.strip()]
    if not metrics:
        raise RepgeomError("no metric requested")
    specs = instantiate_metrics(metrics, host, metric_params, per_text, pooling)
    if preprocess not in PREPROCESS_METHODS:
        raise RepgeomError(f"unknown preprocess {preprocess!r} (valid: {', '.join(PREPROCESS_METHODS)})")
    if preprocess == "none" and (preprocess_stats or save_preprocess_stats):
        flag = "--preprocess-stats" if preprocess_stats else "--save-preprocess-stats"
        raise RepgeomError(f"{flag} has no effect without preprocessing; add --preprocess center, standardize or "
                           "whiten (or drop the flag)")
    prep = Preprocessor.load(preprocess_stats, preprocess) if preprocess_stats and preprocess != "none" \
        else Preprocessor()
    source = open_source(data, text_field=text_field)  # validates a file whole before the model is loaded

    # -- model and addresses -------------------------------------------------------------------------------------
    dist = Distributed.from_env(device)
    try:
        return _measure(model, source, dist, host, specs, prep, t_start, layers=layers, pooling=pooling,
                        batch_size=batch_size, max_length=max_length, padding_side=padding_side, dtype=dtype,
                        device=dist.device(device), per_text=per_text, text_field=text_field, seed=seed,
                        preprocess=preprocess, preprocess_stats=preprocess_stats,
                        save_preprocess_stats=save_preprocess_stats, massive_share_warning=massive_share_warning,
                        shard_size=shard_size, run_dir=run_dir, resume=resume, progress=progress)
    finally:
        dist.close()


def _measure(model, source: TextSource, dist: Distributed, host: PluginHost, specs: list[MetricSpec],
             prep: Preprocessor, t_start: float, *, layers, pooling, batch_size, max_length, padding_side, dtype,
             device, per_text, text_field, seed, preprocess, preprocess_stats, save_preprocess_stats,
             massive_share_warning, shard_size, run_dir, resume, progress) -> MeasureResult:
    t0 = time.perf_counter()
    loaded = model if isinstance(model, LoadedModel) else load_model(model, dtype=dtype, device=device, host=host)
    t_load = time.perf_counter() - t0
    n_layers = loaded.info.n_layers
    show = progress and dist.is_main

    def selector(name: str):
        return host.layer_selectors.get(name) if name in host.layer_selectors else None

    addresses = parse_layers(layers, n_layers, selector, loaded.info, selector_names=host.layer_selectors.names())
    addresses.sort(key=lambda a: a.depth_key(n_layers))
    points = _one_name_per_tensor(resolve(addresses, loaded), loaded.info.model_type)
    addresses = list(points)

    tok = loaded.tokenizer  # never mutated: padding_side is passed per call
    context = _context_length(loaded, max_length)
    run = _RunState(addresses, specs, per_text, context)
    n_views = max([int(m.n_views) for spec, m in run.first_metrics()  # type: ignore[attr-defined]
                   if spec.cls.consumes == Consumes.VIEWS] or [0])
    need_originals = any(spec.cls.consumes != Consumes.VIEWS for spec in specs)
    augmenter = None
    if n_views:
        from repgeom_eval.measurement.augment import Augmenter

        augmenter = Augmenter(seed=seed)

    # -- checkpoints -----------------------------------------------------------------------------------------------
    ckpt = None
    if run_dir:
        key = {"model": model_fingerprint(loaded.info.name, loaded.info.source, loaded.model.config),
               "model_name": loaded.info.name, "data": source.fingerprint, "data_path": source.source,
               "addresses": [str(a) for a in addresses],
               "metrics": {spec.name: spec.config(m) for spec, m in run.first_metrics()},
               "max_length": context, "dtype": loaded.info.dtype, "batch_size": batch_size,
               "shard_size": shard_size, "padding_side": padding_side, "seed": seed,
               "preprocess": preprocess, "preprocess_stats": str(preprocess_stats) if preprocess_stats else None,
               "text_field": text_field, "world_size": dist.world}
        ckpt = RunDir(run_dir, key, dist.rank, dist.world, resume, dist.is_main)
        dist.barrier()  # rank 0 has created the directory
        saved = ckpt.load()
        if saved is not None:
            run.load(saved)
            if run.prep_transforms is not None:
                prep = Preprocessor(preprocess, run.prep_transforms, "same data (checkpoint)")

    def plan(shard: list[Record]) -> _ShardPlan:
        return _plan_shard(shard, tok, context, batch_size, n_views, need_originals, augmenter)

    timer = {"forward": 0.0, "metrics": 0.0, "augment_tokenize": 0.0}
    dev = loaded.device
    per_item = (1 if need_originals else 0) + n_views
    expected = None if source.n_texts is None else -(-source.n_texts * per_item // dist.world)

    processed = [0]  # sequences this process ran through the model in the current pass

    def run_pass(desc: str, on_address, start_shard: int, after_shard=None) -> None:
        """One forward per owned batch of every shard from ``start_shard`` on."""
        with Capture(loaded.model, points, stop_early=True) as cap, tqdm(
            total=expected, unit="seq", desc=desc, disable=not show, leave=False
        ) as bar:
            for shard_no, shard in enumerate(source.shards(shard_size)):
                if shard_no < start_shard:
                    continue  # done before the checkpoint: read past it, no forward pass
                t0 = time.perf_counter()
                sp = plan(shard)
                timer["augment_tokenize"] += time.perf_counter() - t0
                for u, unit in enumerate(sp.units):
                    if not dist.owns(u):
                        continue
                    for start in range(0, len(unit), batch_size):
                        rows = unit[start:start + batch_size]
                        _forward_batch(cap, loaded, tok, sp, rows, context, padding_side, dev, timer, on_address,
                                       addresses)
                        processed[0] += len(rows)
                        bar.update(len(rows))
                if after_shard is not None:
                    after_shard(shard_no, sp)

    # -- preprocessing statistics from the same data: one extra pass --------------------------------------------
    t_stats = 0.0
    if preprocess != "none" and not preprocess_stats and not prep.active:
        stats: dict[str, VectorStats] = {}
        kinds = _preprocess_kinds(specs)
        t0 = time.perf_counter()
        run_pass("preprocess statistics",
                 lambda addr, h, mask, its: _collect_stats(addr, h, mask, its, kinds, stats, preprocess == "whiten"),
                 0)
        merged: dict[str, VectorStats] = {}
        for part in dist.all_gather(stats):
            for k, st in part.items():
                merged[k] = merged[k].merge(st) if k in merged else st
        prep = Preprocessor.from_stats(preprocess, merged, "same data")
        run.prep_transforms = prep.transforms
        timer["forward"] = timer["metrics"] = 0.0
        processed[0] = 0
        t_stats = time.perf_counter() - t0
    if save_preprocess_stats and prep.active and dist.is_main:
        prep.save(save_preprocess_stats)

    # -- the measuring pass: every address and metric fed from one forward per batch -----------------------------
    buffers = {(addr, p): _ViewBuffer(n_views) for addr in addresses
               for p in sorted({spec.pooling for spec in specs if spec.cls.consumes == Consumes.VIEWS})}

    def measure_address(addr, h, mask, batch_items) -> None:
        orig = [r for r, it in enumerate(batch_items) if it.view < 0]
        if orig:
            sel = torch.tensor(orig, device=h.device)
            mean_pooled = pool(h[sel].double(), mask[sel], "mean")[0]
            run.add_energy(addr, (mean_pooled * mean_pooled).sum(0).cpu())
        _feed(addr, h, mask, batch_items, run.states[addr], buffers, prep)

    def after_shard(shard_no: int, sp: "_ShardPlan") -> None:
        assert all(len(b) == 0 for b in buffers.values()), "some augmented views never arrived"
        run.count_shard(shard_no, sp)
        run.n_processed += processed[0]
        processed[0] = 0
        if ckpt is not None:
            ckpt.save(run.state())

    run_pass("measure", measure_address, run.next_shard, after_shard)
    counts = source.counts()
    if ckpt is not None:
        run.complete = True
        ckpt.save(run.state())

    # -- merge the processes' states, then compute and report (rank 0) -------------------------------------------
    t0 = time.perf_counter()
    run.merge_ranks(dist)
    if run.n_empty and dist.is_main:
        warnings.warn(f"{run.n_empty} text(s) tokenize to no tokens and are skipped (ids: {run.empty_ids})",
                      stacklevel=3)
    n_usable = counts["n_texts"] - run.n_empty
    if n_usable < 2:
        raise RepgeomError(f"only {n_usable} text(s) have any tokens; at least 2 are needed")
    if run.n_truncated and dist.is_main:
        warnings.warn(f"{run.n_truncated} of {counts['n_texts']} texts are longer than {context} tokens and were "
                      "truncated (set --max-length to change the limit)", stacklevel=3)
    results: dict[str, dict[str, Any]] = {}
    diagnostics: dict[str, dict[str, Any]] = {}
    summary: dict[str, Any] = {}
    per_text_rows: list[dict[str, Any]] = []
    if dist.is_main:
        results, diagnostics, summary, per_text_rows = _report(run, specs, per_text, massive_share_warning, context)
    t_metrics = timer["metrics"] + time.perf_counter() - t0

    total = time.perf_counter() - t_start
    config = {
        "layers": [str(a) for a in addresses],
        "layer_spec": layers if isinstance(layers, str) else list(layers),
        "metrics": {spec.name: spec.config(metric) for spec, metric in run.first_metrics()},
        "pooling": pooling,
        "batch_size": batch_size,
        "max_length": context,
        "padding_side": padding_side,
        "dtype": loaded.info.dtype,
        "device": str(loaded.device),
        "per_text": per_text,
        "text_field": text_field,
        "seed": seed,
        "massive_share_warning": massive_share_warning,
        "shard_size": shard_size,
        "run_dir": str(run_dir) if run_dir else None,
        "resumed_from_shard": run.resumed_from,
        "distributed": dist.config() | {"sequences_by_rank": run.processed_by_rank},
        "augmentation": augmenter.config() | {"n_views": n_views} if augmenter else None,
        "preprocess": prep.config(),
        "versions": {"repgeom_eval": __version__, "torch": torch.__version__,
                     "transformers": _version("transformers"), "python": platform.python_version()},
    }
    data_summary = counts | {"n_tokens": run.n_tokens, "n_truncated": run.n_truncated,
                             "n_views_per_text": n_views, "n_skipped_no_tokens": run.n_empty}
    timings = {"load_model_s": t_load, "augment_tokenize_s": timer["augment_tokenize"],
               "preprocess_stats_s": t_stats, "forward_s": timer["forward"], "metrics_s": t_metrics,
               "total_s": total,
               "sequences_per_s": run.n_sequences / max(timer["forward"] + timer["metrics"], 1e-9)}
    return MeasureResult(loaded.info.to_dict(), data_summary, config, results, diagnostics, timings, per_text_rows,
                         summary, is_main=dist.is_main)


@dataclass
class _ShardPlan:
    """One shard, ready to run: its sequences (originals and views), their token counts, and its batches."""

    items: list[_Item]
    strings: list[str]
    lengths: list[int]
    units: list[list[int]]  # batches (rows into items); unit u runs on rank u % world
    ids: dict[int, Any]  # text index → record id
    empty: list[int]  # text indices with no tokens


def _plan_shard(shard: list[Record], tok, context: int, batch_size: int, n_views: int, need_originals: bool,
                augmenter) -> _ShardPlan:
    """Augment, tokenize once for lengths, and cut the shard into batches.

    Originals are sorted by length (less padding) and cut into batches; the views of each text stay together, so
    a text's views are all pooled by the same process. The plan depends only on the shard, never on the number of
    processes: every batch is padded the same way whether it runs alone or on one rank of many.
    """
    items: list[_Item] = []
    strings: list[str] = []
    for rec in shard:
        if need_originals:
            items.append(_Item(rec.index, -1))
            strings.append(rec.text)
        for v in range(n_views):
            items.append(_Item(rec.index, v))
            strings.append(augmenter.view(rec.text, rec.index, v))
    lengths = [len(x) for x in tok(strings, add_special_tokens=True, verbose=False)["input_ids"]] if strings else []
    empty = sorted({it.text for it, n in zip(items, lengths) if n == 0})
    drop = set(empty)
    keep = [k for k, it in enumerate(items) if it.text not in drop]
    items, strings, lengths = [items[k] for k in keep], [strings[k] for k in keep], [lengths[k] for k in keep]

    originals = sorted((k for k, it in enumerate(items) if it.view < 0), key=lambda k: -lengths[k])
    units = [originals[i:i + batch_size] for i in range(0, len(originals), batch_size)]
    if n_views:
        by_text: dict[int, list[int]] = {}
        for k, it in enumerate(items):
            if it.view >= 0:
                by_text.setdefault(it.text, []).append(k)
        texts = sorted(by_text, key=lambda t: -max(lengths[k] for k in by_text[t]))
        per_batch = max(1, batch_size // n_views)
        for i in range(0, len(texts), per_batch):
            rows = [k for t in texts[i:i + per_batch] for k in by_text[t]]
            units.append(sorted(rows, key=lambda k: -lengths[k]))
    return _ShardPlan(items, strings, lengths, units, {rec.index: rec.id for rec in shard}, empty)


def _forward_batch(cap: Capture, loaded: LoadedModel, tok, sp: _ShardPlan, rows: list[int], context: int,
                   padding_side: str, dev, timer: dict[str, float], on_address, addresses: list[Address]) -> None:
    t0 = time.perf_counter()
    enc = tok([sp.strings[i] for i in rows], padding=True, truncation=True, max_length=context,
              padding_side=padding_side, return_tensors="pt", verbose=False)
    enc = {k: v.to(dev) for k, v in enc.items()}
    mask = enc["attention_mask"].bool()
    if loaded.spec.position_ids_from_mask:
        enc["position_ids"] = (enc["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)
    captured = cap.run(**enc, use_cache=False) if loaded.spec.causal else cap.run(**enc)
    timer["forward"] += time.perf_counter() - t0

    t0 = time.perf_counter()
    batch_items = [sp.items[i] for i in rows]
    batch_ids = [sp.ids[it.text] for it in batch_items]
    for addr in addresses:
        h = captured[addr]
        if h.dtype in (torch.float16, torch.bfloat16):
            h = h.float()
        _check_finite(addr, h, mask, batch_ids)
        on_address(addr, h, mask, batch_items)
    timer["metrics"] += time.perf_counter() - t0


class _RunState:
    """Everything a run accumulates: metric states per address, energy per address, and counts.

    Exactly what a checkpoint saves and what the processes merge; all of it is O(D²) per address at most, except
    the per-text bookkeeping asked for with ``per_text``.
    """

    def __init__(self, addresses: list[Address], specs: list[MetricSpec], per_text: bool, context: int):
        self.addresses, self.specs, self.per_text, self.context = addresses, specs, per_text, context
        self.states: dict[Address, list[tuple[MetricSpec, Metric]]] = {
            addr: [(spec, spec.cls(**spec.kwargs)) for spec in specs] for addr in addresses}
        self.energy = {addr: torch.zeros(0, dtype=torch.float64) for addr in addresses}
        self.next_shard = 0
        self.resumed_from = None
        self.complete = False
        self.n_tokens = self.n_truncated = self.n_empty = self.n_sequences = 0
        self.n_processed = 0  # sequences this process ran (the others ran the rest of the n_sequences)
        self.processed_by_rank: list[int] = []
        self.empty_ids: list[Any] = []
        self.text_info: dict[int, tuple[Any, int | None]] = {}  # per_text only: index → (id, tokens untruncated)
        self.prep_transforms: dict[str, dict[str, torch.Tensor]] | None = None

    def first_metrics(self) -> list[tuple[MetricSpec, Metric]]:
        return next(iter(self.states.values()))

    def add_energy(self, addr: Address, e: torch.Tensor) -> None:
        self.energy[addr] = e if self.energy[addr].numel() == 0 else self.energy[addr] + e

    def count_shard(self, shard_no: int, sp: _ShardPlan) -> None:
        """Counts that every process computes identically from the plan (so they are never summed over ranks)."""
        self.next_shard = shard_no + 1
        self.n_empty += len(sp.empty)
        self.empty_ids += [sp.ids[t] for t in sp.empty][: max(0, 5 - len(self.empty_ids))]
        for it, n in zip(sp.items, sp.lengths):
            if it.view < 0:
                self.n_tokens += min(n, self.context)
                self.n_truncated += n > self.context
                if self.per_text:
                    self.text_info[it.text] = (sp.ids[it.text], n)
        if self.per_text:
            self.text_info.update({t: (sp.ids[t], None) for t in sp.empty})
        self.n_sequences += len(sp.items)

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            "next_shard": self.next_shard, "complete": self.complete,
            "metrics": {str(a): {spec.name: m.state_dict() for spec, m in ms} for a, ms in self.states.items()},
            "energy": {str(a): e for a, e in self.energy.items()},
            "counts": [self.n_tokens, self.n_truncated, self.n_empty, self.n_sequences, self.n_processed],
            "empty_ids": list(self.empty_ids),
            "text_info": {i: list(v) for i, v in self.text_info.items()},
            "prep": self.prep_transforms,
        }

    def load(self, saved: dict[str, Any]) -> None:
        for addr, ms in self.states.items():
            for spec, m in ms:
                m.load_state_dict(saved["metrics"][str(addr)][spec.name])
        self.energy = {a: saved["energy"][str(a)] for a in self.addresses}
        self.n_tokens, self.n_truncated, self.n_empty, self.n_sequences, self.n_processed = saved["counts"]
        self.empty_ids = list(saved["empty_ids"])
        self.text_info = {int(i): (rid, n) for i, (rid, n) in saved["text_info"].items()}
        self.next_shard = self.resumed_from = saved["next_shard"]
        self.prep_transforms = saved.get("prep")

    # -- processes -----------------------------------------------------------------------------------------------
    def merge_ranks(self, dist: Distributed) -> None:
        """Fold every other rank's metric states and energy into rank 0's (in rank order)."""
        if not dist.active:
            self.processed_by_rank = [self.n_processed]
            return
        parts = dist.gather({"metrics": self.state()["metrics"], "energy": self.energy,
                             "processed": self.n_processed})
        if parts is None:
            return
        self.processed_by_rank = [part["processed"] for part in parts]
        for part in parts[1:]:
            for addr, ms in self.states.items():
                for spec, m in ms:
                    other = spec.cls(**spec.kwargs)
                    other.load_state_dict(part["metrics"][str(addr)][spec.name])
                    m.merge(other)
                if part["energy"][addr].numel():
                    self.add_energy(addr, part["energy"][addr])


def _report(run: _RunState, specs: list[MetricSpec], per_text: bool, massive_share_warning: float,
            context: int) -> tuple[dict, dict, dict, list]:
    """compute() every metric; diagnostics, the massive-dimension warning, summaries and per-text rows."""
    results: dict[str, dict[str, Any]] = {}
    diagnostics: dict[str, dict[str, Any]] = {}
    per_text_cols: dict[int, dict[str, Any]] = {}
    for addr, metric_list in run.states.items():
        key = str(addr)
        results[key] = {}
        for spec, metric in metric_list:
            results[key][spec.name] = metric.compute()
            diag = metric.diagnostics()
            if diag:
                diagnostics.setdefault(key, {})[spec.name] = diag
            pt = metric.per_text_results() if per_text else None
            for score_name, (idx, values) in (pt or {}).items():
                for i, v in zip(idx.tolist(), values.tolist()):
                    per_text_cols.setdefault(i, {}).setdefault(key, {})[score_name] = v
    flagged = []
    for addr, e in run.energy.items():
        if e.numel() == 0 or float(e.sum()) == 0:
            continue
        shares = e / e.sum()
        top = torch.argsort(shares, descending=True)[:3]
        info = {"pooling": "mean", "top_dimensions": top.tolist(),
                "top_shares": [round(float(shares[i]), 6) for i in top]}
        diagnostics.setdefault(str(addr), {})["energy"] = info
        if float(shares[top[0]]) >= massive_share_warning:
            flagged.append((addr, int(top[0]), float(shares[top[0]])))
    if flagged:  # one warning for the whole run, not one line per layer
        warnings.warn(
            f"one hidden dimension carries at least {massive_share_warning:.0%} of the squared norm of the "
            f"mean-pooled vectors at {len(flagged)} address(es): {_compact(flagged)}; cosine-based metrics there "
            "mostly measure that dimension. See the massive_activations metric, or try --preprocess standardize",
            stacklevel=4)
    summary: dict[str, Any] = {}
    for spec in specs:
        across = spec.cls.across_layers({k: results[k][spec.name] for k in results}, list(range(len(results))))
        if across is not None:
            summary[spec.name] = across
    rows = []
    if per_text:
        for i in sorted(run.text_info):
            rid, n_tok = run.text_info[i]
            rows.append({"index": i, "id": rid, "n_tokens": None if n_tok is None else min(n_tok, context),
                         "truncated": None if n_tok is None else n_tok > context,
                         "scores": per_text_cols.get(i, {})})
    return results, diagnostics, summary, rows


def _compact(flagged: list[tuple[Address, int, float]]) -> str:
    """``resid_post:1..27 (dim 507: 53-98%), final (dim 17: 76%)``: runs of consecutive layers of one site with the
    same dominant dimension are merged, so a 30-layer model gives one short line."""
    runs: list[list[tuple[Address, int, float]]] = []
    for item in flagged:
        last = runs[-1][-1] if runs else None
        if (last is not None and item[0].layer is not None and last[0].layer is not None
                and item[0].site == last[0].site and item[0].layer == last[0].layer + 1 and item[1] == last[1]):
            runs[-1].append(item)
        else:
            runs.append([item])
    parts = []
    for run in runs:
        lo, hi = min(r[2] for r in run), max(r[2] for r in run)
        share = f"{lo:.0%}" if len(run) == 1 or round(lo * 100) == round(hi * 100) else f"{lo:.0%}-{hi:.0%}"
        name = str(run[0][0]) if len(run) == 1 else f"{run[0][0]}..{run[-1][0].layer}"
        parts.append(f"{name} (dim {run[0][1]}: {share})")
    return ", ".join(parts)


def _feed(
    addr: Address,
    h: torch.Tensor,
    mask: torch.Tensor,
    batch_items: list[_Item],
    metric_list: list[tuple[MetricSpec, Metric]],
    buffers: dict[tuple[Address, str], _ViewBuffer],
    prep: Preprocessor,
) -> None:
    """Pool one address's batch for each metric (each pooling computed once) and update the metric states."""
    orig = torch.tensor([r for r, it in enumerate(batch_items) if it.view < 0], dtype=torch.long)
    views = torch.tensor([r for r, it in enumerate(batch_items) if it.view >= 0], dtype=torch.long)
    text_index = torch.tensor([it.text for it in batch_items], dtype=torch.long)
    h_dev = orig.to(h.device)
    pooled: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hidden = None
    for spec, metric in metric_list:
        consumes = spec.cls.consumes
        if consumes == Consumes.VIEWS or not len(orig):
            continue
        if consumes == Consumes.TOKENS:
            if hidden is None:
                m = mask[h_dev]
                tokens = h[h_dev].double()
                if prep.active:
                    tokens[m] = prep(str(addr), "tokens", tokens[m])
                hidden = tokens.masked_fill(~m.unsqueeze(-1), 0.0), m
            metric.update(LayerBatch(str(addr), text_index[orig], hidden=hidden[0], mask=hidden[1]))
            continue
        if spec.pooling not in pooled:
            vecs, owner = pool(h[h_dev].double(), mask[h_dev], spec.pooling)  # float64 sums (spec §9.1)
            vecs = prep(str(addr), spec.pooling, vecs)
            pooled[spec.pooling] = vecs.cpu(), text_index[orig][owner.cpu()]
        vecs, index = pooled[spec.pooling]
        metric.update(LayerBatch(str(addr), index, pooled=vecs))
    if not len(views):
        return
    v_dev = views.to(h.device)
    for (buf_addr, method), buffer in buffers.items():
        if buf_addr != addr:
            continue
        vecs, _ = pool(h[v_dev].double(), mask[v_dev], method)
        vecs = prep(str(addr), f"views:{method}", vecs)
        for row, vec in zip(views.tolist(), vecs.cpu()):
            buffer.add(batch_items[row].text, batch_items[row].view, vec)
        done = buffer.pop_complete()
        if done is None:
            continue
        index, stacked = done
        for spec, metric in metric_list:
            if spec.cls.consumes == Consumes.VIEWS and spec.pooling == method:
                metric.update(LayerBatch(str(addr), index, views=stacked[:, : int(metric.n_views)]))


def _one_name_per_tensor(points: dict[Address, HookPoint], model_type: str) -> dict[Address, HookPoint]:
    """Report each captured tensor once: e.g. BERT's ``final`` is ``resid_post:-1``, and ``embed`` is always
    ``resid_pre:0``. The alias (``final``/``embed``) wins; a warning says which names were merged."""
    by_point: dict[HookPoint, list[Address]] = {}
    for addr, point in points.items():
        by_point.setdefault(point, []).append(addr)
    keep: set[Address] = set()
    for point, names in by_point.items():
        chosen = next((a for a in names if a.site in ("final", "embed")), names[0])
        keep.add(chosen)
        others = [str(a) for a in names if a != chosen]
        if others:
            warnings.warn(f"{', '.join(others)} and {chosen} are the same tensor on this {model_type} model; "
                          f"reporting it once, as {chosen}", stacklevel=3)
    return {a: p for a, p in points.items() if a in keep}


def _preprocess_kinds(specs: list[MetricSpec]) -> set[str]:
    kinds = set()
    for spec in specs:
        if spec.cls.consumes == Consumes.TOKENS:
            kinds.add("tokens")
        elif spec.cls.consumes == Consumes.VIEWS:
            kinds.add(f"views:{spec.pooling}")
        else:
            kinds.add(str(spec.pooling))
    return kinds


def _collect_stats(addr: Address, h: torch.Tensor, mask: torch.Tensor, batch_items: list[_Item], kinds: set[str],
                   stats: dict[str, VectorStats], full: bool) -> None:
    """First pass of ``preprocess``: moments of exactly the vectors each kind of metric will see."""
    orig = torch.tensor([r for r, it in enumerate(batch_items) if it.view < 0], dtype=torch.long, device=h.device)
    views = torch.tensor([r for r, it in enumerate(batch_items) if it.view >= 0], dtype=torch.long, device=h.device)
    for kind in kinds:
        rows = views if kind.startswith("views:") else orig
        if not len(rows):
            continue
        if kind == "tokens":
            x = h[rows][mask[rows]]
        else:
            x = pool(h[rows].double(), mask[rows], kind.removeprefix("views:"))[0]
        stats.setdefault(Preprocessor.key(str(addr), kind), VectorStats(full)).update(x)


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None
