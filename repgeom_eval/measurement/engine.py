"""``measure``: the measurement engine, top to bottom.

plan (config, metrics, model, layers, checkpoint) → forward (one pass per batch, every address) → feed states →
merge (processes) → report. Each step lives in its own module of this package:

* :mod:`.config`        the run's options (:class:`RunConfig`), its resume key and ``config`` block
* :mod:`.metric_specs`  the requested metrics, looked up and checked
* :mod:`repgeom_eval.modeling.addresses`  the layer request → canonical addresses and hook points
* :mod:`.plan`          a shard of texts → batches (originals and augmented views)
* :mod:`.forward`       model inputs, hooks, one forward pass per batch, non-finite check
* :mod:`.feed`          pooling, preprocessing, metric-state updates
* :mod:`.states`        what a run accumulates; checkpoints and the merge across processes
* :mod:`.results`       compute, diagnostics, per-text rows, the results file
"""

from __future__ import annotations

import functools
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from repgeom_eval.output.progress import progress_bar

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.measurement.checkpoint import RunDir, file_fingerprint, model_identity
from repgeom_eval.measurement.device_timer import DeviceTimer
from repgeom_eval.spec.options.measure import RunConfig
from repgeom_eval.measurement.distributed import Distributed
from repgeom_eval.measurement.feed import Feeder, StatsCollector, feed_threads, streams_addresses
from repgeom_eval.measurement.forward import Forward, context_length
from repgeom_eval.measurement.memory import memory_used
from repgeom_eval.measurement.metric_specs import MetricSpec, instantiate_metrics, isolate_third_party
from repgeom_eval.measurement.oom import out_of_memory
from repgeom_eval.measurement.plan import ShardPlan, plan_shard
from repgeom_eval.measurement.preprocess import Preprocessor
from repgeom_eval.measurement.results import MeasureResult, kept_warnings, report
from repgeom_eval.measurement.states import RunState, energy_metric, shard_counts
from repgeom_eval.measurement.texts import TextSet, TextSource, open_source
from repgeom_eval.spec.metric import Consumes
from repgeom_eval.modeling.addresses import resolve_request
from repgeom_eval.modeling.in_memory import as_loaded
from repgeom_eval.modeling.loading import LoadedModel, load_model
from repgeom_eval.output.versions import versions
from repgeom_eval.plugin_system.host import PluginHost, get_host

__all__ = ["MeasureResult", "RunConfig", "measure"]


