"""The weights check: a checkpoint is measured as saved or refused, and only for what the measured hidden states read
(docs/metrics.md#how-an-address-is-found)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from repgeom_eval.spec.errors import RepgeomError, first_line
from repgeom_eval.modeling.layout import Layout
from repgeom_eval.spec.options.model import ModelOptions


def check_safetensors(directory: Path, name: str) -> None:
    """Open the header of every ``*.safetensors`` file of a model directory (milliseconds: the tensors stay on
    disk), so that a truncated, empty or garbage weights file is one line naming it rather than a traceback from the
    middle of ``from_pretrained``."""
    try:
        from safetensors import safe_open
    except ImportError:  # pragma: no cover - a core dependency
        return
    for f in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as fh:
                fh.keys()
        except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError ...: the file is unusable either way
            detail = first_line(exc).removeprefix("Error while deserializing header: ")
            raise RepgeomError(f"model {name!r}: weights file {f.name} is truncated, empty or not a safetensors file "
                               f"({detail}); download or save the checkpoint again") from None


def check_loading_report(name: str, report: dict[str, Any], policy: ModelOptions, model: Any,
                          layout: Layout) -> tuple[list[str], list[str]]:
    """Refuse a checkpoint whose tensors do not fill what the measured hidden states read (transformers would quietly
    initialise the missing ones at random); with ``allow_random_init``, warn and return their names. Tensors that no
    measured hidden state reads (a pooler, the LM head of another class) are returned apart: harmless for geometry,
    refused where logits are needed (:meth:`LoadedModel.check_logits`)."""
    missing = sorted(report.get("missing_keys") or [])
    unexpected = sorted(report.get("unexpected_keys") or [])
    mismatched = sorted(str(k[0]) if isinstance(k, (tuple, list)) else str(k)
                        for k in (report.get("mismatched_keys") or []))
    relevant = reads(model, layout)
    unused = [k for k in missing + mismatched if not relevant(k)]
    missing, mismatched = [k for k in missing if relevant(k)], [k for k in mismatched if relevant(k)]
    unexpected = [k for k in unexpected if relevant(k)]
    if not (missing or unexpected or mismatched):
        return [], unused
    parts = []
    for label, keys in (("missing", missing), ("unexpected", unexpected), ("of the wrong shape", mismatched)):
        if keys:
            shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
            parts.append(f"{len(keys)} tensor(s) {label} ({shown})")
    detail = "; ".join(parts)
    if not policy.allow_random_init:
        raise RepgeomError(f"model {name!r} does not match its architecture: {detail}; its weights would be random. "
                           "Fix the checkpoint (or its config.json), or pass --allow-random-init to measure it anyway")
    warnings.warn(f"model {name!r}: {detail}; those tensors keep their random initialisation "
                  "(--allow-random-init)", stacklevel=3)
    return missing + mismatched, unused


def reads(model: Any, layout: Layout):
    """``key → bool``: whether a checkpoint tensor belongs to what the measured hidden states are computed from.

    The module that holds the tensor (or its nearest ancestor that ran in the load check's probe) decides: one that
    ran before ``final`` was read counts, one that ran only afterwards (a pooler, an LM head) does not. A key that
    belongs to no module of this class (the head of another class in the checkpoint) does not; anything undecided
    counts (strict)."""
    names = {n for n, _ in model.named_modules()}

    def relevant(key: str) -> bool:
        parts = key.split(".")
        owner = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in names), "")
        if not owner:
            return False
        while owner:
            if owner in layout.depends_on:
                return True
            if owner in layout.after_final:
                return False
            owner = owner.rpartition(".")[0]
        return True

    return relevant
