"""Evaluate many layers of one model on MTEB tasks, one forward pass per batch for all of them.

For each task: the layers whose results are not cached yet are the sweep's active set; the first layer's
evaluation runs the forward passes that capture every active layer, the others are answered from those vectors.
Each layer is evaluated by ``mteb.evaluate`` with its own :class:`LayerEncoder` (own ``ModelMeta``, own results
folder), on a task whose random state is reset first, so a sweep gives exactly the numbers of single-layer runs.
Requested metrics (:mod:`.metrics`) are fed from the same forward passes; a cached result that lacks one of them,
or holds it with other parameters, is evaluated again.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import mteb
import numpy as np
from mteb.evaluate import OverwriteStrategy
from repgeom_eval.output.progress import progress_bar as tqdm  # bars or log lines: --progress

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.spec.layer_request import LayerRequest
from repgeom_eval.modeling.loading import LoadedModel
from repgeom_eval.measurement.memory import peak_memory

from repgeom_eval.spec.options.model import ModelOptions

from repgeom_eval.spec.options.mteb import SweepConfig
from .embedder import LayerEmbedder
from .encoder import LayerEncoder, LayerSweep
from .geometry import GEOMETRY_KEYS, MASSIVE_KEYS, WARNINGS_KEY, ZERO_KEY, attach_geometry, sweep_warning
from .metrics import SweepMetrics, check_metrics, metric_keys
from .pick import PICK_KEY, pick_layer, role
from .preprocess import PREPROCESS_KEY, file_digest, fit_on_texts, load_stats_file, record, task_texts
from .tasks import load_tasks_file


@dataclass
class SweepResult:
    """What :func:`run_layers` did: one row per (task, layer, split, subset), plus bookkeeping."""

    model: str
    revision: str
    layers: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    forward_passes: int = 0  # embed() calls; 0 when everything came from the cache
    view_sequences: int = 0  # augmented views run through the model for multi-view metrics (all layers at once)
    seconds: float = 0.0
    output_folder: str | None = None
    picks: dict[str, dict[str, Any]] = field(default_factory=dict)  # --layer auto: task → its pick record
    layer_request: list[str] = field(default_factory=list)  # the request as given (REQUEST_KEY, every output's name)
    memory: dict[str, Any] = field(default_factory=dict)  # this process's peaks (measurement/memory.py)


def resolve_tasks(tasks: Sequence[Any] | None = None, *, tasks_file: str | Path | None = None,
                  task_types: Sequence[str] | None = None, categories: Sequence[str] | None = None,
                  languages: Sequence[str] | None = None, benchmarks: Sequence[str] | None = None,
                  eval_splits: Sequence[str] | None = None) -> list:
    """Task instances from names (local tasks of ``tasks_file`` first, then mteb's), benchmarks and filters."""
    local = {t.metadata.name: t for t in load_tasks_file(tasks_file)} if tasks_file else {}
    chosen: list = []
    names: list[str] = []
    for item in tasks or []:
        if isinstance(item, str):
            if item in local:
                chosen.append(local[item])
            else:
                names.append(item)
        else:
            chosen.append(item)  # an mteb task instance (e.g. from make_task)
    if local and not tasks:
        kinds = {k.lower() for k in task_types} if task_types else None
        chosen += [t for t in local.values() if kinds is None or t.metadata.type.lower() in kinds]
    try:
        if names:
            chosen += list(mteb.get_tasks(tasks=names, languages=languages, eval_splits=eval_splits))
        elif not tasks and not local and (task_types or categories or languages):
            chosen += list(mteb.get_tasks(task_types=task_types, categories=categories, languages=languages,
                                          eval_splits=eval_splits))
        for bench in mteb.get_benchmarks(names=list(benchmarks)) if benchmarks else []:
            chosen += list(bench.tasks)
    except (KeyError, ValueError) as exc:
        msg = (str(exc.args[0]) if exc.args else str(exc)).removeprefix("KeyError: ")
        raise RepgeomError(f"cannot select the tasks: {msg}" + (f" (local tasks in {tasks_file}: {', '.join(local)})" if local else "")) \
            from None
    if eval_splits:
        chosen = [t.filter_eval_splits(list(eval_splits)) if t.metadata.name in local else t for t in chosen]
    if not chosen:
        raise RepgeomError("no task selected: name tasks with -t/--tasks, pick --benchmarks or --task-types, or "
                           "define local tasks with --tasks-file")
    unique: dict[str, Any] = {}
    for t in chosen:
        unique.setdefault(t.metadata.name, t)
    return list(unique.values())


def _reseed(task: Any) -> None:
    # mteb tasks draw subsamples and bootstraps from RNGs made once in __init__ (rng_state, np_rng); give every
    # layer the state a fresh instance has, so layer k of a sweep equals a single run of layer k.
    task.rng_state, task.np_rng = random.Random(task.seed), np.random.default_rng(task.seed)


def _status(cache: mteb.ResultCache, task: Any, encoder: LayerEncoder,
            metrics: SweepMetrics | None, pick: str | None = None) -> tuple[str, Any]:
    """("done" | "metrics" | "pick" | "missing", cached result): complete, complete but for requested metrics or
    for this ``--layer auto`` pick record, or not."""
    try:
        existing = cache.load_task_result(task.metadata.name, encoder.mteb_model_meta)
    except Exception:  # noqa: BLE001 - an unreadable cached file: evaluate again
        return "missing", None
    if existing is None or existing.get_missing_evaluations(task):
        return "missing", existing
    if metrics is not None and not all(metrics.satisfied(scores) for split in task.eval_splits
                                       for scores in existing.scores.get(split, [])):
        return "metrics", existing
    if pick is not None and not all(scores.get(PICK_KEY) == pick for split in task.eval_splits
                                    for scores in existing.scores.get(split, [])):
        return "pick", existing
    return "done", existing


def _load(task: Any, num_proc: int | None) -> None:
    try:
        task.load_data(num_proc=num_proc)
    except Exception as exc:  # noqa: BLE001 - datasets/hub errors come in many types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RepgeomError(
            f"cannot load the data of task {task.metadata.name!r} ({type(exc).__name__}: {first}). Built-in MTEB "
            "tasks download their data from the Hugging Face Hub; offline, define local tasks with --tasks-file"
        ) from None


