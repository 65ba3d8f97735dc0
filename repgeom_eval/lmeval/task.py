"""The task classes the repgeom YAMLs name (``class: !function repgeom_eval.lmeval.task.…``).

Each is lm-eval's own ``ConfigurableTask`` (the YAML gives upstream's prompt, choices, target and metrics) plus
geometry. Importing this module registers the metrics with lm-eval and installs the hidden-state capture for
runs that include a repgeom task (``session``).

Settings come from ``--metadata`` (and from ``--model_args`` with ``--model repgeom-hf``), all optional: the keys
``repgeom_<field>`` of :class:`~repgeom_eval.spec.options.lmeval.Settings`, where each is declared once, with its default
and meaning (docs/lmeval.md#settings---metadata). What a task reads (its ``repgeom_layer`` address and pooling) is
resolved on the model when the run starts (``session``).

Why ``apply_filters`` does the geometry: lm-eval runs every request of every task before it scores any document,
then calls ``apply_filters`` once per task on every rank (in the same order), then ``process_results`` per
document. At that point each query's vector is known, so c_i (its mean cosine distance to all queries,
docs/metrics.md#per-text-scores) can be computed against the whole population — the sums of the unit vectors are
added across ranks there — and ``process_results`` can put c_i into each document's log-samples record. The states
of the registered metrics (``repgeom_metrics``, :mod:`repgeom_eval.lmeval.registered`) are merged across ranks
and computed there too.
"""

from __future__ import annotations

import functools
import math
import operator
import warnings
from collections import defaultdict
from typing import Any

import numpy as np
from lm_eval.api.samplers import ContextSampler
from lm_eval.api.task import ConfigurableTask

from repgeom_eval.analyses import slices
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.functional.dispersion import DispersionSums
from repgeom_eval.lmeval import metrics, session
from repgeom_eval.lmeval.documents import SCHEMAS
from repgeom_eval.lmeval.ranks import lm_eval_ranks
from repgeom_eval.lmeval.registered import MetricRequest
from repgeom_eval.spec.options.lmeval import SCHEMA_KEY, Settings
from repgeom_eval.modeling.addresses import Address


