"""``repgeom mteb``: MTEB scores at any layer (``run``) and per-layer tables and plots from the cache (``summary``)."""

from __future__ import annotations

import argparse
import sys

from repgeom_eval.modeling.options import ModelOptions


def _words(values: list[str] | None) -> list[str] | None:
    """Space- or comma-separated lists (``-t A B`` or ``-t A,B``)."""
    if not values:
        return None
    return [w.strip() for v in values for w in v.split(",") if w.strip()]


def _bool(text: str) -> bool:
    low = text.lower()
    if low in ("true", "yes", "1", "on"):
        return True
    if low in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _metric_param_option() -> dict:
    """``repgeom measure``'s --metric-param declaration (parser of METRIC.PARAM=VALUE, and the merge of repeated
    flags into ``{metric: {param: value}}``), so both commands read parameters alike."""
    from dataclasses import fields

    from repgeom_eval.measurement.config import RunConfig

    meta = next(f for f in fields(RunConfig) if f.name == "metric_params").metadata
    return {"type": meta["cli"]["type"], "merge": meta["from_cli"]}


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="mteb_command", metavar="SUBCOMMAND")
    run = sub.add_parser("run", help="evaluate a model at one or many layers on MTEB tasks",
                         description="Evaluate a model at one or many layer addresses on MTEB tasks. A sweep "
                                     "(--layer all, or several layers) runs one forward pass per batch for every "
                                     "layer. Geometry (repgeom_* keys) is written next to each score; results are "
                                     "cached in mteb's layout under --output-folder, one folder per layer.")
    run.add_argument("--model", "-m", required=True,
                     help="hub id, local model directory (sentence-transformers folders included) or .gguf file")
    run.add_argument("--layer", "--layers", dest="layers", nargs="+", default=["final"],
                     help="layer addresses: a hidden-state index (12), resid_post:11, final, embed, all (every hidden "
                          "state), blocks, or several of them (default: final)")
    run.add_argument("--pooling", default="auto",
                     choices=["auto", "st", "mean", "last", "cls", "first"],
                     help="auto (the model's own sentence-transformers pooling if it has one, else mean), st, mean, "
                          "last (last non-pad token) or cls/first")
    run.add_argument("--normalize", type=_bool, default=None, metavar="BOOL",
                     help="unit-normalise embeddings (default: the model's own choice for st pooling, else false)")
    run.add_argument("--max-length", type=int, default=None,
                     help="truncate texts to this many tokens (default: max_seq_length of a sentence-transformers "
                          "model, else the model context)")
    run.add_argument("--preprocess", default="none", choices=["none", "center", "standardize", "whiten"],
                     help="transform each layer's pooled vectors before unit normalisation and scoring: center, "
                          "standardize (per dimension) or whiten, as in `repgeom measure`. Statistics: "
                          "--preprocess-stats, else the task's own texts (every text its evaluation embeds, one pass "
                          "per task for all layers). Recorded as repgeom_preprocess in each score dict")
    run.add_argument("--preprocess-stats", default=None, metavar="FILE",
                     help="statistics written by `repgeom measure --save-preprocess-stats` (same pooling, every "
                          "evaluated layer) instead of the task's own texts")
    run.add_argument("--metrics", nargs="+", default=None, metavar="NAME",
                     help="registered metrics (built-in or from plugins; `repgeom plugins` lists them) computed at "
                          "every layer from the sweep's forward passes, on the texts each task split embedded, and "
                          "written next to its score as repgeom.<metric>[.<sub>]. Pooled metrics use --pooling "
                          "unless METRIC.pooling=... is set; multi-view metrics cost extra forward passes")
    run.add_argument("--metric-param", dest="metric_params", action="append", default=[],
                     type=_metric_param_option()["type"], metavar="METRIC.PARAM=VALUE",
                     help="set a parameter of a --metrics metric, as in `repgeom measure` (e.g. "
                          "dispersion.pooling=last; repeatable)")
    run.add_argument("--seed", type=int, default=0, help="seed of the augmented views of multi-view metrics "
                                                         "(infonce, lidar, dime)")
    run.add_argument("--name", default=None,
                     help="model name in the results (org/name; default: the hub id, or local/<folder>)")
    run.add_argument("--model-revision", dest="record_revision", default=None,
                     help="revision recorded in the results (default: --revision, else the hub commit or a content "
                          "hash of the folder)")
    run.add_argument("--tasks", "-t", nargs="+", default=None, help="task names (local tasks of --tasks-file or "
                                                                   "MTEB tasks)")
    run.add_argument("--tasks-file", default=None, metavar="FILE",
                     help="YAML/JSON file defining local STS, Classification, Clustering and Retrieval tasks from "
                          "JSONL files (see docs/mteb.md); without --tasks every task of the file runs")
    run.add_argument("--task-types", nargs="+", default=None, help="task types (STS, Classification, ...)")
    run.add_argument("--categories", nargs="+", default=None, help="MTEB task categories (t2t, ...)")
    run.add_argument("--languages", "-l", nargs="+", default=None, help="ISO 639-3 language codes (eng, deu, ...)")
    run.add_argument("--benchmarks", "-b", nargs="+", default=None, help="MTEB benchmark names")
    run.add_argument("--eval-splits", nargs="+", default=None, help="evaluation splits to run")
    run.add_argument("--batch-size", type=int, default=32)
    ModelOptions.add_arguments(run)  # --revision, --dtype, --device, --peft ... (repgeom_eval/modeling/options.py)
    run.add_argument("--output-folder", default="results",
                     help="mteb result cache folder (default: results)")
    run.add_argument("--overwrite-strategy", default="only-missing",
                     choices=["always", "never", "only-missing", "only-cache"],
                     help="mteb's: only-missing (default) resumes, always re-runs, only-cache only reads")
    run.add_argument("--prediction-folder", default=None, help="also save mteb's per-task predictions here")
    run.add_argument("--num-proc", type=int, default=None, help="processes for dataset loading")
    run.add_argument("--co2-tracker", action="store_true", help="track CO2 with codecarbon (if installed)")
    run.add_argument("--no-summary", action="store_true",
                     help="do not write repgeom_summary.{csv,md,png} into the output folder afterwards")
    run.add_argument("--no-progress", action="store_true", help="hide the progress bars")

    summary = sub.add_parser("summary", help="per-layer tables (CSV, Markdown) and plots from an mteb cache folder",
                             description="Read every layer result under FOLDER and write a CSV (one row per model, "
                                         "layer, task, split and subset), a Markdown report (layers × main score "
                                         "and geometry, best layer against the last) and one plot per model.")
    summary.add_argument("folder", help="the --output-folder of `repgeom mteb run` (an mteb cache folder)")
    summary.add_argument("--output-dir", "-o", default=None, help="where to write (default: FOLDER)")
    summary.add_argument("--prefix", default="repgeom_summary", help="file name prefix (default: repgeom_summary)")
    summary.add_argument("--no-plot", action="store_true", help="tables only")

    examples = sub.add_parser("example-tasks", help="write local example tasks (all four types) from text on this "
                                                    "machine, for offline runs",
                              description="Write JSONL files and a tasks.yaml for --tasks-file: topic "
                                          "classification, topic clustering, graded STS and retrieval, generated "
                                          "from Python's documentation (pydoc) or the Debian fortunes package.")
    examples.add_argument("folder", help="folder to write into (created if missing)")
    examples.add_argument("--source", choices=["pydoc", "fortunes"], default="pydoc")
    examples.add_argument("--size", choices=["small", "medium", "large"], default="medium")
    examples.add_argument("--seed", type=int, default=0)
    p.set_defaults(_mteb_parser=p)