def _rows(result: Any, task: Any, encoder: LayerEncoder) -> list[dict[str, Any]]:
    rows = []
    for split, subsets in result.scores.items():
        for scores in subsets:
            row = {"task": task.metadata.name, "task_type": task.metadata.type, "layer": str(encoder.address),
                   "depth": encoder.depth, "split": split, "subset": scores.get("hf_subset"),
                   "main_score_name": task.metadata.main_score, "main_score": scores.get("main_score")}
            row.update({k: scores.get(k) for k in (*GEOMETRY_KEYS, "repgeom_n_texts", *MASSIVE_KEYS, ZERO_KEY)})
            row[WARNINGS_KEY] = json.loads(scores.get(WARNINGS_KEY) or "[]")
            if scores.get(PICK_KEY):
                row[PICK_KEY] = json.loads(scores[PICK_KEY])
                row["pick_role"] = role(row[PICK_KEY], row["layer"])
            row["preprocess"] = encoder.sweep.embedder.recipe.preprocess
            if PREPROCESS_KEY in scores:
                row[PREPROCESS_KEY] = scores[PREPROCESS_KEY]
            row.update({k: scores[k] for k in metric_keys(scores)})
            rows.append(row)
    return rows


def run_layers(
    model: str | LoadedModel | LayerEmbedder,
    tasks: Sequence[Any],
    config: SweepConfig | str | int | LayerRequest | Sequence[str | int] | None = None,
    /,
    *,
    tokenizer: Any = None,
    host: Any = None,
    model_options: ModelOptions | None = None,
    **options: Any,
) -> SweepResult:
    """Evaluate ``model`` at every address of ``layers`` on ``tasks`` (instances, or names for
    :func:`resolve_tasks`), with ``repgeom_*`` geometry next to each score, cached in ``output_folder`` (mteb's
    cache layout; ``None`` = no cache). ``model`` may also be a model in memory (a ``SentenceTransformer``, or a
    transformers model with its ``tokenizer``); a name is loaded with ``model_options`` (revision, remote code, device
    map ...; ``dtype`` and ``device`` of the sweep win).

    The options are a :class:`~repgeom_eval.spec.options.mteb.SweepConfig`, given whole as ``config`` or as
    keywords (``pooling="mean"``, ``batch_size=8``, ...); a layer request in its place is its ``layers``
    (``run_layers(model, tasks, "all", pooling="mean")``).

    ``metrics``: registered metric names computed at every layer from the sweep's forward passes and written next to
    each score as ``repgeom.<metric>[.<sub>]`` (:mod:`repgeom_eval.mteb_layers.metrics`); ``metric_params``:
    ``{metric: {parameter: value}}`` (``pooling`` included; the default pooling is the embedding recipe's);
    ``seed``: seed of the augmented views of multi-view metrics.

    ``preprocess`` (``none``, ``center``, ``standardize``, ``whiten``) transforms each layer's pooled vectors before
    unit normalisation, with :mod:`repgeom_eval.measurement.preprocess`; its statistics come from
    ``preprocess_stats`` (a ``repgeom measure --save-preprocess-stats`` file) or else from the task's own texts
    (:mod:`repgeom_eval.mteb_layers.preprocess`); a file written on another model is refused unless
    ``allow_other_stats`` (then recorded in ``repgeom_preprocess``).

    ``layers="auto"``: for each task, one forward pass over every text its evaluation embeds scores every hidden
    state with the label-free rule ``layer_pick`` (default ``min_dataset_entropy``; ``layer_pick_params`` its
    parameters), and the chosen layer and ``final`` are evaluated; ``repgeom_layer_pick`` (every score dict, each
    row, and ``SweepResult.picks``) records the choice, the rule and every layer's score (docs/picks.md).
    ``host``: the plugin host that provides the rules and the model's architecture (default: the process's)."""
    t_start = time.perf_counter()
    if config is not None and not isinstance(config, SweepConfig):
        options, config = {"layers": config, **options}, None
    cfg = SweepConfig.build(config, options)  # every option checked once, before anything loads
    strategy = OverwriteStrategy.from_str(cfg.overwrite_strategy)
    metric_names = check_metrics(cfg.metrics or (), cfg.metric_params)  # unknown names fail before the model loads
    rule = None
    request = cfg.layers
    if request.auto:
        from repgeom_eval.spec.layer_pick import make_pick

        rule = make_pick(cfg.layer_pick, cfg.layer_pick_params, host)  # an unknown rule or parameter: before loading
    task_list = [t for t in tasks if not isinstance(t, str)] + (
        resolve_tasks([t for t in tasks if isinstance(t, str)]) if any(isinstance(t, str) for t in tasks) else [])
    embedder = model if isinstance(model, LayerEmbedder) else LayerEmbedder(
        model, pooling=cfg.pooling, normalize=cfg.normalize, max_length=cfg.max_length, dtype=cfg.dtype,
        device=cfg.device, tokenizer=tokenizer, host=host, model_options=model_options)
    addresses = embedder.addresses("all" if rule is not None else request)
    file_prep, file_sha = None, None
    if cfg.preprocess != "none" and cfg.preprocess_stats:
        file_prep = load_stats_file(cfg.preprocess_stats, cfg.preprocess, embedder, addresses, cfg.allow_other_stats)
        file_sha = file_digest(cfg.preprocess_stats)
    embedder.recipe = dataclasses.replace(
        embedder.recipe, preprocess=cfg.preprocess,
        preprocess_stats=None if cfg.preprocess == "none" else f"file-{file_sha[:16]}" if file_sha else "task")
    sweep_metrics = SweepMetrics(metric_names, addresses, params=cfg.metric_params, pooling=embedder.recipe.pooling,
                                 seed=cfg.seed) if metric_names else None
    if sweep_metrics is not None:
        sweep_metrics.progress = cfg.progress
    sweep = LayerSweep(embedder, addresses, progress=cfg.progress, metrics=sweep_metrics)
    if file_prep is not None:
        sweep.prep = file_prep
        sweep.prep_record = record(cfg.preprocess, "file", file=str(cfg.preprocess_stats), sha256=file_sha,
                                   pooling=embedder.recipe.pooling,
                                   accepted_from_other_model=file_prep.accepted_from_other_model)
    encoders = {a: sweep.encoder(a, name=cfg.name, revision=cfg.revision) for a in addresses}
    first = encoders[addresses[0]]
    cache = mteb.ResultCache(cfg.output_folder) if cfg.output_folder is not None else None
    out = SweepResult(model=first.name, revision=first.revision, layers=[str(a) for a in addresses],
                      output_folder=str(cfg.output_folder) if cfg.output_folder is not None else None,
                      layer_request=request.record())
    encode_kwargs = {"batch_size": cfg.batch_size, "show_progress_bar": False}
    bar = tqdm(total=len(task_list) * (len(addresses) if rule is None else 2), unit="layer", desc="mteb",
               disable=not cfg.progress)
    datasets_bars = not datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()  # one bar per row of mteb's preprocessing is noise; ours says enough
    try:
        for task in task_list:
            attach_geometry(task)
            task_addresses, pick, picked, loaded_here = addresses, None, None, False
            if rule is not None:  # --layer auto: the pick needs the task's texts, whatever the cache holds
                loaded_here = not task.data_loaded
                if loaded_here:
                    bar.set_description(f"{task.metadata.name} · loading data")
                    _load(task, cfg.num_proc)
                bar.set_description(f"{task.metadata.name} · layer pick")
                _reseed(task)
                texts = task_texts(task, first.mteb_model_meta, embedder, encode_kwargs)
                picked = pick_layer(embedder, rule, texts, cfg.batch_size, progress=cfg.progress, host=host,
                                    texts_note="every distinct text the task's evaluation embeds (all evaluated "
                                               "splits)")
                sweep.forward_passes += 1
                task_addresses = list(dict.fromkeys([picked.chosen, addresses[-1]]))  # the pick, then final
                pick = sweep.pick_records[task.metadata.name] = picked.record
                out.picks[task.metadata.name] = json.loads(pick)
            status = {a: _status(cache, task, encoders[a], sweep_metrics, pick) if cache is not None
                      else ("missing", None) for a in task_addresses} if strategy != OverwriteStrategy.ALWAYS else {}
            rerun: set = set()  # cached but for requested metrics: evaluated again, other cached metrics kept
            if strategy == OverwriteStrategy.ALWAYS or cache is None:
                todo = list(task_addresses)
            elif strategy == OverwriteStrategy.ONLY_CACHE:
                todo = []
            elif strategy == OverwriteStrategy.NEVER:
                todo = [a for a in task_addresses if status[a][0] == "missing"]
            else:
                todo = [a for a in task_addresses if status[a][0] != "done"]
                rerun = {a for a in todo if status[a][0] in ("metrics", "pick")}
            for a in rerun:
                if status[a][0] == "metrics":
                    sweep_metrics.carry(task.metadata.name, a, status[a][1])  # type: ignore[union-attr]
            loaded_here = loaded_here or (bool(todo) and not task.data_loaded
                                          and strategy != OverwriteStrategy.ONLY_CACHE)
            if loaded_here:
                bar.set_description(f"{task.metadata.name} · loading data")
                _load(task, cfg.num_proc)
            sweep.active = list(todo)
            if picked is not None and cfg.preprocess == "none":  # the pick's pass answers the evaluations
                sweep.set_pooled(texts, {a: picked.pooled[a] for a in task_addresses})
            if cfg.preprocess != "none" and file_prep is None:
                sweep.prep = sweep.prep_record = None
                if todo:  # statistics from the task's own texts: a dry run lists them, one pass embeds them
                    bar.set_description(f"{task.metadata.name} · preprocess statistics")
                    _reseed(task)
                    texts = task_texts(task, first.mteb_model_meta, embedder, encode_kwargs)
                    sweep.prep, pooled = fit_on_texts(embedder, texts, todo, cfg.preprocess, cfg.batch_size,
                                                      cfg.progress)
                    sweep.forward_passes += 1
                    sweep.set_pooled(texts, pooled)
                    sweep.prep_record = record(cfg.preprocess, "task", n_texts=len(texts),
                                               pooling=embedder.recipe.pooling)
            sweep.said = []
            try:
                for addr in task_addresses:
                    bar.set_description(f"{task.metadata.name} · {addr}" + ("" if addr in todo else " (cached)"))
                    _reseed(task)
                    try:
                        result = mteb.evaluate(
                            encoders[addr], task, cache=cache,
                            overwrite_strategy=OverwriteStrategy.ALWAYS if addr in rerun else strategy,
                            encode_kwargs=dict(encode_kwargs), show_progress_bar=False, co2_tracker=cfg.co2_tracker,
                            prediction_folder=layer_predictions(cfg.prediction_folder, encoders[addr]),
                            num_proc=cfg.num_proc)
                    except ValueError as exc:  # mteb's refusals (only-cache / never with missing results)
                        raise RepgeomError(f"{task.metadata.name} at {addr}: {exc}") from None
                    except OSError as exc:  # a full disk or a read-only cache while mteb writes its results
                        from repgeom_eval.output.files import write_error

                        where = exc.filename or cfg.output_folder or cfg.prediction_folder or "the mteb cache"
                        clean = write_error(where, exc)
                        if clean is None:
                            raise
                        raise RepgeomError(f"{task.metadata.name} at {addr}: {clean}; free space or pass another "
                                           "--output-folder") from None
                    sweep.release(addr)
                    for task_result in result.task_results:
                        rows = _rows(task_result, task, encoders[addr])
                        out.rows += rows
                        if rows and rows[0]["main_score"] is not None:
                            bar.set_postfix_str(f"{task.metadata.main_score}={rows[0]['main_score']:.4f}")
                    bar.update(1)
            finally:
                message = sweep_warning(first.name, sweep.said)
                if message:  # degenerate numbers of this task's layers, said once (as repgeom measure says them)
                    warnings.warn(message, stacklevel=2)
                sweep.said = None
                sweep.clear()
                if loaded_here and task.data_loaded:
                    task.unload_data()
    finally:
        bar.close()
        if datasets_bars:
            datasets.utils.enable_progress_bars()
    if rule is not None:
        evaluated = {r["layer"] for r in out.rows}
        out.layers = [str(a) for a in addresses if str(a) in evaluated]
    out.forward_passes = sweep.forward_passes
    out.view_sequences = sweep_metrics.view_sequences if sweep_metrics is not None else 0
    out.seconds = time.perf_counter() - t_start
    out.memory = peak_memory(embedder.loaded.device)
    return out


def layer_predictions(folder: str | Path | None, encoder: Any) -> Path | None:
    """The prediction folder of one layer: ``folder/<model name as mteb writes it in paths>`` (the layer and recipe
    are in the name). mteb names a prediction file after the task only, so one folder for every layer would keep
    the last layer's predictions alone."""
    if folder is None:
        return None
    return Path(folder) / encoder.mteb_model_meta.model_name_as_path()
