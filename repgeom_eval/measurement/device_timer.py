"""The GPU's own time of each stage of the hot loop (the forward, the metric updates), read without waiting.

On a GPU the forward and the metric updates are queued and the host runs ahead, so the host's timers
(``timings.forward_s``, ``metrics_s``) charge the device's time to whichever stage the host happens to wait in. CUDA
events recorded on the model's stream between the stages measure the device's own timeline instead; each pair is read
once its end has completed (``Event.query``, which does not wait) and the rest when the run ends
(docs/how-to/large-models.md#timings-on-a-gpu). Only for a model on one GPU: a ``--device-map`` model's blocks run
on several streams, which one device's events do not see.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable


class DeviceTimer:
    """``mark(stage)`` records an event; the device time since the previous mark is charged to ``stage`` (``None``
    charges it to nothing: the gap between batches). ``seconds()`` waits for the last event and returns the totals."""

    def __init__(self, new_event: Callable[[], Any], record: Callable[[Any], None]):
        self._new_event, self._record = new_event, record
        self._last: Any = None
        self._pending: deque = deque()  # (stage, start, end) not yet read
        self.totals: dict[str, float] = {}

    @classmethod
    def for_model(cls, loaded: Any) -> DeviceTimer | NoDeviceTimer:
        """A timer on the model's GPU stream; on the CPU and for a model spread over several devices, one that
        records nothing."""
        import torch

        device = loaded.device
        spread = {str(v) for v in (getattr(loaded.model, "hf_device_map", None) or {}).values()}
        if getattr(device, "type", None) != "cuda" or len(spread) > 1 or not torch.cuda.is_available():
            return NO_DEVICE_TIMER
        stream = torch.cuda.current_stream(device)
        return cls(lambda: torch.cuda.Event(enable_timing=True), lambda event: event.record(stream))

    def mark(self, stage: str | None) -> None:
        event = self._new_event()
        self._record(event)
        if stage is not None and self._last is not None:
            self._pending.append((stage, self._last, event))
        self._last = event
        self._read(wait=False)

    def _read(self, wait: bool) -> None:
        while self._pending:
            stage, start, end = self._pending[0]
            if wait:
                end.synchronize()
            elif not end.query():  # later pairs finish later on the one stream: stop at the first unfinished
                return
            self.totals[stage] = self.totals.get(stage, 0.0) + start.elapsed_time(end) / 1e3  # ms → s
            self._pending.popleft()

    def reset(self) -> None:
        """Forget everything so far (the engine's preprocessing pass is not the measured one)."""
        self._last, self.totals = None, {}
        self._pending.clear()

    def seconds(self) -> dict[str, float]:
        """Every stage's device seconds so far (waits for the events not yet finished: call it at the end)."""
        self._read(wait=True)
        return dict(self.totals)


class NoDeviceTimer:
    """The timer of a run without one GPU: records nothing, reports nothing."""

    def mark(self, stage: str | None) -> None:
        """Nothing to record: no single GPU stream to put an event on."""

    def reset(self) -> None:
        """Nothing recorded, nothing to forget."""

    def seconds(self) -> dict[str, float]:
        return {}


NO_DEVICE_TIMER = NoDeviceTimer()
