"""An out-of-memory error during a run, as one line: the stage, the memory the states held, what to lower, and how
to resume (docs/how-to/large-models.md)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from repgeom_eval.spec.errors import RepgeomError

_MESSAGES = ("out of memory", "can't allocate memory", "cannot allocate memory")


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _MESSAGES))


@contextlib.contextmanager
def out_of_memory(stage: str, run: Any, n_texts: int) -> Iterator[None]:
    """Around one stage of a batch: an out-of-memory error becomes a RepgeomError naming the stage and the estimate."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - only memory errors are rewritten; anything else goes on as it was
        if not is_out_of_memory(exc):
            raise
        from repgeom_eval.measurement.estimate import human

        # read in place: copying every state (state_dict) is the last thing to do out of memory
        held = sum(m.state_bytes() for ms in run.state.states.values() for _, m in ms)
        resume = (f"; every finished shard is kept in {run.config.run_dir}: run the same command with --resume"
                  if run.config.run_dir else "; with --run-dir a run resumes after such an error")
        raise RepgeomError(f"out of memory in the {stage} of a batch of {n_texts} text(s) on {run.loaded.device} "
                           f"(metric states held: {human(held)}; repgeom measure --dry-run estimates them before a "
                           f"run): lower --batch-size or --max-length, measure fewer --layers or --metrics, or spread "
                           f"the model with --device-map auto{resume}") from None
