"""Any registered metric at every layer of an MTEB sweep, fed from the sweep's own forward passes.

``repgeom mteb run --metrics NAME ...`` (``run_layers(metrics=[...])``) keeps one
:class:`~repgeom_eval.measurement.bank.MetricBank` per evaluated (task, split, subset). While a task is evaluated,
every forward pass the sweep runs for that split hands its captured token vectors, at every layer still to be
evaluated, to the bank, so token metrics (``token_dispersion``, ``curvature`` ...) cost no extra pass and pooled
metrics are pooled by the same code as ``repgeom measure``. When a layer's evaluation is over, its metric values are
added to each subset's score dict (docs/mteb.md#any-metric-next-to-the-scores):

* ``repgeom.<metric>`` for a number, ``repgeom.<metric>.<sub>`` for each number of a dict result
  (:func:`~repgeom_eval.measurement.bank.flatten_result` names behind a ``repgeom.`` prefix);
* ``repgeom_metrics``: a JSON string ``{metric: configuration}`` (parameters and pooling actually used), which also
  tells a resumed run whether a cached value was computed with the requested parameters.

What a metric sees, so that a value equals ``repgeom measure`` on the same texts, layer and pooling:

* the texts: the distinct texts embedded for that split and subset (queries and documents for retrieval; the
  evaluated split, not the training split, for classification), as the encoder tokenized them (prompt prefixed,
  lower-cased where the model's recipe says so); whitespace-only texts are left out, as ``measure`` leaves them out;
* the pooling: the embedding recipe's (``--pooling``), unless ``--metric-param METRIC.pooling=...`` sets another;
  token metrics read the token vectors;
* no unit normalisation: ``--normalize`` shapes the embedding MTEB scores, not the vectors metrics read (``measure``
  has no such step; the cosine-based metrics do not change under it anyway).

Metrics that read augmented views (``infonce``, ``lidar``, ``dime``) cost extra forward passes: after a task's split
is evaluated, each distinct text's views run once through the model for all layers of the sweep (a warning says so).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.measurement.bank import MetricBank, flatten_result
from repgeom_eval.spec.options.measure import split_names
from repgeom_eval.measurement.forward import Batch
from repgeom_eval.measurement.metric_specs import instantiate_metrics
from repgeom_eval.measurement.plan import Item
from repgeom_eval.spec.metric import Consumes
from repgeom_eval.modeling.addresses import Address
from repgeom_eval.plugin_system.host import PluginHost, get_host

#: prefix of every registered metric's key in an mteb score dict
RESULT_PREFIX = "repgeom."
#: score-dict key of the metrics' configurations (a JSON string: mteb rounds every float of a score dict to 6 digits)
CONFIG_KEY = "repgeom_metrics"

Context = tuple[str, str, str]  # task name, split, subset


def score_key(flat_name: str) -> str:
    """The score-dict key of a flat metric name: ``dispersion`` → ``repgeom.dispersion``."""
    return RESULT_PREFIX + flat_name


def metric_keys(scores: Mapping[str, Any]) -> list[str]:
    """The ``repgeom.*`` keys of a score dict, in its order."""
    return [k for k in scores if k.startswith(RESULT_PREFIX)]


def stored_configs(scores: Mapping[str, Any]) -> dict[str, Any]:
    """The ``{metric: configuration}`` recorded in a score dict (empty if none or unreadable)."""
    raw = scores.get(CONFIG_KEY)
    try:
        out = json.loads(raw) if isinstance(raw, str) else {}
    except json.JSONDecodeError:
        return {}
    return out if isinstance(out, dict) else {}


def _belongs(key: str, metric: str) -> bool:
    name = key[len(RESULT_PREFIX):]
    return name == metric or name.startswith(metric + ".")


def _plain(value: Any) -> Any:
    """A configuration as JSON gives it back (tuples as lists, keys as strings), for comparisons."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def check_metrics(names: str | Sequence[str], params: Mapping[str, Mapping[str, Any]] | None = None,
                  host: PluginHost | None = None) -> tuple[str, ...]:
    """Unknown metric names or parameters fail here, before a model is loaded. Returns the names."""
    wanted = split_names(names or ())
    if not wanted:
        if params:
            raise RepgeomError(f"--metric-param given for {sorted(params)} but no --metrics requested")
        return ()
    instantiate_metrics(list(wanted), host or get_host(), params, False, None)
    return wanted


