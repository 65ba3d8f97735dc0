"""The peak memory a run reached, recorded in every command's output beside the ``--dry-run`` estimate
(docs/how-to/large-models.md): the process's peak resident memory and, on a GPU, the peak torch allocated on each
GPU the run used (a ``--device-map`` model's blocks, and their states, sit on several)."""

from __future__ import annotations

from typing import Any


def peak_memory(device: Any) -> dict[str, Any]:
    """``peak_rss_bytes``; when ``device`` is a GPU, ``cuda_max_memory_allocated_bytes`` (summed over the GPUs that
    allocated) and, for more than one, ``cuda_max_memory_allocated_bytes_per_device``."""
    import resource

    import torch

    out: dict[str, Any] = {"peak_rss_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024}
    if getattr(device, "type", str(device).partition(":")[0]) == "cuda" and torch.cuda.is_available():
        peaks = {f"cuda:{i}": int(torch.cuda.max_memory_allocated(i)) for i in range(torch.cuda.device_count())}
        peaks = {k: v for k, v in peaks.items() if v} or {str(device): 0}
        out["cuda_max_memory_allocated_bytes"] = sum(peaks.values())
        if len(peaks) > 1:
            out["cuda_max_memory_allocated_bytes_per_device"] = peaks
    return out


def describe(memory: dict[str, Any]) -> str:
    """One line for a console: ``peak memory: resident 1.2 GiB; GPU 3.4 GiB``."""
    from repgeom_eval.measurement.estimate import human

    line = f"peak memory: resident {human(memory['peak_rss_bytes'])}"
    if "cuda_max_memory_allocated_bytes" in memory:
        per = memory.get("cuda_max_memory_allocated_bytes_per_device")
        line += f"; GPU {human(memory['cuda_max_memory_allocated_bytes'])}" + (
            " (" + ", ".join(f"{k} {human(v)}" for k, v in per.items()) + ")" if per else "")
    return line


def memory_used(state: Any, device: Any) -> dict[str, int]:
    """What a run held: the bytes of its metric states (``RunState``; as ``--dry-run`` estimates them), and its
    peaks (:func:`peak_memory`)."""
    held = sum(m.state_bytes() for ms in state.states.values() for _, m in ms)  # in place: no copy of the states
    return {"state_bytes": int(held), **peak_memory(device)}
