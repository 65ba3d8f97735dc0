"""Geometry of the embeddings an mteb task scored, written into the same result as the scores.

``attach_geometry(task)`` wraps one task instance's ``evaluate``: while it runs, a :class:`LayerEncoder` keeps the
embeddings it returns; afterwards each subset's score dict gets ``repgeom_*`` keys computed by the project's metric
plugins (``dataset_entropy``, ``dispersion``, ``effective_rank``) on the distinct texts embedded for that split and
subset (queries and documents for retrieval; the evaluated split, not the training split, for classification), the
``repgeom.*`` values of the sweep's requested metrics (:mod:`.metrics`), and the main score's name.
mteb saves extra keys of a subset's score dict in its cache and loads them back.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from repgeom_eval.metric import LayerBatch
from repgeom_eval.plugin_system.host import PluginHost, get_host

#: score key → (metric plugin, field of its result or None for a float result)
GEOMETRY_KEYS = {
    "repgeom_dataset_entropy": ("dataset_entropy", "normalized"),
    "repgeom_dataset_entropy_raw": ("dataset_entropy", "raw"),
    "repgeom_dispersion": ("dispersion", None),
    "repgeom_effective_rank": ("effective_rank", "rankme"),
}
#: score key naming the task's main score (mteb's result files hold only its value)
MAIN_SCORE_NAME_KEY = "repgeom_main_score_name"
GEOMETRY_CONFIG = ("dataset_entropy: von Neumann entropy of the centred, unit embeddings, normalised by "
                   "log min(N, D) (paper B's maxEntropy); dispersion: mean pairwise cosine distance; "
                   "effective_rank: RankMe of the embedding matrix (no centring)")


def geometry_scores(vectors: np.ndarray, host: PluginHost | None = None) -> dict[str, float]:
    """``repgeom_*`` values of an N×D embedding matrix, from the registered metric plugins."""
    host = host or get_host()
    x = torch.from_numpy(np.asarray(vectors, dtype=np.float64))
    batch = LayerBatch("embeddings", torch.arange(x.shape[0]), pooled=x)
    results: dict[str, Any] = {}
    for metric_name, _ in GEOMETRY_KEYS.values():
        if metric_name not in results:
            metric = host.metrics.get(metric_name)()
            metric.update(batch)
            results[metric_name] = metric.compute()
    out = {}
    for key, (metric_name, field) in GEOMETRY_KEYS.items():
        value = results[metric_name] if field is None else results[metric_name][field]
        out[key] = float(value)
    out["repgeom_n_texts"] = int(x.shape[0])
    return out


def attach_geometry(task: Any, host: PluginHost | None = None) -> Any:
    """Wrap ``task.evaluate`` (this instance only) so layer encoders add ``repgeom_*`` keys to every subset's
    scores; other models pass through untouched. Idempotent; returns the task."""
    from .encoder import LayerEncoder

    if getattr(task, "_repgeom_geometry", False):
        return task
    original = task.evaluate

    @functools.wraps(original)
    def evaluate(model, split: str = "test", subsets_to_run=None, **kwargs):
        if not isinstance(model, LayerEncoder):
            return original(model, split, subsets_to_run, **kwargs)
        name = task.metadata.name
        metrics = model.sweep.metrics
        if metrics is not None:
            metrics.evaluating = (name, split)  # this split's encodes feed the registered metrics
        try:
            with model.recording():
                scores = original(model, split, subsets_to_run, **kwargs)
        finally:
            if metrics is not None:
                metrics.evaluating = None
        for subset, subset_scores in scores.items():
            vectors = model.take_embeddings(name, split, subset)
            if vectors is not None:
                subset_scores.update(geometry_scores(vectors, host))
            if metrics is not None:
                subset_scores.update(metrics.scores((name, split, subset), model.address, model.sweep.embedder))
            subset_scores["repgeom_depth"] = model.depth
            if model.sweep.prep_record is not None:  # --preprocess: what was done, statistics from where
                subset_scores["repgeom_preprocess"] = model.sweep.prep_record
            # mteb's result file names the main score's value, not the score: keep its name for the summary
            subset_scores[MAIN_SCORE_NAME_KEY] = task.metadata.main_score
        return scores

    task.evaluate = evaluate
    task._repgeom_geometry = True
    return task
