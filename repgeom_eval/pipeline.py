"""The measurement pipeline, top to bottom:

load model → resolve layer addresses → capture (hooks, one forward per batch, early stop) → pool → update metric
states → compute → results.
"""

from __future__ import annotations

import platform
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from . import __version__
from .addresses import Address, HookPoint, parse_layers, resolve
from .capture import Capture
from .data import TextSet, from_texts, load_texts
from .errors import NonFiniteError, RepgeomError
from .io import write_json, write_jsonl
from .metric import Consumes, LayerBatch, Metric
from .models import LoadedModel, load_model
from .plugin_host import PluginHost, get_host
from .pooling import check_pooling, pool
from .preprocess import METHODS as PREPROCESS_METHODS
from .preprocess import Preprocessor, VectorStats


@dataclass
class MeasureResult:
    """Everything one run produced; ``to_dict()`` is the results-file schema."""

    model: dict[str, Any]
    data: dict[str, Any]
    config: dict[str, Any]
    results: dict[str, dict[str, Any]]
    diagnostics: dict[str, dict[str, Any]]
    timings: dict[str, float]
    per_text: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)  # metric → result of Metric.across_layers

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "data": self.data, "config": self.config, "results": self.results,
                "summary": self.summary, "diagnostics": self.diagnostics, "timings": self.timings}

    def write(self, path: str | Path, per_text_path: str | Path | None = None) -> None:
        write_json(path, self.to_dict())
        if per_text_path is not None:
            write_jsonl(per_text_path, self.per_text)


@dataclass
class MetricSpec:
    """A requested metric: its class, constructor arguments and the pooling it reads (None for token metrics)."""

    name: str
    cls: type[Metric]
    kwargs: dict[str, Any]
    pooling: str | None

    def config(self, metric: Metric) -> dict[str, Any]:
        out = metric.config()
        if self.pooling is not None:
            out["pooling"] = self.pooling
        if self.cls.consumes == Consumes.VIEWS:
            out["n_views"] = int(metric.n_views)  # type: ignore[attr-defined]
        return out


def instantiate_metrics(
    names: Sequence[str],
    host: PluginHost,
    params: Mapping[str, Mapping[str, Any]] | None,
    per_text: bool,
    pooling: str | None = None,
) -> list[MetricSpec]:
    """Look every metric up (unknown names fail before the model is loaded) and check its parameters.

    Pooling: ``METRIC.pooling`` if given, else the run's ``pooling``, else the metric's ``default_pooling``.
    """
    params = dict(params or {})
    unknown_params = set(params) - set(names)
    if unknown_params:
        raise RepgeomError(f"parameters given for metrics that were not requested: {sorted(unknown_params)}")
    out = []
    for name in dict.fromkeys(names):
        cls = host.metrics.get(name)
        accepted = cls.parameter_names()
        kwargs = dict(params.get(name, {}))
        metric_pooling = kwargs.pop("pooling", None) if "pooling" not in accepted else None
        bad = set(kwargs) - set(accepted)
        if bad:
            raise RepgeomError(f"metric {name!r} has no parameter(s) {sorted(bad)} "
                               f"(parameters: {', '.join(accepted + ['pooling'])})")
        if per_text and "per_text" in accepted:
            kwargs.setdefault("per_text", True)
        if cls.consumes == Consumes.TOKENS:
            chosen = None
        else:
            chosen = check_pooling(metric_pooling or pooling or cls.default_pooling)
            if cls.consumes == Consumes.VIEWS and chosen == "tokens":
                raise RepgeomError(f"metric {name!r} compares pooled views of each text; pooling 'tokens' does not "
                                   "apply (use mean, last or first)")
        out.append(MetricSpec(name, cls, kwargs, chosen))
    return out


@dataclass(frozen=True)
class _Item:
    """One sequence to run through the model: an original text (view = -1) or one of its augmented views."""

    text: int
    view: int


class _ViewBuffer:
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


def _context_length(loaded: LoadedModel, max_length: int | None) -> int:
    limit = loaded.info.max_positions
    tok_limit = getattr(loaded.tokenizer, "model_max_length", None)
    if tok_limit and tok_limit < 10**8:
        limit = min(limit, tok_limit) if limit else tok_limit
    if max_length is None:
        return limit or 512
    if max_length < 1:
        raise RepgeomError(f"--max-length must be positive, got {max_length}")
    if limit and max_length > limit:
        warnings.warn(f"--max-length {max_length} exceeds the model context ({limit}); using {limit}", stacklevel=3)
        return limit
    return max_length


