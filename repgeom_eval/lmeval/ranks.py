"""The processes lm-eval shards a run's documents across, as the project's
:class:`~repgeom_eval.measurement.distributed.Distributed`.

lm-eval reports its data-parallel world in ``Task.build_all_requests(world_size=...)``; under ``accelerate launch``
its ``Accelerator`` has created the ``torch.distributed`` process group, which :meth:`Distributed.from_env` joins
(it never creates one here). With one rank every collective is a no-op, also where a process group exists for
another reason (HFLM on CPU keeps each process at world size 1: each evaluates every document).
"""

from __future__ import annotations

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.measurement.distributed import Distributed


def lm_eval_ranks(world_size: int, needed: str) -> Distributed:
    """lm-eval's ``world_size`` ranks; ``needed`` says what the caller gathers, for the error when there is no
    process group to gather over."""
    if world_size <= 1:
        return Distributed()
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RepgeomError(f"lm-eval reports {world_size} ranks but torch.distributed is not initialised, and {needed}: "
                           "start data-parallel runs with accelerate launch")
    return Distributed.from_env()
