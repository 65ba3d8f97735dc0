"""Correlation and ranking statistics for every command: Pearson's r, Spearman's ρ, Kendall's τ_b and the AUROC.

Every number of this kind that repgeom-eval reports (``repgeom gap --scores``, ``slices``, ``ppl-bins``, the
condensation trend against depth, the lm-eval aggregations) is computed here, so one input gives one answer in
every command. Pure float64 math on CPU tensors; no scipy at run time (the tests check every function against
``scipy.stats`` and ``sklearn.metrics``).

Missing values and degenerate inputs
------------------------------------
One policy for every statistic:

1. The two inputs are paired (``x`` with ``y``, ``scores`` with ``labels``) and must have the same length;
   otherwise ``ValueError``.
2. A non-finite value (NaN, +inf, −inf) is *missing*. A pair with a missing value on either side is dropped
   (pairwise deletion) and the statistic is computed over the remaining complete pairs. :func:`complete_pairs`
   gives those pairs and the number dropped, for callers that report it.
3. Pearson, Spearman and Kendall need at least :data:`MIN_PAIRS` = 3 complete pairs, and NaN is returned below
   that: through 2 points every correlation is ±1 whatever the data, so it carries no information.
4. A variable that is constant over the complete pairs has zero variance and no correlation with anything: NaN.
5. Ties get the average of the ranks they span. Spearman's ρ is Pearson's r of these ranks; Kendall's τ_b corrects
   for ties in both variables; in the AUROC a positive and a negative with equal scores count one half.
6. AUROC labels must be 0 or 1 (or bool; anything else is a ``ValueError``); with no positive or no negative
   among the complete pairs the AUROC is undefined: NaN.

Degenerate inputs give NaN and never raise; only malformed input (unequal lengths, labels not 0/1) raises.
Correlations are clipped to [−1, 1] against rounding. The policy is restated for users in
docs/reference/outputs.md#statistics-and-missing-values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MIN_PAIRS = 3

_NAN = float("nan")


def as_vector(values) -> torch.Tensor:
    """``values`` (a list, range, numpy array or tensor) as a flat float64 CPU tensor."""
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", torch.float64).flatten()
    return torch.as_tensor(values, dtype=torch.float64).flatten()


@dataclass(frozen=True, eq=False)
class Pairs:
    """The complete pairs of two paired inputs (both values finite) and how many pairs were dropped."""

    x: torch.Tensor
    y: torch.Tensor
    n_dropped: int

    @property
    def n(self) -> int:
        """The number of complete pairs."""
        return int(self.x.numel())


def complete_pairs(x, y) -> Pairs:
    """The pairs (x_i, y_i) where both values are finite, and the number of the others (rule 2 of the policy)."""
    a, b = as_vector(x), as_vector(y)
    if a.numel() != b.numel():
        raise ValueError(f"x and y differ in length: {a.numel()} vs {b.numel()}")
    keep = torch.isfinite(a) & torch.isfinite(b)
    return Pairs(a[keep], b[keep], int(a.numel()) - int(keep.sum()))


def rankdata(values) -> torch.Tensor:
    """1-based ranks, ties given the average of the ranks they span (scipy's ``rankdata(method="average")``).

    ±inf are ranked as the extreme values; NaN has no rank (``ValueError``): drop missing values first
    (:func:`complete_pairs`).
    """
    x = as_vector(values)
    if bool(torch.isnan(x).any()):
        raise ValueError("rankdata: NaN has no rank; drop missing values first (complete_pairs)")
    order = torch.argsort(x, stable=True)
    xs = x[order]
    starts_group = torch.ones(x.numel(), dtype=torch.bool)
    starts_group[1:] = xs[1:] != xs[:-1]
    group = torch.cumsum(starts_group.long(), 0) - 1
    sizes = torch.bincount(group).to(torch.float64)
    first = torch.cumsum(sizes, 0) - sizes  # 0-based position of each group's first element
    ranks = torch.empty(x.numel(), dtype=torch.float64)
    ranks[order] = (first + (sizes + 1) / 2)[group]
    return ranks


def _is_constant(x: torch.Tensor) -> bool:
    return bool((x == x[0]).all())


def _undefined(pairs: Pairs) -> bool:
    """Too few complete pairs, or a constant variable (rules 3 and 4): the correlation is NaN."""
    return pairs.n < MIN_PAIRS or _is_constant(pairs.x) or _is_constant(pairs.y)


def _centered_correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson's r of two finite, non-constant vectors: Σ(a−ā)(b−b̄) / sqrt(Σ(a−ā)² · Σ(b−b̄)²), clipped to [−1, 1].

    The sums run in numpy (same float64, numpy's summation order), which keeps the last digit of the values that
    ``ppl-bins`` reported before this module existed.
    """
    a, b = a.numpy(), b.numpy()
    a, b = a - a.mean(), b - b.mean()
    den = math.sqrt(float(a @ a) * float(b @ b))
    if not den > 0:  # the deviations underflow (values within ~1e-154 of each other)
        return _NAN
    return max(-1.0, min(1.0, float(a @ b) / den))


def pearson(x, y) -> float:
    """Pearson's r over the complete pairs; NaN below 3 pairs or for a constant variable."""
    pairs = complete_pairs(x, y)
    return _NAN if _undefined(pairs) else _centered_correlation(pairs.x, pairs.y)


def spearman(x, y) -> float:
    """Spearman's ρ: Pearson's r of the average ranks of the complete pairs; NaN as :func:`pearson`.

    Oracle: [0.1, 0.3, 0.3, 0.5] against 0, 1, 2, 3 → 0.948683.
    """
    pairs = complete_pairs(x, y)
    return _NAN if _undefined(pairs) else _centered_correlation(rankdata(pairs.x), rankdata(pairs.y))


def kendall_tau_b(x, y, block: int = 2048) -> float:
    """Kendall's τ_b = (n_c − n_d) / sqrt((n₀ − n_x)(n₀ − n_y)) over the complete pairs; NaN as :func:`pearson`.

    n_c/n_d count concordant/discordant pairs of points, n₀ = n(n−1)/2, n_x/n_y the pairs tied in x/y (scipy
    ``kendalltau``'s default variant). Computed with sign products, Σ sgn(x_i−x_j)·sgn(y_i−y_j) /
    sqrt(Σ sgn(x_i−x_j)² · Σ sgn(y_i−y_j)²) over all i, j, in O(n²) time and O(block·n) memory: meant for
    per-layer series, not millions of points. Oracle: [0.1, 0.3, 0.3, 0.5] against 0, 1, 2, 3 → 0.912871.
    """
    pairs = complete_pairs(x, y)
    if _undefined(pairs):
        return _NAN
    a, b = pairs.x, pairs.y
    num = sa = sb = 0.0
    for lo in range(0, pairs.n, block):
        da = torch.sign(a[lo:lo + block, None] - a[None, :])
        db = torch.sign(b[lo:lo + block, None] - b[None, :])
        num += float((da * db).sum())
        sa += float((da * da).sum())
        sb += float((db * db).sum())
    return max(-1.0, min(1.0, num / math.sqrt(sa * sb)))


def auroc(scores, labels) -> float:
    """Area under the ROC curve of ``scores`` for predicting ``labels`` (1 = positive), over the complete pairs.

    The Mann–Whitney form: the probability that a random positive scores higher than a random negative, a tie
    counting one half (= ``sklearn.metrics.roc_auc_score``). 0.5 = no information. NaN when the complete pairs
    hold no positive or no negative; ``ValueError`` for a finite label other than 0 or 1.
    """
    pairs = complete_pairs(scores, labels)
    other = pairs.y[(pairs.y != 0) & (pairs.y != 1)]
    if other.numel():
        raise ValueError(f"auroc: labels must be 0 or 1 (or bool), got {float(other[0])!r}")
    positive = pairs.y == 1
    n_pos = int(positive.sum())
    n_neg = pairs.n - n_pos
    if n_pos == 0 or n_neg == 0:
        return _NAN
    rank_sum = float(rankdata(pairs.x)[positive].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)
