"""Geometry of the embeddings an mteb task scored, written into the same result as the scores.

``attach_geometry(task)`` wraps one task instance's ``evaluate``: while it runs, a :class:`LayerEncoder` keeps the
embeddings it returns; afterwards each subset's score dict gets ``repgeom_*`` keys computed by the project's metric
plugins (``dataset_entropy``, ``dispersion``, ``effective_rank``) on the distinct texts embedded for that split and
subset (queries and documents for retrieval; the evaluated split, not the training split, for classification), the
``repgeom.*`` values of the sweep's requested metrics (:mod:`.metrics`), and the main score's name.
mteb saves extra keys of a subset's score dict in its cache and loads them back.

The same keys reach plain ``mteb.evaluate(layer_encoder(...), tasks)`` and the legacy ``mteb.MTEB(tasks).run(...)``:
importing :mod:`repgeom_eval.mteb_layers` wraps the ``evaluate`` method of mteb's task classes
(:func:`install_geometry_hook`), and the wrapper acts only when the model is a :class:`LayerEncoder` (any other model
passes through untouched). The score dicts it fills are the ones mteb turns into its ``TaskResult`` and cache files.

Degenerate numbers are said, as ``repgeom measure`` says them: when one hidden dimension carries at least half of the
squared norm of the scored embeddings (massive activations), when some embeddings are zero vectors, or when a
geometry value is NaN, the score dict gets the message in ``repgeom_warnings`` (a JSON list) and it is logged
(logger ``repgeom_eval.mteb_layers``) and raised as a Python warning.
"""

from __future__ import annotations

import functools
import json
import logging
import warnings
from typing import Any

import numpy as np
import torch

from repgeom_eval.measurement.degenerate import degenerate_warning
from repgeom_eval.spec.metric import LayerBatch
from repgeom_eval.plugin_system.host import PluginHost, get_host

from .pick import PICK_KEY

#: score key → (metric plugin, field of its result or None for a float result)
GEOMETRY_KEYS = {
    "repgeom_dataset_entropy": ("dataset_entropy", "normalized"),
    "repgeom_dataset_entropy_raw": ("dataset_entropy", "raw"),
    "repgeom_dispersion": ("dispersion", None),
    "repgeom_effective_rank": ("effective_rank", "rankme"),
}
#: score key naming the task's main score (mteb's result files hold only its value)
MAIN_SCORE_NAME_KEY = "repgeom_main_score_name"
#: score keys of the degenerate-number checks (see the module docstring)
WARNINGS_KEY = "repgeom_warnings"
MASSIVE_KEYS = ("repgeom_massive_dimension", "repgeom_massive_share")
ZERO_KEY = "repgeom_zero_vectors"
#: share of the squared norm one dimension must carry to be warned about (``repgeom measure``'s default)
MASSIVE_SHARE_WARNING = 0.5
logger = logging.getLogger("repgeom_eval.mteb_layers")
logger.addHandler(logging.NullHandler())  # a library: shown where the application configures logging
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
    out[ZERO_KEY] = int((x.abs().sum(1) == 0).sum())
    energy = host.metrics.get("massive_activations")(top_k=1) if "massive_activations" in host.metrics else None
    if energy is not None:
        energy.update(batch)
        top = energy.compute()
        if top["top_dimensions"]:
            out[MASSIVE_KEYS[0]], out[MASSIVE_KEYS[1]] = int(top["top_dimensions"][0]), float(top["top_shares"][0])
    return out


def geometry_warnings(scores: dict[str, Any], model: str, where: str) -> list[str]:
    """The degenerate-number messages of one score dict (``where``: the layer, task, split and subset), worded as
    ``repgeom measure`` words them."""
    said = [f"model {model!r}: {line} (at {where})" for line in metric_lines(scores)]
    share = _number(scores.get(MASSIVE_KEYS[1]))
    if share is not None and share >= MASSIVE_SHARE_WARNING:
        said.append(f"model {model!r}: one hidden dimension carries at least {MASSIVE_SHARE_WARNING:.0%} of the "
                    f"squared norm of the embeddings mteb scored at {where} (dim {scores[MASSIVE_KEYS[0]]}: "
                    f"{share:.0%}); cosine-based scores and geometry there mostly measure that dimension. See the "
                    "massive_activations metric, or try --preprocess standardize")
    values = {key: scores[key] for key in GEOMETRY_KEYS if key in scores}
    counts = {"n_vectors": scores.get("repgeom_n_texts"), "n_zero_vectors": scores.get(ZERO_KEY)}
    degenerate = degenerate_warning(model, {where: values}, {where: {"dispersion": counts}})
    if degenerate:
        said.append(degenerate)
    return said


def metric_lines(scores: dict[str, Any]) -> list[str]:
    """The requested metrics' own warnings in one score dict (a JSON list of lines; anything else holds none)."""
    from .metrics import METRIC_WARNINGS_KEY

    raw = scores.get(METRIC_WARNINGS_KEY)
    try:
        lines = json.loads(raw) if isinstance(raw, (str, bytes)) else raw
    except ValueError:
        return []
    return [str(line) for line in lines] if isinstance(lines, (list, tuple)) else []


