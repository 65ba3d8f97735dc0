"""Hardness analysis over per-query vectors with correctness labels (paper A §3.1 and B.1).

* :func:`query_scores`: c_i, the mean cosine distance of query i to all others (their mean is the dispersion D),
  and the same against the correct and the incorrect queries only. O(N·d) through the sum identity.
* :func:`decile_accuracy` (and :func:`repgeom_eval.functional.stats.auroc`): how well c_i separates correct from
  incorrect queries.
* :func:`controlled_slices`: slices of ``size`` queries with a controlled fraction correct (0 %, 10 %, …, 100 %),
  drawn without replacement for each of ``seeds`` seeds; per fraction the mean ± s.e. over seeds of the slice
  dispersion (D across the slice's vectors) and of the slice's mean perplexities (of the gold answers given the
  prompts, and of the prompts themselves, where known); Spearman of the curve.
* :func:`calibrate`: predict a slice's accuracy from its dispersion (20 % calibration / 10 % validation / 70 %
  test; dense 2 % slices; isotonic, linear and polynomial regressors chosen on validation; MAE on test).

Everything takes plain arrays: ``vectors`` [N, d], ``correct`` [N] (0/1), ``ppl`` [N] (optional: the gold answer's
per-token perplexity given the prompt, what lm-eval scores) and ``prompt_ppl`` [N] (optional: the prompt's own).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from repgeom_eval.functional.dispersion import DispersionSums
from repgeom_eval.functional.stats import spearman

FRACTIONS = tuple(round(i / 10, 1) for i in range(11))
DENSE_FRACTIONS = tuple(round(i / 50, 2) for i in range(51))
from repgeom_eval.spec.options.analyses import SlicesConfig

SLICE_SIZE, SEEDS = SlicesConfig().size, SlicesConfig().seeds  # the defaults under their earlier names
REGRESSORS = ("isotonic", "linear", "poly2", "poly3")
CALIBRATION_SPLIT = (0.2, 0.1, 0.7)


def unit_rows(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length in float64; zero rows stay zero (eps = 1e-12, as torch's normalize)."""
    x = np.asarray(vectors, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"expected a [N, d] array of vectors, got shape {x.shape}")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


def dispersion_of_units(u: np.ndarray) -> float:
    """D = 1 − (‖Σu‖² − Σ‖u‖²)/(n(n−1)) for unit rows (docs/metrics.md#cosine-dispersion); NaN when n < 2."""
    n = u.shape[0]
    if n < 2:
        return float("nan")
    s = u.sum(0)
    return float(1.0 - (s @ s - np.einsum("ij,ij->", u, u)) / (n * (n - 1)))


# -- per-query scores ---------------------------------------------------------------------------------------------

#: The earlier name of the (S, Q, n) sums, kept while repgeom_eval/lmeval/task.py still uses it.
SetSums = DispersionSums


def scores_against(u: np.ndarray, member: np.ndarray, sums: DispersionSums) -> np.ndarray:
    """Mean cosine distance of each row of ``u`` to the set summarised by ``sums``, leaving the row itself out
    where ``member`` says it belongs to the set: 1 − (u_i·S − [i∈set]‖u_i‖²)/(n − [i∈set]). NaN where the set
    has no other element."""
    own = np.einsum("ij,ij->i", u, u) * member
    others = sums.n - member.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = 1.0 - (u @ sums.s - own) / others
    return np.where(others > 0, out, np.nan)


def query_scores(vectors: np.ndarray, correct: np.ndarray) -> dict[str, np.ndarray]:
    """``c`` (against all queries), ``c_correct`` and ``c_incorrect`` (against the correct / incorrect ones).

    mean(c) = D(all); the mean of ``c_correct`` over the correct queries is D(correct) (docs/metrics.md#per-text-scores).
    """
    u = unit_rows(vectors)
    ok = np.asarray(correct, dtype=bool)
    everyone = np.ones(len(u), dtype=bool)
    return {
        "c": scores_against(u, everyone, DispersionSums.of(u)),
        "c_correct": scores_against(u, ok, DispersionSums.of(u[ok])),
        "c_incorrect": scores_against(u, ~ok, DispersionSums.of(u[~ok])),
    }


