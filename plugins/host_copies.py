"""States that grow with the data and so live in host memory, copied there from a GPU without making the host wait
(docs/how-to/large-models.md#host-synchronisations): a plain ``.cpu()`` per batch would wait for the device every
batch. The copies go into pinned memory (``non_blocking``) and are waited for, on every GPU they came from, only
when the kept tensors are read: a metric's compute, a checkpoint, a merge."""

from __future__ import annotations

from typing import Any

from repgeom_eval.plugin_system.lazy import lazy

torch = lazy("torch")


class HostCopies:
    """Mixin for a :class:`~repgeom_eval.Metric` with host-memory states (``state_device = "cpu"``): append
    ``self._to_host(t)`` to them in ``update``, and call ``self._settle()`` before reading them in ``compute``
    (``state_dict`` and ``merge`` do it themselves)."""

    def _to_host(self, t: "torch.Tensor") -> "torch.Tensor":
        """``t`` in host memory: itself on the CPU, else a copy queued into pinned memory (the host goes on)."""
        if t.device.type == "cpu":
            return t
        # the devices copied from: a model split over GPUs (--device-map) sends each address's vectors from its own
        self._copying = getattr(self, "_copying", set()) | {t.device}
        return t.to("cpu", non_blocking=True)

    def _settle(self) -> None:
        """Wait for the copies :meth:`_to_host` queued, on every device they came from."""
        devices = getattr(self, "_copying", set())
        if devices and torch.cuda.is_available():
            for device in sorted(devices, key=str):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
        self._copying = set()

    def state_dict(self, copy: bool = True) -> Any:
        self._settle()
        return super().state_dict(copy)  # type: ignore[misc]

    def merge(self, other: Any) -> Any:
        self._settle()
        if isinstance(other, HostCopies):
            other._settle()
        return super().merge(other)  # type: ignore[misc]
