"""Embedding condensation by depth, for one model or several side by side (paper C Fig. 2;
docs/metrics.md#condensation).

For each model, one :func:`~repgeom_eval.measurement.engine.measure` run with the ``condensation`` metric at every hidden state
(``all``: embeddings, every block, final) gives per layer the mean token–token cosine (diagonal included, paper C's
statistic) and the histogram of all S² cosines of each text (the heatmap's rows), plus the Spearman ρ and Kendall τ_b
of the mean cosine against depth. Texts are truncated to ``max_length`` tokens (paper C: 512). Models of different
depth are compared on relative depth ℓ / L.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..spec.errors import RepgeomError
from ..functional.condensation import CONDENSATION_EPS, DEFAULT_BINS  # noqa: F401 - re-exported
from repgeom_eval.spec.options.model import ModelOptions
from repgeom_eval.modeling.loading import LoadedModel
from repgeom_eval.spec.options.analyses import CondensationConfig
from repgeom_eval.spec.option_fields import takes_options
from repgeom_eval.analyses.envelope import AnalysisResult
from repgeom_eval.analyses.series import series_labels

KIND = "condensation"
_DEFAULTS = CondensationConfig()  # the defaults under their earlier names (declared once, in the configuration)
DEFAULT_MAX_LENGTH = _DEFAULTS.max_length


@takes_options(CondensationConfig)
def condensation(models: Sequence[str | LoadedModel], data: Any, cfg: CondensationConfig, /, *,
                 model_options: ModelOptions | None = None) -> AnalysisResult:
    """Per-layer condensation of every model in ``models`` over the same texts; returns the ``condensation``
    result (``results["models"][label]``: layers, mean cosine, histogram densities, ρ, τ)."""
    from repgeom_eval.measurement.engine import measure

    t_start = time.perf_counter()
    if not models:
        raise RepgeomError("give at least one model")
    if not (isinstance(cfg.bins, int) and cfg.bins >= 1):
        raise RepgeomError(f"bins must be a positive integer, got {cfg.bins!r}")
    from repgeom_eval.measurement.texts import from_texts, load_texts

    textset = load_texts(data, text_field=cfg.text_field) if isinstance(data, (str, Path)) else (
        data if hasattr(data, "texts") else from_texts(list(data)))
    texts = list(textset.texts)
    if cfg.n_texts is not None:
        if cfg.n_texts < 1:
            raise RepgeomError(f"--n-texts must be positive, got {cfg.n_texts}")
        texts = texts[:cfg.n_texts]
    labels = series_labels(models)
    per_model: dict[str, Any] = {}
    infos, timings = [], {}
    for label, model in zip(labels, models):
        r = measure(model, texts, layers=cfg.layers, metrics=["condensation"], batch_size=cfg.batch_size,
                    max_length=cfg.max_length, dtype=cfg.dtype, device=cfg.device, progress=cfg.progress,
                    metric_params={"condensation": {"bins": cfg.bins, "eps": cfg.eps}}, model_options=model_options)
        addrs = list(r.results)
        values = [r.results[a]["condensation"] for a in addrs]
        summary = r.summary.get("condensation") or {}
        if len(addrs) < 3:
            raise RepgeomError(f"the depth trend needs at least 3 layer addresses, got {len(addrs)} "
                               f"({', '.join(addrs)}); pass --layers all")
        per_model[label] = {
            "layers": addrs,
            "relative_depth": [i / (len(addrs) - 1) for i in range(len(addrs))],
            "mean_cosine": [v["mean_cosine"] for v in values],
            "mean_cosine_excl_diag": [v["mean_cosine_excl_diag"] for v in values],
            "density": [v["histogram"]["density"] for v in values],
            "spearman": summary.get("spearman"),
            "kendall": summary.get("kendall"),
            "mean_last_n": summary.get("mean_last_n"),
            "n_texts": r.data.get("n_texts"),
            "n_tokens": r.data.get("n_tokens"),
        }
        infos.append(r.model)
        timings[f"{label}_s"] = r.timings["total_s"]
    from ..functional.condensation import histogram_edges

    result = AnalysisResult(KIND, config={}, results={}, models=infos)
    result.results = {"edges": [round(e, 9) for e in histogram_edges(cfg.bins).tolist()], "models": per_model}
    result.data = {"n_texts": len(texts), "path": textset.source}
    result.config = cfg.config_block({
        "statistic": "mean of all S² cosines per text (diagonal included), averaged over texts",
        "trend": "Spearman ρ and Kendall τ_b of the mean cosine against layer index"})
    timings["total_s"] = time.perf_counter() - t_start
    result.timings = timings
    return result
