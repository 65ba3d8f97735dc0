"""``repgeom mteb``: MTEB scores at any layer (``run``) and per-layer tables and plots from the cache (``summary``)."""

from __future__ import annotations

import argparse

from repgeom_eval.spec.options.mteb import MtebExampleTasksCommand, MtebRunCommand, MtebSummaryCommand, split_words

def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="mteb_command", metavar="SUBCOMMAND")
    run = sub.add_parser("run", help="evaluate a model at one or many layers on MTEB tasks",
                         description="Evaluate a model at one or many layer addresses on MTEB tasks. A sweep "
                                     "(--layer all, or several layers) runs one forward pass per batch for every "
                                     "layer. Geometry (repgeom_* keys) is written next to each score; results are "
                                     "cached in mteb's layout under --output-folder, one folder per layer.")
    MtebRunCommand.add_arguments(run)
    summary = sub.add_parser("summary", help="per-layer tables (CSV, Markdown) and plots from an mteb cache folder",
                             description="Read every layer result under FOLDER and write a CSV (one row per model, "
                                         "layer, task, split and subset), a Markdown report (layers × main score "
                                         "and geometry, best layer against the last) and one plot per model.")
    MtebSummaryCommand.add_arguments(summary)
    examples = sub.add_parser("example-tasks", help="write local example tasks (all four types) from text on this "
                                                    "machine, for offline runs",
                              description="Write JSONL files and a tasks.yaml for --tasks-file: topic "
                                          "classification, topic clustering, graded STS and retrieval, generated "
                                          "from Python's documentation (pydoc) or the Debian fortunes package.")
    MtebExampleTasksCommand.add_arguments(examples)
    p.set_defaults(_mteb_parser=p)


def run(args: argparse.Namespace) -> int:
    if args.mteb_command is None:
        args._mteb_parser.print_help()
        return 0
    cfg = args._options_class.from_args(args)
    if args.mteb_command == "summary":
        return _summary(cfg)
    if args.mteb_command == "example-tasks":
        from repgeom_eval.mteb_layers.examples import write_example_tasks

        path = write_example_tasks(cfg.folder, source=cfg.source, size=cfg.size, seed=cfg.seed,
                                   overwrite=cfg.overwrite)
        print(f"wrote {path} (use it with: repgeom mteb run -m MODEL --tasks-file {path})")
        return 0
    return _run(cfg)


def _header(key: str) -> str:
    """A metric key as a two-line column header: ``repgeom.dataset_entropy.raw`` → ``dataset_entropy`` / ``raw``."""
    from repgeom_eval.mteb_layers.summary import metric_label

    return metric_label(key).replace(".", "\n", 1)


def _metric_table(rows: list[dict], extra: list[str]) -> object:
    """Layers × requested metric values (``repgeom.*`` keys) of one task, next to the main score."""
    from rich.table import Table

    from repgeom_eval.mteb_layers.summary import fmt_number

    table = Table(box=None, padding=(0, 1))
    table.add_column("layer", no_wrap=True)
    table.add_column(rows[0].get("main_score_name") or "main score", justify="right")
    for key in extra:
        table.add_column(_header(key), justify="right")
    for r in rows:
        table.add_row(r["layer"], fmt_number(r["main_score"]), *(fmt_number(r.get(k)) for k in extra))
    return table


def _print_table(console, rows: list[dict]) -> None:
    from rich.table import Table

    from repgeom_eval.mteb_layers.summary import fmt_number, metric_columns

    table = Table()
    for col in ("task", "split", "subset", "layer", "main score", "dataset entropy", "dispersion", "eff. rank"):
        table.add_column(col, justify="left" if col in ("task", "split", "subset", "layer") else "right")
    for r in rows:
        table.add_row(r["task"], r["split"], str(r["subset"]), r["layer"], fmt_number(r["main_score"]),
                      fmt_number(r["repgeom_dataset_entropy"]), fmt_number(r["repgeom_dispersion"]),
                      fmt_number(r["repgeom_effective_rank"]))
    console.print(table)
    if metric_columns(rows):  # the requested metrics (repgeom.* keys), one table per task, split and subset
        groups: dict[tuple, list[dict]] = {}
        for r in rows:
            groups.setdefault((r["task"], r["split"], r["subset"]), []).append(r)
        for (task, split, subset), task_rows in groups.items():
            console.print(f"{task} ({split}, {subset}): requested metrics")
            console.print(_metric_table(task_rows, metric_columns(task_rows)))


