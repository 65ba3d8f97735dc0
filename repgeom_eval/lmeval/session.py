"""Runs that include repgeom tasks read hidden states; every other run is left exactly as lm-eval makes it.

:func:`install` wraps ``lm_eval.evaluator.evaluate`` (once; the task module calls it on import). The wrapper looks
at the run's tasks: without a repgeom task it calls lm-eval's function unchanged. With one, it checks the model
before any compute is spent and fails loudly instead of producing a silently missing metric:

* ``--use_cache`` (lm-eval's ``CachingLM``) answers requests from a database without running the model;
* a backend that is not ``HFLM`` (vLLM, APIs, GGUF servers, …) has no hidden states to read;
* a seq2seq model has no single "last context token" in the decoder;

then resolves what each task reads on the model (its ``repgeom_layer`` address and pooling) and reads the hidden
states of HFLM's own forward passes for the duration of the run (:class:`~repgeom_eval.lmeval.fused.HiddenStates`).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..spec.errors import RepgeomError


def install() -> None:
    """Wrap ``lm_eval.evaluator.evaluate`` now, or as soon as that module is imported."""
    from _repgeom_lm_eval_hook import when_imported

    when_imported("lm_eval.evaluator", _wrap_evaluate)


def _wrap_evaluate(module: Any) -> None:
    original = module.evaluate
    if getattr(original, "_repgeom_wrapped", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def evaluate(*args: Any, **kwargs: Any):
        bound = signature.bind_partial(*args, **kwargs).arguments
        lm = bound.get("lm")
        tasks = geometry_tasks(bound.get("task_dict"))
        adopted: list = []
        if getattr(getattr(lm, "lm", lm), "repgeom_metadata", None) is not None:  # repgeom-hf (CachingLM wraps it)
            from repgeom_eval.lmeval.any_task import adopt

            adopted = adopt(bound.get("task_dict"), getattr(lm, "lm", lm), tasks)
        if not tasks and not adopted:
            return original(*args, **kwargs)
        with hidden_states_for(lm, tasks, adopted):
            out = original(*args, **kwargs)
        return with_memory(with_warnings(out, tasks, adopted), lm, tasks, adopted)

    evaluate._repgeom_wrapped = True  # type: ignore[attr-defined]
    module.evaluate = evaluate


def geometry_tasks(task_dict: Any) -> list:
    """The repgeom tasks of a run (``TaskManager.load()`` result or lm-eval's older nested dict): the tasks that
    carry repgeom :class:`~repgeom_eval.spec.options.lmeval.Settings` (``task.GeometryTask`` and its subclasses; that
    module imports this one to install the wrapper, so the tasks are recognised by what they carry)."""
    from repgeom_eval.spec.options.lmeval import Settings

    found: list = []

    def walk(obj: Any) -> None:
        if isinstance(getattr(obj, "settings", None), Settings):
            if all(obj is not t for t in found):
                found.append(obj)
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value)

    if isinstance(task_dict, dict) and "tasks" in task_dict:
        walk(task_dict["tasks"])
    else:
        walk(task_dict)
    return found


def check_model(lm: Any) -> Any:
    """The HFLM to read hidden states from, or a RepgeomError saying why there is none."""
    from lm_eval.api.model import CachingLM
    from lm_eval.models.huggingface import HFLM

    if isinstance(lm, CachingLM):
        raise RepgeomError("repgeom_* tasks cannot run with --use_cache: cached answers skip the forward pass that "
                           "the geometry metrics read, so they would be missing; run without --use_cache")
    if not isinstance(lm, HFLM):
        raise RepgeomError(f"repgeom_* tasks read hidden states of a Hugging Face model; the {type(lm).__name__} "
                           "backend has none. Use --model hf (or repgeom-hf)")
    if getattr(lm, "backend", "causal") != "causal":
        raise RepgeomError(f"repgeom_* tasks need a decoder-only (causal) model; this one is {lm.backend}")
    return lm


def with_warnings(out: Any, tasks: list, adopted: list) -> Any:
    """What ``repgeom measure`` would warn about the registered metrics' numbers (degenerate values, a massive
    dimension; :mod:`repgeom_eval.lmeval.diagnostics`): into lm-eval's log, and into the results as
    ``repgeom_warnings`` (task → lines; present whenever registered metrics ran)."""
    import logging

    banks = [(t.config.task, t.bank) for t in tasks if t.bank is not None] + [(a.name, a.bank) for a in adopted]
    if not banks:
        return out
    said = {name: list(bank.warnings) for name, bank in banks if bank.warnings}
    logger = logging.getLogger("lm_eval.repgeom")
    for name, lines in said.items():
        for line in lines:
            logger.warning("repgeom (task %s): %s", name, line)
    if isinstance(out, dict):
        out["repgeom_warnings"] = said
    return out


def with_memory(out: Any, lm: Any, tasks: list, adopted: list) -> Any:
    """What the registered metrics held and the run's peaks, into the results as ``repgeom_memory``
    (``state_bytes``, ``peak_rss_bytes``, on a GPU ``cuda_max_memory_allocated_bytes``), as ``repgeom measure``
    records them in its timings: the figures to hold against ``repgeom measure --dry-run`` (docs/lmeval.md)."""
    from repgeom_eval.measurement.memory import peak_memory
    from repgeom_eval.modeling.probe import input_device

    banks = [t.bank.bank for t in tasks if t.bank is not None] + [a.bank.bank for a in adopted]
    held = sum(m.state_bytes() for bank in banks if bank is not None for ms in bank.states.values() for _, m in ms)
    model = getattr(getattr(lm, "lm", lm), "model", None)
    if isinstance(out, dict):
        out["repgeom_memory"] = {"state_bytes": int(held),
                                 **peak_memory(input_device(model) if model is not None else "cpu")}
    return out


@contextmanager
def hidden_states_for(lm: Any, tasks: list, adopted: list = ()) -> Iterator[Any]:
    """Attach what ``tasks`` read to ``lm``'s results for the duration of the block, and add the registered
    metrics to the ``adopted`` tasks (:mod:`repgeom_eval.lmeval.any_task`)."""
    from repgeom_eval.lmeval.fused import HiddenStates, resolve_layer
    from repgeom_eval.lmeval.registered import TaskBank
    from repgeom_eval.modeling.loading import wrap_model

    check_model(lm)
    loaded = wrap_model(lm.model, getattr(lm, "tokenizer", None), source="lm-eval")
    reads = {id(t): (resolve_layer(t.settings.layer, loaded), t.settings.read_pooling(t.KIND)) for t in tasks}
    method = "extra" if any(t.settings.capture == "extra" for t in tasks) else "fused"
    banks = {t.config.task: TaskBank(t.config.task, t.metric_request, "document" if t.KIND == "perplexity"
                                     else "context") for t in tasks if t.metric_request is not None}
    banks.update({a.name: a.bank for a in adopted})
    if any(a.settings.capture == "extra" for a in adopted):
        method = "extra"
    with HiddenStates(lm, loaded, reads.values(), method=method, banks=banks) as states:
        for a in adopted:
            a.attach({"capture": states.method, **({"fused_disabled_because": states.reason} if states.reason
                                                   else {})})
        for task in tasks:
            task.read = reads[id(task)]
            task.bank = banks.get(task.config.task)
            task.record_capture({"address": str(task.read[0]), "capture": states.method,
                                 **({"fused_disabled_because": states.reason} if states.reason else {}),
                                 **(task.bank.record() if task.bank is not None else {})})
        try:
            yield states
        finally:
            for a in adopted:
                a.detach()
    if states.method == "fused" and states.extra_requests:
        warnings.warn(f"repgeom: {states.extra_requests} requests needed an extra forward pass", RuntimeWarning,
                      stacklevel=3)
