"""Clusters of contexts that share a continuation (paper A §2.3): within- and between-cluster distances by depth.

A cluster is an n-gram (default n = 10) that occurs at least ``min_count`` times in the corpus; its members are
the ``context_len`` tokens (default 100) that precede up to ``contexts`` (default 100) of its occurrences, drawn with
``random.Random(seed)``. Each member is represented by the hidden state at its last token — the vector from which
the model predicts the shared continuation. The ``n_clusters`` most frequent n-grams (default 500) are kept.

Per address (paper A's definitions; the centroid is this project's choice, the paper does not say):

* within-cluster distance = mean over clusters of the mean cosine distance 1 − cos(x_i, c) of the members to the
  cluster centroid c = mean of the members' unit vectors;
* between-cluster distance = mean pairwise cosine distance of the centroids (:func:`dispersion`, O(K·d)).

Only occurrences with a full left context inside one document count. Several models (a series of checkpoints) are
measured on the same contexts, which requires the same tokenizer.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..spec.errors import RepgeomError
from ..functional.dispersion import dispersion, unit
from repgeom_eval.spec.options.model import ModelOptions
from repgeom_eval.modeling.loading import LoadedModel, load_model
from .corpus import Chunk, check_context, load_documents, tokenize_documents
from .knn_keys import last_token_vectors
from .series import series_labels
from repgeom_eval.spec.options.analyses import ClustersConfig
from repgeom_eval.spec.option_fields import takes_options
from repgeom_eval.analyses.envelope import AnalysisResult
from repgeom_eval.modeling.addresses import resolve_request

KIND = "clusters"
_DEFAULTS = ClustersConfig()  # the defaults under their earlier names (declared once, in the configuration)
DEFAULT_NGRAM = _DEFAULTS.ngram
DEFAULT_MIN_COUNT = _DEFAULTS.min_count
DEFAULT_CONTEXTS = _DEFAULTS.contexts
DEFAULT_CONTEXT_LEN = _DEFAULTS.context_len
DEFAULT_CLUSTERS = _DEFAULTS.n_clusters


@dataclass(frozen=True)
class Cluster:
    ngram: tuple[int, ...]
    count: int  # eligible occurrences in the corpus
    contexts: tuple[tuple[int, ...], ...]  # the sampled left contexts


def find_clusters(token_docs: Sequence[Sequence[int]], ngram: int = DEFAULT_NGRAM,
                  min_count: int = DEFAULT_MIN_COUNT, contexts: int = DEFAULT_CONTEXTS,
                  context_len: int = DEFAULT_CONTEXT_LEN, n_clusters: int = DEFAULT_CLUSTERS,
                  seed: int = 0) -> list[Cluster]:
    """The ``n_clusters`` most frequent n-grams with ≥ ``min_count`` occurrences that have ``context_len`` tokens of
    left context in their document (ties: first occurrence first), each with up to ``contexts`` sampled contexts."""
    for name, v in (("n-gram length", ngram), ("minimum count", min_count), ("contexts per cluster", contexts),
                    ("context length", context_len), ("number of clusters", n_clusters)):
        if v < 1:
            raise RepgeomError(f"{name} must be positive, got {v}")
    counts: Counter[tuple[int, ...]] = Counter()
    for ids in token_docs:
        for i in range(context_len, len(ids) - ngram + 1):
            counts[tuple(ids[i:i + ngram])] += 1
    frequent = [g for g, c in counts.items() if c >= min_count]  # Counter keeps first-seen order
    frequent.sort(key=lambda g: -counts[g])
    chosen = set(frequent[:n_clusters])
    where: dict[tuple[int, ...], list[tuple[int, int]]] = {g: [] for g in chosen}
    for d, ids in enumerate(token_docs):
        for i in range(context_len, len(ids) - ngram + 1):
            g = tuple(ids[i:i + ngram])
            if g in chosen:
                where[g].append((d, i))
    rng = random.Random(seed)
    out = []
    for g in frequent[:n_clusters]:
        occ = where[g] if len(where[g]) <= contexts else sorted(rng.sample(where[g], contexts))
        out.append(Cluster(g, counts[g], tuple(tuple(token_docs[d][i - context_len:i]) for d, i in occ)))
    return out


def cluster_distances(vectors: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Within- and between-cluster cosine distances of per-cluster member vectors (each [m_k, d])."""
    centroids, within = [], []
    for x in vectors:
        u = unit(x.double())
        c = u.mean(0)
        centroids.append(c)
        within.append(float((1.0 - u @ unit(c)).mean()))
    between = float(dispersion(torch.stack(centroids)))
    mean_within = sum(within) / len(within)
    return {"within": mean_within, "between": between,
            "ratio": between / mean_within if mean_within > 0 else float("nan"), "per_cluster_within": within}