def _run(cfg: MtebRunCommand) -> int:
    from pathlib import Path

    from rich.console import Console

    from repgeom_eval.spec.errors import RepgeomError
    from repgeom_eval.measurement.distributed import Distributed
    from repgeom_eval.modeling.loading import model_files
    from repgeom_eval.measurement.memory import describe
    from repgeom_eval.mteb_layers import resolve_tasks, run_layers, write_summary
    from repgeom_eval.mteb_layers.metrics import check_metrics
    from repgeom_eval.output.files import check_creatable_dir, check_outputs
    from repgeom_eval.output.progress import progress_mode
    from repgeom_eval.modeling.addresses import check_request_syntax
    from repgeom_eval.spec.options.model import ModelOptions
    from repgeom_eval.spec.options.mteb import SweepConfig
    from repgeom_eval.plugin_system.host import get_host

    metric_params = dict(cfg.metric_params or {})
    metrics = check_metrics(split_words(cfg.metrics) or (), metric_params)  # before tasks and model are loaded
    # the sweep's options, checked once, here, before tasks and model; run_layers takes the object as it is
    sweep = SweepConfig.of(cfg, revision=cfg.record_revision or cfg.revision, metrics=metrics,
                           metric_params=metric_params, layer_pick_params=dict(cfg.layer_pick_params or {}) or None)
    if sweep.layers.auto:
        from repgeom_eval.spec.layer_pick import make_pick

        make_pick(cfg.layer_pick, cfg.layer_pick_params)  # an unknown rule or parameter: before tasks and model
    else:
        _named(check_request_syntax, sweep.layers, get_host().layer_selectors.names())  # before tasks and model
    if cfg.dry_run:
        return _dry_run(cfg, sweep)
    if cfg.preprocess_stats and not Path(cfg.preprocess_stats).is_file():
        raise RepgeomError(f"preprocess statistics file {cfg.preprocess_stats!r} does not exist")
    out = check_creatable_dir(cfg.output_folder, "--output-folder")
    weight_files, model_dirs = model_files([cfg.model])
    # mteb only adds files under the output folder: it must not be (or hold, or lie in) the model folder
    outputs = {"--output-folder": str(out)}
    if cfg.prediction_folder:
        outputs["--prediction-folder"] = str(check_creatable_dir(cfg.prediction_folder, "--prediction-folder"))
    check_outputs(outputs, inputs={"--model": weight_files, "--tasks-file": cfg.tasks_file,
                                   "--preprocess-stats": cfg.preprocess_stats}, folders={"--model": model_dirs})
    tasks = resolve_tasks(split_words(cfg.tasks), tasks_file=cfg.tasks_file, task_types=split_words(cfg.task_types),
                          categories=split_words(cfg.categories), languages=split_words(cfg.languages),
                          benchmarks=split_words(cfg.benchmarks), eval_splits=split_words(cfg.eval_splits))
    # Under torchrun / accelerate launch, whole tasks are spread over the ranks (mteb evaluates a task in one
    # process); each rank writes its tasks into the shared mteb cache, and rank 0 reports and summarizes them all.
    dist = Distributed.from_env(cfg.device)
    mine = [t for i, t in enumerate(tasks) if dist.owns(i)]
    mode = "never" if cfg.no_progress or not dist.is_main else cfg.progress
    with progress_mode(mode):  # the bars of mteb_layers take an on/off switch; the mode says bars or log lines
        result = run_layers(cfg.model, mine, sweep.replace(output_folder=str(out), device=dist.device(cfg.device),
                                                           progress=mode != "never"),
                            model_options=ModelOptions.of(cfg))
    parts = dist.gather((result.rows, result.forward_passes))
    dist.close(clean=True)  # every rank, right after the gather
    if parts is None:
        return 0
    if dist.active:
        result.rows = [row for rows, _ in parts for row in rows]
        result.forward_passes = sum(n for _, n in parts)
    console = Console(width=max(Console().width, 120))  # a score table truncated to "0.…" is useless
    console.print(f"{result.model} @ {result.revision}: {len(result.layers)} layer(s) × {len(tasks)} task(s), "
                  f"{result.forward_passes} forward sweep(s), {result.seconds:.1f}s", highlight=False)
    # mteb's cache keeps each layer as its own model, shared by every request that names it: the request itself
    # is said here (and returned as SweepResult.layer_request), under the name every output gives it
    console.print(f"layer_request: {' '.join(result.layer_request)} → {', '.join(result.layers)}", highlight=False,
                  soft_wrap=True)
    _print_table(console, result.rows)
    picks = {r["task"]: r["repgeom_layer_pick"] for r in result.rows if r.get("repgeom_layer_pick")}  # all ranks'
    for task, pick in picks.items():
        scores = ", ".join(f"{a} {v:.4f}" for a, v in pick["scores"].items())
        console.print(f"layer pick for {task}: {pick['chosen']} by {pick['rule']} "
                      f"({pick['direction']} of {len(pick['scores'])} layers: {scores})", highlight=False)
    for rule in dict.fromkeys(pick["rule"] for pick in picks.values()):  # once per rule: what it is known to do
        evidence = next(p.get("evidence") for p in picks.values() if p["rule"] == rule)
        console.print(f"{rule} measured against final: {evidence or 'never measured (no evidence declared)'}",
                      highlight=False, soft_wrap=True)
    console.print(f"results: {out}")
    console.print(describe(result.memory) + (" (rank 0)" if dist.active else ""), highlight=False)
    if cfg.summary:
        written = write_summary(out)
        paths = written["paths"]
        console.print(f"summary: {paths['csv']}, {paths['markdown']}"
                      + (f", {len(paths['plots'])} plot(s)" if paths["plots"] else ""))
    return 0