def run(args: argparse.Namespace) -> int:
    if args.mteb_command is None:
        args._mteb_parser.print_help()
        return 0
    if args.mteb_command == "summary":
        return _summary(args)
    if args.mteb_command == "example-tasks":
        from repgeom_eval.mteb_layers.examples import write_example_tasks

        path = write_example_tasks(args.folder, source=args.source, size=args.size, seed=args.seed)
        print(f"wrote {path} (use it with: repgeom mteb run -m MODEL --tasks-file {path})")
        return 0
    return _run(args)


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


def _run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rich.console import Console

    from repgeom_eval.measurement.distributed import Distributed
    from repgeom_eval.errors import RepgeomError
    from repgeom_eval.modeling.loading import model_inputs
    from repgeom_eval.output.files import check_creatable_dir, check_outputs
    from repgeom_eval.mteb_layers import resolve_tasks, run_layers, write_summary

    from repgeom_eval.mteb_layers.metrics import check_metrics
    from repgeom_eval.mteb_layers.preprocess import check_method

    if args.batch_size < 1:
        raise RepgeomError(f"--batch-size must be positive, got {args.batch_size}")
    metric_params = _metric_param_option()["merge"](args.metric_params)
    metrics = check_metrics(_words(args.metrics) or (), metric_params)  # before tasks and model are loaded
    check_method(args.preprocess, args.preprocess_stats)
    if args.preprocess_stats and not Path(args.preprocess_stats).is_file():
        raise RepgeomError(f"preprocess statistics file {args.preprocess_stats!r} does not exist")
    out = check_creatable_dir(args.output_folder, "--output-folder")
    model_files, model_dirs = model_inputs([args.model])
    # mteb only adds files under the output folder: it must not be (or hold, or lie in) the model folder
    check_outputs({"--output-folder": str(out)}, inputs={"--model": model_files}, folders={"--model": model_dirs})
    tasks = resolve_tasks(_words(args.tasks), tasks_file=args.tasks_file, task_types=_words(args.task_types),
                          categories=_words(args.categories), languages=_words(args.languages),
                          benchmarks=_words(args.benchmarks), eval_splits=_words(args.eval_splits))
    # Under torchrun / accelerate launch, whole tasks are spread over the ranks (mteb evaluates a task in one
    # process); each rank writes its tasks into the shared mteb cache, and rank 0 reports and summarizes them all.
    dist = Distributed.from_env(args.device)
    mine = [t for i, t in enumerate(tasks) if dist.owns(i)]
    progress = not args.no_progress and sys.stderr.isatty() and dist.is_main
    result = run_layers(
        args.model, mine, _words(args.layers), pooling=args.pooling, normalize=args.normalize,
        max_length=args.max_length, batch_size=args.batch_size, dtype=args.dtype, device=dist.device(args.device),
        output_folder=str(out), overwrite_strategy=args.overwrite_strategy, name=args.name, revision=args.record_revision or args.revision,
        co2_tracker=args.co2_tracker, prediction_folder=args.prediction_folder, num_proc=args.num_proc,
        progress=progress, metrics=metrics, metric_params=metric_params, seed=args.seed,
        preprocess=args.preprocess, preprocess_stats=args.preprocess_stats)
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
    console.print(f"results: {out}")
    if not args.no_summary:
        written = write_summary(out)
        paths = written["paths"]
        console.print(f"summary: {paths['csv']}, {paths['markdown']}"
                      + (f", {len(paths['plots'])} plot(s)" if paths["plots"] else ""))
    return 0


def _summary(args: argparse.Namespace) -> int:
    from rich.console import Console

    from repgeom_eval.mteb_layers.summary import best_vs_last, metric_columns, rows_by_group, write_summary

    written = write_summary(args.folder, args.output_dir, prefix=args.prefix, plots=not args.no_plot)
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
