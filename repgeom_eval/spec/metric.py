"""The metric API for plugin authors, modelled on torchmetrics' ``Metric``.

A metric keeps *mergeable state*: tensors declared with :meth:`Metric.add_state` and a reduction (``"sum"``,
``"cat"``, ``"max"``, ``"min"``). ``update`` folds one batch into the state, ``merge`` folds another shard's state
into this one (so shards from several processes combine exactly), ``compute`` turns the state into results.
States are float64 whatever the model's dtype. There are no ``"mean"`` states on purpose: a mean of means over
uneven shards is wrong; keep a ``"sum"`` and a count.

Metrics that need the same sufficient statistic of the same vectors share it: a metric names the
:class:`Statistic` objects it reads in :meth:`Metric.statistics`, and a run keeps one state per distinct statistic,
address and pooling, fed once, however many metrics read it (docs/plugins.md#shared-statistics).
"""

from __future__ import annotations

import copy
import enum
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from repgeom_eval.plugin_system.lazy import lazy

# Imported on first use: a plugin module subclasses Metric while `repgeom --help` or `repgeom plugins` runs, and
# neither needs torch (the annotations below are strings, `from __future__ import annotations`).
torch = lazy("torch")

REDUCTIONS = ("sum", "cat", "max", "min")


class Consumes(str, enum.Enum):
    """What a metric reads from each batch; the pipeline prepares only what is asked for."""

    POOLED = "pooled"  #: one vector per text (``batch.pooled``, shape [B, D])
    TOKENS = "tokens"  #: every non-pad token vector of each text (``batch.hidden`` + ``batch.mask``)
    VIEWS = "views"  #: several augmented views per text, pooled (``batch.views``, shape [B, V, D])


@dataclass
class LayerBatch:
    """The vectors of one batch at one layer address, as handed to :meth:`Metric.update`.

    ``index`` holds each text's position in the input data, so per-text results can be put back in order.
    """

    address: str
    index: torch.Tensor  # [B] int64
    pooled: torch.Tensor | None = None  # [B, D] float64, on the CPU
    hidden: torch.Tensor | None = None  # [B, T, D] float64, pad positions zero, on the model's device
    mask: torch.Tensor | None = None  # [B, T] bool, True at real tokens, on the model's device
    views: torch.Tensor | None = None  # [B, V, D] float64

    def token_vectors(self) -> Iterator[torch.Tensor]:
        """The [T_i, D] non-pad token vectors of each text, in batch order."""
        assert self.hidden is not None and self.mask is not None, "metric must declare consumes = TOKENS"
        for h, m in zip(self.hidden, self.mask):
            yield h[m]


