"""``--preprocess`` for MTEB layer embeddings: centre, standardize or whiten the pooled vectors mteb scores.

The transform is :mod:`repgeom_eval.measurement.preprocess`'s (one implementation for ``measure`` and ``mteb``),
applied per layer address between pooling and unit normalisation: ``embedding = unit?((pooled − mean) / std)``.
Its statistics are those of the recipe's pooled vectors (kind = the pooling method, as ``measure`` keys pooled
statistics) and come from

* ``--preprocess-stats FILE``: a file written by ``repgeom measure --save-preprocess-stats`` with the same pooling
  (``measure --pooling <the recipe's>`` and a pooled metric); every evaluated address must be in it, at the model's
  hidden size; or, without a file,
* **the task's own texts** (``statistics: task``): before a task is evaluated, a dry run of mteb's evaluation with a
  placeholder encoder lists every text the evaluation embeds (all evaluated splits and subsets; both sides of STS
  pairs, queries and documents, and the training texts of classification), and one forward pass over those distinct
  texts gives each layer's moments. That pass is also the sweep's: the evaluations answer from its pooled vectors,
  so preprocessing adds no forward pass unless ``--metrics`` need token vectors fed.

The choice is part of every result's identity (``experiment_kwargs``: ``preprocess`` and ``preprocess_stats`` =
``task`` or ``file-<sha256 prefix>``) and is written into every score dict as ``repgeom_preprocess`` (a JSON string).
``--metrics`` read the raw hidden states as before; the ``repgeom_*`` geometry describes the vectors mteb scored.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mteb.models.abs_encoder import AbsEncoder

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.measurement.preprocess import METHODS, Preprocessor, VectorStats
from repgeom_eval.modeling.addresses import Address

from .embedder import LayerEmbedder

#: score-dict key recording the preprocessing of a result (a JSON string)
PREPROCESS_KEY = "repgeom_preprocess"


def check_method(method: str, stats_file: str | Path | None) -> None:
    if method not in METHODS:
        raise RepgeomError(f"unknown preprocess {method!r} (valid: {', '.join(METHODS)})")
    if method == "none" and stats_file:
        raise RepgeomError("--preprocess-stats has no effect without preprocessing; add --preprocess center, "
                           "standardize or whiten")


def file_digest(path: str | Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def load_stats_file(path: str | Path, method: str, embedder: LayerEmbedder,
                    addresses: Sequence[Address], allow_other: bool = False) -> Preprocessor:
    """The transforms of a ``measure --save-preprocess-stats`` file, checked against the model that wrote it (its
    content hash; ``allow_other`` accepts another model's, recorded) and every evaluated address."""
    from repgeom_eval.measurement.checkpoint import model_identity

    prep = Preprocessor.load(path, method)
    prep.check_identity(model_identity(embedder.loaded), embedder.loaded.info.name, allow_other)
    kind = embedder.recipe.pooling
    width = embedder.loaded.info.hidden_size
    missing = [str(a) for a in addresses if Preprocessor.key(str(a), kind) not in prep.transforms]
    if missing:
        have = sorted(prep.transforms)
        raise RepgeomError(
            f"preprocess statistics {path} have no entry for {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}"
            f" with {kind} pooling; they cover {', '.join(have[:8])}{' ...' if len(have) > 8 else ''} (write them "
            f"with `repgeom measure --layers ... --pooling {kind} --preprocess {method} --save-preprocess-stats`)")
    for a in addresses:
        got = prep.transforms[Preprocessor.key(str(a), kind)]["shift"].shape[-1]
        if got != width:
            raise RepgeomError(f"preprocess statistics {path} are for vectors of dimension {got}, but {a} of "
                               f"{embedder.source} has dimension {width}; they come from another model")
    return prep


class TextProbe(AbsEncoder):
    """A placeholder mteb encoder: records every text an evaluation embeds (prompt prefixed, as the layer encoder
    sees them) and answers with seeded random vectors, so the dry run costs no forward pass."""

    def __init__(self, meta: Any, prompts: dict[str, str] | None, dim: int):
        self.model = None
        self.model_prompts = prompts or None
        self.mteb_model_meta = meta.model_copy(update={"name": "repgeom/text-probe", "experiment_kwargs": None})
        self.dim = dim
        self.texts: dict[str, None] = {}
        self._rng = np.random.default_rng(0)

    def encode(self, inputs, *, task_metadata, hf_split: str, hf_subset: str, prompt_type=None,
               **kwargs: Any) -> np.ndarray:
        texts: list[str] = []
        for batch in inputs:
            texts.extend(batch.get("text", []))
        prompt_name = self.get_prompt_name(task_metadata, prompt_type)
        if prompt_name:
            texts = [self.model_prompts[prompt_name] + t for t in texts]  # type: ignore[index]
        for t in texts:
            if isinstance(t, str):
                self.texts.setdefault(t)
        return self._rng.standard_normal((len(texts), self.dim)).astype(np.float32)


def task_texts(task: Any, meta: Any, embedder: LayerEmbedder, encode_kwargs: dict[str, Any]) -> list[str]:
    """Every distinct text mteb's evaluation of ``task`` embeds (all its evaluated splits), in first-seen order,
    from a dry run with :class:`TextProbe` (no cache, nothing written)."""
    import mteb

    probe = TextProbe(meta, embedder.prompts, embedder.loaded.info.hidden_size)
    mteb.evaluate(probe, task, cache=None, encode_kwargs=dict(encode_kwargs), show_progress_bar=False)
    return list(probe.texts)


def fit_on_texts(embedder: LayerEmbedder, texts: Sequence[str], addresses: Sequence[Address], method: str,
                 batch_size: int, progress: bool = False) -> tuple[Preprocessor, dict[Address, np.ndarray]]:
    """One forward pass over ``texts`` at every address: the transforms (statistics of the pooled vectors) and the
    pooled vectors themselves, float32, row i for text i."""
    pooled = embedder.embed(texts, addresses, batch_size=batch_size, progress=progress,
                            desc=f"preprocess statistics ({len(addresses)} layer{'s' if len(addresses) > 1 else ''})",
                            raw=True)
    kind = embedder.recipe.pooling
    stats: dict[str, VectorStats] = {}
    for a in addresses:
        s = VectorStats(full_covariance=method == "whiten")
        s.update(torch.from_numpy(pooled[a]))
        stats[Preprocessor.key(str(a), kind)] = s
    try:
        prep = Preprocessor.from_stats(method, stats, f"the task's own {len(texts)} texts")
    except RepgeomError as exc:
        raise RepgeomError(f"{exc} (statistics from the task's own {len(texts)} distinct texts)") from None
    return prep, pooled


def record(method: str, source: str, *, n_texts: int | None = None, file: str | None = None,
           sha256: str | None = None, pooling: str, accepted_from_other_model: dict | None = None) -> str:
    """The ``repgeom_preprocess`` value: what was done and where the statistics came from (a JSON string, since
    mteb rounds every number of a score dict)."""
    doc: dict[str, Any] = {"method": method, "statistics": source, "pooling": pooling,
                           "applied": "pooled vectors, before unit normalisation"}
    if source == "task":
        doc["n_texts"] = n_texts
        doc["texts"] = "every distinct text the task's evaluation embeds (all evaluated splits)"
    else:
        doc["file"] = file
        doc["sha256"] = sha256
        if accepted_from_other_model is not None:  # --allow-other-stats: statistics of another model, said so
            doc["allow_other_stats"] = accepted_from_other_model
    return json.dumps(doc, sort_keys=True)
