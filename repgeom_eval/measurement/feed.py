"""From one address's captured batch to metric states: pool (each pooling once), preprocess, update.

Pooling sums run in float64 (docs/metrics.md#conventions); a metric reads exactly the vectors of its kind (pooled
originals, token vectors, or the pooled augmented views of each text once all of them have arrived). All the metrics
of an address share one float64 copy of the captured batch and the sums computed from it
(:class:`~repgeom_eval.functional.tokens.TokenBlock`), instead of a copy and several full-size passes per kind of
metric.
"""

from __future__ import annotations

import torch

from repgeom_eval.measurement.metric_specs import MetricSpec
from repgeom_eval.measurement.plan import Item
from repgeom_eval.functional.tokens import TokenBlock, block_limit, row_chunks
from repgeom_eval.measurement.pooling import pool64
from repgeom_eval.measurement.preprocess import Preprocessor, VectorStats
from repgeom_eval.spec.metric import Consumes, LayerBatch, Metric
from repgeom_eval.modeling.addresses import Address


def feed_threads(device_type: str, builtin_only: bool) -> int:
    """How many threads one batch's metric work may use: on the CPU, with only built-in metrics (whose states are
    per address and touch nothing shared), one address per intra-op thread; anywhere else one."""
    return torch.get_num_threads() if device_type == "cpu" and builtin_only else 1


#: the most a batch's captured hidden states may hold, over every address, for the CPU's threads to be fed them
#: after the pass; a larger batch is fed during the pass, one address at a time
THREADED_CAPTURE_BYTES = 1 << 30