@dataclass
class _Split:
    """The bank of one (task, split, subset), the distinct texts registered for it, and what each layer got."""

    bank: MetricBank
    index: dict[str, int] = field(default_factory=dict)  # prepared text → index, in first-seen order
    fed: dict[Address, set[int]] = field(default_factory=dict)  # texts whose token vectors reached each layer
    views_fed: set[Address] = field(default_factory=set)
    done: set[Address] = field(default_factory=set)


METRIC_WARNINGS_KEY = "repgeom_metric_warnings"  # a JSON list: the metrics' own diagnostics warnings


class SweepMetrics:
    """Registered metrics for the layers of one sweep (see the module docstring).

    Args:
        names: registered metric names.
        addresses: the sweep's canonical addresses.
        params: ``{metric: {parameter: value}}`` as ``--metric-param`` gives them (``pooling`` included).
        pooling: the pooling of every pooled metric that does not set its own (the embedding recipe's).
        seed: seed of the augmented views (as ``measure --seed``).
    """

    def __init__(self, names: str | Sequence[str], addresses: Sequence[Address], *,
                 params: Mapping[str, Mapping[str, Any]] | None = None, pooling: str | None = None, seed: int = 0,
                 host: PluginHost | None = None):
        self.host = host or get_host()
        self.names = list(check_metrics(names, params, self.host))
        if not self.names:
            raise RepgeomError("no metric requested")
        self.params = {m: dict(p) for m, p in (params or {}).items()}
        self.pooling = pooling
        self.addresses = list(addresses)
        self.seed = seed
        specs = instantiate_metrics(self.names, self.host, self.params, False, pooling)
        # each metric's parameters and the plugin (distribution, version) that computed it: a cached result from
        # other parameters or another plugin version is computed again
        self.configs = {s.name: _plain(s.config(s.new()) | {"plugin": {"plugin": s.plugin, "distribution":
                                                                       s.distribution, "version": s.version}})
                        for s in specs}
        views = [(s.name, int(s.new().n_views)) for s in specs if s.consumes == Consumes.VIEWS]  # type: ignore
        self.n_views = max([n for _, n in views] or [0])
        self.augmenter = None
        if self.n_views:
            from repgeom_eval.measurement.augment import Augmenter

            self.augmenter = Augmenter(seed=seed)
            warnings.warn(f"{', '.join(n for n, _ in views)} read{'s' if len(views) == 1 else ''} {self.n_views} "
                          "augmented views of every text: each evaluated task split costs extra forward passes "
                          f"({self.n_views} per distinct text, shared by all layers)", stacklevel=2)
        self.evaluating: tuple[str, str] | None = None  # (task, split) being evaluated: its encodes feed the banks
        self.batch_size = 32
        self.progress = False
        self.view_sequences = 0  # augmented views run through the model
        self._splits: dict[Context, _Split] = {}
        self._carried: dict[tuple[Context, Address], dict[str, Any]] = {}

    # -- feeding ---------------------------------------------------------------------------------------------------
    def context(self, task: str, split: str, subset: str) -> Context | None:
        """The bank key of an encode call, or None when its texts are not the evaluated split's (training texts)."""
        return (task, split, subset) if self.evaluating == (task, split) else None

    def _split(self, context: Context) -> _Split:
        if context not in self._splits:
            self._splits[context] = _Split(MetricBank(self.names, self.addresses, params=self.params,
                                                      pooling=self.pooling, host=self.host))
        return self._splits[context]

    def register(self, context: Context, texts: Sequence[str]) -> None:
        """Give the prepared ``texts`` of an encode call their indices (first-seen order, as ``measure`` numbers
        the texts of its data; whitespace-only texts get none, as ``measure`` skips them)."""
        index = self._split(context).index
        for t in texts:
            if t.strip() and t not in index:
                index[t] = len(index)

    def missing(self, context: Context, texts: Sequence[str], address: Address) -> bool:
        """True if some of the prepared ``texts`` never reached the metrics of ``address`` (stored embeddings
        cannot feed token metrics: a forward pass must run)."""
        split = self._split(context)
        if address in split.done:
            return False
        seen = split.fed.get(address, set())
        return any(split.index[t] not in seen for t in texts if t in split.index)

    def sink(self, context: Context) -> Callable[[Address, torch.Tensor, torch.Tensor, list[str]], None]:
        """The ``sink`` of :meth:`LayerEmbedder.embed`: feeds each layer's batch, each text once per layer."""
        split = self._split(context)

        def feed(addr: Address, hidden: torch.Tensor, batch_mask: torch.Tensor, strings: list[str]) -> None:
            if addr not in split.bank.states or addr in split.done:
                return
            seen = split.fed.setdefault(addr, set())
            rows, ids = [], []
            for row, text in enumerate(strings):
                i = split.index.get(text)
                if i is not None and i not in seen:
                    seen.add(i)
                    rows.append(row)
                    ids.append(i)
            # the metric API's place for it (repgeom_eval.spec.metric.LayerBatch); a blocking copy would wait on a GPU
            mask = batch_mask.to(hidden.device, non_blocking=True)
            if len(rows) == len(strings):  # the usual case: no copy
                split.bank.update(addr, hidden, mask, ids)
            elif rows:
                sel = torch.tensor(rows, dtype=torch.long).to(hidden.device, non_blocking=True)
                split.bank.update(addr, hidden[sel], mask[sel], ids)

        return feed

    def _views(self, split: _Split, embedder: Any) -> None:
        """One pass over the augmented views of the split's texts, for every layer still waiting for them."""
        waiting = [a for a in split.fed if a not in split.done and a not in split.views_fed]
        if not waiting:
            return

        def feed(batch: Batch, items: list[Item]) -> None:
            texts, views = [it.text for it in items], [it.view for it in items]
            for addr in waiting:
                hidden = batch.hidden[addr]
                split.bank.update(addr, hidden, batch.mask.to(hidden.device), texts, views)

        self.view_sequences += embedder.forward_views(list(split.index), waiting, self.n_views, self.augmenter,
                                                      self.batch_size, feed, progress=self.progress)
        split.views_fed.update(waiting)

    # -- results -----------------------------------------------------------------------------------------------------
    def scores(self, context: Context, address: Address, embedder: Any) -> dict[str, Any]:
        """The ``repgeom.*`` values and ``repgeom_metrics`` of one layer on one split and subset (then forgotten),
        plus what an earlier run had cached for metrics not requested now."""
        out: dict[str, Any] = {}
        configs: dict[str, Any] = {}
        split = self._splits.get(context)
        if split is not None and address in split.fed and address not in split.done:
            if self.n_views:
                self._views(split, embedder)
            said = []
            for spec, metric in split.bank.states[address]:
                out.update({score_key(k): v for k, v in flatten_result(spec.name, metric.compute()).items()})
                configs[spec.name] = self.configs[spec.name]
                with spec.guard("diagnostics", str(address)):
                    diag = metric.diagnostics() or {}
                # what the metric could not honour as given (massive_activations' top_k beyond the width ...): its
                # numbers beside the scores, its words in repgeom_warnings, as `repgeom measure` reports them
                if isinstance(diag.get("warning"), str):
                    out.update({score_key(f"{spec.name}.{k}"): v for k, v in diag.items()
                                if isinstance(v, (int, float)) and not isinstance(v, bool)})
                    said.append(f"{spec.name}: {diag['warning']}")
            if said:
                out[METRIC_WARNINGS_KEY] = json.dumps(said)
            split.done.add(address)
            split.bank.states[address] = []  # computed: free the states
        carried = self._carried.pop((context, address), None)
        if carried:
            for metric, config in carried["configs"].items():
                if metric not in configs:
                    configs[metric] = config
                    out.update({k: v for k, v in carried["scores"].items() if _belongs(k, metric)})
        if configs:
            out[CONFIG_KEY] = json.dumps(configs, sort_keys=True)
        return out

    # -- resuming ----------------------------------------------------------------------------------------------------
    def satisfied(self, scores: Mapping[str, Any]) -> bool:
        """True if a cached score dict holds every requested metric with the requested configuration."""
        stored = stored_configs(scores)
        return all(_plain(stored.get(name)) == self.configs[name] for name in self.names)

    def carry(self, task: str, address: Address, existing: Any) -> None:
        """Keep the metrics a cached result holds but this run does not request, to write them back beside the
        recomputed ones (``existing``: the cached mteb ``TaskResult``)."""
        for split, subsets in existing.scores.items():
            for scores in subsets:
                stored = {m: c for m, c in stored_configs(scores).items() if m not in self.names}
                if stored:
                    self._carried[((task, split, scores.get("hf_subset")), address)] = {
                        "configs": stored, "scores": {k: scores[k] for k in metric_keys(scores)}}

    def clear(self) -> None:
        """Forget every bank (between tasks)."""
        self._splits.clear()
        self._carried.clear()
