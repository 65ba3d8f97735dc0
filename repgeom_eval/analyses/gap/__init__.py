"""The dispersion gap G of a checkpoint's output projection, behind ``repgeom gap`` (paper A §3.2).

Checkpoints are ranked by G without loading them or running a forward pass (docs/metrics.md#dispersion-gap).
One idea per module, in the order a screening run uses them:

* :mod:`.weights`      read the output-embedding tensor (safetensors, sharded or not, or GGUF) and the tokenizer of
                       a checkpoint without loading the model;
* :mod:`.vocabulary`   a tokenizer's vocabulary as stripped token texts, and token-set specs resolved to token ids;
* :mod:`.screening`    :func:`screen`: the vocabulary check, T and T̄ per model, G per model, the ranking.

The distance math (within, between, G) is pure and lives in :mod:`repgeom_eval.functional.gap_distances`; the
Spearman correlation of ``--scores`` comes from :mod:`repgeom_eval.functional.stats`.
"""

from ...functional.gap_distances import DISTANCES, SIGN, dispersion_gap
from repgeom_eval.modeling.checkpoint_tensors import EmbeddingInfo, OutputEmbeddings, load_tokenizer, open_output_embeddings, read_output_embeddings
from .screening import GapResult, screen
from .vocabulary import (
    DEFAULT_DOMAIN,
    DEFAULT_REFERENCE,
    DEFAULT_SEED,
    DEFAULT_SIZE,
    TokenSet,
    Vocabulary,
    resolve_token_set,
    strip_token_text,
    vocabulary_difference,
)

__all__ = [
    "DEFAULT_DOMAIN",
    "DEFAULT_REFERENCE",
    "DEFAULT_SEED",
    "DEFAULT_SIZE",
    "DISTANCES",
    "SIGN",
    "EmbeddingInfo",
    "GapResult",
    "OutputEmbeddings",
    "TokenSet",
    "Vocabulary",
    "dispersion_gap",
    "load_tokenizer",
    "open_output_embeddings",
    "read_output_embeddings",
    "resolve_token_set",
    "screen",
    "strip_token_text",
    "vocabulary_difference",
]