def decile_accuracy(scores: Sequence[float], correct: Sequence[float]) -> tuple[float, float, int]:
    """(accuracy of the lowest-scoring 10 %, of the highest-scoring 10 %, queries per decile ≥ 1).

    Equal scores are ordered incorrect before correct, so the result does not depend on the input order."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(correct, dtype=np.float64)
    keep = np.isfinite(s)
    s, y = s[keep], y[keep]
    if len(s) == 0:
        return float("nan"), float("nan"), 0
    k = max(1, len(s) // 10)
    order = np.lexsort((y, s))
    return float(y[order[:k]].mean()), float(y[order[-k:]].mean()), k


# -- controlled slices --------------------------------------------------------------------------------------------

@dataclass
class SliceCurve:
    """Result of :func:`controlled_slices`; ``to_dict()`` is what ``repgeom slices`` writes."""

    fractions: list[float]
    size: int
    requested_size: int
    seeds: int
    n_queries: int
    n_correct: int
    dispersion: list[list[float]]  # [fraction][seed]
    perplexity: list[list[float]] | None  # mean gold-answer perplexity of each slice
    dispersion_mean: list[float] = field(default_factory=list)
    dispersion_se: list[float] = field(default_factory=list)
    perplexity_mean: list[float] | None = None
    perplexity_se: list[float] | None = None
    spearman: float = float("nan")  # fraction correct vs mean slice dispersion (the curve)
    spearman_all_slices: float = float("nan")  # the same over every (fraction, seed) slice
    spearman_perplexity: float = float("nan")  # fraction correct vs mean slice (gold-answer) perplexity
    # the same for the prompts' own perplexity (None when not known)
    prompt_perplexity: list[list[float]] | None = None
    prompt_perplexity_mean: list[float] | None = None
    prompt_perplexity_se: list[float] | None = None
    spearman_prompt_perplexity: float = float("nan")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _known_mean(values: np.ndarray) -> float:
    known = values[np.isfinite(values)]
    return float(known.mean()) if known.size else math.nan


def _mean_se(rows: np.ndarray) -> tuple[list[float], list[float]]:
    mean = rows.mean(1)
    se = rows.std(1, ddof=1) / math.sqrt(rows.shape[1]) if rows.shape[1] > 1 else np.full(len(rows), np.nan)
    return mean.tolist(), se.tolist()


def slice_size(n_correct: int, n_incorrect: int, fractions: Sequence[float], requested: int) -> int:
    """The largest size ≤ ``requested`` for which every fraction can be drawn without replacement (0 if none)."""

    def feasible(size: int) -> bool:
        return all(round(size * f) <= n_correct and size - round(size * f) <= n_incorrect for f in fractions)

    size = requested
    while size > 0 and not feasible(size):
        size -= 1
    return size


def _draw(rng: np.random.Generator, pos: np.ndarray, neg: np.ndarray, size: int, fraction: float) -> np.ndarray:
    k = round(size * fraction)
    return np.concatenate([rng.choice(pos, k, replace=False), rng.choice(neg, size - k, replace=False)])


def controlled_slices(vectors: np.ndarray, correct: Sequence[float], ppl: Sequence[float] | None = None,
                      fractions: Sequence[float] = FRACTIONS, size: int = SLICE_SIZE, seeds: int = SEEDS,
                      seed: int = 0, prompt_ppl: Sequence[float] | None = None) -> SliceCurve:
    """The controlled-slice experiment of docs/metrics.md#hardness-slices (paper A Fig. 8, Tables 3–4).

    For every fraction f and seed s: ``round(size·f)`` correct and the rest incorrect queries, drawn without
    replacement; slice dispersion = D across their vectors, slice perplexity = mean of their ``ppl`` (the gold
    answers' perplexity), slice prompt perplexity = mean of their ``prompt_ppl``. Adding ``prompt_ppl`` leaves
    every other number unchanged (the draws do not depend on it). When the pool is too small for ``size`` at every
    fraction, the largest feasible size is used (with a warning; it is recorded as ``size``).
    """
    u = unit_rows(vectors)
    y = np.asarray(correct, dtype=bool)
    if len(y) != len(u):
        raise ValueError(f"{len(u)} vectors but {len(y)} correctness labels")
    p = None if ppl is None else np.asarray(ppl, dtype=np.float64)
    pp = None if prompt_ppl is None else np.asarray(prompt_ppl, dtype=np.float64)
    for name, column in (("perplexities", p), ("prompt perplexities", pp)):
        if column is not None and column.shape != y.shape:
            raise ValueError(f"{len(y)} correctness labels but {column.size} {name}")
    pos, neg = np.flatnonzero(y), np.flatnonzero(~y)
    fractions = [float(f) for f in fractions]
    used = slice_size(len(pos), len(neg), fractions, size)
    if used < size:
        warnings.warn(f"controlled slices: {len(pos)} correct and {len(neg)} incorrect queries cannot fill slices "
                      f"of {size} at every fraction; using slices of {used}", RuntimeWarning, stacklevel=2)
    disp = np.full((len(fractions), seeds), np.nan)
    perp = None if p is None else np.full((len(fractions), seeds), np.nan)
    prompt = None if pp is None else np.full((len(fractions), seeds), np.nan)
    if used >= 2:
        for s in range(seeds):
            rng = np.random.default_rng([seed, s])
            for i, f in enumerate(fractions):
                idx = _draw(rng, pos, neg, used, f)
                disp[i, s] = dispersion_of_units(u[idx])
                # perplexities a query lacks (NaN: a one-token prompt has none) are left out of its slice's mean
                if perp is not None:
                    perp[i, s] = _known_mean(p[idx])
                if prompt is not None:
                    prompt[i, s] = _known_mean(pp[idx])
    curve = SliceCurve(fractions=fractions, size=used, requested_size=size, seeds=seeds, n_queries=len(y),
                       n_correct=int(y.sum()), dispersion=disp.tolist(),
                       perplexity=None if perp is None else perp.tolist())
    curve.dispersion_mean, curve.dispersion_se = _mean_se(disp)
    curve.spearman = spearman(fractions, curve.dispersion_mean)
    curve.spearman_all_slices = spearman(np.repeat(fractions, seeds), disp.ravel())
    if perp is not None:
        curve.perplexity_mean, curve.perplexity_se = _mean_se(perp)
        curve.spearman_perplexity = spearman(fractions, curve.perplexity_mean)
    if prompt is not None:
        curve.prompt_perplexity = prompt.tolist()
        curve.prompt_perplexity_mean, curve.prompt_perplexity_se = _mean_se(prompt)
        curve.spearman_prompt_perplexity = spearman(fractions, curve.prompt_perplexity_mean)
    return curve


# -- calibration --------------------------------------------------------------------------------------------------

@dataclass
class Calibration:
    """Result of :func:`calibrate`: test MAE per seed and the regressor validation chose."""

    splits: tuple[float, float, float]
    fractions: list[float]
    size: int
    seeds: int
    regressors: list[str]
    chosen: list[str]
    validation_mae: list[dict[str, float]]
    test_mae: list[float]
    mae_mean: float = float("nan")
    mae_se: float = float("nan")
    # per seed, the test slices: their dispersion, true accuracy and the chosen regressor's prediction (for plots)
    test_slices: list[dict[str, list[float]]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _slices_of(u: np.ndarray, y: np.ndarray, rng: np.random.Generator, fractions: Sequence[float],
               size: int) -> tuple[np.ndarray, np.ndarray]:
    pos, neg = np.flatnonzero(y), np.flatnonzero(~y)
    xs, ys = [], []
    for f in fractions:
        idx = _draw(rng, pos, neg, size, f)
        xs.append(dispersion_of_units(u[idx]))
        ys.append(round(size * f) / size)
    return np.asarray(xs), np.asarray(ys)


def _fit(name: str, x: np.ndarray, y: np.ndarray):
    """A function mapping slice dispersion to predicted accuracy, clipped to [0, 1]."""
    if name == "isotonic":
        from sklearn.isotonic import IsotonicRegression

        model = IsotonicRegression(increasing="auto", out_of_bounds="clip", y_min=0.0, y_max=1.0).fit(x, y)
        return lambda z: np.clip(model.predict(z), 0.0, 1.0)
    degree = {"linear": 1, "poly2": 2, "poly3": 3}[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", np.exceptions.RankWarning if hasattr(np, "exceptions") else UserWarning)
        coef = np.polyfit(x, y, degree)
    return lambda z: np.clip(np.polyval(coef, z), 0.0, 1.0)


def calibrate(vectors: np.ndarray, correct: Sequence[float], splits: tuple[float, float, float] = CALIBRATION_SPLIT,
              fractions: Sequence[float] = DENSE_FRACTIONS, size: int = SLICE_SIZE, seeds: int = SEEDS,
              regressors: Sequence[str] = REGRESSORS, seed: int = 0) -> Calibration:
    """Predict slice accuracy from slice dispersion (docs/metrics.md#hardness-slices, paper A B.1.3).

    Per seed: split the queries at random into calibration / validation / test parts (``splits``), draw one slice
    per fraction (2 % steps) in each part, fit every regressor on the calibration slices, keep the one with the
    lowest MAE on the validation slices, and report its MAE on the test slices. Slice size: ``size`` or the
    largest every part can fill at every fraction (recorded).
    """
    u = unit_rows(vectors)
    y = np.asarray(correct, dtype=bool)
    if len(y) != len(u):
        raise ValueError(f"{len(u)} vectors but {len(y)} correctness labels")
    if not math.isclose(sum(splits), 1.0) or min(splits) <= 0:
        raise ValueError(f"splits must be three positive fractions summing to 1, got {splits}")
    bad = [r for r in regressors if r not in REGRESSORS]
    if bad:
        raise ValueError(f"unknown regressor {bad[0]!r} (valid: {', '.join(REGRESSORS)})")
    fractions = [float(f) for f in fractions]
    n = len(y)
    cuts = np.cumsum([0, *[round(n * s) for s in splits[:2]]])
    parts = []
    used = size
    for s in range(seeds):
        order = np.random.default_rng([seed, s, 1]).permutation(n)
        part = [order[cuts[0]:cuts[1]], order[cuts[1]:cuts[2]], order[cuts[2]:]]
        parts.append(part)
        for idx in part:
            used = min(used, slice_size(int(y[idx].sum()), int((~y[idx]).sum()), fractions, size))
    if used < 2:
        raise ValueError(f"too few correct or incorrect queries ({int(y.sum())} of {n} correct) to draw slices in "
                         "every calibration part")
    if used < size:
        warnings.warn(f"calibration: the parts cannot fill slices of {size} at every fraction; using slices of "
                      f"{used}", RuntimeWarning, stacklevel=2)
    chosen, val_maes, test_maes, test_slices = [], [], [], []
    for s, part in enumerate(parts):
        rng = np.random.default_rng([seed, s, 2])
        (xc, yc), (xv, yv), (xt, yt) = (_slices_of(u[idx], y[idx], rng, fractions, used) for idx in part)
        fitted = {name: _fit(name, xc, yc) for name in regressors}
        val = {name: float(np.mean(np.abs(f(xv) - yv))) for name, f in fitted.items()}
        best = min(regressors, key=lambda name: (val[name], regressors.index(name)))
        chosen.append(best)
        val_maes.append(val)
        predicted = fitted[best](xt)
        test_maes.append(float(np.mean(np.abs(predicted - yt))))
        test_slices.append({"dispersion": xt.tolist(), "accuracy": yt.tolist(), "predicted": predicted.tolist()})
    result = Calibration(splits=tuple(splits), fractions=fractions, size=used, seeds=seeds,
                         regressors=list(regressors), chosen=chosen, validation_mae=val_maes, test_mae=test_maes,
                         test_slices=test_slices)
    result.mae_mean = float(np.mean(test_maes))
    result.mae_se = float(np.std(test_maes, ddof=1) / math.sqrt(seeds)) if seeds > 1 else float("nan")
    return result
