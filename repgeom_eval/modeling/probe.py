"""The load check's probe: one forward pass of random token ids with every module hooked, recording what each hook
would read (a copy taken when it fires, whether the model later changed it in place, which call of the module it
was), and the forward keyword arguments of a pass (the only place they are built)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from repgeom_eval.modeling.hooks import HookPoint, input_tensor, output_tensor


class Recorded:
    """A tensor a hook would read, copied to the host when the hook fired (so that discovery's arithmetic never mixes
    devices: a model on a GPU, or split over several), with a linear fingerprint for fast matching and whether the
    model changed the original in place afterwards."""

    __slots__ = ("t", "fp", "live", "version", "flat")

    def __init__(self, tensor: torch.Tensor):
        self.t = tensor.detach().to("cpu", copy=True)
        self.fp: torch.Tensor | None = None
        self.live, self.version = tensor, tensor._version
        self.flat = False

    @property
    def changed(self) -> bool:
        return self.live._version != self.version


@dataclass
class Call:
    name: str
    module: nn.Module
    start: int
    ordinal: int = 0  # earlier calls of the same module in this forward pass
    end: int = -1
    inp: Recorded | None = None
    out: Recorded | None = None
    last_hidden_state: torch.Tensor | None = None

    def inside(self, other: "Call") -> bool:
        return other.start <= self.start and self.end <= other.end


class Recorder:
    """Hooks on every module: the order of calls and the tensor a Capture hook would read at each input/output."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.calls: list[Call] = []
        self._open: dict[int, list[Call]] = {}
        self._count: dict[int, int] = {}
        self._tick = 0
        self._handles: list[Any] = []

    def __enter__(self) -> "Recorder":
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(name), always_call=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self._tick += 1
            call = Call(name, module, self._tick, self._count.get(id(module), 0))
            self._count[id(module)] = call.ordinal + 1
            try:
                call.inp = Recorded(input_tensor(args, kwargs))
            except (TypeError, StopIteration):
                pass  # no tensor input (a module called with none): nothing of it can be a site
            self.calls.append(call)
            self._open.setdefault(id(module), []).append(call)

        return hook

    def _post(self, name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self._tick += 1
            stack = self._open.get(id(module))
            if not stack:
                return
            call = stack.pop()
            call.end = self._tick
            try:
                call.out = Recorded(output_tensor(output))
            except (TypeError, IndexError):
                pass  # no tensor output: nothing of it can be a site
            lhs = getattr(output, "last_hidden_state", None)
            if isinstance(lhs, torch.Tensor):
                call.last_hidden_state = lhs.detach().cpu()

        return hook

    def of(self, module: nn.Module) -> list[Call]:
        return [c for c in self.calls if c.module is module and c.end >= 0]


HALF = (torch.float16, torch.bfloat16)

Scale = "float | torch.Tensor"  # one magnitude, or one per hidden dimension (half precision)


def tolerance(t: torch.Tensor) -> float:
    return 2e-2 if t.dtype in HALF else 1e-5


def scale_of(*ts: torch.Tensor) -> "float | torch.Tensor":
    """The magnitude an equality of sums of ``ts`` is judged against: their largest value in float32/float64, and in
    half precision the largest value of each hidden dimension (last axis), at least 1e-3 of the overall largest, so
    that a massive dimension widens the tolerance of its own channel only (docs/metrics.md#how-an-address-is-found)."""
    if not any(t.dtype in HALF for t in ts):
        return magnitude(*ts)
    width = ts[0].shape[-1]
    per_dim = torch.stack([t.detach().double().abs().reshape(-1, width).amax(0) for t in ts]).amax(0)
    return per_dim.clamp_min(1e-3 * float(per_dim.max()) + 1e-30)


def close(a: "torch.Tensor | Recorded | None", b: "torch.Tensor | Recorded | None",
          scale: "float | torch.Tensor | None" = None) -> bool:
    """Equal up to the rounding of a few additions in the tensors' dtype: relative to the largest magnitude in
    float32/float64, per hidden dimension in half precision (:func:`scale_of`)."""
    a = a.t if isinstance(a, Recorded) else a
    b = b.t if isinstance(b, Recorded) else b
    if a is None or b is None or a.shape != b.shape:
        return False
    if a is b or a.numel() == 0:
        return True
    a64, b64 = a.detach().double(), b.detach().double()
    if not (torch.isfinite(a64).all() and torch.isfinite(b64).all()):
        return False
    tol = max(tolerance(a), tolerance(b))
    if scale is None:
        scale = scale_of(a, b)
    if isinstance(scale, torch.Tensor):
        if scale.shape[-1] != a64.shape[-1]:
            return False
        return bool(((a64 - b64).abs() <= tol * scale.to(a64.device)).all())
    return float((a64 - b64).abs().max()) <= tol * max(scale, 1e-30)


def magnitude(*ts: torch.Tensor) -> float:
    return max(float(t.detach().double().abs().max()) for t in ts)


def probe_ids(model: nn.Module, config: Any, rows: int = 2, length: int = 7, seed: int = 0) -> torch.Tensor:
    """Random token ids (no special tokens), the same every time."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None) or getattr(config, "vocab_size", None) or 256
    special: set[int] = set()
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id", "sep_token_id", "cls_token_id",
                "decoder_start_token_id"):
        value = getattr(config, key, None)
        special.update(v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, int))
    pool = [i for i in range(min(int(vocab), 4096)) if i not in special][8:] or list(range(int(vocab)))
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(pool), (rows, length), generator=g)
    return torch.tensor(pool)[picks]


# -- what the runner accepts -------------------------------------------------------------------------------------------

def accepted_inputs(module: nn.Module) -> frozenset[str]:
    """The keyword arguments a module's forward names, plus ``"**"`` when it also takes ``**kwargs``."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return frozenset()
    names = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        names.add("**")
    return frozenset(names)


def build_inputs(device: torch.device, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 accepted: frozenset[str] = frozenset(), position_ids: bool = False,
                 **extra: torch.Tensor) -> dict[str, Any]:
    """The keyword arguments of one forward pass — the only place they are built: ``position_ids = cumsum(mask) - 1``
    where the load check showed they reproduce the model's own positions (so left padding does not shift them),
    ``use_cache=False`` where the forward takes it (no key/value cache is built), and of the ``extra`` inputs (such as
    ``token_type_ids``) only those the forward names (``accepted``; empty: all)."""

    def takes(name: str) -> bool:
        return not accepted or name in accepted

    # non_blocking: a copy from the host that does not wait for the work already queued on a GPU
    inputs: dict[str, Any] = {"input_ids": input_ids.to(device, non_blocking=True)}
    inputs.update({k: v.to(device, non_blocking=True) for k, v in extra.items() if takes(k)})
    if attention_mask is not None:
        inputs["attention_mask"] = attention_mask.to(device, non_blocking=True)
        if position_ids:
            inputs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0).to(device, non_blocking=True)
    if "use_cache" in accepted or "**" in accepted:  # Granite-MoE-hybrid takes it through **kwargs
        inputs["use_cache"] = False
    return inputs


