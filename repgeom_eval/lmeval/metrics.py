"""The geometry metrics of the repgeom tasks, registered with lm-eval (metric + aggregation per row of its table).

A task's ``process_results`` returns one item per query and metric (:func:`query_items`,
:func:`document_items`); lm-eval gathers the items of every rank and calls each metric's aggregation once with
the full list, in rank order (nothing here depends on the order). The items are what ``--log_samples`` writes:

=============================== ========================================== ==========================================
metric                          per-query item                             aggregation (table value)
=============================== ========================================== ==========================================
``repgeom_dispersion``          c_i, mean cosine distance to all queries   mean = D over all queries
``repgeom_dispersion_correct``  c_i against the correct queries (or null)  mean over correct queries = D(correct)
``repgeom_dispersion_incorrect`` the same for the incorrect ones           D(incorrect)
``repgeom_auroc``               [c_i, correct]                             AUROC of c_i for predicting correctness
``repgeom_acc_low_c``           [c_i, correct]                             accuracy of the lowest-c_i decile
``repgeom_acc_high_c``          [c_i, correct]                             accuracy of the highest-c_i decile
``repgeom_slice_spearman``      {doc_id, correct, ppl, prompt_ppl,         Spearman of the controlled-slice curve
                                vector (base64)}
``repgeom_token_dispersion``    D over the document's tokens (or null)     mean over documents
``repgeom_ppl_pearson``         [perplexity, token dispersion]             Pearson over documents
``repgeom_ppl_spearman``        [perplexity, token dispersion]             Spearman over documents
=============================== ========================================== ==========================================

In the ``repgeom_slice_spearman`` item, ``ppl`` is the gold answer's per-token perplexity given the prompt (the
continuation lm-eval scores), ``prompt_ppl`` the prompt's own per-token perplexity (its tokens after the first,
from the same forward pass; null when the context is one token).

The c_i are computed against the whole evaluated population (all ranks, see ``task``), so the mean of the c_i is
exactly D (docs/metrics.md#per-text-scores).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import lm_eval.api.metrics  # noqa: F401  (fills lm-eval's built-in registries before anything is added to them)
import numpy as np
from lm_eval.api.registry import aggregation_registry, metric_registry, register_aggregation, register_metric

from repgeom_eval.analyses import slices
from repgeom_eval.functional import stats
from repgeom_eval.analyses.queries import decode_vector, encode_vector

HARDNESS_METRICS = ("repgeom_dispersion", "repgeom_dispersion_correct", "repgeom_dispersion_incorrect",
                    "repgeom_auroc", "repgeom_acc_low_c", "repgeom_acc_high_c", "repgeom_slice_spearman")
PERPLEXITY_METRICS = ("repgeom_token_dispersion", "repgeom_ppl_pearson", "repgeom_ppl_spearman")


# -- items ---------------------------------------------------------------------------------------------------------

def _number(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def query_items(c: float, c_correct: float, c_incorrect: float, correct: bool, ppl: float,
                vector: np.ndarray, doc_id: int, prompt_ppl: float = math.nan) -> dict[str, Any]:
    """Every hardness metric's item for one query (``ppl``: the gold answer's perplexity; ``prompt_ppl``: the
    prompt's)."""
    ok = 1.0 if correct else 0.0
    return {
        "repgeom_dispersion": float(c),
        "repgeom_dispersion_correct": float(c_correct) if correct else None,
        "repgeom_dispersion_incorrect": None if correct else float(c_incorrect),
        "repgeom_auroc": [float(c), ok],
        "repgeom_acc_low_c": [float(c), ok],
        "repgeom_acc_high_c": [float(c), ok],
        "repgeom_slice_spearman": {"doc_id": int(doc_id), "correct": ok, "ppl": float(ppl),
                                   "prompt_ppl": _number(prompt_ppl), "vector": encode_vector(vector)},
    }


def document_items(perplexity: float, token_dispersion: float) -> dict[str, Any]:
    """Every perplexity-task metric's item for one document (token dispersion null below 2 tokens)."""
    d = _number(token_dispersion)
    return {
        "repgeom_token_dispersion": d,
        "repgeom_ppl_pearson": [float(perplexity), d],
        "repgeom_ppl_spearman": [float(perplexity), d],
    }