def measure(
    model: Any,
    data: str | Path | Sequence[str] | TextSet | TextSource,
    config: RunConfig | None = None,
    *,
    host: PluginHost | None = None,
    tokenizer: Any = None,
    model_options: Any = None,
    **options: Any,
) -> MeasureResult:
    """Measure ``metrics`` at every address in ``layers`` over ``data`` with one forward pass per batch.

    ``model`` is a hub id, a local directory or a ``.gguf`` file (loaded with ``model_options``, a
    :class:`~repgeom_eval.spec.options.model.ModelOptions`: revision, PEFT adapter, device map ...), an already loaded
    :class:`LoadedModel`, or a model in memory: a transformers model (give its ``tokenizer``), a PEFT model or a
    ``SentenceTransformer``;
    ``data`` is a ``.jsonl``/``.txt`` path, an ``hf:NAME?split=...`` dataset stream, a list of strings or a
    :class:`TextSet`. The options are a :class:`~repgeom_eval.spec.options.measure.RunConfig`, given whole as
    ``config`` or as keywords (``layers="all"``, ``metrics=["dispersion"]``, ``pooling``, ``batch_size``,
    ``max_length``, ``padding_side``, ``dtype``, ``device``, ``per_text``, ``metric_params``, ``text_field``,
    ``seed``, ``preprocess``, ``preprocess_stats``, ``save_preprocess_stats``, ``massive_share_warning``,
    ``shard_size``, ``run_dir``, ``resume``, ``progress``); see that class for each one's meaning and default.

    ``pooling`` overrides every metric's default pooling (``None``: each metric's own, e.g. ``last`` for
    dispersion). ``seed`` drives the augmented views of the multi-view metrics, which run in the same forward passes
    as the originals. ``preprocess`` (``none``, ``center``, ``standardize``, ``whiten``) transforms every vector a
    metric sees, with statistics from ``preprocess_stats`` (a file written through ``save_preprocess_stats``) or,
    if none is given, from the same data in an extra forward pass. A warning names each address where one hidden
    dimension carries at least ``massive_share_warning`` of the squared norm of the mean-pooled vectors.

    Texts are read and processed ``shard_size`` at a time (memory: one shard plus the metric states). With
    ``run_dir`` the states are checkpointed after every shard, and ``resume=True`` continues a killed run. Under
    ``torchrun``/``accelerate launch`` the batches of each shard are spread over the processes and the states are
    merged on rank 0, which alone gets the results (other ranks get ``results == {}``).
    """
    if config is None:
        config = RunConfig(**options)
    elif options:
        raise RepgeomError(f"give the options either as a RunConfig or as keywords, not both ({sorted(options)})")
    t_start = time.perf_counter()
    host = host or get_host()
    kept: list[str] = []  # every warning of the run, from the choice of pooling on, goes into the results file
    dist = None
    try:
        with kept_warnings(kept):
            config = _with_model_pooling(config, model)
            specs = instantiate_metrics(config.metrics, host, config.metric_params, config.per_text, config.pooling)
            isolate_third_party(specs)  # a plugin metric that raises is dropped, the others go on
            prep = Preprocessor()
            if config.preprocess_stats and config.preprocess != "none":
                prep = Preprocessor.load(config.preprocess_stats, config.preprocess)
            source = open_source(data, text_field=config.text_field)  # a file validated whole before the model loads
            dist = Distributed.from_env(config.device)
            result = _measure_loaded(model, tokenizer, model_options, config, host, source, dist, specs, prep,
                                     t_start)
        result.warnings = kept
        return result
    finally:
        if dist is not None:
            dist.close(clean=sys.exc_info()[0] is None)


def _with_model_pooling(config: RunConfig, model: Any) -> RunConfig:
    """A sentence-transformers model (a folder or a ``SentenceTransformer`` object) is measured with its own pooling
    unless ``pooling`` is given, as the MTEB encoder reads it (its Normalize module changes no cosine; see
    docs/metrics.md#pooling)."""
    from dataclasses import replace

    from repgeom_eval.modeling.st_config import st_config_for, st_config_of

    if config.pooling is not None or isinstance(model, LoadedModel):
        return config
    st = st_config_for(str(model)) if isinstance(model, (str, Path)) and Path(str(model)).is_dir() \
        else st_config_of(model)
    if st is None:
        return config
    warnings.warn(f"pooling {st.pooling!r}: the sentence-transformers model's own (its Pooling module); --pooling "
                  "sets another", stacklevel=3)
    return replace(config, pooling=st.pooling)


def _measure_loaded(model, tokenizer, model_options, config, host, source, dist, specs, prep, t_start):
    """Load ``model`` (unless loaded) and run :class:`MeasureRun` (the body of :func:`measure`)."""
    t0 = time.perf_counter()
    if isinstance(model, (str, Path)):
        from repgeom_eval.spec.options.model import ModelOptions

        opts = (model_options or ModelOptions()).replace(dtype=config.dtype, device=dist.device(config.device))
        loaded = load_model(str(model), host=host, options=opts)
    else:
        loaded = as_loaded(model, tokenizer, host=host)
    run = MeasureRun(config, loaded, source, dist, host, specs, prep, t_load=time.perf_counter() - t0)
    return run.execute(t_start)


