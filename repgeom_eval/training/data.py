"""The training data of ``repgeom train``: each domain's texts read and split, then packed into token blocks.

Texts are tokenized, joined by EOS and cut into ``block_size``-token blocks (run_clm's ``group_texts``); every
block carries its domain's label, so that cross-domain aux losses know which examples come from which domain, and a
domain's blocks never mix with another's. A domain without an eval file holds out a seeded ``eval_fraction`` of its
texts.
"""

from __future__ import annotations

import itertools
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.measurement.texts import TextSet, load_texts
from repgeom_eval.spec.options.train import DataOptions


def split_texts(texts: TextSet, fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(train, eval) texts: a seeded ``fraction`` of the texts held out (at least one of each when possible)."""
    order = list(range(len(texts.texts)))
    random.Random(seed).shuffle(order)
    n_eval = min(max(1, round(fraction * len(order))), len(order) - 1) if fraction > 0 else 0
    held = set(order[:n_eval])
    train = [t for i, t in enumerate(texts.texts) if i not in held]
    return train, [t for i, t in enumerate(texts.texts) if i in held]


def read_domains(data: DataOptions, seed: int) -> dict[str, tuple[list[str], list[str]]]:
    """Each domain's (train, eval) texts: its eval file, or a held-out split seeded by ``seed`` + its position."""
    texts: dict[str, tuple[list[str], list[str]]] = {}
    for i, (name, files) in enumerate(data.domains.items()):
        train_set = load_texts(files.train, text_field=data.text_field)
        if files.eval is not None:
            texts[name] = (train_set.texts, load_texts(files.eval, text_field=data.text_field, min_texts=1).texts)
        else:
            texts[name] = split_texts(train_set, data.eval_fraction, seed + i)
    return texts


def pack_blocks(texts: Sequence[str], tokenizer: Any, block_size: int, domain: int):
    """A ``datasets.Dataset`` of ``block_size``-token blocks: texts tokenized, joined by EOS, cut (remainder
    dropped), ``labels = input_ids`` but for position 0, every example labelled ``domain`` (run_clm's
    ``group_texts``). Position 0 is never a next-token target (a causal LM's loss shifts the labels); its label is
    -100 so that every transformers 5 counts the targets of a batch right (before 5.10.1 the Trainer divided the
    summed CE by all labels that are not -100, position 0 included, so CE and perplexity came out scaled by (T−1)/T)."""
    import datasets
    import transformers

    eos = tokenizer.eos_token_id
    sep = [] if eos is None else [eos]

    def tokenize(batch):
        return {"input_ids": tokenizer(batch["text"], add_special_tokens=False)["input_ids"]}

    def group(batch):
        ids = list(itertools.chain.from_iterable(x + sep for x in batch["input_ids"]))
        n = len(ids) // block_size * block_size
        blocks = [ids[i:i + block_size] for i in range(0, n, block_size)]
        return {"input_ids": blocks, "attention_mask": [[1] * block_size for _ in blocks],
                "labels": [[-100, *b[1:]] for b in blocks], "domain": [domain] * len(blocks)}

    bars = datasets.is_progress_bar_enabled()
    verbosity = transformers.logging.get_verbosity()
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()  # "sequence longer than the model's max length": we cut it below
    try:
        ds = datasets.Dataset.from_dict({"text": list(texts)})
        ds = ds.map(tokenize, batched=True, remove_columns=["text"])
        ds = ds.map(group, batched=True, remove_columns=["input_ids"], batch_size=1000)
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()
    return ds.with_format("torch")


@dataclass
class Blocks:
    """The packed data of a run: one training dataset (every domain), an eval dataset per domain, a summary."""

    train: Any  # datasets.Dataset
    eval_sets: dict[str, Any]
    summary: dict[str, dict[str, Any]]  # per domain: files, texts and blocks (results.json's "data")


def pack_domains(texts: dict[str, tuple[list[str], list[str]]], tokenizer: Any, data: DataOptions,
                 seed: int) -> Blocks:
    """Every domain's texts packed into blocks labelled by its position; with ``data.balance``, each domain's
    training blocks are cut (seeded) to the smallest domain's count."""
    import datasets

    train_parts, eval_sets, summary = [], {}, {}
    for i, (name, (tr, ev)) in enumerate(texts.items()):
        train_ds = pack_blocks(tr, tokenizer, data.block_size, i)
        eval_ds = pack_blocks(ev, tokenizer, data.block_size, i) if ev else None
        if len(train_ds) == 0:
            raise RepgeomError(f"domain {name!r}: its training texts give no block of {data.block_size} tokens; add "
                               "text or lower data.block_size")
        train_parts.append(train_ds)
        if eval_ds is not None and len(eval_ds) > 0:
            eval_sets[name] = eval_ds
        else:
            warnings.warn(f"domain {name!r} has no evaluation block of {data.block_size} tokens; its perplexity is "
                          "not reported (give it an eval file or more text)", stacklevel=3)
        files = data.domains[name]
        summary[name] = {"id": i, "train": files.train, "eval": files.eval, "train_texts": len(tr),
                         "eval_texts": len(ev), "train_blocks": len(train_ds),
                         "eval_blocks": len(eval_ds) if eval_ds is not None else 0}
    if data.balance and len(train_parts) > 1:
        n = min(len(d) for d in train_parts)
        train_parts = [d.shuffle(seed=seed).select(range(n)) if len(d) > n else d for d in train_parts]
        for name, d in zip(summary, train_parts):
            summary[name]["train_blocks_used"] = len(d)
    train_ds = datasets.concatenate_datasets(train_parts) if len(train_parts) > 1 else train_parts[0]
    return Blocks(train_ds, eval_sets, summary)