def hidden_states_of(output: Any) -> tuple[torch.Tensor, ...]:
    """The ``hidden_states`` a forward pass returned, one tensor each (PEGASUS-X pairs each entry with its global
    tokens: the tokens come first); empty when there are none."""
    hidden = getattr(output, "hidden_states", None)
    if not isinstance(hidden, (tuple, list)):
        return ()
    hidden = [h[0] if isinstance(h, (tuple, list)) and h and isinstance(h[0], torch.Tensor) else h for h in hidden]
    return tuple(h.detach() for h in hidden) if all(isinstance(h, torch.Tensor) for h in hidden) else ()


def few_logits(accepted: frozenset[str]) -> dict[str, int]:
    """The probe needs hidden states, not a vocabulary-sized output at every token (SmolLM2's LM head is 49152 x 576)."""
    return {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}


def point_of(call: Call, direction: str) -> HookPoint:
    t = call.inp if direction == "input" else call.out
    return HookPoint(call.name, direction, call=call.ordinal, copy=bool(t is not None and t.changed),
                     flat=bool(t is not None and t.flat))


def call_of(rec: Recorder, model: nn.Module, point: HookPoint | None) -> Call | None:
    if point is None or point.direction == "hidden_states":
        return None
    try:
        module = model.get_submodule(point.module_name) if point.module_name else model
    except AttributeError:
        return None
    calls = rec.of(module)
    return calls[point.call] if point.call < len(calls) else None


def tensor_at(rec: Recorder, model: nn.Module, point: HookPoint | None) -> Recorded | None:
    call = call_of(rec, model, point)
    if call is None:
        return None
    return call.inp if point.direction == "input" else call.out


def input_device(model: Any) -> torch.device:
    """Where a model's inputs go: its parameters' device, or for a model dispatched by accelerate (``device_map``,
    with parts offloaded to CPU or disk, whose parameters may sit on the meta device) the first device its map
    names; accelerate's hooks move every block's inputs to where that block runs."""
    device_map = getattr(model, "hf_device_map", None) or {}
    for where in device_map.values():
        if where not in ("cpu", "disk", "meta"):
            return torch.device(f"cuda:{where}" if isinstance(where, int) else where)
    param = next(model.parameters(), None)
    if device_map or param is None or param.device.type == "meta":
        return torch.device("cpu")
    return param.device
