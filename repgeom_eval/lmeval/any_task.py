"""Geometry rows for every task of a ``--model repgeom-hf`` run: lm-eval's own tasks, groups, a user's YAML.

``lm_eval --model repgeom-hf --model_args pretrained=M,repgeom_metrics=dispersion --tasks arc_easy,my_task``: every
task that is not a repgeom task gets, next to its own metrics, the registered metrics of ``repgeom_metrics`` at
``repgeom_layers``, computed from the run's own forward passes (docs/lmeval.md#any-task). The repgeom tasks read the
same settings themselves (:mod:`repgeom_eval.lmeval.task`).

What one text is, per document (its index is the ``doc_id``), by the task's output type:

* ``multiple_choice`` and ``loglikelihood``: the context of the document's first request, as lm-eval scored it
  (its tokenization, left-truncated to the model length): the population rule of the hardness tasks;
* ``loglikelihood_rolling``: the positions whose next token lm-eval scores, over all rolling windows;
* ``generate_until``: the prompt (the context of the first request), encoded as ``generate_until`` encodes it, in
  one forward pass of its own (generation batches prompts with left padding; they are run again as texts).

An adopted task is lm-eval's own instance with three instance attributes shadowing its methods for the run
(``apply_filters``, ``process_results``, ``aggregation``): removed again when the run ends.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.lmeval.registered import MetricRequest, TaskBank
from repgeom_eval.spec.options.lmeval import PREFIX, Settings

_SHADOWED = ("apply_filters", "process_results")


def run_metadata(lm: Any) -> dict[str, Any] | None:
    """The ``repgeom_*`` model arguments of a ``repgeom-hf`` model (None for any other model)."""
    return getattr(lm, "repgeom_metadata", None)


def all_tasks(task_dict: Any) -> list:
    """Every task object of a run (``TaskManager.load()`` result or lm-eval's older nested dict)."""
    from lm_eval.api.task import Task

    found: list = []

    def walk(obj: Any) -> None:
        if isinstance(obj, Task):
            if all(obj is not t for t in found):
                found.append(obj)
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value)

    walk(task_dict["tasks"] if isinstance(task_dict, dict) and "tasks" in task_dict else task_dict)
    return found


def _doc_key(doc: Any) -> bytes:
    """A document's identity for ``process_results``, which receives the document but not its ``doc_id``."""
    text = json.dumps(doc, sort_keys=True, default=str) if isinstance(doc, dict) else repr(doc)
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class AdoptedTask:
    """One lm-eval task with the registered metrics of a ``repgeom-hf`` run added."""

    def __init__(self, task: Any, model_metadata: dict[str, Any], world_size: int = 1):
        self.task = task
        self.world_size = world_size
        metadata = dict(task.config.metadata or {}) if isinstance(task.config.metadata, dict) else {}
        given = {**model_metadata, **{k: v for k, v in metadata.items() if k.startswith(PREFIX)}}
        self.settings = Settings.from_metadata(given, "any")
        self.request = MetricRequest.from_settings(self.settings)
        self.output_type = task.OUTPUT_TYPE
        kind = "document" if self.output_type == "loglikelihood_rolling" else "context"
        self.bank = TaskBank(task.config.task, self.request, kind) if self.request is not None else None
        if self.bank is not None:
            self.bank.generation = self.output_type == "generate_until"
        self._doc_ids: dict[bytes, int] = {}
        self._added: list[str] = []

    @property
    def name(self) -> str:
        return self.task.config.task

    def _bypassed(self) -> bool:
        return "bypass" in getattr(self.task, "_metric_fn_list", {})

    # -- the run -----------------------------------------------------------------------------------------------------
    def attach(self, capture: dict[str, Any]) -> None:
        """Shadow the task's methods for the run; ``capture``: how the states were obtained (recorded)."""
        original_filters, original_results = self.task.apply_filters, self.task.process_results

        def apply_filters(*args: Any, **kwargs: Any):
            out = original_filters(*args, **kwargs)
            self.finish()
            return out

        def process_results(doc: Any, results: list) -> dict[str, Any]:
            return {**original_results(doc, results), **self.items(doc)}

        self.task.apply_filters, self.task.process_results = apply_filters, process_results
        record = {"population": self.population(), **self.request.record(), **self.bank.record(), **capture}
        if isinstance(self.task.config.metadata, dict):
            self.task.config.metadata["repgeom"] = record
        else:
            self.task.config.metadata = {"repgeom": record}

    def detach(self) -> None:
        for name in _SHADOWED:
            self.task.__dict__.pop(name, None)
        for name in self._added:
            self.task._aggregation_list.pop(name, None)
            self.task._higher_is_better.pop(name, None)

    def population(self) -> str:
        return {"loglikelihood_rolling": "document: scored positions of every rolling window",
                "generate_until": "document: the prompt of its first request (one forward pass of its own)"}.get(
            self.output_type, "document: the context of its first request, as lm-eval scored it")

    def finish(self) -> None:
        """After lm-eval's filters (every rank, in the same order): merge the states, compute, register the rows."""
        if self._bypassed():
            return
        instances = list(self.task.instances or [])
        missing = self.bank.missing([int(inst.doc_id) for inst in instances])
        if missing:
            raise RepgeomError(f"task {self.name}: no hidden states reached the registered metrics (repgeom_metrics) "
                               f"of documents {missing[:5]}; run without --use_cache on a Hugging Face model")
        self.bank.finish(self.world_size)
        for name, aggregation in self.bank.aggregations.items():
            self.task._aggregation_list[name] = aggregation
            self.task._higher_is_better[name] = None
            self._added.append(name)
        for inst in instances:
            self._doc_ids.setdefault(_doc_key(inst.doc), int(inst.doc_id))

    def items(self, doc: Any) -> dict[str, Any]:
        if self._bypassed():
            return {}
        doc_id = self._doc_ids.get(_doc_key(doc))
        if doc_id is None:
            raise RepgeomError(f"task {self.name}: a document reached scoring that the registered metrics never saw")
        return self.bank.items(doc_id)


def adopt(task_dict: Any, lm: Any, geometry: list) -> list[AdoptedTask]:
    """The tasks of a ``repgeom-hf`` run that are not repgeom tasks, with registered metrics requested."""
    metadata = run_metadata(lm)
    if metadata is None:
        return []
    out = []
    for task in all_tasks(task_dict):
        if any(task is g for g in geometry):
            continue
        adopted = AdoptedTask(task, metadata, int(getattr(lm, "world_size", 1) or 1))
        if adopted.bank is not None:
            out.append(adopted)
    return out
