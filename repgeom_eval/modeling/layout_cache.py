"""The load check's findings kept on disk, so that a checkpoint is probed once rather than on every run
(docs/metrics.md#how-an-address-is-found).

Discovery runs several forward passes of the whole model (the probe, and one per padding side); at a 8B width that
is most of ``load_model``'s time. Its result, the :class:`~repgeom_eval.modeling.layout.Layout`, is saved as JSON,
keyed by everything it depends on:

* the model's config (every field but its path), its class and the source file of that class (remote code
  included), the architecture table applied, the parameters' dtype and device type, whether half precision was
  upcast for the probe;
* the transformers version and this package's version;
* a fingerprint of the weights (each tensor's name, shape and its first and last values): what the probe finds can depend
  on the weights (a norm gain of exactly 1 makes two tensors equal that trained weights keep apart), so another
  checkpoint of the same type is probed again; the same checkpoint is not.

``REPGEOM_LAYOUT_CACHE=0`` switches it off; ``REPGEOM_CACHE`` moves it (default ``~/.cache/repgeom-eval``). An entry
that cannot be read is ignored (and rewritten); one that cannot be written costs only speed.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from repgeom_eval.modeling.hooks import HookPoint
from repgeom_eval.modeling.layout import Layout, Site

FORMAT = 1
SAMPLES = 16  # values read from each weight tensor for the fingerprint


def enabled() -> bool:
    return os.environ.get("REPGEOM_LAYOUT_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def _root() -> Path:
    return Path(os.environ.get("REPGEOM_CACHE") or Path.home() / ".cache" / "repgeom-eval").expanduser() / "layouts"


def _class_source(model: nn.Module) -> str:
    try:
        path = inspect.getsourcefile(type(model))
        return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else ""
    except (TypeError, OSError):
        return ""


def _weights_fingerprint(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        if tensor.numel() and tensor.device.type != "meta":
            # the first and last few values: two pages of a memory-mapped file, not the whole tensor
            flat = tensor.detach().reshape(-1)
            ends = torch.cat([flat[:SAMPLES // 2], flat[-(SAMPLES // 2):]])
            digest.update(ends.to("cpu", torch.float64).numpy().tobytes())
    return digest.hexdigest()


def key(model: nn.Module, table_name: str | None, upcast: bool) -> str | None:
    """The cache key of ``model``'s layout, or None for a model that has no config to key it by."""
    import transformers

    from repgeom_eval import __version__

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    fields = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "name_or_path")}
    param = next(model.parameters(), None)
    parts = {"format": FORMAT, "config": fields, "class": f"{type(model).__module__}.{type(model).__qualname__}",
             "source": _class_source(model), "table": table_name, "upcast": upcast,
             "dtype": str(param.dtype) if param is not None else None,
             "device": param.device.type if param is not None else None,
             "transformers": transformers.__version__, "repgeom_eval": __version__,
             "weights": _weights_fingerprint(model)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _site(d: dict | None) -> Site:
    assert d is not None
    point = HookPoint(**d["point"]) if d["point"] is not None else None
    return Site(point, d["note"], d["absent"], d["width"], d["verified"])


def _site_dict(site: Site) -> dict:
    point = site.point
    return {"point": None if point is None else {"module_name": point.module_name, "direction": point.direction,
                                                 "index": point.index, "call": point.call, "copy": point.copy,
                                                 "flat": point.flat},
            "note": site.note, "absent": site.absent, "width": site.width, "verified": site.verified}


def to_dict(layout: Layout) -> dict[str, Any]:
    return {"model_type": layout.model_type, "runner": layout.runner, "blocks": layout.blocks,
            "n_layers": layout.n_layers, "embed": _site_dict(layout.embed), "final": _site_dict(layout.final),
            "hidden_states": list(layout.hidden_states),
            "sites": [{name: _site_dict(s) for name, s in block.items()} for block in layout.sites],
            "block_kinds": list(layout.block_kinds), "causal": layout.causal, "logits": layout.logits,
            "accepted_inputs": sorted(layout.accepted_inputs), "position_ids": layout.position_ids,
            "padding_sides": list(layout.padding_sides), "depends_on": sorted(layout.depends_on),
            "after_final": sorted(layout.after_final), "notes": list(layout.notes), "table": layout.table}


def from_dict(d: dict[str, Any]) -> Layout:
    plain = {k: d[k] for k in ("model_type", "runner", "blocks", "n_layers", "causal", "logits", "position_ids",
                               "table")}
    return Layout(**plain, embed=_site(d["embed"]), final=_site(d["final"]), hidden_states=tuple(d["hidden_states"]),
                  sites=[{name: _site(s) for name, s in block.items()} for block in d["sites"]],
                  block_kinds=list(d["block_kinds"]), accepted_inputs=frozenset(d["accepted_inputs"]),
                  padding_sides=tuple(d["padding_sides"]), depends_on=frozenset(d["depends_on"]),
                  after_final=frozenset(d["after_final"]), notes=list(d["notes"]))


def load(cache_key: str) -> Layout | None:
    path = _root() / f"{cache_key}.json"
    try:
        return from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return None


def save(cache_key: str, layout: Layout) -> None:
    root = _root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=root, suffix=".tmp", delete=False) as fh:
            json.dump(to_dict(layout), fh)
        os.replace(fh.name, root / f"{cache_key}.json")
    except OSError:
        pass  # a read-only or full cache costs only speed
