"""The options of an MTEB layer sweep (:func:`~repgeom_eval.mteb_layers.runner.run_layers`), declared and checked
once: ``repgeom mteb run`` builds one from its flags and passes it on; from Python, give one whole or its fields as
keywords. Below it, every flag of ``repgeom mteb run`` (``--layer`` included), ``mteb summary`` and
``mteb example-tasks`` (entrypoints/mteb_cmd.py runs them)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import MISSING, dataclass
from typing import Any

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.spec.option_fields import Options, option, option_like, positive
from repgeom_eval.spec.options.groups import ModelGroup, RunGroup, request_problem
from repgeom_eval.spec.options.measure import RunConfig

POOLINGS = ("auto", "st", "mean", "last", "cls", "first")
OVERWRITE_STRATEGIES = ("only-missing", "always", "never", "only-cache")  # mteb's OverwriteStrategy values
PREPROCESS_METHODS = ("none", "center", "standardize", "whiten")


@dataclass(frozen=True, kw_only=True)
class SweepConfig(Options):
    """Every option of ``run_layers``: which layers, how a layer's vectors become an embedding, the metrics beside
    each score, and mteb's cache. ``layers`` is a layer request in the one grammar (docs/metrics.md#layer-addresses),
    ``auto`` included; the other fields are documented on :func:`~repgeom_eval.mteb_layers.runner.run_layers`."""

    layers: Any = option("final")
    pooling: str = option("auto", choices=list(POOLINGS))
    normalize: bool | None = option(None)
    max_length: int | None = option(None, check=positive)
    batch_size: int = option(32, check=positive)
    dtype: Any = option("auto")
    device: Any = option("cpu")
    output_folder: Any = option("results")
    overwrite_strategy: str = option("only-missing", choices=list(OVERWRITE_STRATEGIES))
    name: str | None = option(None)
    revision: str | None = option(None)  # the revision recorded in the results (not the one loaded)
    co2_tracker: bool = option(False)
    prediction_folder: Any = option(None)
    num_proc: int | None = option(None, check=positive)
    progress: bool = option(True)
    metrics: Any = option(None)
    metric_params: Mapping[str, Mapping[str, Any]] | None = option(None)
    seed: int = option(0)
    preprocess: str = option("none", choices=list(PREPROCESS_METHODS))
    preprocess_stats: Any = option(None)
    allow_other_stats: bool = option(False)
    layer_pick: str | None = option(None)
    layer_pick_params: Mapping[str, Any] | None = option(None)

    def __post_init__(self) -> None:
        super().__post_init__()  # choices and checks of every field
        from repgeom_eval.spec.layer_request import layer_request

        request = layer_request(self.layers)  # split and checked once; "resid_post:[0,1]" is two layers
        self._set("layers", request)
        if isinstance(self.metrics, str):
            self._set("metrics", (self.metrics,))
        if (self.layer_pick or self.layer_pick_params) and not request.auto:
            raise RepgeomError("a layer-pick rule (--layer-pick, --layer-pick-param) needs --layer auto")
        if self.preprocess == "none" and self.preprocess_stats:
            raise RepgeomError("--preprocess-stats has no effect without preprocessing; add --preprocess center, "
                               "standardize or whiten")


def split_words(values: list[str] | tuple[str, ...] | None) -> list[str] | None:
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
    pooling: str = option("auto", "--pooling", choices=list(POOLINGS),
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
