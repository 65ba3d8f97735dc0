"""Everything a run accumulates, as mergeable state: metric states per address, the energy diagnostic, counts.

Exactly what a checkpoint saves and what the processes merge; all of it is O(D²) per address at most, except the
per-text bookkeeping asked for with ``per_text``. The energy diagnostic (how much of the squared norm of the
mean-pooled vectors one hidden dimension carries) is the ``massive_activations`` metric plugin, fed the raw
mean-pooled vectors of every address.
"""

from __future__ import annotations

from typing import Any

import torch

from repgeom_eval.measurement.distributed import Distributed
from repgeom_eval.measurement.metric_specs import MetricSpec, fresh_metrics
from repgeom_eval.measurement.plan import ShardPlan
from repgeom_eval.spec.metric import Metric, state_of
from repgeom_eval.modeling.addresses import Address
from repgeom_eval.plugin_system.host import PluginHost

ENERGY_METRIC = "massive_activations"
ENERGY_TOP = 3  # dimensions listed in diagnostics[address]["energy"]


def energy_metric(host: PluginHost) -> type[Metric] | None:
    """The metric class behind the energy diagnostic, or None when that plugin is not loaded."""
    return host.metrics.get(ENERGY_METRIC) if ENERGY_METRIC in host.metrics else None


