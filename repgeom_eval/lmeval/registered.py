"""Any registered metric (built-in or a third party's plugin) in a repgeom lm-eval task, at any layers.

``--metadata '{"repgeom_metrics": ["dataset_entropy", "mean_norm"], "repgeom_layers": ["final", "resid_post:0"]}'``
adds, next to the task's own geometry, every requested metric at every requested address. The metric states are a
:class:`~repgeom_eval.measurement.bank.MetricBank`, fed through the same pooling code as ``repgeom measure`` from
the hidden states of the forward pass lm-eval already runs (:mod:`repgeom_eval.lmeval.feeding`); see
docs/lmeval.md#any-registered-metric for the user's side.

What one text is (its index is the document's ``doc_id``):

* hardness tasks (``kind="context"``): the context tokens of the query, exactly as lm-eval scored them (its own
  tokenization, left-truncated to the model length). POOLED metrics read them pooled as the metric asks (``last``:
  the last context token, ``mean``: the mean over the context, ``first``), TOKENS metrics read every context token.
* the perplexity task (``kind="document"``): the positions whose next token lm-eval scores, over all rolling
  windows of the document (the prefix token and every document token but the last; the vectors of
  ``repgeom_token_dispersion``).
* VIEWS metrics (infonce, lidar, dime) compare augmented views of each text, which lm-eval never runs: they get
  one extra forward pass over the augmented contexts (or documents), with a warning.

Names in lm-eval's table, results JSON and ``--log_samples``: :func:`score_name`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.lmeval.ranks import lm_eval_ranks
from repgeom_eval.measurement.bank import MetricBank
from repgeom_eval.spec.options.measure import split_names
from repgeom_eval.spec.metric import Consumes
from repgeom_eval.modeling.addresses import Address
from repgeom_eval.spec.layer_request import REQUEST_KEY, layer_request

if TYPE_CHECKING:  # pragma: no cover
    from repgeom_eval.spec.options.lmeval import Settings

PREFIX = "repgeom:"
KINDS = ("context", "document")
# lm-eval keys a value as "metric,filter" and its table splits at the first comma; "|" would break the Markdown
# table. Such characters in a plugin's sub-score names become "_".
_UNSAFE = str.maketrans({",": "_", "|": "_", " ": "_", "\t": "_", "\n": "_"})


def score_name(score: str, address: Address | str) -> str:
    """The lm-eval metric name of one value: ``repgeom:<metric>[.<sub-score>]@<address>``.

    ``score`` is a flat name of :func:`~repgeom_eval.measurement.bank.flatten_result` (``dataset_entropy.normalized``)
    or of a per-text score (:func:`~repgeom_eval.measurement.bank.per_text_key`).
    """
    return f"{PREFIX}{score}@{address}".translate(_UNSAFE)


@dataclass(frozen=True)
class MetricRequest:
    """``repgeom_metrics``, ``repgeom_metric_params``, ``repgeom_layers`` and ``repgeom_seed`` of one task, checked."""

    metrics: tuple[str, ...]
    params: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    layers: tuple[str, ...] = ("final",)
    seed: int = 0
    pooling: str | None = None  # repgeom_pooling as one name: the pooling of every POOLED metric without its own

    @classmethod
    def from_settings(cls, settings: "Settings", host: Any = None) -> "MetricRequest | None":
        """The request of a task's :class:`~repgeom_eval.spec.options.lmeval.Settings`; None when no metric is requested.
        Unknown metrics, parameters or bad values fail here, when lm-eval loads the task, before any model is
        loaded."""
        metrics, params, layers, seed = settings.metrics, settings.metric_params, settings.layers, settings.seed
        pooling = settings.pooling
        if metrics is None or metrics == [] or metrics == "":
            if layers is not None:
                raise RepgeomError("repgeom_layers selects the layers of repgeom_metrics, and none are requested; "
                                   "add repgeom_metrics (the task's own geometry reads repgeom_layer)")
            if params is not None:
                raise RepgeomError("repgeom_metric_params given without repgeom_metrics")
            if isinstance(pooling, Mapping):
                raise RepgeomError("repgeom_pooling names metrics, and no repgeom_metrics are requested")
            return None
        names = cls._names(metrics, "repgeom_metrics")
        if params is None:
            params = {}
        if not isinstance(params, Mapping) or not all(
                isinstance(k, str) and isinstance(v, Mapping) for k, v in params.items()):
            raise RepgeomError('repgeom_metric_params must map metric names to their parameters, e.g. '
                               f'{{"dataset_entropy": {{"alpha": 2}}}}, got {params!r}')
        params = {k: dict(v) for k, v in params.items()}
        run_pooling = _pooling_into(params, pooling, names)
        # split by the one grammar of every surface (docs/lmeval.md#any-registered-metric): "resid_post:[0,-1]" is
        # one item, "final,resid_post:0" two
        layer_request = (request_items(layers, "repgeom_layers") if layers is not None
                         else request_items(str(settings.layer), "repgeom_layer"))
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise RepgeomError(f"repgeom_seed must be an integer, got {seed!r}")
        check_layers(layer_request, host)
        request = cls(names, params, layer_request, seed, run_pooling)
        request.specs(host)  # unknown names and bad parameters are errors now, not after the forward passes
        return request

    @staticmethod
    def _items(value: Any, key: str) -> tuple[str, ...]:
        items = [value] if isinstance(value, (str, int)) and not isinstance(value, bool) else value
        if not isinstance(items, (list, tuple)) or not all(
                isinstance(x, (str, int)) and not isinstance(x, bool) for x in items):
            raise RepgeomError(f"{key} must be a list of names (or one comma-separated string), got {value!r}")
        out = tuple(str(x).strip() for x in items if str(x).strip())
        if not out:
            raise RepgeomError(f"{key} is empty")
        return out

    @classmethod
    def _names(cls, value: Any, key: str) -> tuple[str, ...]:
        return split_names(cls._items(value, key))

    def specs(self, host: Any = None) -> list:
        """The metric specs, each instantiated once (a plugin's own parameter checks run here)."""
        from repgeom_eval.measurement.metric_specs import instantiate_metrics
        from repgeom_eval.plugin_system.host import get_host

        specs = instantiate_metrics(list(self.metrics), host or get_host(), self.params, per_text=True,
                                    pooling=self.pooling)
        for spec in specs:
            spec.new()
        return specs

    def record(self) -> dict[str, Any]:
        """What the task config records under ``metadata.repgeom`` (the request as given)."""
        out = {"metrics": list(self.metrics), "metric_params": {k: dict(v) for k, v in self.params.items()},
               REQUEST_KEY: list(self.layers), "seed": self.seed}
        if self.pooling is not None:
            out["pooling"] = self.pooling
        return out


def _pooling_into(params: dict[str, dict[str, Any]], pooling: Any, names: Sequence[str]) -> str | None:
    """``repgeom_pooling`` for the registered metrics: a name is returned (every POOLED metric without its own), a
    mapping goes into ``params`` as each metric's ``pooling``. ``repgeom_metric_params.METRIC.pooling``, the older
    spelling, still works, with a DeprecationWarning."""
    import warnings

    old = sorted(m for m, p in params.items() if "pooling" in p)
    if old:
        warnings.warn(f"repgeom_metric_params.{old[0]}.pooling is deprecated: give repgeom_pooling "
                      f'{{"{old[0]}": "{params[old[0]]["pooling"]}"}} (or one name for every metric)',
                      DeprecationWarning, stacklevel=4)
    if not isinstance(pooling, Mapping):
        return pooling
    for metric, value in pooling.items():
        if metric not in names:
            raise RepgeomError(f"repgeom_pooling sets the pooling of metric {metric!r}, which repgeom_metrics does "
                               f"not request (requested: {', '.join(names)})")
        given = params.get(metric, {}).get("pooling")
        if given is not None and given != value:
            raise RepgeomError(f"metric {metric!r}: repgeom_pooling says {value!r}, repgeom_metric_params "
                               f"{given!r}; give it once, in repgeom_pooling")
        params.setdefault(metric, {})["pooling"] = value
    return None


def request_items(value: Any, key: str) -> tuple[str, ...]:
    """``repgeom_layers`` (or ``repgeom_layer``) split by the one grammar of every surface
    (:func:`~repgeom_eval.modeling.addresses.layer_request`), its errors naming the key."""
    try:
        return layer_request(value).items
    except RepgeomError as exc:
        raise RepgeomError(f"{key}: {exc}") from None


def check_layers(layers: Sequence[str], host: Any = None, key: str = "repgeom_layers") -> None:
    """What can be checked of a layer request without the model: site names, index syntax and selector names
    (the ranges are checked on the model, before its first forward pass)."""
    from repgeom_eval.modeling.addresses import check_request_syntax
    from repgeom_eval.plugin_system.host import get_host

    host = host or get_host()
    try:
        check_request_syntax(layers, host.layer_selectors.names())
    except RepgeomError as exc:
        raise RepgeomError(f"{key}: {exc}") from None


def _reported(value: float, items: Sequence[Any]) -> float:
    """The aggregation of a metric's table value: computed from the merged metric states, not from the items."""
    return value


def _plain(value: float) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def _cpu(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, Mapping):
        return {k: _cpu(v) for k, v in state.items()}
    return state


class TaskBank:
    """The registered metrics of one task during one run: fed by the capture, merged across ranks, reported.

    Lifecycle: :meth:`resolve` (once the model is known) → :meth:`feed` / :meth:`add_window` (the
    :class:`~repgeom_eval.lmeval.feeding.BankFeeder`) → :meth:`finish` (the task's ``apply_filters``, on every
    rank) → :meth:`items` per document and :attr:`aggregations` for lm-eval.
    """

    def __init__(self, task: str, request: MetricRequest, kind: str, host: Any = None):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        from repgeom_eval.plugin_system.host import get_host

        self.task, self.request, self.kind = task, request, kind
        self.host = host or get_host()
        self.addresses: list[Address] = []
        self.points: dict = {}
        self.bank: MetricBank | None = None
        self.augmenter = None
        self._claimed: set[int] = set()  # texts fed (context kind)
        self._viewed: set[int] = set()  # texts whose views were fed
        self._expected: dict[int, int] = {}  # document → number of rolling windows
        self._windows: dict[int, dict[int, dict[Address, torch.Tensor]]] = {}  # documents still incomplete
        self.values: dict[str, float] = {}
        self.per_doc: dict[int, dict[str, float | None]] = {}
        self.names: list[str] = []
        self.finished = False
        self.generation = False  # a generate_until task: its prompts get a forward pass of their own (feeding)
        self.energy: dict = {}  # address → the energy diagnostic (massive_activations), as in repgeom measure
        self.warnings: list[str] = []  # what repgeom measure would warn about these numbers

    # -- set-up ------------------------------------------------------------------------------------------------------
    def resolve(self, loaded: Any) -> None:
        """Resolve the layer request on the run's model and create the metric states."""
        from repgeom_eval.modeling.addresses import resolve_request

        plan = resolve_request(list(self.request.layers), loaded, self.host)
        self.addresses, self.points = list(plan.addresses), dict(plan.points)
        self.bank = self._new_bank()
        self.energy = self._new_energy()
        if self.bank.needs_views:
            from repgeom_eval.measurement.augment import Augmenter

            self.augmenter = Augmenter(seed=self.request.seed)

    def _new_bank(self) -> MetricBank:
        return MetricBank(self.request.metrics, self.addresses, params=self.request.params, per_text=True,
                          host=self.host, pooling=self.request.pooling)

    def _new_energy(self) -> dict:
        from repgeom_eval.measurement.states import ENERGY_TOP, energy_metric

        cls = energy_metric(self.host)
        return {a: cls(top_k=ENERGY_TOP) for a in self.addresses} if cls is not None else {}

    @property
    def n_views(self) -> int:
        return self.bank.n_views if self.bank is not None else 0

    @property
    def needs_originals(self) -> bool:
        return any(spec.consumes != Consumes.VIEWS for spec in self.bank.specs) if self.bank else False

    def view_metrics(self) -> list[str]:
        return [spec.name for spec in self.bank.specs if spec.consumes == Consumes.VIEWS] if self.bank else []

    def record(self) -> dict[str, Any]:
        """What the run resolved: addresses and every metric's parameters (``metadata.repgeom`` of the task)."""
        assert self.bank is not None
        out: dict[str, Any] = {"metric_addresses": [str(a) for a in self.addresses],
                               "metric_configs": self.bank.configs(), "metric_plugins": self.bank.provenance()}
        if self.augmenter is not None:
            out["views"] = self.augmenter.config() | {"n_views": self.n_views, "extra_pass": True}
        return out

    # -- feeding -----------------------------------------------------------------------------------------------------
    def claim(self, doc_id: int) -> bool:
        """True the first time a text is offered: the caller then feeds it (each text is fed once)."""
        if doc_id in self._claimed:
            return False
        self._claimed.add(doc_id)
        return True

    def feed(self, hidden: Mapping[Address, torch.Tensor], mask: torch.Tensor, doc_ids: Sequence[int],
             views: Sequence[int] | None = None) -> None:
        """One batch of texts at every address: ``hidden[addr]`` [B, T, D], ``mask`` [B, T] True at the text's
        tokens, ``views`` the view number of each row (None: the texts themselves)."""
        assert self.bank is not None
        host_mask = mask if mask.device.type == "cpu" else None
        on_device: dict[Any, torch.Tensor] = {}  # the mask copied once per device, without waiting
        for addr in self.addresses:
            h = hidden[addr]
            if h.device not in on_device:
                on_device[h.device] = mask.to(h.device, non_blocking=True)
            self.bank.update(addr, h, on_device[h.device], list(doc_ids), views, host_mask=host_mask)
            if views is None and addr in self.energy:  # the raw mean-pooled vectors of the texts themselves
                from repgeom_eval.measurement.pooling import pool64
                from repgeom_eval.spec.metric import LayerBatch

                vectors = pool64(h, on_device[h.device].bool(), "mean")[0]
                self.energy[addr].update(LayerBatch(str(addr), torch.tensor(list(doc_ids)), pooled=vectors))

    def expect(self, doc_id: int, n_windows: int) -> bool:
        """Announce a document of ``n_windows`` rolling windows; False if it was announced already."""
        if doc_id in self._expected:
            return False
        self._expected[doc_id] = n_windows
        self._windows[doc_id] = {}
        return True

    def needs_window(self, doc_id: int, window: int) -> bool:
        return doc_id in self._windows and window not in self._windows[doc_id]

    def add_window(self, doc_id: int, window: int, vectors: Mapping[Address, torch.Tensor]) -> None:
        """The [n, D] scored-position vectors of one window at every address; the document is fed (as one text,
        its windows in order) once all its windows are there."""
        parts = self._windows[doc_id]
        parts[window] = dict(vectors)
        if len(parts) < self._expected[doc_id]:
            return
        del self._windows[doc_id]
        hidden = {a: torch.cat([parts[w][a] for w in range(len(parts))])[None] for a in self.addresses}
        first = hidden[self.addresses[0]]
        self.feed(hidden, torch.ones(first.shape[:2], dtype=torch.bool), [doc_id])

    def incomplete(self) -> list[int]:
        return sorted(self._windows)

    def claim_views(self, doc_id: int) -> bool:
        if doc_id in self._viewed:
            return False
        self._viewed.add(doc_id)
        return True

    def missing(self, doc_ids: Sequence[int]) -> list[int]:
        """The documents among ``doc_ids`` (this rank's) that never reached the metric states."""
        fed = self._claimed if self.kind == "context" else set(self._expected)
        return sorted(d for d in set(doc_ids) if (self.needs_originals and d not in fed)
                      or (self.n_views and d not in self._viewed))

    # -- results -----------------------------------------------------------------------------------------------------
    def finish(self, world_size: int = 1) -> None:
        """Merge the states of every rank (a collective) and compute the table values and per-text scores."""
        assert self.bank is not None
        if self._windows:
            raise RepgeomError(f"task {self.task}: documents {self.incomplete()[:5]} never received all their "
                               "rolling windows")
        if self.bank.feeder.pending_views():
            raise RuntimeError("augmented views of some texts never all arrived")  # a bug, never a user error
        ranks = lm_eval_ranks(world_size, "the metric states of every rank are needed")
        if not ranks.active:  # one rank: its states are the merged ones (no host copy of every Gram to gather)
            merged, energy = self.bank, self.energy
        else:
            states = ranks.all_gather(_cpu((self.bank.state(), {str(a): e.state_dict()
                                                                for a, e in self.energy.items()})))
            merged, energy = self._new_bank(), self._new_energy()
            for state, energy_state in states:
                merged.merge_state(state)
                for a, e in energy.items():
                    other = type(e)(top_k=e.top_k)
                    other.load_state_dict(dict(energy_state[str(a)]))
                    e.merge(other)
        from repgeom_eval.measurement.bank import flatten_result
        from repgeom_eval.lmeval.diagnostics import bank_warnings

        computed = merged.compute()
        self.warnings = bank_warnings(merged, computed, energy)
        self.values = {score_name(name, addr): value for addr, results in computed.items()
                       for metric, result in results.items()
                       for name, value in flatten_result(metric, result).items()}
        for addr, ms in merged.states.items():  # what a metric could not honour as given (top_k_used ...)
            for spec, metric in ms:
                with spec.guard("diagnostics", addr):
                    diag = metric.diagnostics() or {}
                if isinstance(diag.get("warning"), str):  # its numbers beside its values; its words in the warnings
                    self.values.update({score_name(f"{spec.name}.{k}", str(addr)): v for k, v in diag.items()
                                        if isinstance(v, (int, float)) and not isinstance(v, bool)})
        self.per_doc = {}
        for doc_id, by_addr in merged.per_text_scores().items():
            self.per_doc[doc_id] = {score_name(key, addr): _plain(v)
                                    for addr, scores in by_addr.items() for key, v in scores.items()}
        self.names = sorted(set(self.values) | {n for scores in self.per_doc.values() for n in scores})
        self.finished = True

    def items(self, doc_id: int) -> dict[str, float | None]:
        """One document's item of every name: its per-text score where the metric has one, else null."""
        scores = self.per_doc.get(doc_id, {})
        return {name: scores.get(name) for name in self.names}

    @property
    def aggregations(self) -> dict[str, Any]:
        """lm-eval aggregation of every name: a metric's own value (from the merged states), or, for a per-text
        score that is not one, the mean of its defined per-query values."""
        from repgeom_eval.lmeval.metrics import mean_of_defined

        return {name: functools.partial(_reported, self.values[name]) if name in self.values else mean_of_defined
                for name in self.names}
