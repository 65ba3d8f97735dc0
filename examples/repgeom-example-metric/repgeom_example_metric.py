"""An example repgeom-eval plugin: the mean L2 norm of the pooled vectors (docs/plugins.md)."""

import torch

import repgeom_eval
from repgeom_eval import Consumes, LayerBatch, Metric


class MeanNorm(Metric):
    """Mean L2 norm of the pooled vectors, one per text."""

    name = "mean_norm"
    consumes = Consumes.POOLED

    def __init__(self):
        super().__init__()
        self.add_state("total", torch.zeros((), dtype=torch.float64), "sum")
        self.add_state("count", torch.zeros((), dtype=torch.float64), "sum")

    def update(self, batch: LayerBatch) -> None:
        norms = batch.pooled.double().norm(dim=-1)
        self.total = self.total + norms.sum()
        self.count = self.count + norms.numel()

    def compute(self) -> float:
        return float(self.total / self.count) if self.count > 0 else float("nan")


@repgeom_eval.hookimpl
def repgeom_register_metrics(registry):
    registry.add(MeanNorm)
