"""Embedding condensation (paper C; docs/metrics.md#condensation): how aligned the token vectors of a text are, per
layer."""

from __future__ import annotations

import math
from typing import Any

from repgeom_eval import Consumes, hookimpl
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.plugin_system.lazy import lazy

from .token_metric import TokenMetric
from repgeom_eval.spec.names import CONDENSATION_BINS, CONDENSATION_EPS

# Heavy names are imported on first use, so listing the plugins needs no torch (repgeom_eval.plugin_system.lazy).
torch = lazy("torch")
condensation_batch = lazy("repgeom_eval.functional.condensation:condensation_batch")
cosine_histogram = lazy("repgeom_eval.functional.condensation:cosine_histogram")
histogram_edges = lazy("repgeom_eval.functional.condensation:histogram_edges")
kendall_tau_b = lazy("repgeom_eval.functional.stats:kendall_tau_b")
spearman = lazy("repgeom_eval.functional.stats:spearman")

_NAN = float("nan")


class Condensation(TokenMetric):
    """Mean token–token cosine within each text, averaged over texts (paper C's condensation statistic).

    Per text with S tokens: u_i = x_i / max(‖x_i‖, ``eps``) (paper C's max-eps, default 1e-3) and
    ``mean_cosine`` = the mean of all S² entries of clip(UUᵀ, −1, 1), **diagonal included** as in paper C's code,
    computed in O(S·d) as ‖Σu‖²/S² (the clip is a no-op because ‖u_i‖ ≤ 1). ``mean_cosine_excl_diag`` is the i ≠ j
    mean, (‖Σu‖² − Σ‖u‖²)/(S(S−1)); 1-token texts have none and are left out of that mean only. Paper C averages
    equal-length S×S matrices over texts and takes the mean entry; the mean over texts of the per-text means is the
    same number and also covers texts of unequal length.

    ``histogram`` (for the layer × cosine heatmap): the S² entries of each text's cosine matrix binned into
    ``bins`` equal bins over [−1, 1] (default 50; ``bins=0`` turns it off, since it costs O(S²·d) per text),
    each text weighing 1 like in the means; ``density`` integrates to 1 over [−1, 1].

    State: the sums of the two per-text means, their counts, the summed per-text bin fractions (and per-text
    values with ``per_text=True``).

    Across layers (:meth:`across_layers`): Spearman ρ and Kendall τ_b of ``mean_cosine`` against depth (positive:
    condensation grows with depth) and ``mean_last_n`` = mean of the last n layers' values, n = 1..L.
    """

    name = "condensation"
    consumes = Consumes.TOKENS

    def __init__(self, eps: float = CONDENSATION_EPS, bins: int = CONDENSATION_BINS, per_text: bool = False):
        super().__init__()
        if not (isinstance(bins, int) and bins >= 0):
            raise RepgeomError(f"{self.name}: bins must be a non-negative integer, got {bins!r}")
        if not (isinstance(eps, (int, float)) and eps > 0):
            raise RepgeomError(f"{self.name}: eps must be a positive number, got {eps!r}")
        self.eps, self.bins, self.per_text = float(eps), bins, per_text
        self.add_state("sums", torch.zeros(2, dtype=torch.float64), "sum", shape=(2,))  # Σ m_incl, Σ m_excl
        self.add_state("counts", torch.zeros(2, dtype=torch.float64), "sum", shape=(2,))  # texts with S ≥ 1, ≥ 2
        self.add_state("hist", torch.zeros(bins, dtype=torch.float64), "sum", shape=(bins,))
        if per_text:
            self.add_per_text_states()

    def update_tokens(self, index: torch.Tensor, block) -> None:
        """:meth:`update` from a :class:`~repgeom_eval.functional.tokens.TokenBlock` (the pipeline's path: float64
        sums one text at a time, no [B, T, d] float64 copy)."""
        from repgeom_eval.functional.condensation import condensation_block, cosine_histogram_block

        incl, excl = condensation_block(block, self.eps)
        # summed where they live, NaN (too few tokens) masked without boolean indexing, which waits on a GPU
        values = torch.stack([incl, excl], 1)
        ok = ~torch.isnan(values)
        self.sums = self.sums + torch.where(ok, values, torch.zeros_like(values)).sum(0)
        self.counts = self.counts + ok.sum(0).to(torch.float64)
        if self.bins:
            self.hist = self.hist + cosine_histogram_block(block, self.bins, self.eps)
        self.keep_per_text(index, incl)

    def compute(self) -> dict[str, Any]:
        mean = [float(s / c) if c > 0 else _NAN for s, c in zip(self.sums, self.counts)]
        out: dict[str, Any] = {"mean_cosine": mean[0], "mean_cosine_excl_diag": mean[1]}
        if self.bins:
            edges = histogram_edges(self.bins)
            n = float(self.counts[0])
            density = self.hist / (n * (2.0 / self.bins)) if n > 0 else torch.full_like(self.hist, _NAN)
            out["histogram"] = {"edges": [round(e, 9) for e in edges.tolist()], "density": density.tolist()}
        return out

    def per_text_results(self):
        kept = self.kept_per_text()
        return None if kept is None else {"condensation": kept}

    def diagnostics(self):
        return {"n_texts": int(self.counts[0]), "n_texts_single_token": int(self.counts[0] - self.counts[1])}

    @classmethod
    def across_layers(cls, values: dict[str, Any], depth: list[int]) -> dict[str, Any] | None:
        """Spearman ρ and Kendall τ_b of ``mean_cosine`` against depth, and ``mean_last_n`` (paper C;
        docs/metrics.md#condensation).

        ``values`` maps each address to this metric's ``compute()`` result in depth order. Needs ≥ 3 addresses
        (``None`` otherwise). A layer whose mean cosine is NaN is left out of both correlations, which are NaN
        when fewer than 3 layers remain (the policy of :mod:`repgeom_eval.functional.stats`).
        """
        if len(values) < 3:
            return None
        m = [float(v["mean_cosine"]) if isinstance(v, dict) else float(v) for v in values.values()]
        return {
            "spearman": spearman(m, depth),
            "kendall": kendall_tau_b(m, depth),
            "mean_last_n": [math.fsum(m[-n:]) / n for n in range(1, len(m) + 1)],
        }


@hookimpl
def repgeom_register_metrics(registry):
    registry.add(Condensation)
