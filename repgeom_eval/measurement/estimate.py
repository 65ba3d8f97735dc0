"""What a ``measure`` run will hold in memory, from the model's config alone (no weights read): ``--dry-run``.

Every metric state is declared with its shape (``Metric.add_state(..., shape=...)``: ``"D"`` the layer's width,
``"N"`` one row per text, ``max_rows`` for a buffer folded into a fixed-size sum), so the memory of a run's states is
known before it starts:

* **fixed**: the ``sum`` states (a D×D Gram is 8·D² bytes in float64) and bounded buffers, per address and metric;
* **per 1,000 texts**: the ``cat`` states that keep a row per text (the pooled vectors of ``dataset_entropy``'s
  default global centring, the views of InfoNCE and DiME, per-text scores);
* the **device** each state lives on (``Metric.state_device``: the model's, or host memory);
* the model's weights (parameters counted on the meta device, in the run's dtype) and the hidden states one batch
  captures (batch × tokens × width × addresses, float32).

The widths are the config's hidden size for every address (a model whose sub-layers are wider is measured at its
real widths when it loads). The number of hidden states is the config's layer count + 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from repgeom_eval.spec.errors import RepgeomError

FLOAT64 = 8


@dataclass
class StateEstimate:
    metric: str
    fixed_bytes: int
    per_1000_texts_bytes: int
    device: str
    #: held for one address at a time, on top of the states: a buffer beside the sum it is folding into, or the
    #: arrays ``compute`` makes (``Stateful.compute_temporaries``); the run counts the largest once
    transient_bytes: int = 0
    transient_per_1000_texts_bytes: int = 0

    def transient_for(self, n_texts: int) -> int:
        return self.transient_bytes + self.transient_per_1000_texts_bytes * n_texts // 1000


@dataclass
class MemoryEstimate:
    model: str
    model_type: str
    n_layers: int
    width: int
    dtype: str
    device: str
    n_addresses: int
    addresses: list[str]
    per_address: dict[str, list[StateEstimate]]
    weights_bytes: int | None
    batch_hidden_bytes: int
    notes: list[str] = field(default_factory=list)
    #: the float64 working copies of one block of a batch at one address (functional/tokens.py), held while it is fed
    working_bytes: int = 0

    def transient_for(self, n_texts: int) -> int:
        """The largest temporary of one address (a fold, a compute) over ``n_texts`` texts, held once: addresses
        are folded and computed one after another."""
        return max((s.transient_for(n_texts) for states in self.per_address.values() for s in states), default=0)

    @property
    def transient_bytes(self) -> int:
        """The fixed part of the largest temporary (:meth:`transient_for`)."""
        return max((s.transient_bytes for states in self.per_address.values() for s in states), default=0)

    @property
    def transient_per_1000_texts_bytes(self) -> int:
        return max((s.transient_per_1000_texts_bytes for states in self.per_address.values() for s in states),
                   default=0)

    def _held(self) -> tuple[int, int]:
        """(fixed bytes, bytes per 1,000 texts) of the states of every address, temporaries aside."""
        states = [s for per in self.per_address.values() for s in per]
        return sum(s.fixed_bytes for s in states), sum(s.per_1000_texts_bytes for s in states)

    @property
    def state_bytes(self) -> int:
        """The fixed states of every address, plus the fixed part of the largest temporary."""
        return self._held()[0] + self.transient_bytes

    @property
    def per_1000_texts_bytes(self) -> int:
        """The states that keep a row per text, and the per-text part of the largest temporary, per 1,000 texts."""
        return self._held()[1] + self.transient_per_1000_texts_bytes

    def for_texts(self, n_texts: int) -> int:
        """State bytes of a run over ``n_texts`` texts, the largest temporary included."""
        fixed, grows = self._held()
        return fixed + grows * n_texts // 1000 + self.transient_for(n_texts)

    def to_dict(self) -> dict[str, Any]:
        by_metric: dict[str, dict[str, Any]] = {}
        for states in self.per_address.values():
            for s in states:
                row = by_metric.setdefault(s.metric, {"fixed_bytes_per_address": s.fixed_bytes,
                                                      "per_1000_texts_bytes_per_address": s.per_1000_texts_bytes,
                                                      "device": s.device, "addresses": 0})
                row["addresses"] += 1
        return {"model": self.model, "model_type": self.model_type, "n_layers": self.n_layers, "width": self.width,
                "dtype": self.dtype, "device": self.device, "addresses": self.addresses,
                "metrics": by_metric, "state_bytes": self.state_bytes, "transient_bytes": self.transient_bytes,
                "transient_per_1000_texts_bytes": self.transient_per_1000_texts_bytes,
                "per_1000_texts_bytes": self.per_1000_texts_bytes, "weights_bytes": self.weights_bytes,
                "batch_hidden_bytes": self.batch_hidden_bytes, "working_bytes": self.working_bytes,
                "notes": self.notes}


def _bytes(shape: tuple, width: int, itemsize: int, skip_rows: bool = False) -> int:
    dims = list(shape[1:] if skip_rows else shape)
    out = itemsize
    for d in dims:
        out *= width if d == "D" else width + 1 if d == "D+1" else d if isinstance(d, int) else 1
    return out


def metric_memory(metric: Any, width: int, device: str) -> StateEstimate:
    """The memory of one metric instance's states at a layer of ``width``, from their declared shapes: its own
    states and those of the statistics it owns (a statistic it shares with another metric is counted there)."""
    per_text = 0
    sizes: dict[str, int] = {}  # the fixed bytes of each state
    folds: dict[str, str] = {}  # a buffer → the sum it is folded into
    devices = set()
    for name, reduce, default, shape, bound, state_device, folds_into in metric.declared_states():
        itemsize = default.element_size() if hasattr(default, "element_size") else FLOAT64
        shape = shape or (tuple(default.shape) if hasattr(default, "shape") else ())
        if reduce == "cat":
            row = _bytes(shape, width, itemsize, skip_rows=True)
            if bound is not None:
                sizes[name] = row * (width if bound == "D" else int(bound))
            else:
                per_text += row * 1000
        else:
            sizes[name] = _bytes(shape, width, itemsize)
        if folds_into:
            folds[name] = folds_into
        devices.add("cpu" if state_device == "cpu" else device)
    if not devices:
        devices.add("cpu" if getattr(metric, "state_device", "input") == "cpu" else device)
    # a buffer and the sum it folds into hold data together only while one address folds: the larger of the two
    # per address, the smaller once for the run
    fixed = sum(v for k, v in sizes.items() if k not in folds)
    transient = 0
    for buffer, total in folds.items():
        fixed += max(sizes[buffer] - sizes.get(total, 0), 0)
        transient = max(transient, min(sizes[buffer], sizes.get(total, 0)))
    # compute's arrays: the metric's own, or those of a statistic it reads (owned or borrowed: a borrower's compute
    # makes its own), whichever is larger
    per_text_temporary = 0
    for shapes in [getattr(metric, "compute_temporaries", ())] + [getattr(st, "compute_temporaries", ())
                                                                  for st in _statistics_read(metric)]:
        fixed_part = sum(_bytes(s, width, FLOAT64) for s in shapes if "N" not in s)
        per_text_part = sum(_bytes(s, width, FLOAT64, skip_rows=True) * 1000 for s in shapes if "N" in s)
        if (fixed_part, per_text_part) > (transient, per_text_temporary):
            transient, per_text_temporary = fixed_part, per_text_part
    return StateEstimate(metric.name, fixed, per_text, "+".join(sorted(devices)), transient, per_text_temporary)


def _statistics_read(metric: Any) -> list:
    """Every statistic ``metric`` reads, owned or borrowed (a borrower's compute makes its own copies too)."""
    slots = getattr(metric, "_slots", None)
    return list(slots().values()) if callable(slots) else []


def _apart_by_pooling(pairs: list) -> list[str]:
    """A note for each statistic that several metrics keep apart only because they pool differently (vendi reads
    the last token's vector, effective_rank the mean, by default): one pooling for them would keep one."""
    from repgeom_eval.spec.metric import Consumes

    by_key: dict[Any, dict[str, list[str]]] = {}
    labels: dict[Any, str] = {}
    for spec, metric in pairs:
        if spec.consumes != Consumes.POOLED or not hasattr(metric, "owned_statistics"):
            continue
        for st in metric.owned_statistics().values():
            try:
                hash(st.key())
            except TypeError:
                continue
            by_key.setdefault(st.key(), {}).setdefault(str(spec.pooling), []).append(spec.name)
            labels[st.key()] = st.name or type(st).__name__
    notes = []
    for key, poolings in by_key.items():
        if len(poolings) > 1:
            parts = [f"{' and '.join(names)} ({p} pooling)" for p, names in sorted(poolings.items())]
            who = ", ".join(parts[:-1]) + " and " + parts[-1]
            notes.append(f"{who} each keep a {labels[key]} of their own vectors: one --pooling for them (or "
                         "--metric-param METRIC.pooling=...) would keep one (docs/plugins.md#shared-statistics)")
    return notes


def _text_config(config: Any) -> Any:
    from repgeom_eval.modeling.layout import text_config

    return text_config(config)


def _first(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _tokenizer_limit(target: str, source: str) -> int | None:
    """The ``model_max_length`` a local model directory's tokenizer_config.json declares (a run's context is the
    smaller of it and the config's positions: ``context_length``), read without loading the tokenizer."""
    import json
    from pathlib import Path

    if source != "directory":
        return None
    try:
        value = json.loads((Path(target) / "tokenizer_config.json").read_text(encoding="utf-8")).get("model_max_length")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, (int, float)) and 0 < value < 10**8 else None


def estimate(model: str, run: Any, options: Any = None, host: Any = None, batch_size: int | None = None,
             max_length: int | None = None, energy: bool = True, streams: bool | None = None) -> MemoryEstimate:
    """The memory of ``measure(model, ..., run)`` (a :class:`~repgeom_eval.spec.options.measure.RunConfig`) from the
    model's config: no weights are read. ``energy``: count ``measure``'s per-address energy diagnostic.
    ``streams``: whether the run feeds each address during the forward pass (None: as ``measure`` would; True for
    the MTEB sweep, which always does; False for a caller that holds every address of a batch)."""
    import torch
    from transformers import AutoConfig

    from repgeom_eval.measurement.metric_specs import instantiate_metrics, share_statistics
    from repgeom_eval.measurement.states import ENERGY_TOP, energy_metric
    from repgeom_eval.modeling.addresses import parse_request
    from repgeom_eval.modeling.loading import ModelInfo, auto_class, locate_model, resolve_device, resolve_dtype
    from repgeom_eval.spec.options.model import ModelOptions
    from repgeom_eval.plugin_system.host import get_host

    host = host or get_host()
    opts = (options or ModelOptions()).replace(dtype=run.dtype, device=run.device)
    # a device map puts the blocks, and the states beside them, on the GPUs when there are any
    mapped = "cuda" if torch.cuda.is_available() else "cpu"
    device = resolve_device(mapped if opts.device_map else opts.device, planned=True)
    dtype = resolve_dtype(opts.dtype, device)
    target, extra, source = locate_model(str(model))
    try:
        config = AutoConfig.from_pretrained(target, **extra, trust_remote_code=opts.trust_remote_code,
                                            **({"revision": opts.revision} if opts.revision else {}))
    except Exception as exc:  # noqa: BLE001 - the same errors the load reports, in one line
        raise RepgeomError(f"--dry-run: cannot read the config of {model!r}: {str(exc).splitlines()[0][:200]}") from None
    text = _text_config(config)
    width = _first(text, "hidden_size", "n_embd", "d_model", "dim")
    n_layers = _first(text, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
    if width is None or n_layers is None:
        raise RepgeomError(f"--dry-run: the config of {model!r} names no hidden size or layer count")
    info = ModelInfo(name=str(model), model_type=getattr(config, "model_type", "?"), architecture="?",
                     n_layers=n_layers, hidden_size=width, dtype=str(dtype).removeprefix("torch."), n_parameters=0,
                     vocab_size=getattr(text, "vocab_size", None), max_positions=None, source=source,
                     n_hidden_states=n_layers + 1)
    addresses = [str(a) for a in parse_request(run.layers, info, host)]
    specs = instantiate_metrics(run.metrics, host, run.metric_params, run.per_text, run.pooling)
    energy_cls = energy_metric(host) if energy else None
    per_address: dict[str, list[StateEstimate]] = {}
    notes = [f"every address at the config's width {width}; hidden states = layers + 1 = {n_layers + 1}"]
    pairs = [(spec, spec.new()) for spec in specs]
    shared = share_statistics(pairs)
    if shared:
        notes.append("shared statistics (kept once, counted under the first metric): "
                     + ", ".join(f"{k} ← {v}" for k, v in sorted(shared.items())))
    notes += _apart_by_pooling(pairs)
    from repgeom_eval.spec.metric import Consumes

    def home(spec: Any) -> str:  # --state-device cpu: the pooled metrics' states in host memory (RunConfig)
        on_host = getattr(run, "state_device", "model") == "cpu" and spec.consumes != Consumes.TOKENS
        return "cpu" if on_host else device.type

    tokens = max_length or _first(text, "max_position_embeddings", "n_positions") or 512
    tokens = min(tokens, _tokenizer_limit(target, source) or tokens)  # the run's context is capped by both
    tokens = min(tokens, run.max_length or tokens)

    def memory(spec: Any, metric: Any) -> StateEstimate:
        state = metric_memory(metric, width, home(spec))
        if spec.pooling == "tokens":  # every real token is a row: a text adds up to `tokens` of them
            state.per_1000_texts_bytes *= tokens
            state.transient_per_1000_texts_bytes *= tokens
        return state

    if any(spec.pooling == "tokens" for spec, _ in pairs):
        notes.append(f"--pooling tokens: every real token is a row, so what grows per text is counted for {tokens} "
                     "tokens a text (the context length; shorter texts hold less)")
    for addr in addresses:
        states = [memory(spec, m) for spec, m in pairs]
        if energy_cls is not None:
            energy = metric_memory(energy_cls(top_k=ENERGY_TOP), width,
                                   "cpu" if getattr(run, "state_device", "model") == "cpu" else device.type)
            energy.metric = "(energy diagnostic)"
            states.append(energy)
        if run.per_text:  # one float64 score per text, metric and address
            states.append(StateEstimate("(per-text scores)", 0, 1000 * FLOAT64 * max(len(specs), 1), "cpu"))
        per_address[addr] = states
    weights = None
    try:
        with torch.device("meta"):
            shell = auto_class(config, host).from_config(config, trust_remote_code=opts.trust_remote_code)
        weights = sum(p.numel() for p in shell.parameters()) * torch.tensor([], dtype=dtype).element_size()
    except Exception as exc:  # noqa: BLE001 - an architecture that cannot be built on the meta device
        notes.append(f"weights not estimated ({type(exc).__name__})")
    for spec, metric in pairs:  # work that outgrows the forward pass with the context length
        try:
            work = metric.work_note(tokens, width) if hasattr(metric, "work_note") else None
        except Exception as exc:  # noqa: BLE001 - a plugin's broken note costs its line, not the dry run
            work = f"work_note raised {type(exc).__name__}: {exc}"
        if work:
            work = " ".join(str(work).split())  # one line, as the plugin API asks (docs/plugins.md)
            where = f"{len(addresses)} address" + ("es" if len(addresses) != 1 else "")
            notes.append(f"{spec.name} at {tokens} tokens × {where}: {work}")
    batch = batch_size or run.batch_size
    from repgeom_eval.measurement.feed import feed_threads, streams_addresses
    from repgeom_eval.plugin_system.host import BUILTIN_DISTRIBUTION

    builtin = all(spec.distribution == BUILTIN_DISTRIBUTION for spec, _ in pairs) and (
        energy_cls is None or energy_cls.__module__.startswith("repgeom_eval."))
    threads = feed_threads(device.type, builtin)
    one = batch * tokens * width * 4
    as_measure = streams is None
    if as_measure:
        streams = streams_addresses(threads, len(addresses), one)
    if streams:  # each address fed as the pass reaches it (MeasureRun)
        hidden = one
        notes.append(f"captured hidden states of one batch: {batch} texts × {tokens} tokens × {width} in float32, "
                     "one address at a time (each is fed to its metrics as the forward pass reaches it)")
    else:
        hidden = one * len(addresses)
        held = (f"on the CPU every address of a batch is held, then fed in {threads} threads"
                if as_measure and threads > 1 else "every address of a batch is held")
        notes.append(f"captured hidden states of one batch: {batch} texts × {tokens} tokens × {width} × "
                     f"{len(addresses)} addresses in float32 ({held})")
    working = _working_bytes(pairs, batch, tokens, width, device)
    return MemoryEstimate(str(model), info.model_type, n_layers, width, info.dtype, device.type, len(addresses),
                          addresses, per_address, weights, hidden, notes, working)


def _working_bytes(pairs: list, batch: int, tokens: int, width: int, device: Any) -> int:
    """The float64 copies one block of a batch is fed through (functional/tokens.py: the copy; with token metrics
    also the centred tokens, and curvature's differences and their products), up to the block's size limit."""
    from repgeom_eval.functional.tokens import block_limit
    from repgeom_eval.spec.metric import Consumes

    row = tokens * width
    rows = max(1, min(batch, block_limit(device) // max(1, row)))
    copies = 4 if any(spec.consumes == Consumes.TOKENS for spec, _ in pairs) else 1
    return 8 * rows * row * copies


def check_budget(est: MemoryEstimate, budget: int, n_texts: int | None, per_text_flag: str = "--per-text") -> None:
    """Refuse, in one line, a run whose metric states would exceed ``budget`` bytes, naming what to drop: the
    metrics that hold the most, the layers (the cost of one address), the per-text states."""
    need = est.for_texts(n_texts) if n_texts is not None else est.state_bytes
    if need <= budget:
        return
    by_metric: dict[str, int] = {}
    for states in est.per_address.values():
        for s in states:
            by_metric[s.metric] = by_metric.get(s.metric, 0) + s.fixed_bytes + s.per_1000_texts_bytes * (
                n_texts or 0) // 1000
    biggest = sorted(((b, m) for m, b in by_metric.items() if b > 0 and not m.startswith("(")), reverse=True)[:3]
    per_address = need // max(est.n_addresses, 1)
    texts = f" for {n_texts:,} texts" if n_texts is not None else " (fixed part; the per-text part grows with the data)"
    drop = [f"metrics ({', '.join(f'{m} {human(b)}' for b, m in biggest)})" if biggest else "",
            f"layers (each of the {est.n_addresses} addresses holds about {human(per_address)}; e.g. --layers final)"
            if est.n_addresses > 1 else ""]
    per_text = sum(b for m, b in by_metric.items() if m == "(per-text scores)")
    if per_text:
        drop.append(f"per-text states ({per_text_flag}, {human(per_text)})")
    raise RepgeomError(f"--state-memory {human(budget)}: the metric states need about {human(need)}{texts}; drop "
                       + ", ".join(d for d in drop if d) + " (repgeom measure --dry-run shows each)")


def count_texts(data: str) -> int | None:
    """The number of lines of a local .txt/.jsonl data file (an upper bound on its texts), None for a stream."""
    import os

    if not os.path.isfile(data):
        return None
    with open(data, "rb") as fh:
        return sum(1 for line in fh if line.strip())


def add_kept_vectors(est: MemoryEstimate, label: str, itemsize: int = 4, device: str = "cpu") -> MemoryEstimate:
    """Count, at every address, vectors a command keeps per text beside the metric states (``mteb run`` keeps each
    task's embeddings of every layer until the task is scored): one row of ``width × itemsize`` bytes a text."""
    for states in est.per_address.values():
        states.append(StateEstimate(label, 0, 1000 * est.width * itemsize, device))
    return est


def render(est: MemoryEstimate, console: Any = None) -> None:
    """Print an estimate as ``--dry-run`` shows it: one row a state (its device, its bytes per address and per
    1,000 texts, the total), then the totals, the weights, one batch's captured hidden states and the notes."""
    from rich.console import Console
    from rich.table import Table

    doc = est.to_dict()
    table = Table(title=f"{est.model}: {est.model_type}, {est.n_layers} blocks × width {est.width}, {est.dtype} on "
                        f"{est.device}; {est.n_addresses} address(es)")
    for col in ("state", "lives on", "per address", "+ per 1,000 texts", "addresses", "total"):
        table.add_column(col, justify="left" if col in ("state", "lives on") else "right")
    for name, row in doc["metrics"].items():
        table.add_row(name, row["device"], human(row["fixed_bytes_per_address"]),
                      human(row["per_1000_texts_bytes_per_address"]), str(row["addresses"]),
                      human(row["fixed_bytes_per_address"] * row["addresses"]))
    console = console or Console(width=max(Console().width, 120))  # a state's name cut to "(task…" says nothing
    console.print(table)
    console.print(f"metric states: {human(est.state_bytes)} + {human(est.per_1000_texts_bytes)} per 1,000 texts; "
                  f"weights: {human(est.weights_bytes)}; captured hidden states per batch: "
                  f"{human(est.batch_hidden_bytes)}; float64 working copies while one is fed: "
                  f"{human(est.working_bytes)}")
    if est.transient_bytes or est.transient_per_1000_texts_bytes:
        console.print(f"of the metric states, once for the run (one address at a time folds or computes): "
                      f"{human(est.transient_bytes)} + {human(est.transient_per_1000_texts_bytes)} per 1,000 texts")
    for note in est.notes:
        console.print(f"note: {note}")


def human(n: int | None) -> str:
    if n is None:
        return "?"
    if n < 1024:
        return f"{n} B"
    units = ["KiB", "MiB", "GiB", "TiB"]
    k = min(int(math.log(n, 1024)), len(units))
    return f"{n / 1024 ** k:.1f} {units[k - 1]}"
