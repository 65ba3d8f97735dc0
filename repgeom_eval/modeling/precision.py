"""The precision the load check decides in (docs/metrics.md#how-an-address-is-found).

A half-precision model (bfloat16, float16: the usual dtypes on a GPU) cannot tell its own hidden states apart at the
resolution of its largest value: real models carry one or a few *massive* dimensions (SmolLM2's reaches about 10³
times the others), and a tolerance relative to that value calls two different blocks' outputs equal. So the probe runs
with the model's half-precision parameters and buffers upcast to float32, where every decision is the float32 one,
and casts them back afterwards. The round trip is exact (float32 holds every bfloat16 and float16 value), tensors
that were float32 already (rotary frequencies, ``_keep_in_fp32_modules``) are left alone, and the measurement then
runs in the dtype asked for.

Where the upcast cannot be done (a model spread over several devices or offloaded by accelerate, a quantized model,
or a float32 copy that does not fit the free memory), the probe runs in the model's own dtype and every equality is
decided per hidden dimension (:func:`repgeom_eval.modeling.probe.close`), so a massive dimension sets the tolerance of
its own channel only. The layout records which of the two decided.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

HALF = (torch.float16, torch.bfloat16)
_HEADROOM = 1.25  # free memory needed, as a multiple of what the float32 copies add


def half_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The model's bfloat16/float16 parameters and buffers, each once (tied weights are one tensor)."""
    seen: set[int] = set()
    out = []
    for t in [*model.parameters(), *model.buffers()]:
        if t.dtype in HALF and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def why_not_upcast(model: nn.Module, tensors: list[torch.Tensor]) -> str | None:
    """Why the model cannot be upcast for the probe, or None when it can."""
    if quantized(model):
        return "the model is quantized"
    if any(hasattr(m, "_hf_hook") for m in model.modules()):
        return "accelerate places its weights (a device map or offloading)"
    need: dict[torch.device, int] = {}
    for t in tensors:
        if t.device.type == "meta":
            return "some weights are on the meta device"
        need[t.device] = need.get(t.device, 0) + 2 * t.numel()  # float32 adds 2 bytes to every 2-byte element
    for device, extra in need.items():
        free = free_memory(device)
        if free is not None and free < _HEADROOM * extra:
            return (f"a float32 copy needs {extra / 2**30:.1f} GiB more on {device}, and {free / 2**30:.1f} GiB "
                    "is free")
    return None


def quantized(model: nn.Module) -> bool:
    """Weights kept in a quantized form (bitsandbytes, GPTQ, float8 ...). A GGUF file is de-quantized to plain
    tensors when it loads, so it does not count."""
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if quantizer is not None and str(getattr(method, "value", method)).lower() != "gguf":
        return True
    return any(not p.is_floating_point() or p.element_size() == 1 for p in model.parameters())


def free_memory(device: torch.device) -> int | None:
    """Free bytes on ``device`` (None when unknown)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        try:
            with open("/proc/meminfo", encoding="ascii") as fh:
                for line in fh:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


@contextlib.contextmanager
def probe_precision(model: nn.Module, upcast: bool = True) -> Iterator[str]:
    """Within the block the model's half-precision tensors are float32 (when ``upcast`` and possible). Yields how the
    probe decides, for the layout's notes; the tensors are cast back exactly afterwards, whatever happens."""
    tensors = half_tensors(model)
    if not tensors:
        yield ""
        return
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors})
    reason = why_not_upcast(model, tensors) if upcast else "the upcast was switched off"
    if reason is not None:
        yield (f"the load check ran in {'/'.join(dtypes)} ({reason}), deciding each equality per hidden dimension")
        return
    original = [(t, t.dtype) for t in tensors]
    try:
        for t, _ in original:
            t.data = t.data.float()
        yield f"the load check ran in float32 (the model's {'/'.join(dtypes)} weights upcast, then cast back)"
    finally:
        for t, dtype in original:
            t.data = t.data.to(dtype)
