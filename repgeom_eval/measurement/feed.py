"""From one address's captured batch to metric states: pool (each pooling once), preprocess, update.

Pooling sums run in float64 (docs/metrics.md#conventions); a metric reads exactly the vectors of its kind (pooled
originals, token vectors, or the pooled augmented views of each text once all of them have arrived).
"""

from __future__ import annotations

import torch

from repgeom_eval.measurement.metric_specs import MetricSpec
from repgeom_eval.measurement.plan import Item
from repgeom_eval.measurement.pooling import pool
from repgeom_eval.measurement.preprocess import Preprocessor, VectorStats
from repgeom_eval.metric import Consumes, LayerBatch, Metric
from repgeom_eval.modeling.addresses import Address


class ViewBuffer:
    """Collects the pooled views of each text (they may arrive in different batches) until all are there."""

    def __init__(self, n_views: int):
        self.n_views = n_views
        self._slots: dict[int, list[torch.Tensor | None]] = {}

    def add(self, text: int, view: int, vector: torch.Tensor) -> None:
        self._slots.setdefault(text, [None] * self.n_views)[view] = vector

    def pop_complete(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        done = [t for t, slots in self._slots.items() if all(v is not None for v in slots)]
        if not done:
            return None
        views = torch.stack([torch.stack(self._slots.pop(t)) for t in done])  # type: ignore[arg-type]
        return torch.tensor(done, dtype=torch.long), views

    def __len__(self) -> int:
        return len(self._slots)


def split_rows(items: list[Item]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch rows of originals, batch rows of views, and the text index of every row."""
    orig = torch.tensor([r for r, it in enumerate(items) if it.view < 0], dtype=torch.long)
    views = torch.tensor([r for r, it in enumerate(items) if it.view >= 0], dtype=torch.long)
    return orig, views, torch.tensor([it.text for it in items], dtype=torch.long)


class Feeder:
    """Feeds the metric states of every address from the batches of one pass."""

    def __init__(self, specs: list[MetricSpec], n_views: int, prep: Preprocessor):
        self.prep = prep
        view_poolings = sorted({s.pooling for s in specs if s.consumes == Consumes.VIEWS})  # type: ignore[type-var]
        self.n_views = n_views
        self._view_poolings = view_poolings
        self.buffers: dict[tuple[Address, str], ViewBuffer] = {}

    def pending_views(self) -> int:
        """Texts whose views have not all arrived (zero at the end of every shard)."""
        return sum(len(b) for b in self.buffers.values())

    def feed(self, addr: Address, h: torch.Tensor, mask: torch.Tensor, items: list[Item],
             metrics: list[tuple[MetricSpec, Metric]]) -> None:
        """Pool one address's batch for each metric (each pooling computed once) and update the metric states."""
        orig, views, text_index = split_rows(items)
        name = str(addr)
        if len(orig):
            o = orig.to(h.device)
            pooled: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            tokens = None
            for spec, metric in metrics:
                if spec.consumes == Consumes.VIEWS:
                    continue
                if spec.consumes == Consumes.TOKENS:
                    if tokens is None:
                        m = mask[o]
                        t = h[o].double()
                        if self.prep.active:
                            t[m] = self.prep(name, "tokens", t[m])
                        tokens = t.masked_fill(~m.unsqueeze(-1), 0.0), m
                    with spec.guard("update", name):
                        metric.update(LayerBatch(name, text_index[orig], hidden=tokens[0], mask=tokens[1]))
                    continue
                if spec.pooling not in pooled:
                    vecs, owner = pool(h[o].double(), mask[o], spec.pooling)
                    vecs = self.prep(name, spec.pooling, vecs)
                    pooled[spec.pooling] = vecs.cpu(), text_index[orig][owner.cpu()]
                vecs, index = pooled[spec.pooling]
                with spec.guard("update", name):
                    metric.update(LayerBatch(name, index, pooled=vecs))
        if len(views):
            self._feed_views(addr, h, mask, items, views, metrics)

    def _feed_views(self, addr: Address, h: torch.Tensor, mask: torch.Tensor, items: list[Item],
                    views: torch.Tensor, metrics: list[tuple[MetricSpec, Metric]]) -> None:
        v = views.to(h.device)
        for method in self._view_poolings:
            buffer = self.buffers.setdefault((addr, method), ViewBuffer(self.n_views))
            vecs = self.prep(str(addr), f"views:{method}", pool(h[v].double(), mask[v], method)[0])
            for row, vec in zip(views.tolist(), vecs.cpu()):
                buffer.add(items[row].text, items[row].view, vec)
            done = buffer.pop_complete()
            if done is None:
                continue
            index, stacked = done
            for spec, metric in metrics:
                if spec.consumes == Consumes.VIEWS and spec.pooling == method:
                    with spec.guard("update", addr):
                        metric.update(LayerBatch(str(addr), index, views=stacked[:, : int(metric.n_views)]))


class StatsCollector:
    """The first pass of ``preprocess``: moments of exactly the vectors each kind of metric will see."""

    def __init__(self, specs: list[MetricSpec], full_covariance: bool):
        self.kinds = sorted({spec.kind for spec in specs})
        self.full = full_covariance
        self.stats: dict[str, VectorStats] = {}

    def feed(self, addr: Address, h: torch.Tensor, mask: torch.Tensor, items: list[Item]) -> None:
        orig, views, _ = split_rows(items)
        for kind in self.kinds:
            rows = (views if kind.startswith("views:") else orig).to(h.device)
            if not len(rows):
                continue
            if kind == "tokens":
                x = h[rows][mask[rows]]
            else:
                x = pool(h[rows].double(), mask[rows], kind.removeprefix("views:"))[0]
            self.stats.setdefault(Preprocessor.key(str(addr), kind), VectorStats(self.full)).update(x)
