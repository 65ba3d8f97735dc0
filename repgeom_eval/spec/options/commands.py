"""The flags of the commands that have no run options of their own elsewhere on this floor: ``addresses``,
``compare``, ``demo``, ``plugins``, ``report`` and ``tasks-dir`` (each command module of entrypoints/ runs
them)."""

from __future__ import annotations

from dataclasses import MISSING, dataclass

from repgeom_eval.spec.option_fields import Options, option, option_like, positive
from repgeom_eval.spec.options.groups import ChunksGroup, JsonGroup, LayersGroup, ModelGroup, RunGroup
from repgeom_eval.spec.options.model import ModelOptions


# -- repgeom addresses -------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class AddressesCommand(ModelGroup, LayersGroup, JsonGroup):
    """Every option of ``repgeom addresses``."""

    layers: tuple[str, ...] | None = option_like(LayersGroup, "layers", None, flags=("--layers",), cli_default=None,
                                                 help="show what this layer specification resolves to")
    json: bool = option_like(JsonGroup, "json", help="print the discovery (hook point, check and status of every "
                                                     "address) as JSON")


# -- repgeom compare ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class CompareCommand(Options):
    """Every option of ``repgeom compare``."""

    results: tuple[str, ...] = option(MISSING, "RESULT", nargs="+", from_cli=tuple,
                                      help="repgeom measure result .json files, lm-eval --output_path folders (or "
                                           "their results_*.json) and repgeom mteb run --output-folder folders")
    csv: str | None = option(None, "--csv", writes="file", metavar="PATH", help="write the long table (one row per value) as CSV")
    plot: str | None = option(None, "--plot", writes="file", metavar="PATH",
                              help="PNG: depth profiles overlaid, one panel per metric, one line per model")
    x: str = option("relative", "--x", choices=["relative", "layer"],
                    help="x axis of --plot: relative depth (default; models of different depth line up) or layer")
    metrics: tuple[str, ...] | None = option(None, "--metrics", nargs="+", from_cli=tuple,
                                             help="only these metrics (default: all)")

    def __post_init__(self) -> None:
        if isinstance(self.results, str):
            self._set("results", (self.results,))
        super().__post_init__()


# -- repgeom demo ------------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class DemoCommand(Options):
    """Every option of ``repgeom demo`` (all have defaults: the demo runs without arguments)."""

    output_dir: str = option("repgeom-demo", "--output-dir", writes="folder",
                             help="where results.json and the plot go (default: ./{default})")
    n_texts: int = option(96, "--n-texts", type=int, check=positive,
                          help="paragraphs of pydoc_data.topics (default {default})")
    max_length: int = option(192, "--max-length", type=int, check=positive, help="tokens per text (default {default})")
    batch_size: int = option_like(RunGroup, "batch_size", 16)
    progress: str = option_like(RunGroup, "progress")
    no_progress: bool = option_like(RunGroup, "no_progress")
    model: str | None = option(None, "--model", help="override the model (default: SmolLM2-135M-Instruct GGUF)")
    dtype: str = option_like(ModelOptions, "dtype")
    revision: str | None = option_like(ModelOptions, "revision")
    trust_remote_code: bool = option_like(ModelOptions, "trust_remote_code")
    ppl_chunks: int = option(240, "--ppl-chunks", type=int, check=positive,
                             help="chunks of the Python docs for the perplexity-vs-dispersion law (default {default})")
    chunk_len: int = option_like(ChunksGroup, "chunk_len", 128, help="tokens per chunk (default {default}; paper A: "
                                                                      "512)")
    group_size: int = option(10, "--group-size", type=int, check=positive,
                             help="chunks per perplexity group (default {default})")
    profile_only: bool = option(False, "--profile-only", action="store_true",
                                help="only step 1, the dispersion profile")


# -- repgeom plugins ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class PluginsCommand(JsonGroup):
    """Every option of ``repgeom plugins``."""

    json: bool = option_like(JsonGroup, "json", help="machine-readable list of objects")
    kind: str | None = option(None, "--kind", help="only this kind (metric, architecture, layer_selector, aux_loss, "
                                                   "token_set, command, plugin)")


# -- repgeom report ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ReportCommand(Options):
    """Every option of ``repgeom report``."""

    results: tuple[str, ...] = option(MISSING, "RESULT", nargs="+",
                                      help="results .json files written with --output by measure, gap, ppl-bins, "
                                           "knn-keys, knnlm, condensation, clusters, perturb, ...; a directory "
                                           "stands for its *.json files")
    output: str = option("report.html", "--output", "-o", writes="file", help="the HTML page (default: {default})")
    title: str = option("repgeom-eval report", "--title", help="page title")


# -- repgeom tasks-dir -------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class TasksDirCommand(Options):
    """``repgeom tasks-dir`` has no options of its own (``--config`` only, like every command)."""
