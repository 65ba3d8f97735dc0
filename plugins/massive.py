"""Massive-activation diagnostic: how much of the vectors' energy sits in a few hidden dimensions."""

from __future__ import annotations

from repgeom_eval import Consumes, LayerBatch, Metric, hookimpl
from repgeom_eval.spec.errors import check_param, is_count
from repgeom_eval.plugin_system.lazy import lazy

# Heavy names are imported on first use, so listing the plugins needs no torch (repgeom_eval.plugin_system.lazy).
torch = lazy("torch")


class MassiveActivations(Metric):
    """Share of the squared norm of the pooled vectors carried by the top-k hidden dimensions.

    share_d = Σ_i x_id² / Σ_i ‖x_i‖². When one dimension carries most of it (SmolLM2-135M's middle blocks put about
    99% in one), cosine-based geometry at that layer measures that dimension; ``--preprocess standardize`` shows the
    rest. Streaming state: Σ x² per dimension (D floats), the count.
    """

    name = "massive_activations"
    consumes = Consumes.POOLED
    default_pooling = "mean"

    def __init__(self, top_k: int = 5):
        super().__init__()
        check_param("massive_activations", "top_k", top_k, is_count(top_k), "an integer ≥ 1")
        self.top_k = top_k
        self.add_state("energy", torch.zeros(0, dtype=torch.float64), "sum", shape=("D",))
        self.add_state("n", torch.zeros((), dtype=torch.float64), "sum", shape=())

    def update(self, batch: LayerBatch) -> None:
        x = batch.pooled.double()
        e = (x * x).sum(0)
        self.energy = e if self.energy.numel() == 0 else self.energy + e
        self.n = self.n + x.shape[0]

    def compute(self) -> dict:
        total = float(self.energy.sum()) if self.energy.numel() else 0.0
        if total == 0.0:
            return {"top1_share": float("nan"), "topk_share": float("nan"), "top_dimensions": [], "top_shares": [],
                    "effective_dimensions": float("nan")}
        shares = self.energy / total
        k = min(self.top_k, shares.numel())  # top_k beyond the width: every dimension, and the output says so
        values, dims = torch.topk(shares, k)
        return {
            "top1_share": float(values[0]),
            "topk_share": float(values.sum()),
            "top_dimensions": dims.tolist(),
            "top_shares": values.tolist(),
            # participation ratio of the energy: D for a perfectly spread energy, 1 when one dimension has it all
            "effective_dimensions": float(1.0 / (shares * shares).sum()),
        }


    def diagnostics(self):
        width = self.energy.numel()
        if width and self.top_k > width:
            return {"top_k_used": width,
                    "warning": f"top_k = {self.top_k} exceeds the layer's {width} dimensions: every dimension is "
                               f"listed (top_k_used = {width} in the diagnostics)"}
        return {}

    def check_state(self, state, width=None):
        problems = super().check_state(state, width)
        n, energy = state["n"], state["energy"]
        if not self.is_count(n):
            problems.append(f"n = {float(n)} is not a whole number")
        if energy.numel() and bool((energy < 0).any()):
            problems.append("energy (a sum of squares) has negative entries")
        if energy.numel() and float(n) < 1:
            problems.append("energy holds sums but n = 0 vectors were added")
        return problems


@hookimpl
def repgeom_register_metrics(registry):
    registry.add(MassiveActivations)
