"""The options of every analysis, each declared once (with its flag, help, default and check), torch-free so that
``--help`` stays instant. Each analysis function takes its configuration whole or the same names as keywords
(``ppl_bins(model, data, PplBinsConfig(n_bins=50))`` or ``ppl_bins(model, data, n_bins=50)``); its command adds the
model, data and output options (entrypoints/*_cmd.py). Machinery: repgeom_eval/spec/option_fields.py; shared groups:
repgeom_eval/spec/options/groups.py.
"""

from __future__ import annotations

import numbers
from dataclasses import MISSING, dataclass

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.spec.names import CONDENSATION_BINS, CONDENSATION_EPS
from repgeom_eval.spec.option_fields import Options, each, option, option_like, positive
from repgeom_eval.spec.options.groups import (ChunksGroup, DataGroup, JsonGroup, LayersGroup, ModelGroup, ModelsGroup,
                                             OutputGroup, PlotsGroup, RunGroup, TextsGroup)
from repgeom_eval.spec.options.model import ModelOptions

# ppl-bins: the "auto" group size is the smallest source's chunks // GROUPS_PER_SOURCE, capped at GROUP_SIZE_MAX
# (paper A's group size, reached from 2000 chunks a source on); docs/metrics.md#perplexity-groups
GROUPS_PER_SOURCE = 20
GROUP_SIZE_MAX = 100


