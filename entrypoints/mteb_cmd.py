"""``repgeom mteb``: MTEB scores at any layer (``run``) and per-layer tables and plots from the cache (``summary``)."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass

from repgeom_eval.measurement.config import RunConfig
from repgeom_eval.spec.option_fields import Options, option, option_like
from repgeom_eval.modeling.option_groups import ModelGroup, RunGroup, request_problem

MTEB_POOLINGS = ("auto", "st", "mean", "last", "cls", "first")


def _words(values: list[str] | tuple[str, ...] | None) -> list[str] | None:
    """Space- or comma-separated lists (``-t A B`` or ``-t A,B``)."""
    if not values:
        return None
    return [w.strip() for v in values for w in v.split(",") if w.strip()]


def _key_value(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` → (key, value parsed as JSON when possible)."""
    import json

    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(raw)
    except json.JSONDecodeError:
        return key.strip(), raw


def _bool(text: str) -> bool:
    low = text.lower()
    if low in ("true", "yes", "1", "on"):
        return True
    if low in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


@dataclass(frozen=True, kw_only=True)
class MtebRunCommand(ModelGroup):
    """Every option of ``repgeom mteb run``."""

    model: str = option_like(ModelGroup, "model", help="hub id, local model directory (sentence-transformers folders "
                                                       "included) or .gguf file")
    layers: tuple[str, ...] = option(("final",), "--layer", "--layers", "-l", nargs="+",
                                     check=lambda value: request_problem(value, auto=True),
                                     help="layer addresses, as `repgeom measure --layers` takes them: a hidden-state "
                                          "index (12), resid_post:11, resid_post:[0,5,-1], final, embed, all (every "
                                          "hidden state), blocks, or several of them; auto: a layer picked "
                                          "per task from the label-free geometry of the task's own texts, evaluated "
                                          "with final (docs/picks.md) (default: {default})")
    layer_pick: str | None = option(None, "--layer-pick", metavar="RULE",
                                    help="the label-free rule of --layer auto (default: min_dataset_entropy; "
                                         "plugins add rules: `repgeom plugins --kind layer_pick`)")
    layer_pick_params: dict = option(None, "--layer-pick-param", action="append", type=_key_value, cli_default=[],
                                     metavar="KEY=VALUE", from_cli=dict,
                                     help="set a parameter of the --layer-pick rule, e.g. include_embed=true "
                                          "(repeatable)")
    pooling: str = option("auto", "--pooling", choices=list(MTEB_POOLINGS),
                          help="auto (the model's own sentence-transformers pooling if it has one, else mean), st, "
                               "mean, last (last non-pad token) or cls/first")
    normalize: bool | None = option(None, "--normalize", type=_bool, metavar="BOOL",
                                    help="unit-normalise embeddings (default: the model's own choice for st pooling, "
                                         "else false)")
    max_length: int | None = option_like(RunConfig, "max_length",
                                         help="truncate texts to this many tokens (default: max_seq_length of a "
                                              "sentence-transformers model, else the model context)")
    preprocess: str = option_like(RunConfig, "preprocess",
                                  help="transform each layer's pooled vectors before unit normalisation and scoring: "
                                       "center, standardize (per dimension) or whiten, as in `repgeom measure`. "
                                       "Statistics: --preprocess-stats, else the task's own texts (every text its "
                                       "evaluation embeds, one pass per task for all layers). Recorded as "
                                       "repgeom_preprocess in each score dict")
    preprocess_stats: str | None = option_like(RunConfig, "preprocess_stats",
                                               help="statistics written by `repgeom measure --save-preprocess-stats` "
                                                    "(same pooling, every evaluated layer) instead of the task's own "
                                                    "texts")
    allow_other_stats: bool = option_like(RunConfig, "allow_other_stats")
    metrics: tuple[str, ...] | None = option(
        None, "--metrics", nargs="+", metavar="NAME",
        help="registered metrics (built-in or from plugins; `repgeom plugins` lists them) computed at every layer "
             "from the sweep's forward passes, on the texts each task split embedded, and written next to its score "
             "as repgeom.<metric>[.<sub>]. Pooled metrics use --pooling unless METRIC.pooling=... is set; "
             "multi-view metrics cost extra forward passes")
    metric_params: dict = option_like(RunConfig, "metric_params",
                                      help="set a parameter of a --metrics metric, as in `repgeom measure` (e.g. "
                                           "dispersion.pooling=last; repeatable)")
    seed: int = option_like(RunGroup, "seed", help="seed of the augmented views of multi-view metrics (infonce, "
                                                   "lidar, dime)")
    name: str | None = option(None, "--name", help="model name in the results (org/name; default: the hub id, or "
                                                   "local/<folder>)")
    record_revision: str | None = option(None, "--model-revision",
                                         help="revision recorded in the results (default: --revision, else the hub "
                                              "commit or a content hash of the folder)")
    tasks: tuple[str, ...] | None = option(None, "--tasks", "-t", nargs="+",
                                           help="task names (local tasks of --tasks-file or MTEB tasks)")
    tasks_file: str | None = option(None, "--tasks-file", metavar="FILE",
                                    help="YAML/JSON file defining local STS, Classification, Clustering and Retrieval "
                                         "tasks from JSONL files (see docs/mteb.md); without --tasks every task of "
                                         "the file runs")
    task_types: tuple[str, ...] | None = option(None, "--task-types", nargs="+",
                                                help="task types (STS, Classification, ...)")
    categories: tuple[str, ...] | None = option(None, "--categories", nargs="+",
                                                help="MTEB task categories (t2t, ...)")
    # no short flags for --languages and --benchmarks: -l and -b are --layers and --batch-size in every command
    languages: tuple[str, ...] | None = option(None, "--languages", nargs="+",
                                               help="ISO 639-3 language codes (eng, deu, ...)")
    benchmarks: tuple[str, ...] | None = option(None, "--benchmarks", nargs="+", help="MTEB benchmark names")
    eval_splits: tuple[str, ...] | None = option(None, "--eval-splits", nargs="+", help="evaluation splits to run")
    batch_size: int = option_like(RunGroup, "batch_size", 32)
    output_folder: str = option("results", "--output-folder", writes="folder", help="mteb result cache folder (default: {default})")
    overwrite_strategy: str = option("only-missing", "--overwrite-strategy",
                                     choices=["always", "never", "only-missing", "only-cache"],
                                     help="mteb's: only-missing (default) resumes, always re-runs, only-cache only "
                                          "reads")
    prediction_folder: str | None = option(None, "--prediction-folder", writes="folder",
                                           help="also save mteb's per-task predictions here")
    num_proc: int | None = option(None, "--num-proc", type=int, help="processes for dataset loading")
    co2_tracker: bool = option(False, "--co2-tracker", action="store_true",
                               help="track CO2 with codecarbon (if installed)")
    dry_run: bool = option(False, "--dry-run", action="store_true", key=False, config=False,
                           help="print the memory the sweep will hold (the --metrics states at every layer, each "
                                "task's embeddings per 1,000 texts, the device of each, the weights) from the "
                                "model's config alone, and stop (as repgeom measure --dry-run)")
    summary: bool = option(True, "--no-summary", action="store_false",
                           help="do not write repgeom_summary.{csv,md,png} into the output folder afterwards")
    progress: str = option_like(RunGroup, "progress")
    no_progress: bool = option_like(RunGroup, "no_progress")