class MeasureRun:
    """One ``measure`` run on one process: the plan, the passes over the data, and the report."""

    def __init__(self, config: RunConfig, loaded: LoadedModel, source: TextSource, dist: Distributed,
                 host: PluginHost, specs: list[MetricSpec], prep: Preprocessor, t_load: float):
        self.config, self.loaded, self.source, self.dist, self.specs, self.prep, self.host = (
            config, loaded, source, dist, specs, prep, host)
        self.plan = resolve_request(config.layers, loaded, host)
        if config.preprocess_stats and prep.active:
            prep.check_identity(self.model_identity, loaded.info.name, config.allow_other_stats)
        # where each metric comes from (plugin, distribution, version): recorded in the config, part of the resume key
        self.plugins = host.provenance("metric", [spec.name for spec in specs])
        self.addresses = list(self.plan.addresses)
        self.context = context_length(loaded, config.max_length)
        self.state = RunState(self.addresses, specs, config.per_text, self.context, energy_metric(host))
        self.n_views = max([int(m.n_views) for spec, m in self.state.first_metrics()  # type: ignore[attr-defined]
                            if spec.consumes == Consumes.VIEWS] or [0])
        self.need_originals = any(spec.consumes != Consumes.VIEWS for spec in specs)
        self.augmenter = None
        if self.n_views:
            from repgeom_eval.measurement.augment import Augmenter

            self.augmenter = Augmenter(seed=config.seed)
        self.timer = {"load_model": t_load, "forward": 0.0, "metrics": 0.0, "augment_tokenize": 0.0,
                      "preprocess_stats": 0.0}
        self.device_timer = DeviceTimer.for_model(loaded)  # one GPU: its own split of the loop (queued, unwaited)
        self.processed = 0  # sequences this process ran through the model in the current pass
        self._pool = None  # threads of the metric work (see _feed_addresses), made on first use
        self._feed_workers = self._metric_threads(host)
        self.checkpoint = self._open_checkpoint()

    @functools.cached_property
    def model_identity(self) -> str:
        """The model's content hash, which keys the checkpoint and statistics files: read the first time one of them
        asks (hashing the weights costs a read of every file, which a plain run does not need)."""
        return model_identity(self.loaded)

    def _stats_identity(self) -> dict[str, Any]:
        """What this run's preprocessing statistics come from (written into --save-preprocess-stats files)."""
        return {"model": self.model_identity, "model_name": self.loaded.info.name,
                "addresses": [str(a) for a in self.addresses],
                "poolings": sorted({k.rpartition("|")[2] for k in self.prep.transforms}),
                "data": self.source.fingerprint, "method": self.config.preprocess}

    def _metric_threads(self, host: PluginHost) -> int:
        """How many threads the metric work of a batch may use (1: sequential; see :meth:`_feed_addresses`)."""
        from repgeom_eval.plugin_system.host import BUILTIN_DISTRIBUTION

        energy = energy_metric(host)
        builtin = all(spec.distribution == BUILTIN_DISTRIBUTION for spec in self.specs) and (
            energy is None or energy.__module__.startswith("repgeom_eval."))
        return feed_threads(self.loaded.device.type, builtin)

    # -- plan ----------------------------------------------------------------------------------------------------------
    def _open_checkpoint(self) -> RunDir | None:
        cfg, loaded, dist = self.config, self.loaded, self.dist
        if not cfg.run_dir:
            return None
        # The content of every input, never its path: a moved file resumes, an edited one is refused.
        key = cfg.checkpoint_key({
            "model": self.model_identity, "data": self.source.fingerprint,
            "preprocess_stats": "sha256:" + file_fingerprint(Path(cfg.preprocess_stats)) if cfg.preprocess_stats
            else None,
            "addresses": [str(a) for a in self.addresses], "metrics": self.state.metric_configs(),
            "plugins": self.host.state_identity("metric", [spec.name for spec in self.specs]),
            "max_length": self.context, "dtype": loaded.info.dtype, "world_size": dist.world})
        ckpt = RunDir(cfg.run_dir, key, dist.rank, dist.world, cfg.resume, dist.is_main)
        dist.barrier()  # rank 0 has created the directory
        saved = ckpt.load()
        if saved is not None:
            try:
                self.state.load(saved, cfg.shard_size, self.source.n_texts,
                                {a: loaded.layout.width(a) for a in self.addresses})
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                raise RepgeomError(f"checkpoint {ckpt.state_file} does not fit this run ({type(exc).__name__}: "
                                   f"{str(exc)[:160]}); delete the run directory to start over") from None
            if self.state.prep_transforms is not None:
                self.prep = Preprocessor(cfg.preprocess, self.state.prep_transforms, "same data (checkpoint)")
                self.prep.identity = self._stats_identity()
        return ckpt

    def _plan(self, shard: list) -> ShardPlan:
        t0 = time.perf_counter()
        sp = plan_shard(shard, self.loaded.tokenizer, self.config.batch_size, self.n_views, self.need_originals,
                        self.augmenter, self.context)
        self.timer["augment_tokenize"] += time.perf_counter() - t0
        return sp

    # -- forward ---------------------------------------------------------------------------------------------------------
    def _passes(self, desc: str, sink: Any, start_shard: int) -> None:
        """One forward per owned batch of every shard from ``start_shard`` on; ``sink.batch(...)`` reads each
        address's tensor, ``sink.shard_done(...)`` (if present) runs after each shard."""
        cfg, dist = self.config, self.dist
        per_item = (1 if self.need_originals else 0) + self.n_views
        n = self.source.n_texts
        expected = None if n is None else -(-n * per_item // dist.world)
        with Forward(self.loaded, self.plan.points) as fwd, progress_bar(
            total=expected, unit="seq", desc=desc, progress=cfg.progress, disable=not dist.is_main
        ) as bar:
            recount = [0, 0, 0, 0]
            owned = 0  # original texts of the done shards that this process ran (what its states must hold)
            for shard_no, shard in enumerate(self.source.shards(cfg.shard_size)):
                if shard_no < start_shard:  # done before the checkpoint: no forward pass, only recounted
                    sp = self._plan(shard)
                    recount = [a + b for a, b in zip(recount, shard_counts(sp, self.context))]
                    owned += sum(sp.items[i].view < 0 for u, unit in enumerate(sp.units) if dist.owns(u)
                                 for i in unit)
                    continue
                if shard_no == start_shard and start_shard and hasattr(sink, "shard_done"):
                    self._check_resumed_counts(recount, owned if self.need_originals else None)
                    recount = []
                sp = self._plan(shard)
                for u, unit in enumerate(sp.units):
                    if not dist.owns(u):
                        continue
                    for start in range(0, len(unit), cfg.batch_size):
                        rows = unit[start:start + cfg.batch_size]
                        self._forward_batch(fwd, sp, rows, sink)
                        self.processed += len(rows)
                        bar.update(len(rows))
                if hasattr(sink, "shard_done"):
                    fwd.check()  # nothing a NaN reached is checkpointed
                    sink.shard_done(shard_no, sp)
            if start_shard and recount and hasattr(sink, "shard_done"):  # a finished run: every shard was skipped
                self._check_resumed_counts(recount, owned if self.need_originals else None)

    def _check_resumed_counts(self, recount: list[int], owned: int | None) -> None:
        try:
            where = f"checkpoint {self.checkpoint.state_file if self.checkpoint else ''}"
            self.state.check_counts(recount, where)
            if owned is not None:
                self.state.check_vectors(owned, where)
        except ValueError as exc:
            raise RepgeomError(f"{exc}; delete the run directory to start over") from None

    def _forward_batch(self, fwd: Forward, sp: ShardPlan, rows: list[int], sink: Any) -> None:
        t0 = time.perf_counter()
        items = [sp.items[i] for i in rows]
        self.device_timer.mark(None)
        consume, fed = None, [0.0]
        tokens = min(self.context, max(sp.lengths[i] for i in rows))  # the batch's padded length
        one_address = len(rows) * tokens * (self.loaded.info.hidden_size or 0) * 4  # in float32
        if streams_addresses(self._feed_workers, len(self.addresses), one_address):
            # each address fed as the pass reaches it, one held at a time (docs/how-to/large-models.md#memory-before-it-starts)
            def consume(addr, h, mask, host_mask):
                t = time.perf_counter()
                self.device_timer.mark("forward")
                with out_of_memory("metric update", self, len(rows)):
                    sink.batch(addr, h, mask, items, host_mask)
                self.device_timer.mark("metrics")
                fed[0] += time.perf_counter() - t

        with out_of_memory("forward pass", self, len(rows)):
            batch = fwd.texts([sp.strings[i] for i in rows], self.context, self.config.padding_side,
                              row_ids=[sp.ids[it.text] for it in items], consume=consume)
        self.timer["forward"] += time.perf_counter() - t0 - fed[0]
        self.timer["metrics"] += fed[0]
        self.device_timer.mark("forward")
        if consume is None:
            t0 = time.perf_counter()
            with out_of_memory("metric update", self, len(rows)):
                self._feed_addresses(batch, items, sink)
            self.timer["metrics"] += time.perf_counter() - t0
            self.device_timer.mark("metrics")

    def _feed_addresses(self, batch: Any, items: list, sink: Any) -> None:
        """Every address's metric work of one batch, after its pass (only where the addresses are fed in threads;
        otherwise :meth:`_forward_batch` feeds each during the pass).

        On the CPU, with several intra-op threads and only built-in metrics (whose states are per address and
        touch nothing shared), the addresses are spread over that many Python threads, each running torch on one
        thread. The metric work is many medium-sized operations and serial LAPACK calls that gain little from
        intra-op threads while paying for their synchronisation; one address per thread uses the cores fully
        (SmolLM2, 31 addresses, 2 cores: about half the wall time and less CPU time than one address at a time on
        2 threads). Each address computes exactly what it computes alone. The first address runs first, in this
        thread, so that the per-batch layout the others share is built once. Third-party metrics keep the
        sequential path: nothing promises that their code may run concurrently for different addresses."""
        addresses, workers = self.addresses, self._feed_workers
        import torch
        from concurrent.futures import ThreadPoolExecutor

        sink.batch(addresses[0], batch.hidden[addresses[0]], batch.mask, items, batch.host_mask)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(workers, thread_name_prefix="repgeom-metrics")
        torch.set_num_threads(1)
        try:
            def one(a):
                return sink.batch(a, batch.hidden[a], batch.mask, items, batch.host_mask)

            for _ in self._pool.map(one, addresses[1:]):
                pass
        finally:
            torch.set_num_threads(workers)

    # -- the passes --------------------------------------------------------------------------------------------------------
    def execute(self, t_start: float) -> MeasureResult:
        cfg = self.config
        try:
            if cfg.preprocess != "none" and not cfg.preprocess_stats and not self.prep.active:
                self._preprocess_statistics()
            if cfg.save_preprocess_stats and self.prep.active and self.dist.is_main:
                self.prep.save(cfg.save_preprocess_stats)
            self._passes("measure", _MeasureSink(self), self.state.next_shard)
        finally:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None
        counts = self.source.counts()
        if self.checkpoint is not None:
            self.state.complete = True
            self.checkpoint.save(self.state.state(copy=False))
        return self._finish(counts, t_start)

    def _preprocess_statistics(self) -> None:
        """The extra pass of ``preprocess`` without a statistics file: moments over the same data, all ranks."""
        t0 = time.perf_counter()
        collector = StatsCollector(self.specs, self.config.preprocess == "whiten")
        self._passes("preprocess statistics", _StatsSink(collector), 0)
        merged: dict = {}
        for part in self.dist.all_gather(collector.stats):
            for k, st in part.items():
                merged[k] = merged[k].merge(st) if k in merged else st
        self.prep = Preprocessor.from_stats(self.config.preprocess, merged, "same data")
        self.prep.identity = self._stats_identity()
        self.state.prep_transforms = self.prep.transforms
        self.timer["forward"] = self.timer["metrics"] = self.processed = 0
        self.device_timer.reset()
        self.timer["preprocess_stats"] = time.perf_counter() - t0

    # -- merge and report ------------------------------------------------------------------------------------------------
    def _finish(self, counts: dict[str, Any], t_start: float) -> MeasureResult:
        cfg, dist, state = self.config, self.dist, self.state
        t0 = time.perf_counter()
        state.merge_ranks(dist)
        if state.n_empty and dist.is_main:
            warnings.warn(f"{state.n_empty} text(s) tokenize to no tokens and are skipped (ids: {state.empty_ids})",
                          stacklevel=3)
        n_usable = counts["n_texts"] - state.n_empty
        if n_usable < 2:
            raise RepgeomError(f"only {n_usable} text(s) have any tokens; at least 2 are needed")
        if state.n_truncated and dist.is_main:
            warnings.warn(f"{state.n_truncated} of {counts['n_texts']} texts are longer than {self.context} tokens "
                          "and were truncated (set --max-length to change the limit)", stacklevel=5)
        rep = (report(state, self.specs, cfg.per_text, cfg.massive_share_warning, self.loaded.info.name)
               if dist.is_main else None)
        t_metrics = self.timer["metrics"] + time.perf_counter() - t0
        config = cfg.config_block({
            "layers": [str(a) for a in self.addresses], "layers_reported_as": dict(self.plan.reported_as),
            "metrics": state.metric_configs(), "plugins": self.plugins,
            "max_length": self.context, "dtype": self.loaded.info.dtype, "device": str(self.loaded.device),
            "resumed_from_shard": state.resumed_from,
            "distributed": dist.config() | {"sequences_by_rank": state.processed_by_rank},
            "augmentation": self.augmenter.config() | {"n_views": self.n_views} if self.augmenter else None,
            "preprocess": self.prep.config(), "versions": versions()})
        data_summary = counts | {"n_tokens": state.n_tokens, "n_truncated": state.n_truncated,
                                 "n_views_per_text": self.n_views, "n_skipped_no_tokens": state.n_empty}
        t = self.timer
        timings = {"load_model_s": t["load_model"],
                   **{f"load_model_{k}": v for k, v in getattr(self.loaded, "timings", {}).items()},
                   "augment_tokenize_s": t["augment_tokenize"],
                   "preprocess_stats_s": t["preprocess_stats"], "forward_s": t["forward"], "metrics_s": t_metrics,
                   "total_s": time.perf_counter() - t_start, "compute_s": t_metrics - t["metrics"],
                   "sequences_per_s": state.n_sequences / max(t["forward"] + t["metrics"], 1e-9),
                   **{f"{k}_device_s": v for k, v in self.device_timer.seconds().items()},
                   **memory_used(state, self.loaded.device)}
        if rep is None:
            return MeasureResult(self.loaded.info.to_dict(), data_summary, config, {}, {}, timings, [], {},
                                 is_main=False)
        failed = {spec.name: spec.failure for spec in self.specs if spec.failure is not None}
        return MeasureResult(self.loaded.info.to_dict(), data_summary, config, rep.results, rep.diagnostics,
                             timings, rep.per_text, rep.summary, is_main=True, failed_metrics=failed)


class _MeasureSink:
    """The measuring pass: energy diagnostic and metric states of every address, a checkpoint after each shard."""

    def __init__(self, run: MeasureRun):
        self.run = run
        self.feeder = Feeder(run.specs, run.n_views, run.prep, run.config.state_device)

    def batch(self, addr, h, mask, items, host_mask=None) -> None:
        state = self.run.state
        # the energy diagnostic reads the same raw mean-pooled vectors as mean-pooling metrics: pooled once
        self.feeder.feed(addr, h, mask, items, state.states[addr], energy=state.energy.get(addr),
                         host_mask=host_mask)

    def shard_done(self, shard_no: int, sp: ShardPlan) -> None:
        if self.feeder.pending_views():
            raise RuntimeError("some augmented views never arrived")  # a planning bug, never a user error
        run = self.run
        run.state.count_shard(shard_no, sp)
        run.state.n_processed += run.processed
        run.processed = 0
        if run.checkpoint is not None:
            run.checkpoint.save(run.state.state(copy=False))


class _StatsSink:
    def __init__(self, collector: StatsCollector):
        self.collector = collector

    def batch(self, addr, h, mask, items, host_mask=None) -> None:
        self.collector.feed(addr, h, mask, items)