class GeometryTask(ConfigurableTask):
    """A YAML task plus geometry; subclasses say what one document contributes."""

    KIND = ""
    NEEDS_OUTPUT_TYPE = ""  # the lm-eval output_type a subclass's per-document code reads; "" takes any
    GEOMETRY_METRICS: tuple[str, ...] = ()  # the task's own geometry metrics, from _document_items

    def __init__(self, config: dict | None = None, **kwargs: Any):
        config = dict(config or {})
        config.pop("class", None)  # lm-eval's PY_TASK route passes the YAML's `class:` key along
        metadata = dict(config.get("metadata") or {})
        self.settings = Settings.from_metadata(metadata, self.KIND)
        record = self.settings.record(self.KIND)
        record["data"] = self._data_source(config)
        self.metric_request = MetricRequest.from_settings(self.settings)
        if self.metric_request is not None:  # recorded only when asked for: today's task config is unchanged
            record.update(self.metric_request.record())
        metadata["repgeom"] = record
        config["metadata"] = metadata
        self.read: tuple[Address, str] | None = None  # (address, pooling), resolved on the model by the session
        self.bank = None  # the run's TaskBank (set by the session when repgeom_metrics are requested)
        self.capture_info: dict[str, Any] | None = None
        self._world_size = 1
        super().__init__(config=config, **kwargs)
        if self.NEEDS_OUTPUT_TYPE and self.OUTPUT_TYPE != self.NEEDS_OUTPUT_TYPE:
            raise RepgeomError(f"{type(self).__name__} needs output_type {self.NEEDS_OUTPUT_TYPE}, "
                               f"got {self.OUTPUT_TYPE}")

    def _data_source(self, config: dict) -> str | None:
        """Where the documents come from, as the task config records it."""
        schema = (config.get("dataset_kwargs") or {}).get(SCHEMA_KEY)
        if schema in SCHEMAS:
            return self.settings.data or "/".join(x for x in SCHEMAS[schema].hub if x) + " (Hugging Face Hub)"
        # a YAML of the user's own (docs/lmeval.md#your-own-prompt-a-hardness-task-from-a-yaml): its dataset_path
        # says where the data is
        if self.settings.data:
            warnings.warn(f"task {config.get('task')}: repgeom_data applies to the shipped repgeom tasks only; "
                          "this task reads its own dataset_path / dataset_kwargs", RuntimeWarning, stacklevel=3)
        given = {k: v for k, v in (config.get("dataset_kwargs") or {}).items() if k != SCHEMA_KEY}
        return " ".join(str(x) for x in (config.get("dataset_path"), given or None) if x) or None

    def record_capture(self, info: dict[str, Any]) -> None:
        """Called by the session: how the hidden states were obtained (goes into the results' task config)."""
        self.capture_info = info
        self.config.metadata["repgeom"].update(info)

    def build_all_requests(self, *args: Any, **kwargs: Any) -> None:
        self._world_size = int(kwargs.get("world_size", 1) or 1)
        return super().build_all_requests(*args, **kwargs)

    def _bypassed(self) -> bool:
        """``--predict_only`` replaces every metric by lm-eval's ``bypass``."""
        return "bypass" in self._metric_fn_list

    def _geometry_metrics(self, names: tuple[str, ...]) -> list[str]:
        return [m for m in names if m in self._metric_fn_list]

    def _finish_bank(self) -> None:
        """Registered metrics: merge the states of every rank (a collective, reached by every rank in the same
        order), compute the values, give lm-eval their aggregations and put each document's per-text scores on
        its first result (``process_results`` reads them there)."""
        if self.metric_request is None or self._bypassed():
            return
        if self.bank is None:
            raise self._missing("the registered metrics (repgeom_metrics)")
        missing = self.bank.missing([int(inst.doc_id) for inst in self._instances or []])
        if missing:
            raise self._missing(f"the registered metrics (repgeom_metrics) of documents {missing[:5]}")
        self.bank.finish(self._world_size)
        for name, aggregation in self.bank.aggregations.items():
            self._aggregation_list[name] = aggregation
            self._higher_is_better[name] = None
        by_doc: dict[int, list] = defaultdict(list)
        for inst in self._instances or []:
            by_doc[inst.doc_id].append(inst)
        for doc_id, insts in by_doc.items():
            first = min(insts, key=lambda x: x.idx)
            key = next(iter(first.filtered_resps))
            carrier = first.filtered_resps[key]
            try:
                carrier.repgeom_bank_items = self.bank.items(int(doc_id))
            except AttributeError:
                raise self._missing(f"document {doc_id}") from None

    def _bank_items(self, results: list) -> dict[str, Any]:
        if self.metric_request is None or self._bypassed():
            return {}
        items = getattr(results[0], "repgeom_bank_items", None)
        if items is None:
            raise self._missing("this document (repgeom_metrics)")
        return items

    def _document_items(self, results: list) -> dict[str, Any]:
        """One document's values of every metric in ``GEOMETRY_METRICS`` (asked only when one is requested); every
        subclass that declares metrics defines it."""
        raise NotImplementedError(f"{type(self).__name__} declares GEOMETRY_METRICS but no _document_items")

    def apply_filters(self):
        out = super().apply_filters()
        self._finish_bank()
        return out

    def process_results(self, doc: dict, results: list) -> dict[str, Any]:
        base = {**super().process_results(doc, results), **self._bank_items(results)}
        wanted = self._geometry_metrics(self.GEOMETRY_METRICS)
        if self._bypassed() or not wanted:
            return base
        items = self._document_items(results)
        return {**base, **{m: items[m] for m in wanted}}

    def _missing(self, what: str) -> RepgeomError:
        return RepgeomError(
            f"task {self.config.task}: no hidden states reached {what}. The run did not go through repgeom's "
            "capture: use `--model hf` without --use_cache, and import lm_eval.evaluator.evaluate only after "
            "loading the task (or call repgeom_eval.lmeval.session.install() first)")


