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
from .addresses import Address, parse_layers, resolve
from .capture import Capture
from .data import TextSet, from_texts, load_texts
from .errors import NonFiniteError, RepgeomError
from .io import write_json, write_jsonl
from .metric import Consumes, LayerBatch, Metric
from .models import LoadedModel, load_model
from .plugin_host import PluginHost, get_host
from .pooling import check_pooling, pool


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

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "data": self.data, "config": self.config, "results": self.results,
                "diagnostics": self.diagnostics, "timings": self.timings}

    def write(self, path: str | Path, per_text_path: str | Path | None = None) -> None:
        write_json(path, self.to_dict())
        if per_text_path is not None:
            write_jsonl(per_text_path, self.per_text)


def instantiate_metrics(
    names: Sequence[str], host: PluginHost, params: Mapping[str, Mapping[str, Any]] | None, per_text: bool
) -> list[tuple[str, type[Metric], dict[str, Any]]]:
    """Look every metric up (unknown names fail before the model is loaded) and check its parameters."""
    params = dict(params or {})
    unknown_params = set(params) - set(names)
    if unknown_params:
        raise RepgeomError(f"parameters given for metrics that were not requested: {sorted(unknown_params)}")
    out = []
    for name in dict.fromkeys(names):
        cls = host.metrics.get(name)
        accepted = cls.parameter_names()
        kwargs = dict(params.get(name, {}))
        bad = set(kwargs) - set(accepted)
        if bad:
            raise RepgeomError(f"metric {name!r} has no parameter(s) {sorted(bad)} "
                               f"(parameters: {', '.join(accepted) or 'none'})")
        if per_text and "per_text" in accepted:
            kwargs.setdefault("per_text", True)
        if cls.consumes == Consumes.VIEWS:
            raise RepgeomError(f"metric {name!r} needs augmented views, which `measure` does not produce yet")
        out.append((name, cls, kwargs))
    return out


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
    pooling: str = "last",
    batch_size: int = 16,
    max_length: int | None = None,
    padding_side: str = "right",
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device | None = "cpu",
    per_text: bool = False,
    metric_params: Mapping[str, Mapping[str, Any]] | None = None,
    text_field: str = "text",
    progress: bool = True,
    host: PluginHost | None = None,
) -> MeasureResult:
    """Measure ``metrics`` at every address in ``layers`` over ``data`` with one forward pass per batch.

    ``model`` is a hub id, a local directory, a ``.gguf`` file or an already loaded :class:`LoadedModel`;
    ``data`` is a ``.jsonl``/``.txt`` path, a list of strings or a :class:`TextSet`.
    """
    t_start = time.perf_counter()
    host = host or get_host()
    pooling = check_pooling(pooling)
    if padding_side not in ("left", "right"):
        raise RepgeomError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    if batch_size < 1:
        raise RepgeomError(f"batch size must be positive, got {batch_size}")
    if isinstance(metrics, str):
        metrics = [m.strip() for m in metrics.split(",") if m.strip()]
    if not metrics:
        raise RepgeomError("no metric requested")
    specs = instantiate_metrics(metrics, host, metric_params, per_text)

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
    points = resolve(addresses, loaded)
    states: dict[Address, list[tuple[str, Metric]]] = {
        addr: [(name, cls(**kwargs)) for name, cls, kwargs in specs] for addr in addresses
    }
    need_tokens = any(cls.consumes == Consumes.TOKENS for _, cls, _ in specs)

    # -- tokenize once for lengths: sort by length (less padding), count truncation -------------------------------
    tok = loaded.tokenizer
    tok.padding_side = padding_side
    context = _context_length(loaded, max_length)
    t0 = time.perf_counter()
    lengths = [len(x) for x in tok(texts.texts, add_special_tokens=True, verbose=False)["input_ids"]]
    n_truncated = sum(n > context for n in lengths)
    if n_truncated:
        warnings.warn(f"{n_truncated} of {len(lengths)} texts are longer than {context} tokens and were truncated "
                      "(set --max-length to change the limit)", stacklevel=2)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    t_tok = time.perf_counter() - t0

    # -- one forward per batch, every address and metric fed from it ----------------------------------------------
    t_forward = t_metrics = 0.0
    dev = loaded.device
    with Capture(loaded.model, points, stop_early=True) as cap, tqdm(
        total=len(order), unit="text", desc="measure", disable=not progress, leave=False
    ) as bar:
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            t0 = time.perf_counter()
            enc = tok([texts.texts[i] for i in rows], padding=True, truncation=True, max_length=context,
                      return_tensors="pt", verbose=False)
            enc = {k: v.to(dev) for k, v in enc.items()}
            mask = enc["attention_mask"].bool()
            if loaded.spec.position_ids_from_mask:
                enc["position_ids"] = (enc["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)
            captured = cap.run(**enc, use_cache=False) if loaded.spec.causal else cap.run(**enc)
            t_forward += time.perf_counter() - t0

            t0 = time.perf_counter()
            index = torch.tensor(rows, dtype=torch.long)
            batch_ids = [texts.ids[i] for i in rows]
            for addr, metric_list in states.items():
                h = captured[addr]
                if h.dtype in (torch.float16, torch.bfloat16):
                    h = h.float()
                _check_finite(addr, h, mask, batch_ids)
                vecs, owner = pool(h, mask, pooling)
                hidden = h.double().masked_fill(~mask.unsqueeze(-1), 0.0) if need_tokens else None
                lb = LayerBatch(address=str(addr), index=index[owner.cpu()], pooled=vecs.double().cpu(),
                                hidden=hidden, mask=mask if need_tokens else None)
                for _, metric in metric_list:
                    metric.update(lb)
            t_metrics += time.perf_counter() - t0
            bar.update(len(rows))

    # -- compute and report ---------------------------------------------------------------------------------------
    t0 = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    diagnostics: dict[str, dict[str, Any]] = {}
    per_text_cols: dict[int, dict[str, Any]] = {}
    for addr, metric_list in states.items():
        key = str(addr)
        results[key] = {}
        for name, metric in metric_list:
            results[key][name] = metric.compute()
            diag = metric.diagnostics()
            if diag:
                diagnostics.setdefault(key, {})[name] = diag
            pt = metric.per_text_results() if per_text else None
            for score_name, (idx, values) in (pt or {}).items():
                for i, v in zip(idx.tolist(), values.tolist()):
                    per_text_cols.setdefault(i, {}).setdefault(key, {})[score_name] = v
    t_metrics += time.perf_counter() - t0

    per_text_rows = []
    if per_text:
        for i in range(len(texts.texts)):
            per_text_rows.append({"index": i, "id": texts.ids[i], "n_tokens": min(lengths[i], context),
                                  "truncated": lengths[i] > context, "scores": per_text_cols.get(i, {})})
    total = time.perf_counter() - t_start
    config = {
        "layers": [str(a) for a in addresses],
        "layer_spec": layers if isinstance(layers, str) else list(layers),
        "metrics": {name: metric.config() for name, metric in next(iter(states.values()))},
        "pooling": pooling,
        "batch_size": batch_size,
        "max_length": context,
        "padding_side": padding_side,
        "dtype": loaded.info.dtype,
        "device": str(loaded.device),
        "per_text": per_text,
        "text_field": text_field,
        "versions": {"repgeom_eval": __version__, "torch": torch.__version__,
                     "transformers": _version("transformers"), "python": platform.python_version()},
    }
    data_summary = texts.summary() | {"n_tokens": int(sum(min(n, context) for n in lengths)),
                                      "n_truncated": int(n_truncated)}
    timings = {"load_model_s": t_load, "tokenize_s": t_tok, "forward_s": t_forward, "metrics_s": t_metrics,
               "total_s": total, "texts_per_s": len(order) / max(t_forward + t_metrics, 1e-9)}
    return MeasureResult(loaded.info.to_dict(), data_summary, config, results, diagnostics, timings, per_text_rows)


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None
