"""prompt_entropy's per-text spectra on the host's cores (``spectra: host``), beside the GPU's next batches.

On a GPU, ``torch.linalg.eigvalsh`` hands cuSOLVER one matrix at a time above 32×32 and waits for each one's status,
so at α ≠ 2 a batch's per-text spectra can cost more than the forward pass (docs/how-to/large-models.md). This route
computes each batch's Grams on the GPU as usual, queues their copy into pinned host memory, and solves them on a pool
of threads, one LAPACK thread and one batch of Grams each, while the host goes on feeding the GPU. The results are
folded into the metric's states, in order, when they are read (a result, a checkpoint, a merge). At most two batches
of Grams per worker are in host memory at once, over all addresses: past that, the next batch waits for the oldest
solve to finish (so a host slower than the GPU holds the GPU back instead of filling memory). The values are those of
the default route: the same float64 eigenvalue solver on the same Grams (on a CPU within 1e-12,
tests/test_host_spectra.py; against cuSOLVER, within the solvers' round-off).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from repgeom_eval.plugin_system.lazy import lazy

torch = lazy("torch")

_POOL: ThreadPoolExecutor | None = None
_SLOTS: threading.BoundedSemaphore | None = None  # batches of Grams allowed in host memory at once
_POOL_LOCK = threading.Lock()
_in_flight = 0  # batches submitted and not yet solved (for the tests)


def workers() -> int:
    """Threads of the pool: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def in_flight() -> int:
    """Batches whose Grams are in host memory, waiting for or in a solve."""
    return _in_flight


def pool() -> ThreadPoolExecutor:
    """The process's one pool, made on first use. Each worker runs LAPACK on one thread: the OpenMP thread count is
    per thread, and unset each solve would start a team of its own that competes with the others (on 2 cores,
    512×512 float64 solves took 11.8 ms each that way against 5.5 ms; benchmarks/gpu_check.py)."""
    global _POOL, _SLOTS
    with _POOL_LOCK:
        if _POOL is None:
            n = workers()
            _POOL = ThreadPoolExecutor(n, thread_name_prefix="repgeom-spectra", initializer=torch.set_num_threads,
                                       initargs=(1,))
            _SLOTS = threading.BoundedSemaphore(2 * n)
        return _POOL


def submit(block: Any, alpha: float, variant: str) -> Future:
    """Queue the spectra of one TokenBlock's texts; the future's result is prompt_entropies' [B, 4] float64 rows,
    in host memory."""
    global _in_flight
    from repgeom_eval.functional.entropy import prompt_grams

    executor = pool()
    _SLOTS.acquire()  # type: ignore[union-attr]  # released when this batch's solve ends
    with _POOL_LOCK:
        _in_flight += 1
    try:
        grams = prompt_grams(block)
        ready = None
        if grams.lengths.device.type == "cuda":
            grams = grams.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(block.hidden.device))
        return executor.submit(_solve, grams, alpha, variant, ready)
    except BaseException:  # nothing was queued: give the slot back
        _release()
        raise


def _release() -> None:
    global _in_flight
    with _POOL_LOCK:
        _in_flight -= 1
    _SLOTS.release()  # type: ignore[union-attr]


def _solve(grams: Any, alpha: float, variant: str, ready: Any) -> Any:
    try:
        if ready is not None:
            ready.synchronize()  # the copies into pinned memory have landed (waits in this worker, not the host)
        with torch.inference_mode():
            return grams.entropies(alpha, variant)
    finally:
        del grams  # this worker's reference; the executor drops its own as the task returns, just after
        _release()