class RunState:
    """Metric states per address, energy per address, and counts of one run (one process)."""

    def __init__(self, addresses: list[Address], specs: list[MetricSpec], per_text: bool, context: int,
                 energy_cls: type[Metric] | None):
        self.addresses, self.specs, self.per_text, self.context = addresses, specs, per_text, context
        self.states: dict[Address, list[tuple[MetricSpec, Metric]]] = {
            addr: fresh_metrics(specs, addr) for addr in addresses}
        self._energy_cls = energy_cls
        self.energy: dict[Address, Metric] = (
            {addr: energy_cls(top_k=ENERGY_TOP) for addr in addresses} if energy_cls is not None else {})
        self.next_shard = 0
        self.resumed_from: int | None = None
        self.complete = False
        self.n_tokens = self.n_truncated = self.n_empty = self.n_sequences = 0
        self.n_processed = 0  # sequences this process ran (the others ran the rest of the n_sequences)
        self.processed_by_rank: list[int] = []
        self.empty_ids: list[Any] = []
        self.text_info: dict[int, tuple[Any, int | None]] = {}  # per_text only: index → (id, tokens untruncated)
        self.prep_transforms: dict[str, dict[str, torch.Tensor]] | None = None

    def first_metrics(self) -> list[tuple[MetricSpec, Metric]]:
        return next(iter(self.states.values()))

    def metric_configs(self) -> dict[str, dict[str, Any]]:
        return {spec.name: spec.config(m) for spec, m in self.first_metrics()}

    def count_shard(self, shard_no: int, sp: ShardPlan) -> None:
        """Counts that every process computes identically from the plan (so they are never summed over ranks)."""
        self.next_shard = shard_no + 1
        tokens, truncated, empty, sequences = shard_counts(sp, self.context)
        self.n_tokens += tokens
        self.n_truncated += truncated
        self.n_empty += empty
        self.n_sequences += sequences
        self.empty_ids += [sp.ids[t] for t in sp.empty][: max(0, 5 - len(self.empty_ids))]
        if self.per_text:
            for it, n in zip(sp.items, sp.lengths):
                if it.view < 0:
                    self.text_info[it.text] = (sp.ids[it.text], n)
            self.text_info.update({t: (sp.ids[t], None) for t in sp.empty})

    def check_counts(self, expected: list[int], where: str) -> None:
        """The counts a resumed checkpoint holds must be those of the shards it says are done (recounted from the
        data): a checkpoint edited to skip or repeat shards is refused, naming the field."""
        have = [self.n_tokens, self.n_truncated, self.n_empty, self.n_sequences]
        for name, got, want in zip(("n_tokens", "n_truncated", "n_empty", "n_sequences"), have, expected):
            if got != want:
                raise ValueError(f"{where}: counts.{name} is {got}, but the {self.resumed_from} shard(s) it says are "
                                 f"done hold {want}")

    def check_vectors(self, owned: int, where: str) -> None:
        """The vectors a resumed checkpoint's states hold must be those of the texts of the shards it says are done:
        the energy diagnostic counts every original text it was fed, so a state whose shard index was set back, or
        whose sums were scaled, is refused instead of resuming into a wrong number."""
        for addr, energy in self.energy.items():
            n = float(energy.n)
            if n != owned:
                raise ValueError(f"{where}: energy.{addr}.n is {n:g} vectors, but the {self.resumed_from} shard(s) it "
                                 f"says are done hold {owned} text(s) for this process")

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def state(self, copy: bool = True) -> dict[str, Any]:
        """Everything to save or send. ``copy=False`` (a checkpoint): the held tensors themselves, so that saving
        does not hold a second copy of every state at once (:meth:`Metric.state_dict`)."""
        return {
            "next_shard": self.next_shard, "complete": self.complete,
            "metrics": {str(a): {spec.name: state_of(m, copy) for spec, m in ms} for a, ms in self.states.items()},
            "energy": {str(a): state_of(m, copy) for a, m in self.energy.items()},
            "counts": [self.n_tokens, self.n_truncated, self.n_empty, self.n_sequences, self.n_processed],
            "empty_ids": list(self.empty_ids),
            "text_info": {i: list(v) for i, v in self.text_info.items()},
            "prep": self.prep_transforms,
            # metrics dropped after raising (an isolated plugin metric): still dropped after a resume
            "failures": {spec.name: spec.failure for spec in self.specs if spec.failure is not None},
        }

    def load(self, saved: dict[str, Any], shard_size: int, n_texts: int | None,
             widths: dict[Address, int | None] | None = None) -> None:
        """Take a checkpoint's state, after checking that it fits this run: every metric state of the same
        kind and dtype as a fresh one, of the shapes the metric declares (its ``D`` the layer's width, from
        ``widths``), satisfying the metric's own invariants (:meth:`Metric.check_state`), finite, with sane counts and
        a shard index the data can have. Anything else raises ValueError (the caller refuses the checkpoint in one
        line naming the file and the field)."""
        next_shard = saved["next_shard"]
        counts = saved["counts"]
        if not (isinstance(next_shard, int) and next_shard >= 0):
            raise ValueError(f"shard index {next_shard!r} is not a count")
        if n_texts is not None and next_shard > -(-n_texts // shard_size):
            raise ValueError(f"shard index {next_shard} is past the data's {-(-n_texts // shard_size)} shards")
        if not (isinstance(counts, (list, tuple)) and len(counts) == 5
                and all(isinstance(c, int) and c >= 0 for c in counts)):
            raise ValueError(f"counts {counts!r} are not five non-negative integers")
        seen: set[int] = set()
        widths = widths or {}
        for addr, ms in self.states.items():
            for spec, m in ms:
                state = saved["metrics"][str(addr)][spec.name]
                _check_state(f"{spec.name} at {addr}", m.state_dict(), state, seen)
                with spec.guard("check_state", addr):
                    problems = m.check_state(state, widths.get(addr))
                if problems:
                    raise ValueError(f"metrics.{addr}.{spec.name}: {'; '.join(problems)}")
                with spec.guard("load_state_dict", addr):
                    m.load_state_dict(state)
        for addr, m in self.energy.items():
            state = saved["energy"][str(addr)]
            _check_state(f"energy at {addr}", m.state_dict(), state, seen)
            problems = m.check_state(state, widths.get(addr))
            if problems:
                raise ValueError(f"energy.{addr}: {'; '.join(problems)}")
            m.load_state_dict(state)
        self.n_tokens, self.n_truncated, self.n_empty, self.n_sequences, self.n_processed = counts
        self.empty_ids = list(saved["empty_ids"])
        self.text_info = {int(i): (rid, n) for i, (rid, n) in saved["text_info"].items()}
        self.next_shard = self.resumed_from = next_shard
        self.prep_transforms = saved.get("prep")
        self._take_failures(saved.get("failures") or {})

    def _take_failures(self, failures: dict[str, str]) -> None:
        for spec in self.specs:
            if spec.failure is None and isinstance(failures.get(spec.name), str):
                spec.failure = failures[spec.name]

    # -- processes -----------------------------------------------------------------------------------------------
    def merge_ranks(self, dist: Distributed) -> None:
        """Fold every other rank's metric states and energy into rank 0's (in rank order)."""
        if not dist.active:
            self.processed_by_rank = [self.n_processed]
            return
        mine = on_host(self.state())  # a state on a GPU would arrive on the sender's device index
        parts = dist.gather({"metrics": mine["metrics"], "energy": mine["energy"], "processed": self.n_processed,
                             "failures": mine["failures"]})
        if parts is None:
            return
        self.processed_by_rank = [part["processed"] for part in parts]
        for part in parts[1:]:  # a metric dropped on any rank is dropped from the merged results
            self._take_failures(part["failures"])
        for m in [m for ms in self.states.values() for _, m in ms] + list(self.energy.values()):
            m.to("cpu")  # merged in host memory, once per run
        for part in parts[1:]:
            for addr, ms in self.states.items():
                for (spec, m), (_, other) in zip(ms, fresh_metrics(self.specs, addr)):
                    if spec.failure is not None:
                        continue
                    with spec.guard("merge", addr):
                        other.load_state_dict(part["metrics"][str(addr)][spec.name])
                        m.merge(other)
            for addr, m in self.energy.items():
                other = self._energy_cls(top_k=ENERGY_TOP)  # type: ignore[misc]
                other.load_state_dict(part["energy"][str(addr)])
                m.merge(other)


def on_host(obj: Any) -> Any:
    """``obj`` with every tensor in it moved to host memory (dicts and lists walked)."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: on_host(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [on_host(v) for v in obj]
    return obj


def shard_counts(sp: ShardPlan, context: int) -> tuple[int, int, int, int]:
    """(tokens read, texts truncated, empty texts, sequences) of one planned shard."""
    tokens = truncated = 0
    for it, n in zip(sp.items, sp.lengths):
        if it.view < 0:
            tokens += min(n, context)
            truncated += n > context
    return tokens, truncated, len(sp.empty), len(sp.items)


def _check_state(what: str, fresh: dict[str, torch.Tensor], saved: Any, widths: set[int]) -> None:
    """A saved metric state must hold the fresh state's tensors, with their dtypes, finite, and every
    hidden-size-shaped sum agreeing with the others'."""
    if not isinstance(saved, dict) or set(saved) != set(fresh):
        raise ValueError(f"{what}: state holds {sorted(saved) if isinstance(saved, dict) else type(saved).__name__}, "
                         f"expected {sorted(fresh)}")
    for name, tensor in saved.items():
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != fresh[name].dtype:
            raise ValueError(f"{what}: {name} is {getattr(tensor, 'dtype', type(tensor).__name__)}, expected "
                             f"{fresh[name].dtype}")
        if fresh[name].ndim and tensor.ndim != fresh[name].ndim and fresh[name].numel():
            raise ValueError(f"{what}: {name} has shape {tuple(tensor.shape)}, expected {tuple(fresh[name].shape)}")
        if tensor.dtype.is_floating_point and tensor.numel():
            # NaN is never a state; ±inf only where the fresh state starts from it (a running max or min)
            starts_infinite = fresh[name].numel() and bool(torch.isinf(fresh[name]).any())
            if bool(torch.isnan(tensor).any()) or (not starts_infinite and bool(torch.isinf(tensor).any())):
                raise ValueError(f"{what}: {name} holds NaN or inf")
    if "energy" in saved and saved["energy"].ndim == 1 and saved["energy"].numel():
        widths.add(int(saved["energy"].shape[0]))
        if len(widths) > 1:
            raise ValueError(f"{what}: hidden sizes {sorted(widths)} disagree")