# -- aggregations --------------------------------------------------------------------------------------------------

def _pairs(items: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    rows = [(x, y) for x, y in items if x is not None and y is not None]
    if not rows:
        return np.zeros(0), np.zeros(0)
    x, y = zip(*rows)
    return np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)


def mean_of_defined(items: Sequence[float | None]) -> float:
    """Mean over the items that are not null (a query outside the subset, a document too short); NaN if none."""
    values = [float(v) for v in items if v is not None]
    return float(np.mean(values)) if values else float("nan")


def auroc(items: Sequence[Any]) -> float:
    c, ok = _pairs(items)
    return stats.auroc(c, ok)


def accuracy_low_c(items: Sequence[Any]) -> float:
    c, ok = _pairs(items)
    return slices.decile_accuracy(c, ok)[0]


def accuracy_high_c(items: Sequence[Any]) -> float:
    c, ok = _pairs(items)
    return slices.decile_accuracy(c, ok)[1]


def slice_spearman(items: Sequence[dict], size: int = slices.SLICE_SIZE, seeds: int = slices.SEEDS) -> float:
    """Spearman between fraction correct and mean slice dispersion over 0 %, 10 %, …, 100 %
    (docs/metrics.md#hardness-slices)."""
    if not items:
        return float("nan")
    items = sorted(items, key=lambda item: item["doc_id"])  # the random draws must not depend on rank order
    vectors = np.stack([decode_vector(item["vector"]) for item in items])
    correct = np.asarray([item["correct"] for item in items], dtype=np.float64)
    ppl = np.asarray([item["ppl"] for item in items], dtype=np.float64)
    return slices.controlled_slices(vectors, correct, ppl, size=size, seeds=seeds).spearman


def pearson(items: Sequence[Any]) -> float:
    x, y = _pairs(items)
    return stats.pearson(x, y)


def spearman(items: Sequence[Any]) -> float:
    x, y = _pairs(items)
    return stats.spearman(x, y)


# -- registration (import side effect; idempotent) -----------------------------------------------------------------

def _passthrough(items):
    """process_results already computed the item; lm-eval calls the metric function only for tasks without
    their own process_results."""
    return items


AGGREGATIONS = {
    "repgeom_mean": mean_of_defined,
    "repgeom_auroc": auroc,
    "repgeom_acc_low_c": accuracy_low_c,
    "repgeom_acc_high_c": accuracy_high_c,
    "repgeom_slice_spearman": slice_spearman,
    "repgeom_pearson": pearson,
    "repgeom_spearman": spearman,
}
# metric: (aggregation, higher_is_better); None = descriptive, no arrow in the table
METRICS = {
    "repgeom_dispersion": ("repgeom_mean", None),
    "repgeom_dispersion_correct": ("repgeom_mean", None),
    "repgeom_dispersion_incorrect": ("repgeom_mean", None),
    "repgeom_auroc": ("repgeom_auroc", None),
    "repgeom_acc_low_c": ("repgeom_acc_low_c", None),
    "repgeom_acc_high_c": ("repgeom_acc_high_c", None),
    "repgeom_slice_spearman": ("repgeom_slice_spearman", None),
    "repgeom_token_dispersion": ("repgeom_mean", None),
    "repgeom_ppl_pearson": ("repgeom_pearson", None),
    "repgeom_ppl_spearman": ("repgeom_spearman", None),
}

for _name, _fn in AGGREGATIONS.items():
    if _name not in aggregation_registry:
        register_aggregation(_name)(_fn)
for _name, (_agg, _better) in METRICS.items():
    if _name not in metric_registry:
        _extra = {} if _better is None else {"higher_is_better": _better}
        register_metric(metric=_name, aggregation=_agg, **_extra)(_passthrough)

# The names the lm_eval.metrics entry points point at (upstream's plugin loader imports `module:object`).
repgeom_dispersion = repgeom_dispersion_correct = repgeom_dispersion_incorrect = _passthrough
repgeom_auroc = repgeom_acc_low_c = repgeom_acc_high_c = repgeom_slice_spearman = _passthrough
repgeom_token_dispersion = repgeom_ppl_pearson = repgeom_ppl_spearman = _passthrough