def _dry_run(cfg: MtebRunCommand, sweep: object) -> int:
    """``--dry-run``: the sweep's memory from the model's config, as ``repgeom measure --dry-run`` prints it, plus
    the embeddings a task keeps at every layer until mteb scores them (repgeom_eval/measurement/estimate.py)."""
    from types import SimpleNamespace

    from repgeom_eval.measurement.estimate import add_kept_vectors, estimate, render
    from repgeom_eval.spec.options.model import ModelOptions

    layers = "all" if sweep.layers.auto else sweep.layers.items  # auto reads every hidden state to pick one
    # what estimate() reads of a measure run; not a RunConfig, which refuses a run without metrics (a sweep has none
    # unless --metrics asks: its geometry columns are computed from the embeddings)
    run = SimpleNamespace(layers=layers, metrics=tuple(sweep.metrics or ()),
                          metric_params=dict(sweep.metric_params or {}), per_text=False, pooling=None, state_device="model", batch_size=sweep.batch_size,
                          max_length=sweep.max_length, dtype=sweep.dtype, device=sweep.device)
    # the sweep pools each address as the pass reaches it (LayerEmbedder.embed), on any device
    est = add_kept_vectors(estimate(cfg.model, run, ModelOptions.of(cfg), energy=False, streams=True),
                           "(task embeddings, float32)")
    est.notes.append("a task keeps its texts' embeddings at every address until mteb scores it (per 1,000 distinct "
                     "texts of the task); the geometry beside each score (dataset entropy, dispersion, effective "
                     "rank) is computed from them one address at a time")
    render(est)
    return 0


def _summary(cfg: MtebSummaryCommand) -> int:
    from rich.console import Console

    from repgeom_eval.mteb_layers.summary import best_vs_last, metric_columns, rows_by_group, write_summary

    written = write_summary(cfg.folder, cfg.output_dir, prefix=cfg.prefix, plots=cfg.plots)
    console = Console(width=max(Console().width, 120))
    for (model, revision, family), tasks in rows_by_group(written["rows"]).items():
        console.print(f"[bold]{model}[/bold] @ {revision} ({family})")
        for label, rows in tasks.items():
            v = best_vs_last(rows)
            if v is None:
                console.print(f"  {label}: {len(rows)} layer(s)")
            elif v["intermediate_wins"]:
                console.print(f"  {label}: best {v['best_layer']} {v['best_score']:.4f} vs last {v['last_layer']} "
                              f"{v['last_score']:.4f} ({v['gain']:+.4f})")
            else:
                console.print(f"  {label}: the last layer {v['last_layer']} is best ({v['last_score']:.4f})")
            extra = metric_columns(rows)
            if extra:  # the requested metrics, layer by layer, next to the main score
                console.print(_metric_table(rows, extra))
    paths = written["paths"]
    console.print(f"wrote {paths['csv']}, {paths['markdown']}" + "".join(f", {p}" for p in paths["plots"]))
    return 0


def _named(check, *args):
    """``check(*args)``, its error naming ``--layer``."""
    from repgeom_eval.spec.errors import RepgeomError

    try:
        return check(*args)
    except RepgeomError as exc:
        raise RepgeomError(f"--layer: {exc}") from None