def streams_addresses(threads: int, n_addresses: int, batch_bytes: int = 0) -> bool:
    """Whether each address is fed as the forward pass reaches it (one address's hidden states held at a time), or
    every address after the pass, spread over ``threads`` threads (every address's held until they are fed: only
    while that stays within :data:`THREADED_CAPTURE_BYTES`; ``batch_bytes`` is one address's float32 batch)."""
    return threads < 2 or n_addresses < 3 or batch_bytes * n_addresses > THREADED_CAPTURE_BYTES


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

    def __init__(self, specs: list[MetricSpec], n_views: int, prep: Preprocessor, state_device: str | None = None):
        """``state_device``: ``"cpu"`` keeps the states of pooled and multi-view metrics in host memory (only the
        pooled vectors travel); by default every state lives where the vectors it is fed are, the model's device."""
        self.prep = prep
        self.to_host = state_device == "cpu"
        self._placed: dict[int, torch.device] = {}  # id(metric) → the device its states were moved to
        view_poolings = sorted({s.pooling for s in specs if s.consumes == Consumes.VIEWS})  # type: ignore[type-var]
        self.n_views = n_views
        self._view_poolings = view_poolings
        self.buffers: dict[tuple[Address, str], ViewBuffer] = {}
        self._batch: tuple | None = None  # (items, mask, split_rows(items), block layouts) of the current batch

    def pending_views(self) -> int:
        """Texts whose views have not all arrived (zero at the end of every shard)."""
        return sum(len(b) for b in self.buffers.values())

    def feed(self, addr: Address, h: torch.Tensor, mask: torch.Tensor, items: list[Item],
             metrics: list[tuple[MetricSpec, Metric]], energy: Metric | None = None,
             host_mask: torch.Tensor | None = None) -> None:
        """Pool one address's batch for each metric (each pooling computed once) and update the metric states;
        ``energy`` (the energy diagnostic), if given, gets the raw mean-pooled vectors of the original texts.

        Every metric of the address reads one :class:`~repgeom_eval.functional.tokens.TokenBlock` of the original
        rows: a single float64 copy of the captured values, the token norms and the float64 sums computed once
        and shared (mean pooling, the energy diagnostic, ``token_dispersion``, ``condensation``, the centred unit
        vectors of ``prompt_entropy``). ``last``/``first`` pooling pick the vectors before converting them. A token
        metric with an ``update_tokens(index, block)`` method reads the block; any other gets the documented padded
        float64 ``LayerBatch.hidden`` (pads zero), built once per block. Batches whose float64 copy would exceed
        :func:`~repgeom_eval.functional.tokens.block_limit` are fed in several blocks of rows. ``host_mask``,
        the same mask in host memory when the caller has it, is where the per-text layout is read from (no wait
        for the device).
        """
        if self._batch is None or self._batch[0] is not items or self._batch[1] is not mask:
            self._batch = (items, mask, split_rows(items), {})  # the same for every address of this batch
        orig, views, text_index = self._batch[2]
        layouts: dict[int, TokenBlock] = self._batch[3]
        name = str(addr)
        metrics = [(spec, m) for spec, m in metrics if spec.failure is None]  # a dropped metric is fed no more
        if len(orig):
            if len(orig) == h.shape[0]:  # no augmented views in this batch: every row is an original
                ho, mo, hm = h, mask, host_mask
            else:
                o = orig.to(h.device, non_blocking=True)  # a blocking copy would wait on a GPU
                ho, mo = h[o], mask[o]
                hm = host_mask[orig] if host_mask is not None else None
            index = text_index[orig]
            for rows in row_chunks(ho.shape[0], ho.shape[1] * ho.shape[2], block_limit(ho.device)):  # one, mostly
                block = TokenBlock(ho[rows], mo[rows], like=layouts.get(rows.start),
                                   host_mask=hm[rows] if hm is not None else None)
                if rows.start not in layouts:
                    layouts[rows.start] = block.layout_only()  # the layout, not this address's values
                self._feed_block(name, block, index[rows], orig[rows], metrics, energy)
        if len(views):
            self._feed_views(addr, h, mask, items, views, metrics)

    def _feed_block(self, name: str, block: TokenBlock, index: torch.Tensor, batch_rows: torch.Tensor,
                    metrics: list[tuple[MetricSpec, Metric]], energy: Metric | None) -> None:
        raw: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

        def pooled_raw(method: str) -> tuple[torch.Tensor, torch.Tensor]:
            if method not in raw:
                raw[method] = pool64(block.hidden, block.mask, method, block)
            return raw[method]

        if energy is not None:
            mean = pooled_raw("mean")[0]
            self._place(energy, mean.device)
            energy.update(LayerBatch(name, batch_rows.to(mean.device, non_blocking=True), pooled=mean))
        pooled: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        tokens: TokenBlock | None = None
        for spec, metric in metrics:
            if spec.consumes == Consumes.VIEWS:
                continue
            if spec.consumes == Consumes.TOKENS:
                if tokens is None:
                    tokens = self._token_block(name, block)
                with spec.guard("update", name):
                    self._place(metric, tokens.hidden.device)
                    fast = getattr(metric, "update_tokens", None)
                    if fast is not None:
                        fast(index, tokens)
                    else:
                        metric.update(LayerBatch(name, index, hidden=tokens.padded64(), mask=tokens.mask))
                continue
            if spec.pooling not in pooled:
                vecs, owner = pooled_raw(spec.pooling)
                vecs = self.prep(name, spec.pooling, vecs)
                if self.to_host:
                    pooled[spec.pooling] = vecs.cpu(), index[owner.cpu()]
                else:  # no transfer to the host: nothing waits for the device
                    pooled[spec.pooling] = vecs, index.to(owner.device, non_blocking=True)[owner]
            vecs, idx = pooled[spec.pooling]
            with spec.guard("update", name):
                self._place(metric, vecs.device)
                metric.update(LayerBatch(name, idx, pooled=vecs))

    def _place(self, metric: Metric, device: torch.device) -> None:
        """States live where the metric's vectors arrive (a resumed checkpoint's and a fresh metric's start in host
        memory); moved once per metric and device."""
        if self._placed.get(id(metric)) != device:
            metric.to(device)
            self._placed[id(metric)] = device

    def _token_block(self, name: str, block: TokenBlock) -> TokenBlock:
        """The token vectors the TOKENS metrics see: the captured ones, or with preprocessing their transform
        (float64, pads zero)."""
        if not self.prep.active:
            return block
        t = block.hidden.to(torch.float64, copy=True)
        m = block.mask
        t[m] = self.prep(name, "tokens", t[m])
        return TokenBlock(t.masked_fill(~m.unsqueeze(-1), 0.0), m)

    def _feed_views(self, addr: Address, h: torch.Tensor, mask: torch.Tensor, items: list[Item],
                    views: torch.Tensor, metrics: list[tuple[MetricSpec, Metric]]) -> None:
        v = views.to(h.device, non_blocking=True)
        hv, mv = h[v], mask[v]
        blocks = [TokenBlock(hv[r], mv[r]) for r in row_chunks(hv.shape[0], hv.shape[1] * hv.shape[2],
                                                              block_limit(hv.device))]
        for method in self._view_poolings:
            buffer = self.buffers.setdefault((addr, method), ViewBuffer(self.n_views))
            vecs = torch.cat([pool64(b.hidden, b.mask, method, b)[0] for b in blocks])
            vecs = self.prep(str(addr), f"views:{method}", vecs)
            rows = [r for r, it in enumerate(items) if it.view >= 0]  # views' rows, from the host's own list
            for row, vec in zip(rows, vecs.cpu() if self.to_host else vecs):
                buffer.add(items[row].text, items[row].view, vec)
            done = buffer.pop_complete()
            if done is None:
                continue
            index, stacked = done
            for spec, metric in metrics:
                if spec.consumes == Consumes.VIEWS and spec.pooling == method:
                    with spec.guard("update", addr):
                        self._place(metric, stacked.device)
                        metric.update(LayerBatch(str(addr), index.to(stacked.device),
                                                 views=stacked[:, : int(metric.n_views)]))


class StatsCollector:
    """The first pass of ``preprocess``: moments of exactly the vectors each kind of metric will see."""

    def __init__(self, specs: list[MetricSpec], full_covariance: bool):
        self.kinds = sorted({spec.kind for spec in specs})
        self.full = full_covariance
        self.stats: dict[str, VectorStats] = {}

    def feed(self, addr: Address, h: torch.Tensor, mask: torch.Tensor, items: list[Item]) -> None:
        orig, views, _ = split_rows(items)
        for kind in self.kinds:
            rows = (views if kind.startswith("views:") else orig).to(h.device, non_blocking=True)
            if not len(rows):
                continue
            if kind == "tokens":
                x = h[rows][mask[rows]]
            else:
                x = pool64(h[rows], mask[rows], kind.removeprefix("views:"))[0]
            self.stats.setdefault(Preprocessor.key(str(addr), kind), VectorStats(self.full)).update(x)
