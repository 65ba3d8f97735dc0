"""Feeding the registered-metric banks (``repgeom_metrics``) from the rows that fused capture reads.

Each task with registered metrics has a :class:`~repgeom_eval.lmeval.registered.TaskBank`. What one of its texts is
(docs/lmeval.md#any-registered-metric): for a hardness task, the context tokens of a query; for the perplexity task,
the scored positions of every rolling window of a document, in order. Which document a row belongs to is known from
the ``Instance`` objects lm-eval hands to ``loglikelihood`` / ``loglikelihood_rolling`` (:meth:`BankFeeder.
register_contexts`, :meth:`BankFeeder.register_documents`), matched to rows by the token keys of
:class:`~repgeom_eval.lmeval.scored.ScoredRow`. Texts whose rows were not read come from the extra pass, and the
augmented views of VIEWS metrics always do (:mod:`repgeom_eval.lmeval.extra_pass`).
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.lmeval.extra_pass import ExtraPass
from repgeom_eval.lmeval.registered import TaskBank
from repgeom_eval.lmeval.scored import ScoredRow, positions_mask, rolling_windows
from repgeom_eval.modeling.addresses import Address


def feed_rows(bank: TaskBank, hidden: Mapping[Address, torch.Tensor], rows: Sequence[int],
              spans: Sequence[slice], doc_ids: Sequence[int]) -> None:
    """Feed rows ``rows`` of a [B, T, D] batch to ``bank``, each text being the positions ``spans[i]`` of its row."""
    first = hidden[bank.addresses[0]]
    index = torch.as_tensor(list(rows), dtype=torch.long, device=first.device)
    mask = positions_mask(first.shape[1], spans)
    bank.feed({a: hidden[a].index_select(0, index) for a in bank.addresses}, mask, doc_ids)


class BankFeeder:
    """The registered-metric banks of a run's tasks (task name → :class:`TaskBank`), fed from the capture's rows.

    ``missed(message)`` is told when texts had to come from the extra pass (the capture warns once per run).
    """

    def __init__(self, lm: Any, loaded: Any, banks: Mapping[str, TaskBank], extra: ExtraPass,
                 missed: Callable[[str], None]):
        self.lm = lm
        self.banks = dict(banks)
        self.extra = extra
        self.missed = missed
        self.points: dict = {}
        for bank in self.banks.values():
            bank.resolve(loaded)
            self.points.update(bank.points)
        # which documents a context / window key belongs to, and its row, until the key's texts are fed
        self._contexts: dict[tuple, set[tuple[str, int]]] = {}
        self._context_rows: dict[tuple, ScoredRow] = {}
        self._windows: dict[tuple, set[tuple[str, int, int]]] = {}
        self._window_rows: dict[tuple, ScoredRow] = {}
        # context rows read from the current batch, fed to their banks before the batch is replaced
        self._pending: list[tuple[TaskBank, int, Mapping[Address, torch.Tensor], int, slice]] = []

    @property
    def reads_contexts(self) -> bool:
        return any(bank.kind == "context" for bank in self.banks.values())

    @property
    def reads_prompts(self) -> bool:
        """A generation task has registered metrics: its prompts get a forward pass of their own."""
        return any(getattr(bank, "generation", False) for bank in self.banks.values())

    def clear(self) -> None:
        self._contexts, self._context_rows, self._windows, self._window_rows = {}, {}, {}, {}
        self._pending = []

    # -- which document a row belongs to -----------------------------------------------------------------------------

    def register_contexts(self, instances: Sequence[Any], requests: Sequence[Any]) -> None:
        """Map the context key of every request of a task with registered metrics to its (task, document)."""
        if len(instances) != len(requests):
            return  # not the call loglikelihood made: nothing to attribute (the fill pass reports missing texts)
        max_len = self.lm.max_length
        for inst, (strings, ctx, cont) in zip(instances, requests):
            bank = self.banks.get(getattr(inst, "task_name", None))
            if bank is None or bank.kind != "context" or not bank.needs_originals:
                continue
            if getattr(inst, "idx", 0) != 0:
                continue  # one text per document: the context of its first request (the choices share it)
            if tuple(strings) != tuple(inst.args):
                continue  # not in the order of the instances: unattributed, reported as missing by the task
            row = ScoredRow.of(ctx, cont, max_len)
            if row.last < 0:
                raise RepgeomError(f"task {bank.task}, document {inst.doc_id}: the continuation fills the whole "
                                   f"model length ({max_len} tokens), so no context token is left to measure")
            key = row.context_key()
            self._contexts.setdefault(key, set()).add((bank.task, int(inst.doc_id)))
            self._context_rows[key] = row.context()

    def register_documents(self, requests: Sequence[Any]) -> None:
        """Map every rolling window of a document of a task with registered metrics to (task, document, window)."""
        max_len = self.lm.max_length
        for inst in requests:
            bank = self.banks.get(getattr(inst, "task_name", None))
            if bank is None or bank.kind != "document" or not bank.needs_originals:
                continue
            windows = rolling_windows(self.lm, inst.args[0])
            if not bank.expect(int(inst.doc_id), len(windows)):
                continue  # lm-eval's padding repeats a request on ranks with fewer documents
            for w, (ctx, cont) in enumerate(windows):
                row = ScoredRow.of(ctx, cont, max_len)
                key = row.window_key()
                self._windows.setdefault(key, set()).add((bank.task, int(inst.doc_id), w))
                self._window_rows[key] = row

    # -- the rows fused capture reads --------------------------------------------------------------------------------

    def take(self, hidden: Mapping[Address, torch.Tensor], index: int, row: ScoredRow, offset: int,
             rolling: bool) -> None:
        """Row ``index`` of the batch lm-eval just ran (``hidden``: {address: [B, T, D]}), holding ``row`` from
        position ``offset`` on: a window goes to its documents now, a context when the batch is done (:meth:`flush`,
        one feed per bank)."""
        if rolling:
            for task, doc_id, w in self._windows.get(row.window_key(), ()):
                bank = self.banks[task]
                if bank.needs_window(doc_id, w):
                    bank.add_window(doc_id, w, {a: hidden[a][index, row.scored_positions(offset)].clone()
                                                for a in bank.addresses})
            return
        for task, doc_id in self._contexts.get(row.context_key(), ()):
            bank = self.banks[task]
            if bank.needs_originals and bank.claim(doc_id):
                self._pending.append((bank, doc_id, hidden, index, row.context_positions(offset)))

    def flush(self) -> None:
        """Feed the context rows read from the current batch to their banks, one call per bank."""
        pending, self._pending = self._pending, []
        by_bank: dict[int, list] = defaultdict(list)
        for entry in pending:
            by_bank[id(entry[0])].append(entry)
        for entries in by_bank.values():
            bank, hidden = entries[0][0], entries[0][2]
            feed_rows(bank, {a: hidden[a] for a in bank.addresses}, [e[3] for e in entries],
                      [e[4] for e in entries], [e[1] for e in entries])

    # -- what fused capture did not read: the extra pass -------------------------------------------------------------

    def fill_contexts(self) -> None:
        """Texts of registered metrics whose rows were not read (extra capture, or a changed call order)."""
        jobs = []
        for key, owners in self._contexts.items():
            targets = [(self.banks[t], d) for t, d in sorted(owners) if self.banks[t].claim(d)]
            if targets:
                jobs.append((self._context_rows[key], targets))
        self._contexts, self._context_rows = {}, {}
        if not jobs:
            return
        self._missed(sum(len(t) for _, t in jobs), "contexts")
        seqs = [row.tokens for row, _ in jobs]
        for chunk, batch in self.extra.run(seqs, self.points, [f"sequence {k}" for k in range(len(seqs))]):
            by_bank: dict[int, list] = defaultdict(list)
            for r, job in enumerate(chunk):
                row, targets = jobs[job]
                for bank, doc_id in targets:
                    by_bank[id(bank)].append((bank, r, row.context_positions(), doc_id))
            for entries in by_bank.values():
                feed_rows(entries[0][0], batch.hidden, [e[1] for e in entries], [e[2] for e in entries],
                          [e[3] for e in entries])

    def fill_documents(self) -> None:
        """Rolling windows of registered metrics whose rows were not read; then every document must be complete."""
        jobs = []
        for key, owners in self._windows.items():
            targets = [(self.banks[t], d, w) for t, d, w in sorted(owners) if self.banks[t].needs_window(d, w)]
            if targets:
                jobs.append((self._window_rows[key], targets))
        self._windows, self._window_rows = {}, {}
        if jobs:
            self._missed(len(jobs), "rolling windows")
            seqs = [row.tokens for row, _ in jobs]
            for chunk, batch in self.extra.run(seqs, self.points, [f"sequence {k}" for k in range(len(seqs))]):
                for r, job in enumerate(chunk):
                    row, targets = jobs[job]
                    for bank, doc_id, w in targets:
                        bank.add_window(doc_id, w, {a: batch.hidden[a][r, row.scored_positions()].clone()
                                                    for a in bank.addresses})
        for bank in self.banks.values():
            if bank.kind == "document" and bank.incomplete():
                raise RepgeomError(f"task {bank.task}: documents {bank.incomplete()[:5]} are missing rolling "
                                   "windows after the extra pass")

    def _missed(self, n: int, what: str) -> None:
        self.missed(f"repgeom: fused capture missed the {what} of {n} texts of repgeom_metrics (lm-eval's private "
                    "call order differs from the tested one); computing them with an extra forward pass")

    def feed_views(self, requests: Sequence[Any], kind: str) -> None:
        """VIEWS metrics: ``n_views`` augmented views of every text of ``requests`` (docs/metrics.md#augmented-views),
        which lm-eval never runs: one extra pass, tokenized as lm-eval tokenizes a context and left-truncated to the
        model length like one."""
        max_len = self.lm.max_length
        for bank in self.banks.values():
            if bank.kind != kind or not bank.n_views:
                continue
            texts: dict[int, str] = {}
            for inst in requests:
                if getattr(inst, "task_name", None) == bank.task and bank.claim_views(int(inst.doc_id)):
                    text = inst.args[0]
                    texts[int(inst.doc_id)] = text[: len(text.rstrip())] if kind == "context" else text
            if not texts:
                continue
            n_views = bank.n_views
            warnings.warn(f"repgeom: {', '.join(bank.view_metrics())} (task {bank.task}) compare augmented views "
                          f"that lm-eval does not run: one extra forward pass over {len(texts) * n_views} augmented "
                          f"{kind}s ({n_views} per text)", RuntimeWarning, stacklevel=3)
            seqs, owners, views = [], [], []
            for doc_id in sorted(texts):
                for v in range(n_views):
                    augmented = bank.augmenter.view(texts[doc_id], doc_id, v)
                    seqs.append(self.lm.tok_encode(augmented)[-max_len:] or [self.lm.prefix_token_id])
                    owners.append(doc_id)
                    views.append(v)
            # whole texts per batch: as many as lm-eval's batch size holds views of (at least one)
            rows = max(1, self.extra.batch_size // n_views) * n_views
            names = [f"view {v} of document {d}" for d, v in zip(owners, views)]
            for chunk, batch in self.extra.run(seqs, bank.points, names, as_lm_eval=False, rows_per_batch=rows):
                bank.feed(batch.hidden, batch.mask, [owners[k] for k in chunk], [views[k] for k in chunk])

    def feed_prompts(self, requests: Sequence[Any]) -> None:
        """Generation tasks (``generate_until``): one forward pass over each document's prompt (the context of its
        first request), encoded and left-truncated as ``HFLM.generate_until`` encodes it (room left for
        ``max_gen_toks``), run as a text of its own with its attention mask, as ``repgeom measure`` runs texts."""
        from lm_eval.models.huggingface import normalize_gen_kwargs

        for bank in self.banks.values():
            if not getattr(bank, "generation", False) or not bank.needs_originals:
                continue
            seqs, owners = [], []
            for inst in requests:
                if getattr(inst, "task_name", None) != bank.task or getattr(inst, "idx", 0) != 0:
                    continue
                if not bank.claim(int(inst.doc_id)):
                    continue
                context, gen_kwargs = inst.args[0], inst.args[1] if len(inst.args) > 1 else {}
                room = normalize_gen_kwargs(dict(gen_kwargs or {}), self.lm.max_gen_toks)["max_gen_toks"]
                ids, _ = self.lm.tok_batch_encode([context], left_truncate_len=max(1, self.lm.max_length - room),
                                                  truncation=self.lm.truncation)
                seqs.append([int(t) for t in ids[0].tolist()] or [self.lm.prefix_token_id])
                owners.append(int(inst.doc_id))
            if not seqs:
                continue
            names = [f"prompt of document {d}" for d in owners]
            for chunk, batch in self.extra.run(seqs, bank.points, names, as_lm_eval=False):
                bank.feed(batch.hidden, batch.mask, [owners[k] for k in chunk])
