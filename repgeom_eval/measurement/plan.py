"""Cutting a shard of texts into batches: originals and augmented views, tokenized once for their lengths."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from repgeom_eval.measurement.forward import token_lengths
from repgeom_eval.measurement.texts import Record


@dataclass(frozen=True)
class Item:
    """One sequence to run through the model: an original text (view = -1) or one of its augmented views."""

    text: int
    view: int


@dataclass
class ShardPlan:
    """One shard, ready to run: its sequences (originals and views), their token counts, and its batches."""

    items: list[Item]
    strings: list[str]
    lengths: list[int]
    units: list[list[int]]  # batches (rows into items); unit u runs on rank u % world
    ids: dict[int, Any]  # text index → record id
    empty: list[int]  # text indices with no tokens


def plan_shard(shard: list[Record], tok: Any, batch_size: int, n_views: int, need_originals: bool,
               augmenter: Any, context: int) -> ShardPlan:
    """Augment, tokenize once for lengths (reading no more of a text than ``context`` tokens use), and cut the
    shard into batches.

    Originals are sorted by length (less padding) and cut into batches; the views of each text stay together, so
    a text's views are all pooled by the same process. The plan depends only on the shard, never on the number of
    processes: every batch is padded the same way whether it runs alone or on one rank of many.
    """
    items: list[Item] = []
    strings: list[str] = []
    for rec in shard:
        if need_originals:
            items.append(Item(rec.index, -1))
            strings.append(rec.text)
        for v in range(n_views):
            items.append(Item(rec.index, v))
            strings.append(augmenter.view(rec.text, rec.index, v))
    strings, lengths = token_lengths(tok, strings, context) if strings else ([], [])
    empty = sorted({it.text for it, n in zip(items, lengths) if n == 0})
    drop = set(empty)
    keep = [k for k, it in enumerate(items) if it.text not in drop]
    items, strings, lengths = [items[k] for k in keep], [strings[k] for k in keep], [lengths[k] for k in keep]

    originals = sorted((k for k, it in enumerate(items) if it.view < 0), key=lambda k: -lengths[k])
    units = [originals[i:i + batch_size] for i in range(0, len(originals), batch_size)]
    if n_views:
        by_text: dict[int, list[int]] = {}
        for k, it in enumerate(items):
            if it.view >= 0:
                by_text.setdefault(it.text, []).append(k)
        texts = sorted(by_text, key=lambda t: -max(lengths[k] for k in by_text[t]))
        per_batch = max(1, batch_size // n_views)
        for i in range(0, len(texts), per_batch):
            rows = [k for t in texts[i:i + per_batch] for k in by_text[t]]
            units.append(sorted(rows, key=lambda k: -lengths[k]))
    return ShardPlan(items, strings, lengths, units, {rec.index: rec.id for rec in shard}, empty)