def _number(value: Any) -> float | None:
    """``value`` as a float when it is a real number (a share read back from a score dict), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _evaluate(original: Any, task: Any, model: Any, split: str, subsets_to_run: Any, kwargs: dict,
              host: PluginHost | None) -> Any:
    """``original(model, split, subsets_to_run, **kwargs)`` (a task's evaluate), with the ``repgeom_*`` keys added
    to every subset's scores when ``model`` is a layer encoder not already being recorded."""
    from .encoder import LayerEncoder

    if not isinstance(model, LayerEncoder) or model._recording:  # another model, or an outer wrapper records it
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
        pick = model.sweep.pick_records.get(name)
        if pick is not None:  # --layer auto: which layer was picked, by which rule, and every layer's score
            subset_scores[PICK_KEY] = pick
        if model.sweep.prep_record is not None:  # --preprocess: what was done, statistics from where
            subset_scores["repgeom_preprocess"] = model.sweep.prep_record
        # mteb's result file names the main score's value, not the score: keep its name for the summary
        subset_scores[MAIN_SCORE_NAME_KEY] = task.metadata.main_score
        said = geometry_warnings(subset_scores, model.name, f"{model.address} ({name}, {split}, {subset})")
        subset_scores[WARNINGS_KEY] = json.dumps(said)
        for message in said:
            logger.warning(message)
        if said and model.sweep.said is not None:  # a sweep: one warning per task, when the task is done
            model.sweep.said.append((model.address, f"{name} ({split}, {subset})", dict(subset_scores)))
        elif said:
            for message in said:
                warnings.warn(message, stacklevel=3)
    return scores


def sweep_warning(model: str, said: list[tuple[Any, str, dict[str, Any]]]) -> str | None:
    """One line for the degenerate numbers and the requested metrics' warnings of a sweep's evaluations
    (``(address, where, scores)`` each), layers merged as ``repgeom measure`` merges them
    (``resid_post:1..27 (dim 507: 53-98%)``; ``massive_activations: ... (at embed, resid_post:0..5)``)."""
    from repgeom_eval.measurement.results import address_runs, compact

    parts = []
    for where in dict.fromkeys(w for _, w, _ in said):
        items = [(a, scores) for a, w, scores in said if w == where]
        lines: dict[str, list[str]] = {}  # a requested metric's warning → the layers that gave it
        for a, sc in items:
            for line in metric_lines(sc):
                lines.setdefault(line, []).append(str(a))
        parts += [f"on {where}, {line} (at {address_runs(at)})" for line, at in lines.items()]
        shares = [(a, sc, _number(sc.get(MASSIVE_KEYS[1]))) for a, sc in items]
        massive = [(a, sc.get(MASSIVE_KEYS[0]), share) for a, sc, share in shares
                   if share is not None and share >= MASSIVE_SHARE_WARNING]
        if massive:
            parts.append(f"one hidden dimension carries at least {MASSIVE_SHARE_WARNING:.0%} of the squared norm of "
                         f"the embeddings mteb scored on {where} at {len(massive)} layer(s): {compact(massive)}; "
                         "cosine-based scores and geometry there mostly measure that dimension (try --preprocess "
                         "standardize)")
        values = {str(a): {k: sc[k] for k in GEOMETRY_KEYS if k in sc} for a, sc in items}
        counts = {str(a): {"dispersion": {"n_vectors": sc.get("repgeom_n_texts"), "n_zero_vectors": sc.get(ZERO_KEY)}}
                  for a, sc in items}
        degenerate = degenerate_warning(None, values, counts)
        if degenerate:
            parts.append(f"on {where}, {degenerate[len('the model: '):]}")
    return f"model {model!r}: " + "; ".join(parts) if parts else None


def install_geometry_hook(host: PluginHost | None = None) -> None:
    """Wrap ``evaluate`` of mteb's task classes (every class under ``AbsTask`` that defines its own), so that any
    evaluation of a :class:`LayerEncoder` (``mteb.evaluate``, ``mteb.MTEB(...).run``, ``run_layers``) gets the
    ``repgeom_*`` keys. Other models pass through. Idempotent."""
    from mteb.abstasks.abstask import AbsTask

    seen, todo = set(), [AbsTask]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo.extend(cls.__subclasses__())
        original = cls.__dict__.get("evaluate")
        if original is None or getattr(original, "_repgeom_hook", False) or getattr(original, "__isabstractmethod__",
                                                                                   False):
            continue

        def make(original: Any) -> Any:
            @functools.wraps(original)
            def evaluate(self, model, split: str = "test", subsets_to_run=None, **kwargs):
                return _evaluate(functools.partial(original, self), self, model, split, subsets_to_run, kwargs, host)

            evaluate._repgeom_hook = True  # type: ignore[attr-defined]
            return evaluate

        cls.evaluate = make(original)


def attach_geometry(task: Any, host: PluginHost | None = None) -> Any:
    """Wrap ``task.evaluate`` (this instance only; for a task class defined after the package was imported, which
    :func:`install_geometry_hook` has not seen) so layer encoders add ``repgeom_*`` keys to every subset's scores;
    other models pass through untouched. Idempotent; returns the task."""
    if getattr(task, "_repgeom_geometry", False):
        return task
    original = task.evaluate

    @functools.wraps(original)
    def evaluate(model, split: str = "test", subsets_to_run=None, **kwargs):
        return _evaluate(original, task, model, split, subsets_to_run, kwargs, host)

    task.evaluate = evaluate
    task._repgeom_geometry = True
    return task