@dataclass(frozen=True, kw_only=True)
class MtebSummaryCommand(Options):
    """Every option of ``repgeom mteb summary``."""

    folder: str = option(MISSING, "FOLDER", help="the --output-folder of `repgeom mteb run` (an mteb cache folder)")
    output_dir: str | None = option(None, "--output-dir", "--output", "-o", writes="folder",
                                    help="where to write (default: FOLDER)")
    prefix: str = option("repgeom_summary", "--prefix", help="file name prefix (default: {default})")
    plots: bool = option(True, "--no-plot", action="store_false", help="tables only")


@dataclass(frozen=True, kw_only=True)
class MtebExampleTasksCommand(Options):
    """Every option of ``repgeom mteb example-tasks``."""

    folder: str = option(MISSING, "FOLDER", help="folder to write into (created if missing)")
    source: str = option("pydoc", "--source", choices=["pydoc", "fortunes"])
    size: str = option("medium", "--size", choices=["small", "medium", "large", "xlarge"],
                       help="small, medium (default), large, or xlarge: 10 topics, 300 evaluated items a task")
    seed: int = option(0, "--seed", type=int)
    overwrite: bool = option(False, "--overwrite", action="store_true",
                             help="replace files in FOLDER whose content differs (an edited tasks file, other tasks)")


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
    from repgeom_eval.mteb_layers import resolve_tasks, run_layers, write_summary
    from repgeom_eval.mteb_layers.metrics import check_metrics
    from repgeom_eval.output.files import check_creatable_dir, check_outputs
    from repgeom_eval.output.progress import progress_mode
    from repgeom_eval.modeling.addresses import check_request_syntax
    from repgeom_eval.modeling.options import ModelOptions
    from repgeom_eval.mteb_layers.config import SweepConfig
    from repgeom_eval.plugin_system.host import get_host

    metric_params = dict(cfg.metric_params or {})
    metrics = check_metrics(_words(cfg.metrics) or (), metric_params)  # before tasks and model are loaded
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
    tasks = resolve_tasks(_words(cfg.tasks), tasks_file=cfg.tasks_file, task_types=_words(cfg.task_types),
                          categories=_words(cfg.categories), languages=_words(cfg.languages),
                          benchmarks=_words(cfg.benchmarks), eval_splits=_words(cfg.eval_splits))
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
    dist.close()
    if parts is None:
        return 0
    if dist.active:
        result.rows = [row for rows, _ in parts for row in rows]
        result.forward_passes = sum(n for _, n in parts)
    console = Console(width=max(Console().width, 120))  # a score table truncated to "0.…" is useless
    console.print(f"{result.model} @ {result.revision}: {len(result.layers)} layer(s) × {len(tasks)} task(s), "
                  f"{result.forward_passes} forward sweep(s), {result.seconds:.1f}s")
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
    from repgeom_eval.modeling.options import ModelOptions

    layers = "all" if sweep.layers.auto else sweep.layers.items  # auto reads every hidden state to pick one
    # what estimate() reads of a measure run; not a RunConfig, which refuses a run without metrics (a sweep has none
    # unless --metrics asks: its geometry columns are computed from the embeddings)
    run = SimpleNamespace(layers=layers, metrics=tuple(sweep.metrics or ()),
                          metric_params=dict(sweep.metric_params or {}), per_text=False, pooling=None, state_device="model", batch_size=sweep.batch_size,
                          max_length=sweep.max_length, dtype=sweep.dtype, device=sweep.device)
    est = add_kept_vectors(estimate(cfg.model, run, ModelOptions.of(cfg), energy=False), "(task embeddings, float32)")
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