def _check_finite(addr: Address, h: torch.Tensor, mask: torch.Tensor, ids: list[Any]) -> None:
    bad = (~torch.isfinite(h)).any(-1) & mask
    if bool(bad.any()):
        rows = bad.any(1).nonzero().flatten().tolist()
        raise NonFiniteError(
            f"NaN or inf in the hidden states at address {addr} for text id {ids[rows[0]]!r}"
            f" ({len(rows)} text(s) of this batch affected); a float16/bfloat16 overflow is the usual cause: "
            "try --dtype float32"
        )


def measure(
    model: str | LoadedModel,
    data: str | Path | Sequence[str] | TextSet,
    *,
    layers: str | Sequence[str] = "final",
    metrics: Sequence[str] = ("dispersion",),
    pooling: str | None = None,
    batch_size: int = 16,
    max_length: int | None = None,
    padding_side: str = "right",
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device | None = "cpu",
    per_text: bool = False,
    metric_params: Mapping[str, Mapping[str, Any]] | None = None,
    text_field: str = "text",
    seed: int = 0,
    preprocess: str = "none",
    preprocess_stats: str | Path | None = None,
    save_preprocess_stats: str | Path | None = None,
    massive_share_warning: float = 0.5,
    progress: bool = True,
    host: PluginHost | None = None,
) -> MeasureResult:
    """Measure ``metrics`` at every address in ``layers`` over ``data`` with one forward pass per batch.

    ``model`` is a hub id, a local directory, a ``.gguf`` file or an already loaded :class:`LoadedModel`;
    ``data`` is a ``.jsonl``/``.txt`` path, a list of strings or a :class:`TextSet`. ``pooling`` overrides every
    metric's default pooling (``None``: each metric's own, e.g. ``last`` for dispersion). ``seed`` drives the
    augmented views of the multi-view metrics, which run in the same forward passes as the originals.

    ``preprocess`` (``none``, ``center``, ``standardize``, ``whiten``) transforms every vector a metric sees, with
    statistics from ``preprocess_stats`` (a file written through ``save_preprocess_stats``) or, if none is given,
    from the same data in an extra forward pass. A warning names each address where one hidden dimension carries
    at least ``massive_share_warning`` of the squared norm of the mean-pooled vectors.
    """
    t_start = time.perf_counter()
    host = host or get_host()
    if pooling is not None:
        pooling = check_pooling(pooling)
    if padding_side not in ("left", "right"):
        raise RepgeomError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    if batch_size < 1:
        raise RepgeomError(f"batch size must be positive, got {batch_size}")
    if isinstance(metrics, str):
        metrics = [m.strip() for m in metrics.split(",") if m.strip()]
    if not metrics:
        raise RepgeomError("no metric requested")
    specs = instantiate_metrics(metrics, host, metric_params, per_text, pooling)
    if preprocess not in PREPROCESS_METHODS:
        raise RepgeomError(f"unknown preprocess {preprocess!r} (valid: {', '.join(PREPROCESS_METHODS)})")
    prep = Preprocessor.load(preprocess_stats, preprocess) if preprocess_stats and preprocess != "none" \
        else Preprocessor()

    # -- data ----------------------------------------------------------------------------------------------------
    if isinstance(data, TextSet):
        texts = data
    elif isinstance(data, (str, Path)):
        texts = load_texts(data, text_field=text_field)
    else:
        texts = from_texts(list(data))

    # -- model and addresses -------------------------------------------------------------------------------------
    t0 = time.perf_counter()
    loaded = model if isinstance(model, LoadedModel) else load_model(model, dtype=dtype, device=device, host=host)
    t_load = time.perf_counter() - t0
    n_layers = loaded.info.n_layers

    def selector(name: str):
        return host.layer_selectors.get(name) if name in host.layer_selectors else None

    addresses = parse_layers(layers, n_layers, selector, loaded.info)
    addresses.sort(key=lambda a: a.depth_key(n_layers))
    points = _one_name_per_tensor(resolve(addresses, loaded), loaded.info.model_type)
    addresses = list(points)
    states: dict[Address, list[tuple[MetricSpec, Metric]]] = {
        addr: [(spec, spec.cls(**spec.kwargs)) for spec in specs] for addr in addresses
    }
    first_metrics = next(iter(states.values()))

    # -- what to run: the originals, and augmented views for multi-view metrics -----------------------------------
    n_views = max([int(m.n_views) for spec, m in first_metrics  # type: ignore[attr-defined]
                   if spec.cls.consumes == Consumes.VIEWS] or [0])
    need_originals = any(spec.cls.consumes != Consumes.VIEWS for spec in specs)
    items: list[_Item] = []
    strings: list[str] = []
    if need_originals:
        items += [_Item(i, -1) for i in range(len(texts.texts))]
        strings += texts.texts
    t0 = time.perf_counter()
    augmenter = None
    if n_views:
        from .augment import Augmenter

        augmenter = Augmenter(seed=seed)
        for i, text in enumerate(tqdm(texts.texts, desc="augment", unit="text", disable=not progress, leave=False)):
            for v in range(n_views):
                items.append(_Item(i, v))
                strings.append(augmenter.view(text, i, v))
    t_augment = time.perf_counter() - t0

    # -- tokenize once for lengths: sort by length (less padding), count truncation -------------------------------
    tok = loaded.tokenizer  # never mutated: padding_side is passed per call
    context = _context_length(loaded, max_length)
    t0 = time.perf_counter()
    lengths = [len(x) for x in tok(strings, add_special_tokens=True, verbose=False)["input_ids"]]
    empty = {it.text for it, n in zip(items, lengths) if n == 0}
    if empty:
        warnings.warn(f"{len(empty)} text(s) tokenize to no tokens and are skipped (ids: "
                      f"{[texts.ids[i] for i in sorted(empty)[:5]]})", stacklevel=2)
        keep = [k for k, it in enumerate(items) if it.text not in empty]
        items, strings, lengths = [items[k] for k in keep], [strings[k] for k in keep], [lengths[k] for k in keep]
        if len(texts.texts) - len(empty) < 2:
            raise RepgeomError(f"only {len(texts.texts) - len(empty)} text(s) have any tokens; at least 2 are needed")
    text_lengths = {it.text: n for it, n in zip(items, lengths) if it.view < 0}
    n_truncated = sum(n > context for it, n in zip(items, lengths) if it.view < 0)
    if n_truncated:
        warnings.warn(f"{n_truncated} of {len(texts.texts)} texts are longer than {context} tokens and were "
                      "truncated (set --max-length to change the limit)", stacklevel=2)
    order = sorted(range(len(items)), key=lambda i: -lengths[i])
    t_tok = time.perf_counter() - t0

    # -- one forward per batch, every address and metric fed from it ----------------------------------------------
    view_poolings = sorted({spec.pooling for spec in specs if spec.cls.consumes == Consumes.VIEWS})
    buffers = {(addr, p): _ViewBuffer(n_views) for addr in addresses for p in view_poolings}
    energy = {addr: torch.zeros(0, dtype=torch.float64) for addr in addresses}  # Σx² per dim, mean-pooled
    timer = {"forward": 0.0, "metrics": 0.0}
    t_stats = 0.0
    dev = loaded.device

    def run_pass(desc: str, on_address) -> None:
        """One forward per batch over every item; ``on_address(addr, h, mask, batch_items)`` per address."""
        with Capture(loaded.model, points, stop_early=True) as cap, tqdm(
            total=len(order), unit="seq", desc=desc, disable=not progress, leave=False
        ) as bar:
            for start in range(0, len(order), batch_size):
                rows = order[start:start + batch_size]
                t0 = time.perf_counter()
                enc = tok([strings[i] for i in rows], padding=True, truncation=True, max_length=context,
                          padding_side=padding_side, return_tensors="pt", verbose=False)
                enc = {k: v.to(dev) for k, v in enc.items()}
                mask = enc["attention_mask"].bool()
                if loaded.spec.position_ids_from_mask:
                    enc["position_ids"] = (enc["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)
                captured = cap.run(**enc, use_cache=False) if loaded.spec.causal else cap.run(**enc)
                timer["forward"] += time.perf_counter() - t0

                t0 = time.perf_counter()
                batch_items = [items[i] for i in rows]
                batch_ids = [texts.ids[it.text] for it in batch_items]
                for addr in addresses:
                    h = captured[addr]
                    if h.dtype in (torch.float16, torch.bfloat16):
                        h = h.float()
                    _check_finite(addr, h, mask, batch_ids)
                    on_address(addr, h, mask, batch_items)
                timer["metrics"] += time.perf_counter() - t0
                bar.update(len(rows))

    if preprocess != "none" and not preprocess_stats:
        stats: dict[str, VectorStats] = {}
        kinds = _preprocess_kinds(specs)
        t0 = time.perf_counter()
        run_pass("preprocess statistics",
                 lambda addr, h, mask, its: _collect_stats(addr, h, mask, its, kinds, stats, preprocess == "whiten"))
        prep = Preprocessor.from_stats(preprocess, stats, "same data")
        timer["forward"] = timer["metrics"] = 0.0
        t_stats = time.perf_counter() - t0
    if save_preprocess_stats and prep.active:
        prep.save(save_preprocess_stats)

    def measure_address(addr, h, mask, batch_items) -> None:
        orig = [r for r, it in enumerate(batch_items) if it.view < 0]
        if orig:
            sel = torch.tensor(orig, device=h.device)
            mean_pooled = pool(h[sel].double(), mask[sel], "mean")[0]
            e = (mean_pooled * mean_pooled).sum(0).cpu()
            energy[addr] = e if energy[addr].numel() == 0 else energy[addr] + e
        _feed(addr, h, mask, batch_items, states[addr], buffers, prep)

    run_pass("measure", measure_address)
    t_forward, t_metrics = timer["forward"], timer["metrics"]
    assert all(len(b) == 0 for b in buffers.values()), "some augmented views never arrived"

    # -- compute and report ---------------------------------------------------------------------------------------
    t0 = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    diagnostics: dict[str, dict[str, Any]] = {}
    per_text_cols: dict[int, dict[str, Any]] = {}
    for addr, metric_list in states.items():
        key = str(addr)
        results[key] = {}
        for spec, metric in metric_list:
            results[key][spec.name] = metric.compute()
            diag = metric.diagnostics()
            if diag:
                diagnostics.setdefault(key, {})[spec.name] = diag
            pt = metric.per_text_results() if per_text else None
            for score_name, (idx, values) in (pt or {}).items():
                for i, v in zip(idx.tolist(), values.tolist()):
                    per_text_cols.setdefault(i, {}).setdefault(key, {})[score_name] = v
    for addr, e in energy.items():
        if e.numel() == 0 or float(e.sum()) == 0:
            continue
        shares = e / e.sum()
        top = torch.argsort(shares, descending=True)[:3]
        info = {"top_dimensions": top.tolist(), "top_shares": [round(float(shares[i]), 6) for i in top]}
        diagnostics.setdefault(str(addr), {})["energy"] = info
        if float(shares[top[0]]) >= massive_share_warning:
            warnings.warn(
                f"{addr}: hidden dimension {int(top[0])} carries {float(shares[top[0]]):.0%} of the squared norm of "
                "the mean-pooled vectors, so cosine-based metrics there mostly measure that one dimension; "
                "see the massive_activations metric, or try --preprocess standardize", stacklevel=2)
    summary: dict[str, Any] = {}
    for spec in specs:
        across = spec.cls.across_layers({k: results[k][spec.name] for k in results}, list(range(len(results))))
        if across is not None:
            summary[spec.name] = across
    t_metrics += time.perf_counter() - t0

    per_text_rows = []
    if per_text:
        for i in range(len(texts.texts)):
            n_tok = text_lengths.get(i)
            per_text_rows.append({"index": i, "id": texts.ids[i],
                                  "n_tokens": None if n_tok is None else min(n_tok, context),
                                  "truncated": None if n_tok is None else n_tok > context,
                                  "scores": per_text_cols.get(i, {})})
    total = time.perf_counter() - t_start
    config = {
        "layers": [str(a) for a in addresses],
        "layer_spec": layers if isinstance(layers, str) else list(layers),
        "metrics": {spec.name: spec.config(metric) for spec, metric in first_metrics},
        "pooling": pooling,
        "batch_size": batch_size,
        "max_length": context,
        "padding_side": padding_side,
        "dtype": loaded.info.dtype,
        "device": str(loaded.device),
        "per_text": per_text,
        "text_field": text_field,
        "augmentation": augmenter.config() | {"n_views": n_views} if augmenter else None,
        "preprocess": prep.config(),
        "versions": {"repgeom_eval": __version__, "torch": torch.__version__,
                     "transformers": _version("transformers"), "python": platform.python_version()},
    }
    original_lengths = list(text_lengths.values())
    data_summary = texts.summary() | {"n_tokens": int(sum(min(n, context) for n in original_lengths)),
                                      "n_truncated": int(n_truncated), "n_views_per_text": n_views,
                                      "n_skipped_no_tokens": len(empty)}
    timings = {"load_model_s": t_load, "augment_s": t_augment, "tokenize_s": t_tok, "preprocess_stats_s": t_stats,
               "forward_s": t_forward,
               "metrics_s": t_metrics, "total_s": total,
               "sequences_per_s": len(order) / max(t_forward + t_metrics, 1e-9)}
    return MeasureResult(loaded.info.to_dict(), data_summary, config, results, diagnostics, timings, per_text_rows,
                         summary)


def _feed(
    addr: Address,
    h: torch.Tensor,
    mask: torch.Tensor,
    batch_items: list[_Item],
    metric_list: list[tuple[MetricSpec, Metric]],
    buffers: dict[tuple[Address, str], _ViewBuffer],
    prep: Preprocessor,
) -> None:
    """Pool one address's batch for each metric (each pooling computed once) and update the metric states."""
    orig = torch.tensor([r for r, it in enumerate(batch_items) if it.view < 0], dtype=torch.long)
    views = torch.tensor([r for r, it in enumerate(batch_items) if it.view >= 0], dtype=torch.long)
    text_index = torch.tensor([it.text for it in batch_items], dtype=torch.long)
    h_dev = orig.to(h.device)
    pooled: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hidden = None
    for spec, metric in metric_list:
        consumes = spec.cls.consumes
        if consumes == Consumes.VIEWS or not len(orig):
            continue
        if consumes == Consumes.TOKENS:
            if hidden is None:
                m = mask[h_dev]
                tokens = h[h_dev].double()
                if prep.active:
                    tokens[m] = prep(str(addr), "tokens", tokens[m])
                hidden = tokens.masked_fill(~m.unsqueeze(-1), 0.0), m
            metric.update(LayerBatch(str(addr), text_index[orig], hidden=hidden[0], mask=hidden[1]))
            continue
        if spec.pooling not in pooled:
            vecs, owner = pool(h[h_dev].double(), mask[h_dev], spec.pooling)  # float64 sums (spec §9.1)
            vecs = prep(str(addr), spec.pooling, vecs)
            pooled[spec.pooling] = vecs.cpu(), text_index[orig][owner.cpu()]
        vecs, index = pooled[spec.pooling]
        metric.update(LayerBatch(str(addr), index, pooled=vecs))
    if not len(views):
        return
    v_dev = views.to(h.device)
    for (buf_addr, method), buffer in buffers.items():
        if buf_addr != addr:
            continue
        vecs, _ = pool(h[v_dev].double(), mask[v_dev], method)
        vecs = prep(str(addr), f"views:{method}", vecs)
        for row, vec in zip(views.tolist(), vecs.cpu()):
            buffer.add(batch_items[row].text, batch_items[row].view, vec)
        done = buffer.pop_complete()
        if done is None:
            continue
        index, stacked = done
        for spec, metric in metric_list:
            if spec.cls.consumes == Consumes.VIEWS and spec.pooling == method:
                metric.update(LayerBatch(str(addr), index, views=stacked[:, : int(metric.n_views)]))


def _one_name_per_tensor(points: dict[Address, HookPoint], model_type: str) -> dict[Address, HookPoint]:
    """Report each captured tensor once: e.g. BERT's ``final`` is ``resid_post:-1``, and ``embed`` is always
    ``resid_pre:0``. The alias (``final``/``embed``) wins; a warning says which names were merged."""
    by_point: dict[HookPoint, list[Address]] = {}
    for addr, point in points.items():
        by_point.setdefault(point, []).append(addr)
    keep: set[Address] = set()
    for point, names in by_point.items():
        chosen = next((a for a in names if a.site in ("final", "embed")), names[0])
        keep.add(chosen)
        others = [str(a) for a in names if a != chosen]
        if others:
            warnings.warn(f"{', '.join(others)} and {chosen} are the same tensor on this {model_type} model; "
                          f"reporting it once, as {chosen}", stacklevel=3)
    return {a: p for a, p in points.items() if a in keep}


def _preprocess_kinds(specs: list[MetricSpec]) -> set[str]:
    kinds = set()
    for spec in specs:
        if spec.cls.consumes == Consumes.TOKENS:
            kinds.add("tokens")
        elif spec.cls.consumes == Consumes.VIEWS:
            kinds.add(f"views:{spec.pooling}")
        else:
            kinds.add(str(spec.pooling))
    return kinds


def _collect_stats(addr: Address, h: torch.Tensor, mask: torch.Tensor, batch_items: list[_Item], kinds: set[str],
                   stats: dict[str, VectorStats], full: bool) -> None:
    """First pass of ``preprocess``: moments of exactly the vectors each kind of metric will see."""
    orig = torch.tensor([r for r, it in enumerate(batch_items) if it.view < 0], dtype=torch.long, device=h.device)
    views = torch.tensor([r for r, it in enumerate(batch_items) if it.view >= 0], dtype=torch.long, device=h.device)
    for kind in kinds:
        rows = views if kind.startswith("views:") else orig
        if not len(rows):
            continue
        if kind == "tokens":
            x = h[rows][mask[rows]]
        else:
            x = pool(h[rows].double(), mask[rows], kind.removeprefix("views:"))[0]
        stats.setdefault(Preprocessor.key(str(addr), kind), VectorStats(full)).update(x)


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None