def group_size_value(text: str) -> int | str:
    """``--group-size``: ``auto`` or a number (checked by the configuration)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        return text


def _group_size_problem(value: object) -> str | None:
    if value == "auto" or (isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1):
        return None
    return f"expected a positive number of chunks or 'auto', got {value!r}"


@dataclass(frozen=True, kw_only=True)
class PplBinsConfig(TextsGroup, ChunksGroup, LayersGroup, RunGroup):
    """``repgeom ppl-bins``: perplexity vs token dispersion over chunks of a corpus (analyses/ppl_bins.py)."""

    source_field: str = option("source", "--source-field",
                               help="field naming each record's domain; correlations are then also given per source")
    n_chunks: int | None = option(None, "--n-chunks", type=int, check=positive,
                                  help="chunks to sample uniformly from the whole corpus (seeded; paper A: 100000), "
                                       "so each source gets chunks in proportion to its text. Default: every chunk")
    per_source: int | None = option(None, "--per-source", type=int, check=positive, metavar="N",
                                    help="sample N chunks from every source instead (seeded, each source on its "
                                         "own), so sources of very different size weigh the same; an error names "
                                         "any source with fewer than N chunks")
    group_size: int | str = option(
        "auto", "--group-size", type=group_size_value, check=_group_size_problem,
        help=f"chunks per perplexity group, or auto (default: auto = the smallest source's sampled chunks // "
             f"{GROUPS_PER_SOURCE}, between 1 and {GROUP_SIZE_MAX}, so every source gets about {GROUPS_PER_SOURCE} "
             f"groups; paper A used {GROUP_SIZE_MAX}). A number is used exactly")
    n_bins: int = option(100, "--bins", type=int, check=positive,
                         help="perplexity targets of the uniform selection (default: {default})")
    seed: int = option_like(RunGroup, "seed", 42, help="chunk sampling seed (default: {default}; paper A: "
                                                       "random.seed(42))")
    max_ppl: float | None = option(None, "--max-ppl", type=float,
                                   help="drop groups with mean perplexity at or above this (paper A's plot used 25); "
                                        "default: keep all")
    confound_ratio: float = option(2.0, "--confound-ratio", type=float,
                                   help="flag pooling sources whose median perplexities differ by this factor "
                                        "(default: {default})")
    per_chunk_path: str | None = option(None, "--per-chunk", writes="file", metavar="OUT.jsonl", key=False, config=False,
                                        help="also write every chunk's perplexity and dispersions")
    run_dir: str | None = option(None, "--run-dir", metavar="DIR", key=False, writes="folder",
                                 help="append every chunk's values here as they are computed, so a killed run can "
                                      "--resume (analyses/chunk_log.py)")
    resume: bool = option(False, "--resume", action="store_true", key=False, config=False,
                          help="continue the run in --run-dir: only the chunks it lacks are computed (same model, "
                               "data and options)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.resume and not self.run_dir:
            raise RepgeomError("resume needs the run directory of the run to continue (--run-dir DIR)")
        if self.n_chunks is not None and self.per_source is not None:
            raise RepgeomError("give --n-chunks (a uniform sample) or --per-source (the same number from every "
                               "source), not both")


@dataclass(frozen=True, kw_only=True)
class KnnKeysConfig(TextsGroup, ChunksGroup, RunGroup):
    """``repgeom knn-keys``: kNN-LM key candidates ranked by dispersion (analyses/knn_keys.py)."""

    candidates: tuple[str, ...] = option(
        ("resid_mid:-1", "resid_post:-1", "mlp_in:-1"), "--candidates", "--key", "-k", nargs="+", metavar="ADDRESS",
        help="candidate key addresses (default: {default}; any address works, e.g. resid_mid:[10,-1] or knn_keys)")
    ns: tuple[int, ...] = option((10, 50, 100), "--n", type=int, nargs="+", metavar="N", check=each(positive),
                                 help="chunks per sample (default: {default})")
    n_seeds: int = option(10, "--seeds", type=int, check=positive, help="samples per N (default: {default})")
    seed: int = option_like(RunGroup, "seed", help="first seed (default: {default})")
    batch_size: int = option_like(RunGroup, "batch_size", 8)


INDEX_KINDS = ("auto", "flat", "ivf")


@dataclass(frozen=True, kw_only=True)
class KnnlmConfig(TextsGroup, ChunksGroup, RunGroup):
    """``repgeom knnlm``: a real kNN-LM over a faiss datastore (analyses/knnlm.py)."""

    text_field: str = option_like(TextsGroup, "text_field", config=False)
    keys: tuple[str, ...] = option(("resid_mid:-1",), "--key", "-k", nargs="+", metavar="ADDRESS",
                                   help="key address(es); several are compared side by side (default: {default})")
    k: int = option(1024, "--neighbors", type=int, check=positive, help="k nearest keys per query (default: {default})")
    lambdas: tuple[float, ...] = option((0.25,), "--lmbda", "--lambda", type=float, nargs="+", metavar="λ",
                                        help="interpolation weight(s) of the kNN distribution (default: {default})")
    temperature: float = option(1.0, "--temperature", type=float,
                                help="softmax temperature over negative squared L2 distances (default: {default})")
    index: str = option("auto", "--index", choices=list(INDEX_KINDS),
                        help="exact search (flat) or IVF; auto = IVF from 100000 keys on (ivf_threshold)")
    nlist: int | None = option(None, "--nlist", type=int, check=positive, help="IVF cells (default: about 4·sqrt(n))")
    nprobe: int = option(32, "--nprobe", type=int, check=positive,
                         help="IVF cells searched per query (default: {default})")
    ivf_threshold: int = option(100_000, check=positive)
    fp16: bool = option(False, "--fp16", action="store_true",
                        help="store keys and index codes in float16 (half the memory)")
    store_dir: str | None = option(None, "--store-dir", writes="folder", key=False,
                                   help="keep the keys (.npy), values and faiss indexes here (default: a temporary "
                                        "directory)")
    overwrite: bool = option(False, "--overwrite", action="store_true", key=False,
                             help="let --store-dir replace what is in that folder (an earlier store, other files)")
    seed: int = option_like(RunGroup, "seed", help="seed of the IVF training sample")

    def __post_init__(self) -> None:
        if self.store_dir is not None:
            self._set("store_dir", str(self.store_dir))
        super().__post_init__()


@dataclass(frozen=True, kw_only=True)
class ClustersConfig(TextsGroup, LayersGroup, RunGroup):
    """``repgeom clusters``: contexts sharing an n-gram continuation (analyses/clusters.py)."""

    ngram: int = option(10, "--ngram", type=int, help="length of the shared continuation (default: {default})")
    min_count: int = option(100, "--min-count", type=int, check=positive,
                            help="occurrences an n-gram needs to form a cluster (default: {default})")
    contexts: int = option(100, "--contexts", type=int, check=positive,
                           help="contexts sampled per cluster (default: {default})")
    context_len: int = option(100, "--context-len", type=int, check=positive,
                              help="tokens of left context (default: {default})")
    n_clusters: int = option(500, "--clusters", type=int, check=positive,
                             help="most frequent n-grams kept (default: {default})")
    seed: int = option_like(RunGroup, "seed", help="seed of the context sampling (default: {default})")
    batch_size: int = option_like(RunGroup, "batch_size", 16)
    dtype: str | None = option_like(RunGroup, "dtype", config=False)
    device: str | None = option_like(RunGroup, "device", config=False)


PERTURB_SWEEPS = ("repetition", "random", "length")


@dataclass(frozen=True, kw_only=True)
class PerturbConfig(TextsGroup, LayersGroup, RunGroup):
    """``repgeom perturb``: prompt entropy and dispersion under perturbations (analyses/perturb.py)."""

    layers: str | tuple[str, ...] = option_like(LayersGroup, "layers", config=False)  # the resolved ones are written
    sweeps: tuple[str, ...] = option(PERTURB_SWEEPS, "--sweeps", nargs="+", choices=list(PERTURB_SWEEPS),
                                     help="which perturbations to run (default: all three)")
    ps: tuple[float, ...] = option((0.0, 0.25, 0.5, 0.75, 1.0), "--p", type=float, nargs="+", metavar="P",
                                   help="replacement probabilities of the repetition and random sweeps (default: "
                                        "{default})")
    lengths: tuple[int, ...] = option((16, 32, 64, 128), "--lengths", type=int, nargs="+", metavar="L",
                                      check=each(positive),
                                      help="prompt lengths in tokens (default: {default}); the longest is the prompt "
                                           "size")
    n_prompts: int = option(32, "--n-prompts", type=int, check=positive, help="prompts (default: {default})")
    seed: int = option_like(RunGroup, "seed", help="seed of the perturbations (default: {default})")
    batch_size: int = option_like(RunGroup, "batch_size", 8)


@dataclass(frozen=True, kw_only=True)
class CondensationConfig(TextsGroup, LayersGroup, RunGroup):
    """``repgeom condensation``: per-layer cosine histograms and the depth trend (analyses/condensation.py)."""

    text_field: str = option_like(TextsGroup, "text_field", config=False)
    layers: str | tuple[str, ...] = option_like(LayersGroup, "layers",
                                                help="layer addresses, at least 3 (default: {default} = every "
                                                     "hidden state)")
    bins: int = option(CONDENSATION_BINS, "--bins", type=int, check=positive,
                       help="histogram bins over [-1, 1] (default: {default})")
    eps: float = option(CONDENSATION_EPS)  # paper C's max-eps
    max_length: int = option(512, "--max-length", type=int, check=positive,
                             help="tokens per text (paper C: 512; default: {default})")
    n_texts: int | None = option(None, "--n-texts", type=int, check=positive,
                                 help="use the first N texts (default: all)")
    seed: int = option_like(RunGroup, "seed", flags=(), key=False, config=False)  # no sampling: nothing to seed
    dtype: str | None = option_like(RunGroup, "dtype", config=False)
    device: str | None = option_like(RunGroup, "device", config=False)


GAP_DISTANCES = ("cosine", "euclidean")


@dataclass(frozen=True, kw_only=True)
class GapConfig(Options):
    """``repgeom gap``: the dispersion gap G of output projections (analyses/gap/screening.py)."""

    domain: str = option("digits", "--domain", "-T",
                         help="domain token set T: a registered name (digits, python_keywords, ...; `repgeom plugins` "
                              "lists them), words:a,b,c, or a file with one word per line (default: {default})")
    reference: str = option("general", "--reference", "-R",
                            help="reference token set T̄, same forms; T is excluded from it (default: {default})")
    distance: str = option("cosine", "--distance", choices=list(GAP_DISTANCES),
                           help="cosine distance (default, paper A) or Euclidean")
    size: int = option(1000, "--size", type=int, check=positive,
                       help="sample size of sampled token sets such as general (default: {default})")
    seed: int = option(0, "--seed", type=int, help="seed of sampled token sets (default: {default})")
    force: bool = option(False, "--force", action="store_true",
                         help="compare models even if their vocabularies differ (G is then not comparable)")


@dataclass(frozen=True, kw_only=True)
class SlicesConfig(Options):
    """``repgeom slices``: the controlled-slice experiment and its calibration (analyses/slices.py)."""

    size: int = option(100, "--size", type=int, check=positive,
                       help="queries per slice (default {default}; reduced, with a warning, if the pool is smaller)")
    seeds: int = option(10, "--seeds", type=int, check=positive, help="slices per fraction (default {default})")
    seed: int = option(0, "--seed", type=int, help="base random seed (default {default})")


# -- repgeom clusters --------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ClustersCommand(ModelsGroup, DataGroup, ClustersConfig, PlotsGroup):
    """Every option of ``repgeom clusters``: models, texts, the analysis (ClustersConfig) and its outputs."""

    model: tuple[str, ...] = option_like(ModelsGroup, "model", help="one model, or a series of checkpoints sharing "
                                         "a tokenizer (measured on the same contexts)")


# -- repgeom condensation ----------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class CondensationCommand(ModelsGroup, DataGroup, CondensationConfig, PlotsGroup):
    """Every option of ``repgeom condensation``: models, texts, the analysis (CondensationConfig), outputs."""


# -- repgeom gap -------------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class GapCommand(GapConfig, OutputGroup, JsonGroup):
    """Every option of ``repgeom gap``: the checkpoints, the analysis (GapConfig) and the outputs."""

    models: tuple[str, ...] = option(MISSING, "--models", "--model", "-m", nargs="+", metavar="MODEL", config=False,
                                     help="model directories (safetensors, sharded or not), .gguf files, or cached "
                                          "hub ids; they must share one tokenizer vocabulary")
    trust_remote_code: bool = option_like(ModelOptions, "trust_remote_code")  # gap reads weights, never loads code
    scores: str | None = option(None, "--scores", metavar="FILE", config=False,
                                help="task accuracy per model (JSON object {model: accuracy}, or CSV/TSV lines "
                                     "model,accuracy): prints the Spearman correlation between G and accuracy")


# -- repgeom knn-keys --------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class KnnKeysCommand(ModelGroup, DataGroup, KnnKeysConfig, PlotsGroup):
    """Every option of ``repgeom knn-keys``: model, corpus, the analysis (KnnKeysConfig) and its outputs."""


# -- repgeom knnlm -----------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class KnnlmCommand(ModelGroup, KnnlmConfig, OutputGroup):
    """Every option of ``repgeom knnlm``: model, the two texts, the analysis (KnnlmConfig) and its output."""

    datastore: str = option(MISSING, "--datastore", metavar="FILE", key=False, config=False,
                            help="text the datastore is built from (.jsonl with a text field, or .txt)")
    eval: str = option(MISSING, "--eval", metavar="FILE", key=False, config=False,
                       help="held-out text to measure perplexity on")


# -- repgeom perturb ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class PerturbCommand(ModelGroup, DataGroup, PerturbConfig, PlotsGroup):
    """Every option of ``repgeom perturb``: model, texts, the analysis (PerturbConfig) and its outputs."""


# -- repgeom ppl-bins --------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class PplBinsCommand(ModelGroup, DataGroup, PplBinsConfig, PlotsGroup):
    """Every option of ``repgeom ppl-bins``: model, corpus, the analysis (PplBinsConfig) and its outputs."""

    data: str = option_like(DataGroup, "data", help=".jsonl with a text field (and optionally a source field) per "
                            "line, or .txt with one document per line")


# -- repgeom slices ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class SlicesCommand(SlicesConfig, OutputGroup, JsonGroup):
    """Every option of ``repgeom slices``: the queries, the experiment (SlicesConfig) and the outputs."""

    source: str = option(MISSING, "SAMPLES", config=False,
                         help="lm-eval --log_samples output of a repgeom_hardness_* task (a samples_*.jsonl file or "
                              "the --output_path folder), or, with --vectors, a JSONL with one record per query")
    task: str | None = option(None, "--task", help="task whose samples to read when the folder holds several")
    vectors: str | None = option(None, "--vectors", metavar="FILE",
                                 help="per-query vectors (.npy [N, d] or .safetensors), row i = record i of SAMPLES")
    correct_field: str = option("correct", "--correct-field",
                                help="field of each record holding correctness (with --vectors; default: {default})")
    ppl_field: str = option("ppl", "--ppl-field", help="field holding the gold answer's perplexity given the prompt, "
                                                       "optional (with --vectors; default: {default})")
    prompt_ppl_field: str = option("prompt_ppl", "--prompt-ppl-field",
                                   help="field holding the prompt's own perplexity, optional (with --vectors; "
                                        "default: {default})")
    calibrate: bool = option(False, "--calibrate", action="store_true",
                             help="also predict slice accuracy from slice dispersion: 20/10/70 %% calibration/"
                                  "validation/test split, 2 %% slices, isotonic/linear/polynomial chosen on "
                                  "validation; prints the test MAE")
    plot: str | None = option(None, "--plot", writes="file", metavar="PNG", config=False, help="plot of the slice curves")