class HardnessTask(GeometryTask):
    """Multiple-choice task: one vector per query, correctness from lm-eval's own ``acc`` (or ``acc_norm``)."""

    KIND = "hardness"
    NEEDS_OUTPUT_TYPE = "multiple_choice"
    GEOMETRY_METRICS = metrics.HARDNESS_METRICS

    def __init__(self, config: dict | None = None, **kwargs: Any):
        super().__init__(config=config, **kwargs)
        if self.multiple_input or self.multiple_target:
            raise RepgeomError(f"task {self.config.task}: multiple inputs or targets per document are not supported")
        if self.settings.correct not in self._metric_fn_list:
            raise RepgeomError(f"repgeom_correct {self.settings.correct!r} is not a metric of task "
                               f"{self.config.task} (its metrics: {', '.join(self._metric_fn_list)})")
        if len(self._filters) != 1:
            raise RepgeomError(f"task {self.config.task}: geometry supports one filter pipeline, got "
                               f"{len(self._filters)}")
        if "repgeom_slice_spearman" in self._aggregation_list:
            self._aggregation_list["repgeom_slice_spearman"] = functools.partial(
                metrics.slice_spearman, size=self.settings.slice_size, seeds=self.settings.slice_seeds)

    def _gold(self, doc: dict) -> int:
        gold = self.doc_to_target(doc)
        if isinstance(gold, str):
            gold = self.doc_to_choice(doc).index(gold)
        return int(gold)

    def apply_filters(self):
        out = super().apply_filters()
        # Every rank reaches the same decision here: the sums below are a collective, also for a rank with no
        # documents of its own.
        if self._bypassed() or not self._geometry_metrics(self.GEOMETRY_METRICS):
            return out
        by_doc: dict[int, list] = defaultdict(list)
        for inst in self._instances:
            by_doc[inst.doc_id].append(inst)
        carriers, doc_ids, vectors, correct, ppl, prompt_ppl = [], [], [], [], [], []
        for doc_id in sorted(by_doc):
            insts = sorted(by_doc[doc_id], key=lambda x: x.idx)
            key = next(iter(insts[0].filtered_resps))
            results = [inst.filtered_resps[key] for inst in insts]
            geometry = getattr(results[0], "geometry", None)
            if not geometry or self.read not in geometry:
                raise self._missing(f"document {doc_id}")
            doc = insts[0].doc
            base = ConfigurableTask.process_results(self, doc, results)
            gold = self._gold(doc)
            n_tokens = getattr(results[gold], "n_tokens", None) or 1
            carriers.append(results[0])
            doc_ids.append(doc_id)
            vectors.append(np.asarray(geometry[self.read], dtype=np.float64))
            correct.append(bool(base[self.settings.correct]))
            ppl.append(math.exp(-float(results[gold][0]) / n_tokens))  # the gold answer's, given the prompt
            prompt = getattr(results[0], "prompt", None)  # the choices share the context: any row's will do
            prompt_ppl.append(prompt.perplexity() if prompt is not None else math.nan)
        # the sums over every rank's queries: all, correct, incorrect
        local = None
        if vectors:
            u = slices.unit_rows(np.stack(vectors))
            ok = np.asarray(correct)
            everyone = np.ones(len(u), dtype=bool)
            local = [DispersionSums.of(u[m]) for m in (everyone, ok, ~ok)]
        ranks = lm_eval_ranks(self._world_size, "geometry needs the sums of every rank")
        gathered = [sums for sums in ranks.all_gather(local) if sums is not None]
        if not vectors:
            return out
        total = [functools.reduce(operator.add, parts) for parts in zip(*gathered)]
        c = slices.scores_against(u, everyone, total[0])
        c_ok = slices.scores_against(u, ok, total[1])
        c_bad = slices.scores_against(u, ~ok, total[2])
        for i, carrier in enumerate(carriers):
            carrier.repgeom_items = metrics.query_items(c[i], c_ok[i], c_bad[i], correct[i], ppl[i], vectors[i],
                                                         doc_ids[i], prompt_ppl[i])
        return out

    def _document_items(self, results: list) -> dict[str, Any]:
        items = getattr(results[0], "repgeom_items", None)  # put there by apply_filters
        if items is None:
            raise self._missing("this document")
        return items


class MMLUHardnessTask(HardnessTask):
    """All MMLU subjects as one task; few-shot examples come from the document's own subject, as upstream."""

    def fewshot_context(self, doc: dict, num_fewshot: int, *args: Any, **kwargs: Any):
        if isinstance(getattr(self, "sampler", None), SubjectFirstNSampler):
            self.sampler.subject = doc.get("subject")
        return super().fewshot_context(doc, num_fewshot, *args, **kwargs)


class SubjectFirstNSampler(ContextSampler):
    """The first n few-shot documents of the evaluated document's subject (upstream MMLU: ``first_n`` on the dev
    split of one subject)."""

    subject: str | None = None

    def sample(self, n: int, eval_doc: dict | None = None, df: Any = None, **kwargs: Any):
        if n == 0:
            return []
        subject = (eval_doc or {}).get("subject", self.subject)
        pool = [d for d in self.fewshot_docs() if d.get("subject") == subject and d != eval_doc]
        if len(pool) < n:
            raise RepgeomError(f"{n}-shot MMLU needs {n} few-shot documents of subject {subject!r}, the dev split "
                               f"has {len(pool)}; pass a repgeom_data folder with test.jsonl and dev.jsonl")
        return pool[:n]


class PerplexityGeometryTask(GeometryTask):
    """Rolling perplexity per document plus the dispersion of the document's token vectors."""

    KIND = "perplexity"
    NEEDS_OUTPUT_TYPE = "loglikelihood_rolling"
    GEOMETRY_METRICS = metrics.PERPLEXITY_METRICS

    def _document_items(self, results: list) -> dict[str, Any]:
        (loglikelihood,) = results
        sums = getattr(loglikelihood, "geometry", {}).get(self.read)
        if sums is None:
            raise self._missing("this document")
        n_tokens = max(1, int(getattr(loglikelihood, "n_tokens", 0) or 0))
        return metrics.document_items(math.exp(-float(loglikelihood) / n_tokens), sums.dispersion())


session.install()
