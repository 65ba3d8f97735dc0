"""Default values shown in ``repgeom … --help``, one place for each.

The analysis and metric modules import torch; the CLI builds every command's help from these numbers without
importing them, so that ``--help`` stays instant (see benchmarks/README.md, ``bench_startup.py``). Each analysis
module re-exports its own defaults under its usual names (``ppl_bins.DEFAULT_GROUP_SIZE`` …)."""

from __future__ import annotations

# repgeom gap (paper A's dispersion gap of the output embeddings)
GAP_DOMAIN = "digits"
GAP_REFERENCE = "general"
GAP_SIZE = 1000
GAP_SEED = 0
GAP_DISTANCES = ("cosine", "euclidean")

# repgeom ppl-bins
PPL_BINS_CHUNK_LEN = 512
PPL_BINS_GROUP_SIZE = "auto"  # or a number of chunks; auto: see the next two
PPL_BINS_GROUPS_PER_SOURCE = 20  # auto: the smallest source's chunks / this many groups ...
PPL_BINS_GROUP_SIZE_MAX = 100  # ... capped here (paper A's group size, reached from 2000 chunks a source on)
PPL_BINS_BINS = 100
PPL_BINS_SEED = 42  # paper A: random.seed(42)
PPL_BINS_CONFOUND_RATIO = 2.0

# repgeom slices
SLICES_SLICE_SIZE = 100
SLICES_SEEDS = 10

# repgeom knn-keys
KNN_KEYS_CANDIDATES = ("resid_mid:-1", "resid_post:-1", "mlp_in:-1")
KNN_KEYS_NS = (10, 50, 100)
KNN_KEYS_SEEDS = 10
KNN_KEYS_CHUNK_LEN = 512

# repgeom knnlm
KNNLM_K = 1024
KNNLM_LAMBDA = 0.25
KNNLM_TEMPERATURE = 1.0
KNNLM_CHUNK_LEN = 512
KNNLM_IVF_THRESHOLD = 100_000

# repgeom clusters
CLUSTERS_NGRAM = 10
CLUSTERS_MIN_COUNT = 100
CLUSTERS_CONTEXTS = 100
CLUSTERS_CONTEXT_LEN = 100
CLUSTERS_CLUSTERS = 500

# repgeom perturb
PERTURB_SWEEPS = ("repetition", "random", "length")
PERTURB_PS = (0.0, 0.25, 0.5, 0.75, 1.0)
PERTURB_LENGTHS = (16, 32, 64, 128)
PERTURB_PROMPTS = 32

# repgeom condensation and the condensation metric
CONDENSATION_MAX_LENGTH = 512
CONDENSATION_BINS = 50