class Stateful:
    """Mergeable state: tensors declared with :meth:`add_state`, saved, checked, loaded and merged. The base of
    :class:`Metric` and :class:`Statistic`."""

    name: ClassVar[str] = ""
    state_device: ClassVar[str] = "input"
    #: the float64 arrays ``compute`` holds at once beside the states, for one address at a time, as shapes like
    #: ``add_state``'s (``"D"`` the width, ``"N"`` a row per text): a Gram rebuilt whole and the eigendecomposition's
    #: copy are ``(("D", "D"), ("D", "D"))``. ``--dry-run`` counts the largest once for the run.
    compute_temporaries: ClassVar[tuple[tuple[int | str, ...], ...]] = ()

    def __init__(self) -> None:
        self._defaults: dict[str, Any] = {}
        self._reductions: dict[str, str] = {}
        self._shapes: dict[str, tuple[int | str, ...] | None] = {}
        self._bounds: dict[str, int | str] = {}
        self._folds: dict[str, str] = {}  # buffer → the sum it is folded into (add_state(folds_into=...))

    # -- state -------------------------------------------------------------------------------------------------
    def add_state(self, name: str, default: torch.Tensor | list, reduce: str,
                  shape: tuple[int | str, ...] | None = None, max_rows: int | str | None = None,
                  folds_into: str | None = None) -> None:
        """Declare a state. ``"cat"`` states start as an empty list and are concatenated on merge.

        ``shape`` declares the state's shape once it holds data, for the checks of a saved state (a resumed
        checkpoint): each dimension a number, ``"D"`` (the width of the layer's vectors), or another name that
        must agree wherever it appears (``"N"`` for the rows of ``cat`` states that grow together); ``"D+1"`` is one
        more than the width (docs/plugins.md#state-checks). ``max_rows``: a ``cat`` state that never holds more rows
        than this (a number or ``"D"``: a buffer the metric folds into a fixed-size sum), so that its memory does not
        grow with the data (``repgeom measure --dry-run`` counts it as fixed). ``folds_into``: the ``sum`` state such
        a buffer is folded into, when that sum is made only at the first fold and the buffer emptied then (the two
        hold data together only while one address folds, so the estimate counts the larger of the two per
        address, and the buffer once for the run)."""
        if reduce not in REDUCTIONS:
            raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
        if reduce == "cat":
            if not (isinstance(default, list) and not default):
                raise ValueError("a 'cat' state starts as an empty list")
        elif not isinstance(default, torch.Tensor):
            raise ValueError(f"state {name!r}: default must be a tensor")
        self._defaults[name] = default
        self._reductions[name] = reduce
        self._shapes[name] = tuple(shape) if shape is not None else None
        if max_rows is not None:
            self._bounds[name] = max_rows
        if folds_into is not None:
            if reduce != "cat" or max_rows is None or self._reductions.get(folds_into) != "sum":
                raise ValueError(f"state {name!r}: folds_into names a 'sum' state declared before it, for a 'cat' "
                                 "buffer with max_rows")
            self._folds[name] = folds_into
        setattr(self, name, copy.deepcopy(default))

    def declared_states(self) -> Iterator[tuple[str, str, Any, tuple | None, int | str | None, str, str | None]]:
        """(name, reduction, default, shape, max_rows, state_device, folds_into) of every declared state."""
        for name, reduce in self._reductions.items():
            yield (name, reduce, self._defaults[name], self._shapes.get(name), self._bounds.get(name),
                   self.state_device, self._folds.get(name))

    def reset(self) -> None:
        for name, default in self._defaults.items():
            setattr(self, name, copy.deepcopy(default))

    def to(self, device: Any) -> "Stateful":
        """Move every state to ``device`` (states already there stay as they are); returns self. The run calls it
        before a state's first update on a device, so ``update`` may assume its states sit beside the vectors it
        is fed. A class with ``state_device = "cpu"`` keeps its states in host memory."""
        if self.state_device == "cpu":
            return self
        for name, reduce in self._reductions.items():
            value = getattr(self, name)
            setattr(self, name, [v.to(device) for v in value] if reduce == "cat" else value.to(device))
        return self

    def state_dict(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """The state as tensors (``cat`` states concatenated along dim 0), e.g. for checkpoints or collectives.

        ``copy=False`` (a checkpoint, written at once and dropped) hands out the held tensors themselves instead of a
        copy of every state of every address at once: a ``cat`` state in several pieces is joined in place first
        (one state's transient at a time), and a view of a larger block is copied alone, so that what is saved is
        the view, not the block behind it. The caller must not modify them."""
        out = {}
        for name, reduce in self._reductions.items():
            value = getattr(self, name)
            if reduce == "cat":
                if not value:
                    out[name] = torch.empty(0, dtype=torch.float64)
                    continue
                if len(value) > 1 and not copy:
                    value[:] = [torch.cat(value)]  # the same rows in one piece: later updates append after it
                value = value[0] if len(value) == 1 else torch.cat(value)
            value = value.detach()
            whole = value.untyped_storage().nbytes() == value.numel() * value.element_size()
            out[name] = value if not copy and whole and value.is_contiguous() else value.clone()
        return out

    def state_bytes(self) -> int:
        """The bytes the states hold now (a ``cat`` state's pieces added up), read in place: no copy is made, unlike
        :meth:`state_dict` (a run reports it at its end, when every address's states are still held)."""
        total = 0
        for name, reduce in self._reductions.items():
            value = getattr(self, name)
            for t in (value if reduce == "cat" else [value]):
                total += t.numel() * t.element_size()
        return total

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = set(self._reductions) - set(state)
        if missing:
            raise ValueError(f"{self.name}: state is missing {sorted(missing)}")
        for name, reduce in self._reductions.items():
            value = state[name].clone()
            setattr(self, name, [value] if reduce == "cat" and value.numel() else [] if reduce == "cat" else value)

    def check_state(self, state: dict[str, torch.Tensor], width: int | None = None) -> list[str]:
        """Why ``state`` (a saved :meth:`state_dict`) cannot be this metric's, as short phrases; empty when it can.

        Checks every declared shape (``add_state(..., shape=...)``; ``width`` is the layer's ``D`` when known);
        states that never received data (empty) pass. A subclass adds what its sums must satisfy (a count that is
        a whole number, a sum of squared unit norms no larger than the count ...): extend the list that
        ``super().check_state(...)`` returns."""
        problems: list[str] = []
        symbols: dict[str, int] = {"D": width} if width else {}
        for name, shape in self._shapes.items():
            value = state.get(name)
            if shape is None or not isinstance(value, torch.Tensor) or value.numel() == 0:
                continue
            if "D+1" in shape and "D" in shape and value.ndim == len(shape):  # read D from the plain dimension
                symbols.setdefault("D", value.shape[shape.index("D")])
            if "D" in symbols:
                symbols["D+1"] = symbols["D"] + 1
            if value.ndim != len(shape):
                problems.append(f"{name} has shape {tuple(value.shape)}, expected {len(shape)} dimension(s) {shape}")
                continue
            for dim, want in zip(value.shape, shape):
                if isinstance(want, int) and dim != want:
                    problems.append(f"{name} has shape {tuple(value.shape)}, expected {shape}")
                elif isinstance(want, str) and symbols.setdefault(want, dim) != dim:
                    problems.append(f"{name} has {want} = {dim} where the rest of the state (or the layer) has "
                                    f"{want} = {symbols[want]}")
        return problems

    @staticmethod
    def is_count(value: torch.Tensor) -> bool:
        """A state that counts things: a non-negative whole number (for :meth:`check_state`)."""
        return bool(value.numel() == 1 and torch.isfinite(value) and value >= 0 and value == value.round())

    def merge(self, other: "Metric") -> "Metric":
        """Fold ``other``'s state (another shard of the same data) into this metric, in place; returns self."""
        if type(other) is not type(self):
            raise TypeError(f"cannot merge {type(other).__name__} into {type(self).__name__}")
        if other.config() != self.config():
            raise ValueError(f"cannot merge {self.name} metrics with different parameters: "
                             f"{self.config()} vs {other.config()}")
        for name, reduce in self._reductions.items():
            mine, theirs = getattr(self, name), getattr(other, name)
            if reduce == "sum":
                # A state that was never updated may still be its empty default (sizes are known lazily).
                setattr(self, name, theirs.clone() if mine.numel() == 0 else mine if theirs.numel() == 0
                        else mine + theirs)
            elif reduce == "cat":
                setattr(self, name, list(mine) + list(theirs))
            elif reduce == "max":
                setattr(self, name, torch.maximum(mine, theirs))
            else:
                setattr(self, name, torch.minimum(mine, theirs))
        return self

    # -- parameters ----------------------------------------------------------------------------------------------
    @classmethod
    def parameter_names(cls) -> list[str]:
        sig = inspect.signature(cls.__init__)
        return [p.name for p in list(sig.parameters.values())[1:]
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    def config(self) -> dict[str, Any]:
        """The parameters this instance was built with (read back by attribute name)."""
        return {n: getattr(self, n) for n in self.parameter_names() if hasattr(self, n)}

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({params})"


class Statistic(Stateful):
    """A sufficient statistic of the vectors a metric reads, that several metrics can share
    (docs/plugins.md#shared-statistics).

    Declare states with :meth:`add_state` in ``__init__`` and fold a batch in :meth:`update`, as for a metric; the
    constructor's keyword arguments are its parameters. Two statistics of the same class and parameters, read at the
    same address with the same pooling, are one state in a run: the first metric that declares it feeds it, every
    other reads it. ``update`` must therefore depend only on ``batch.pooled`` (the vectors all those metrics see).
    """

    def update(self, batch: LayerBatch) -> None:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement update()")

    def key(self) -> tuple:
        """What makes two statistics the same: class and parameters."""
        return (type(self).__module__, type(self).__qualname__, tuple(sorted(self.config().items())))

    def label(self) -> str:
        params = ",".join(f"{k}={v}" for k, v in sorted(self.config().items()))
        return f"{self.name or type(self).__name__}({params})"


class Metric(Stateful):
    """Base class of every metric. Subclass it, declare states in ``__init__``, implement ``update``/``compute``.

    Class attributes:
        name: registry name, e.g. ``"dispersion"``.
        consumes: what ``update`` reads (:class:`Consumes`).
        full_state_update: always ``False`` here: ``update`` only ever needs the batch and the running state.
        default_pooling: how token vectors become one vector per text for this metric, unless overridden.
        state_device: where the states live: ``"input"`` (the device of the vectors fed in, the model's) or
            ``"cpu"`` (the metric moves what it keeps to host memory); ``repgeom measure --dry-run`` reports it.

    A metric whose state is a statistic other metrics need too (a Gram, sums of unit vectors) returns it from
    :meth:`statistics` instead of declaring it with ``add_state``, and reads it with :meth:`stat`; its default
    ``update`` feeds it (docs/plugins.md#shared-statistics).

    A ``VIEWS`` metric must have an ``n_views`` attribute (usually a constructor parameter): the pipeline makes
    that many augmented views of every text and hands them over pooled, as ``batch.views`` [B, n_views, D].

    Constructor keyword arguments are the metric's parameters; :meth:`config` reads them back (by attribute of
    the same name) so every run records the values actually used.
    """

    name: ClassVar[str] = ""
    consumes: ClassVar[Consumes] = Consumes.POOLED
    full_state_update: ClassVar[bool] = False
    #: pooling used for POOLED/VIEWS metrics unless the user sets one (``--pooling`` or ``METRIC.pooling``).
    default_pooling: ClassVar[str] = "last"
    state_device: ClassVar[str] = "input"

    def __init__(self) -> None:
        super().__init__()
        self._stats: dict[str, Statistic] | None = None  # slot → statistic, made on first use (after __init__)
        self._owned: set[str] = set()  # the slots this metric feeds, saves and merges (not borrowed from another)

    # -- shared statistics ---------------------------------------------------------------------------------------
    def statistics(self) -> dict[str, Statistic]:
        """The statistics this metric reads, by slot name (e.g. ``{"sums": UnitSums()}``); called once,
        after ``__init__``, so it may depend on the parameters. Default: none."""
        return {}

    def _slots(self) -> dict[str, Statistic]:
        if self._stats is None:
            self._stats = dict(self.statistics())
            self._owned = set(self._stats)
        return self._stats

    def stat(self, slot: str) -> Statistic:
        """The statistic in ``slot`` (this metric's own, or the one it shares with another metric of the run)."""
        return self._slots()[slot]

    def share(self, slot: str, statistic: Statistic) -> None:
        """Read ``statistic`` (fed, saved and merged by the metric that owns it) in ``slot`` from now on."""
        mine = self._slots()[slot]
        if mine.key() != statistic.key():
            raise ValueError(f"{self.name}: cannot share {statistic.label()} in slot {slot!r} of {mine.label()}")
        self._stats[slot] = statistic  # type: ignore[index]
        self._owned.discard(slot)

    def owned_statistics(self) -> dict[str, Statistic]:
        return {slot: st for slot, st in self._slots().items() if slot in self._owned}

    def declared_states(self) -> Iterator[tuple[str, str, Any, tuple | None, int | str | None, str, str | None]]:
        """(name, reduction, default, shape, max_rows, state_device, folds_into) of every state this metric keeps:
        its own and those of the statistics it owns (``slot.name``); for the memory estimate."""
        yield from super().declared_states()
        keys = self._keys()
        for slot, st in sorted(self.owned_statistics().items()):
            for name, *rest, folds in st.declared_states():
                yield (keys[slot, name], *rest, keys[slot, folds] if folds else None)

    def reset(self) -> None:
        super().reset()
        for st in self.owned_statistics().values():
            st.reset()

    def to(self, device: Any) -> "Metric":
        super().to(device)
        for st in self.owned_statistics().values():  # a borrowed statistic is moved by the metric that owns it
            st.to(device)
        return self

    def _keys(self) -> dict[tuple[str, str], str]:
        """(slot, state name) → the key under which an owned statistic's state is saved: its own name, or
        ``slot.name`` where that would clash with another state of this metric."""
        names = [(slot, n) for slot, st in sorted(self.owned_statistics().items()) for n in st._reductions]
        seen = list(self._reductions) + [n for _, n in names]
        return {(slot, n): n if seen.count(n) == 1 else f"{slot}.{n}" for slot, n in names}

    def state_bytes(self) -> int:
        return super().state_bytes() + sum(st.state_bytes() for st in self.owned_statistics().values())

    def state_dict(self, copy: bool = True) -> dict[str, torch.Tensor]:
        out = super().state_dict(copy)
        keys = self._keys()
        for slot, st in sorted(self.owned_statistics().items()):
            out.update({keys[slot, k]: v for k, v in state_of(st, copy).items()})
        return out

    def _split(self, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
        """A saved state's own part, and each owned statistic's part under the statistic's own names."""
        keys = self._keys()
        parts: dict[str, dict] = {slot: {} for slot in self.owned_statistics()}
        theirs = {key: (slot, n) for (slot, n), key in keys.items()}
        own = {}
        for k, v in state.items():
            if k in theirs:
                parts[theirs[k][0]][theirs[k][1]] = v
            else:
                own[k] = v
        return own, parts

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        own, parts = self._split(state)
        super().load_state_dict(own)
        for slot, st in self.owned_statistics().items():
            st.load_state_dict(parts[slot])

    def check_state(self, state: dict[str, torch.Tensor], width: int | None = None) -> list[str]:
        own, parts = self._split(state)
        problems = super().check_state(own, width)
        for slot, st in self.owned_statistics().items():
            problems += st.check_state(parts[slot], width)
        return problems

    def merge(self, other: "Metric") -> "Metric":
        super().merge(other)
        theirs = other.owned_statistics()
        for slot, st in self.owned_statistics().items():
            if slot not in theirs:
                raise ValueError(f"{self.name}: the other shard does not hold its {slot!r} statistic")
            st.merge(theirs[slot])
        return self

    # -- interface -----------------------------------------------------------------------------------------------
    def update(self, batch: LayerBatch) -> None:
        """Fold one batch into the state. The default feeds the statistics this metric owns (a metric with states
        of its own overrides it and calls ``super().update(batch)``)."""
        owned = self.owned_statistics()
        if not self._slots():
            if type(self).update is Metric.update:  # neither statistics nor an update of its own
                raise NotImplementedError(f"{type(self).__name__} must implement update()")
            return  # an override's super().update(batch) with no statistic to feed (as docs/plugins.md advises)
        for st in owned.values():
            st.update(batch)

    def compute(self) -> float | dict[str, Any]:  # pragma: no cover - abstract
        """A float (written as a JSON number) or a dict of JSON-serialisable values."""
        raise NotImplementedError(f"{type(self).__name__} must implement compute()")

    def per_text_results(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
        """Optional per-text scores: ``{score_name: (text_index [N], value [N])}``. ``None`` if not tracked."""
        return None

    def diagnostics(self) -> dict[str, Any]:
        """Optional counts and caveats written next to the results (e.g. how many texts were skipped)."""
        return {}

    def work_note(self, tokens: int, width: int) -> str | None:
        """Optional: one line ``--dry-run`` prints when this metric's work per text grows faster with the context
        length than the forward pass's (which grows about linearly): what it does per text and address, and how that
        grows. ``tokens`` is the run's longest input, ``width`` the layer's. ``None`` (the default) says nothing."""
        return None

    @classmethod
    def across_layers(cls, values: dict[str, Any], depth: list[int]) -> dict[str, Any] | None:
        """Optional summary over every requested address (e.g. a trend against depth).

        Args:
            values: address → this metric's ``compute()`` result, in depth order.
            depth: the depth index of each address (embed = 0, then execution order), same order as ``values``.
        Returns a JSON-serialisable dict written to ``result.summary[metric]``, or ``None``.
        """
        return None


def state_of(stateful: Stateful, copy: bool) -> dict[str, torch.Tensor]:
    """``stateful.state_dict(copy=copy)``; a plugin's class that overrides ``state_dict()`` without the ``copy``
    parameter gets its own (copying) call."""
    import inspect

    if copy or "copy" not in inspect.signature(stateful.state_dict).parameters:
        return stateful.state_dict()
    return stateful.state_dict(copy=False)