@takes_options(ClustersConfig)
def clusters(models: Sequence[str | LoadedModel], data: Any, cfg: ClustersConfig, /, *,
             model_options: ModelOptions | None = None) -> AnalysisResult:
    """Within/between-cluster distances at ``layers`` for every model in ``models`` (same contexts for all)."""
    from .gap.vocabulary import vocabulary_difference

    t_start = time.perf_counter()
    if not models:
        raise RepgeomError("give at least one model")
    docs, data_path = load_documents(data, cfg.text_field)
    labels = series_labels(models)
    found: list[Cluster] | None = None
    first_tok = None
    per_model: dict[str, Any] = {}
    infos = []
    for label, model in zip(labels, models):
        loaded = model if isinstance(model, LoadedModel) else load_model(
            model, dtype=cfg.dtype, device=cfg.device, options=model_options)
        check_context(cfg.context_len, loaded.info.max_positions)
        addrs = list(resolve_request(cfg.layers, loaded).addresses)
        if found is None:
            first_tok = loaded.tokenizer
            found = find_clusters(tokenize_documents(loaded.tokenizer, docs), cfg.ngram, cfg.min_count,
                                  cfg.contexts, cfg.context_len, cfg.n_clusters, cfg.seed)
            if len(found) < 2:
                raise RepgeomError(
                    f"corpus too small: {len(found)} {cfg.ngram}-gram(s) occur {cfg.min_count}+ times after "
                    f"{cfg.context_len} tokens of context (between-cluster distance needs 2 clusters); give more "
                    f"text or lower --ngram / --min-count / --context-len")
        else:
            diff = vocabulary_difference(first_tok, loaded.tokenizer)
            if diff is not None:
                raise RepgeomError(f"{label} has another tokenizer than {labels[0]} ({diff}); a checkpoint series "
                                   "must share one tokenizer so that the clusters are the same")
        members = [Chunk(ctx, "all", k, 0) for k, cl in enumerate(found) for ctx in cl.contexts]
        owner = [k for k, cl in enumerate(found) for _ in cl.contexts]
        vecs = last_token_vectors(loaded, members, addrs, cfg.batch_size, cfg.progress)
        index = torch.tensor(owner)
        names = [str(a) for a in addrs]
        stats = {name: cluster_distances([vecs[a][index == k] for k in range(len(found))])
                 for a, name in zip(addrs, names)}
        per_model[label] = {"layers": names,
                            "relative_depth": [i / max(1, len(names) - 1) for i in range(len(names))],
                            **{key: [stats[n][key] for n in names] for key in ("within", "between", "ratio")},
                            "per_cluster_within": {n: stats[n]["per_cluster_within"] for n in names}}
        infos.append(loaded.info.to_dict())
    assert found is not None and first_tok is not None
    result = AnalysisResult(KIND, config={}, results={}, models=infos)
    sizes = [len(c.contexts) for c in found]
    result.results = {
        "clusters": [{"ngram": first_tok.decode(list(c.ngram)), "count": c.count, "n_contexts": len(c.contexts)}
                     for c in found],
        "models": per_model,
    }
    if len(found) < cfg.n_clusters:  # --clusters asks for at most this many; say what the corpus gave
        result.warn(f"--clusters {cfg.n_clusters}: the corpus has only {len(found)} {cfg.ngram}-grams that occur "
                    f"{cfg.min_count}+ times with {cfg.context_len} tokens of context; all {len(found)} were used")
    if min(sizes) < cfg.contexts:
        result.warn(f"{sum(s < cfg.contexts for s in sizes)} of {len(found)} clusters have fewer than "
                    f"{cfg.contexts} contexts (smallest: {min(sizes)}); --min-count {cfg.min_count} is below "
                    f"--contexts {cfg.contexts}")
    result.data = {"path": data_path, "n_documents": len(docs), "n_clusters": len(found),
                   "n_contexts": sum(sizes)}
    result.config = cfg.config_block({
        "n_clusters_used": len(found), "vector": "hidden state at the last context token",
        "within": "mean over clusters of mean cosine distance to the centroid (mean unit vector)",
        "between": "mean pairwise cosine distance of the centroids",
        "paper_defaults": "10-grams, 100 contexts of 100 tokens, 500 clusters (paper A §2.3)"})
    result.timings = {"total_s": time.perf_counter() - t_start}
    return result
