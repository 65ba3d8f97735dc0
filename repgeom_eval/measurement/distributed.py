"""Data-parallel measurement on ``torch.distributed``: shard the work by rank, merge metric states exactly.

Started by ``torchrun --nproc-per-node N -m repgeom_eval measure ...`` or ``accelerate launch --num_processes N -m
repgeom_eval measure ...``: both set ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``, and the process group
is created here (gloo on CPU, nccl on GPU) unless the caller already created one. Every rank reads the same shards
and plans the same batches; batch ``b`` of a shard runs on rank ``b % world``, so each batch is padded exactly as in
a single-process run and the hidden states are the same. States are merged on rank 0 with
:meth:`repgeom_eval.Metric.merge` (sums add, ``cat`` states concatenate): metrics that need every vector gather
only their pooled vectors, never hidden states.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from repgeom_eval.spec.errors import RepgeomError, first_line


class RankStopped(RepgeomError):
    """This rank of a distributed run stopped because another one ended (or the launcher stopped the run)."""


@dataclass
class Distributed:
    """This process's place in the run. ``world == 1``: a plain single-process run (every method is a no-op)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    backend: str | None = None
    created_group: bool = False  # we created the process group, so we destroy it
    stopping: bool = False  # this rank has already said why it stops (a later SIGTERM ends it without a word)

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device: str | torch.device | None = "cpu") -> "Distributed":
        """Join the process group that torchrun / accelerate describe in the environment, if any."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)),
                       dist.get_backend())
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if world <= 1:
            return cls()
        if not dist.is_available():
            raise RepgeomError("WORLD_SIZE > 1 but this torch build has no torch.distributed support")
        missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise RepgeomError(f"WORLD_SIZE={world} is set but {', '.join(missing)} is not: start distributed runs "
                               "with torchrun or accelerate launch")
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        gpu = str(device).startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        backend = "nccl" if gpu else "gloo"
        if gpu:
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend)
        out = cls(dist.get_rank(), dist.get_world_size(), local_rank, backend, created_group=True)
        out.stop_on_sigterm()
        return out

    def stop_on_sigterm(self) -> None:
        """When a rank dies, torchrun stops the others with SIGTERM, which would end them without a word: each
        survivor says in one line why it stopped and how to continue (the checkpoint of every finished shard is
        intact: states are written atomically, and each rank's state holds only the batches it owns)."""
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return

        def stop(signum: int, frame: Any) -> None:
            # the line is already out (a dead peer's collective, an earlier signal) or the process is ending:
            # raising again would print a traceback from wherever the signal lands, even a finally block
            if self.stopping or sys.is_finalizing():
                os._exit(2)
            self.stopping = True
            raise RankStopped(f"rank {self.rank} of {self.world}: stopped by the launcher, after another rank ended "
                              f"(see its message); with --run-dir, every finished shard is kept: run the same "
                              f"command with --resume and the same number of processes")

        signal.signal(signal.SIGTERM, stop)

    def _collective(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        """A collective whose failure (a rank that died: gloo's 'Connection closed by peer') is one line."""
        try:
            return call(*args, **kwargs)
        except RuntimeError as exc:  # torch's DistBackendError derives from RuntimeError
            self.stopping = True  # the launcher's SIGTERM that follows must not raise a second time
            raise RankStopped(f"rank {self.rank} of {self.world}: another rank of the run is gone "
                              f"({first_line(exc)[:120]}); with --run-dir, every finished shard is kept: run the "
                              "same command with --resume and the same number of processes") from None

    def device(self, device: str | torch.device | None) -> str | torch.device | None:
        """One GPU per rank: ``cuda`` becomes ``cuda:LOCAL_RANK``."""
        if self.active and str(device) in ("cuda", "auto") and torch.cuda.is_available():
            return torch.device("cuda", self.local_rank)
        return device

    def owns(self, unit: int) -> bool:
        return unit % self.world == self.rank

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (in rank order); ``None`` on the other ranks."""
        if not self.active:
            return [obj]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world if self.is_main else None
        self._collective(dist.gather_object, obj, out, dst=0)
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on every rank (in rank order)."""
        return self._collective(all_gather, obj, self.world)

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            self._collective(dist.barrier)

    def close(self, clean: bool = False) -> None:
        """Destroy the process group this run created. ``clean``: every rank closes at this same point of a run that
        ended without an error, so first wait for them all, so that none tears its group down while another is still
        receiving from it (rank 1 of a gloo run, done after its part of the final gather, could otherwise abort in
        teardown)."""
        if self.created_group:
            import torch.distributed as dist

            if clean and self.active:
                with contextlib.suppress(RankStopped):  # another rank is gone: nothing left to wait for
                    self.barrier()
            dist.destroy_process_group()
            self.created_group = False

    def config(self) -> dict[str, Any]:
        return {"world_size": self.world, "backend": self.backend}


def all_gather(obj: Any, world_size: int, what: str = "the results") -> list[Any]:
    """Every rank's ``obj`` on every rank, in rank order; ``[obj]`` for one rank. A collective: every rank calls it,
    one with nothing to give passes ``None``. The one all-gather of the project: measure's ranks and lm-eval's
    accelerate ranks alike (``world_size`` as the caller's framework reports it). ``what`` names what is missing
    when ``torch.distributed`` is not initialised."""
    if world_size <= 1:
        return [obj]
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RepgeomError(f"{world_size} ranks are reported but torch.distributed is not initialised; {what} of "
                           "every rank are needed")
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out

