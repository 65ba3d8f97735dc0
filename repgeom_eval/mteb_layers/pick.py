"""``--layer auto``: pick a layer from the label-free geometry of a task's own texts (docs/picks.md).

:func:`pick_layer` runs ONE forward pass per batch over the texts that capture every candidate layer (the hidden
states ``embed``, ``resid_post:0`` ... ``final``, less those the rule leaves out), pools them as the embedding recipe
says (before any ``--preprocess`` and unit normalisation), scores each layer with the rule
(:class:`repgeom_eval.spec.layer_pick.LayerPick`) and lets the rule choose. What it did is one JSON string,
written as ``repgeom_layer_pick`` into every score dict of the evaluations it chose (mteb keeps strings as they are).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.spec.layer_pick import LayerPick
from repgeom_eval.modeling.addresses import Address
from repgeom_eval.spec.layer_request import layer_request

from .embedder import LayerEmbedder

#: score-dict key of the pick record (a JSON string)
PICK_KEY = "repgeom_layer_pick"


@dataclass
class Picked:
    """One pick: the chosen address, every candidate's score, the pooled float64 vectors of every candidate (row i
    = text i) and the record written next to the scores."""

    chosen: Address
    scores: dict[str, float]
    pooled: dict[Address, np.ndarray]
    record: str


def is_auto(layers: Any) -> bool:
    """Whether a layer request is ``auto``, as the one grammar reads it (:func:`~repgeom_eval.modeling.addresses.
    layer_request`: ``auto`` cannot be mixed with other addresses)."""
    return layer_request(layers).auto


def pick_layer(embedder: LayerEmbedder, rule: LayerPick, texts: Sequence[str], batch_size: int, *,
               texts_note: str, progress: bool = False, host: Any = None) -> Picked:
    """Score every candidate layer of ``embedder`` on ``texts`` with ``rule`` (one forward pass per batch for all
    layers) and choose one; ``texts_note`` says in the record which texts these are."""
    every = {str(a): a for a in embedder.addresses("all")}
    names = rule.candidates(list(every))
    strange = [n for n in names if n not in every]
    if strange or not names:
        raise RepgeomError(f"layer pick {rule.name!r} chose candidates {strange or names} among the hidden states "
                           f"{', '.join(every)}")
    if len(set(texts)) < 2:
        raise RepgeomError(f"layer pick {rule.name!r} needs at least 2 distinct texts, got {len(set(texts))}")
    candidates = [every[n] for n in names]
    pooled = embedder.embed(texts, candidates, batch_size=batch_size, progress=progress, raw=True, dtype=np.float64,
                            desc=f"layer pick ({len(candidates)} layers)")
    scores = {str(a): float(rule.score(pooled[a])) for a in candidates}
    chosen = rule.choose(dict(scores))
    if chosen not in scores:
        raise RepgeomError(f"layer pick {rule.name!r} chose {chosen!r}, which is not a candidate "
                           f"({', '.join(scores)})")
    record = {
        "chosen": chosen, "rule": rule.name, "params": dict(rule.params), "direction": rule.direction,
        "quantity": rule.quantity, "scores": scores, "n_texts": len(texts), "texts": texts_note,
        "vectors": f"{embedder.recipe.pooling}-pooled hidden states, before preprocessing and unit normalisation",
        "compared_with": "final", "evidence": rule.evidence,
    }
    try:
        from repgeom_eval.plugin_system.host import get_host

        record["plugin"] = (host or get_host()).provenance("layer_pick", [rule.name])[rule.name]
    except Exception:  # noqa: BLE001 - a rule built by hand, not registered: no provenance to record
        record["plugin"] = None
    return Picked(every[chosen], scores, pooled, json.dumps(record))


def role(record: dict[str, Any], address: str) -> str:
    """What an evaluated layer is in an ``auto`` run: ``pick``, ``final`` or ``pick+final``."""
    parts = (["pick"] if record.get("chosen") == address else []) + (["final"] if address == "final" else [])
    return "+".join(parts) or "other"
