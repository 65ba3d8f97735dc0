"""Dispersion metrics (paper A): across texts (``dispersion``) and within each text (``token_dispersion``)."""

from __future__ import annotations

from repgeom_eval import Consumes, LayerBatch, Metric, hookimpl
from repgeom_eval.plugin_system.lazy import lazy

from .token_metric import TokenMetric

# Heavy names are imported on first use, so listing the plugins needs no torch (repgeom_eval.plugin_system.lazy).
torch = lazy("torch")
dispersion_from_sums = lazy("repgeom_eval.functional:dispersion_from_sums")
token_dispersion = lazy("repgeom_eval.functional:token_dispersion")
unit = lazy("repgeom_eval.functional:unit")


class Dispersion(Metric):
    """Mean pairwise cosine distance across texts, one pooled vector per text (paper A Eq. 1).

    Streaming through the O(N·d) identity: the state is S = Σu (d floats), Q = Σ‖u‖² and the count, so memory does
    not grow with the number of texts. With ``per_text=True`` the unit vectors are kept as well, to give each text
    its score c_i = mean distance to the others (docs/metrics.md#per-text-scores); with ``tokens`` pooling c_i is
    averaged over the text's tokens.
    """

    name = "dispersion"
    consumes = Consumes.POOLED

    def __init__(self, per_text: bool = False):
        super().__init__()
        self.per_text = per_text
        if per_text:
            self.add_state("units", [], "cat", shape=("N", "D"))
            self.add_state("index", [], "cat", shape=("N",))

    def statistics(self):
        from repgeom_eval.spec.statistics import UnitSums

        return {"sums": UnitSums()}

    def update(self, batch: LayerBatch) -> None:
        assert batch.pooled is not None
        super().update(batch)  # the shared sums
        if self.per_text:
            self.units.append(unit(batch.pooled.double()))
            self.index.append(batch.index.to(torch.float64))

    def compute(self) -> float:
        s = self.stat("sums")
        if s.sum_u.numel() == 0:
            return float("nan")
        return float(dispersion_from_sums(s.sum_u, s.sum_sq, s.n))

    def per_text_results(self):
        if not self.per_text or not self.units:
            return None
        u = torch.cat(self.units)
        idx = torch.cat(self.index).long()
        n = u.shape[0]
        if n < 2:
            c = torch.full((n,), float("nan"), dtype=torch.float64)
        else:
            c = 1.0 - (u @ self.stat("sums").sum_u - (u * u).sum(-1)) / (n - 1)
        texts, owner = torch.unique(idx, return_inverse=True)
        if texts.numel() != n:  # several vectors per text (tokens pooling): average c over each text's tokens
            total = torch.zeros(texts.numel(), dtype=torch.float64).index_add_(0, owner, c)
            count = torch.zeros(texts.numel(), dtype=torch.float64).index_add_(0, owner, torch.ones_like(c))
            c = total / count
            idx = texts
        return {"dispersion": (idx, c)}

    def diagnostics(self):
        s = self.stat("sums")
        return {"n_vectors": int(s.n), "n_zero_vectors": int(s.n_zero)}

    def check_state(self, state, width=None):
        problems = super().check_state(state, width)  # the sums' own checks included, where this metric owns them
        n = state.get("n")
        if (self.per_text and "units" in state and isinstance(n, torch.Tensor) and self.is_count(n)
                and state["units"].shape[0] != int(n)):
            problems.append(f"{state['units'].shape[0]} per-text vectors for n = {int(n)}")
        return problems


class TokenDispersion(TokenMetric):
    """Dispersion of the token vectors within each text, averaged over texts (docs/metrics.md#token_dispersion).

    This is what paper A's public code computes. Pad positions are excluded; texts with fewer than 2 tokens are
    skipped and counted. State: the sum of the per-text values and the count.
    """

    name = "token_dispersion"
    consumes = Consumes.TOKENS

    def __init__(self, per_text: bool = False):
        super().__init__()
        self.per_text = per_text
        self.add_state("total", torch.zeros((), dtype=torch.float64), "sum", shape=())
        self.add_state("count", torch.zeros((), dtype=torch.float64), "sum", shape=())
        self.add_state("skipped", torch.zeros((), dtype=torch.float64), "sum", shape=())
        if per_text:
            self.add_per_text_states()

    def update_tokens(self, index: torch.Tensor, block) -> None:
        """:meth:`update` from a :class:`~repgeom_eval.functional.tokens.TokenBlock` (the pipeline's path: the
        captured activations as they are, float64 sums one text at a time, shared with other token metrics)."""
        from repgeom_eval.functional.dispersion import token_dispersion_block

        values, _ = token_dispersion_block(block)  # on the block's device: nothing waits for it
        ok = ~torch.isnan(values)
        self.total = self.total + torch.where(ok, values, torch.zeros_like(values)).sum()
        self.count = self.count + ok.sum()
        self.skipped = self.skipped + (~ok).sum()
        self.keep_per_text(index, values)

    def compute(self) -> float:
        return float(self.total / self.count) if self.count > 0 else float("nan")

    def per_text_results(self):
        kept = self.kept_per_text()
        return None if kept is None else {"token_dispersion": kept}

    def diagnostics(self):
        return {"n_texts": int(self.count), "n_skipped_short": int(self.skipped)}

    def check_state(self, state, width=None):
        problems = super().check_state(state, width)
        count, skipped, total = state["count"], state["skipped"], state["total"]
        if not (self.is_count(count) and self.is_count(skipped)):
            return problems + [f"counts count={float(count)}, skipped={float(skipped)} are not whole numbers"]
        if not -1e-9 <= float(total) <= 2 * float(count) + 1e-9:  # each text's dispersion lies in [0, 2]
            problems.append(f"total = {float(total)} is outside [0, 2·count] for count = {int(count)}")
        if self.per_text and "values" in state and state["values"].shape[0] != int(count + skipped):
            problems.append(f"{state['values'].shape[0]} per-text values for {int(count + skipped)} texts")
        return problems


@hookimpl
def repgeom_register_metrics(registry):
    registry.add(Dispersion)
    registry.add(TokenDispersion)
