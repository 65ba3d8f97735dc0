"""One forward pass, hooks at every requested site, early stop after the last one fires.

Every requested address is read by a forward hook (module output) or forward pre-hook (module input). When the
caller does not need the model's outputs (no logits), the pass is stopped by an exception as soon as the last
requested tensor has been captured, so reading block 3 of a 30-block model costs 4 blocks (baukit's
``TraceDict(stop=True)``). The model itself is never truncated: truncation would apply the final norm to the
truncated layer.

For training (auxiliary losses on hidden states), ``Capture(model, points, keep_grad=True)`` keeps the captured
tensors attached to the autograd graph: install it around the ordinary forward pass that also computes the
cross-entropy, then read :meth:`Capture.tensors` — the hidden states of that same pass, no second forward.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch
from torch import nn

from repgeom_eval.modeling.hook_point import HookPoint  # noqa: F401  (re-exported: the hooks read it)


def output_tensor(value: Any) -> torch.Tensor:
    """The tensor a forward hook reads from a module's output: the output itself, the first element of a tuple
    (blocks return ``(hidden, attention_weights)``), or the first field of a ``ModelOutput``."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    if hasattr(value, "to_tuple"):  # a transformers ModelOutput
        return output_tensor(value.to_tuple())
    raise TypeError(f"cannot find a tensor in {type(value).__name__}")


def input_tensor(args: tuple, kwargs: dict) -> torch.Tensor:
    """The tensor a forward pre-hook reads from a module's input: the first positional tensor, else the
    ``hidden_states`` keyword (transformers 5 often passes it by keyword), else the first tensor keyword."""
    if args:
        return output_tensor(args)
    tensor = kwargs.get("hidden_states")
    if isinstance(tensor, torch.Tensor):
        return tensor
    for value in kwargs.values():
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError("no tensor among the module's inputs")


def _ask_hidden_states(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Pre-hook: make the module return its hidden_states, whoever calls it (lm-eval's own forward included)."""
    return args, {**kwargs, "output_hidden_states": True}


class _StopForward(Exception):
    """Raised inside a hook once every requested tensor is captured."""


class Capture:
    """Context manager that installs hooks for ``points`` on ``model``.

    Example::

        with Capture(model, points) as cap:
            tensors = cap.run(input_ids=ids, attention_mask=mask)   # {Address: [B, T, D]}

    With ``keep_grad=True`` the tensors are not detached and the caller runs the forward pass itself (a training
    step)::

        with Capture(model, points, stop_early=False, keep_grad=True) as cap:
            out = model(input_ids=ids, labels=ids)
            hidden = cap.tensors()                                  # part of out.loss's graph
    """

    def __init__(self, model: nn.Module, points: Mapping[Hashable, HookPoint], stop_early: bool = True,
                 keep_grad: bool = False, runner: nn.Module | None = None):
        if keep_grad and stop_early:
            raise ValueError("keep_grad=True is for training, which needs the whole forward pass: "
                             "pass stop_early=False")
        self.model = model
        self.runner = runner if runner is not None else model  # what run() calls (the encoder of a seq2seq model)
        self.points = dict(points)
        self.stop_early = stop_early
        self.keep_grad = keep_grad
        self._handles: list[Any] = []
        self._by_point: dict[HookPoint, list[Hashable]] = {}
        for addr, point in self.points.items():
            self._by_point.setdefault(point, []).append(addr)
        self._captured: dict[HookPoint, torch.Tensor | None] = {}
        self._calls: dict[HookPoint, int] = {}  # calls seen per point in this forward pass (HookPoint.call)
        self._batch_shape: tuple[int, ...] = ()
        self.outputs: Any = None
        #: when set, each captured tensor is handed to ``consume(addresses, tensor)`` as its hook fires, inside the
        #: pass, and is not kept: the caller's work on one address runs before the next block, so a pass holds one
        #: address's tensor rather than every address's (Forward's streamed batches)
        self.consume: Callable[[list[Hashable], torch.Tensor], None] | None = None

    def __enter__(self) -> "Capture":
        modules = dict(self.model.named_modules())
        try:
            # every pass starts afresh, whoever runs it: a second Capture's pass over the same model (lm-eval's extra
            # pass) must not leave this one's call counts (HookPoint.call) or tensors behind
            self._handles.append(self.runner.register_forward_pre_hook(self._new_pass))
            if any(p.flat for p in self._by_point):
                self._handles.append(self.runner.register_forward_pre_hook(self._batch_shape_hook, with_kwargs=True))
            for point in self._by_point:
                module = modules[point.module_name] if point.module_name else self.model
                if point.direction == "input":
                    handle = module.register_forward_pre_hook(self._pre_hook(point), with_kwargs=True)
                elif point.direction == "hidden_states":
                    self._handles.append(module.register_forward_pre_hook(_ask_hidden_states, with_kwargs=True))
                    handle = module.register_forward_hook(self._hidden_states_hook(point))
                else:
                    handle = module.register_forward_hook(self._post_hook(point))
                self._handles.append(handle)
        except BaseException:
            self.__exit__(None, None, None)  # __exit__ is not called when __enter__ raises
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _batch_shape_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        self._batch_shape = tuple(ids.shape[:2])

    def _new_pass(self, module: nn.Module, args: tuple) -> None:
        self._captured = {}
        self._calls = {}

    def _nth(self, point: HookPoint) -> bool:
        """Count this call of the point's module; True when it is the call the point reads."""
        seen = self._calls.get(point, 0)
        self._calls[point] = seen + 1
        return seen == point.call

    def _store(self, point: HookPoint, tensor: torch.Tensor) -> None:
        if point.flat and tensor.dim() == 2:
            tensor = tensor.reshape(*self._batch_shape, tensor.shape[-1])
        if point.copy:
            tensor = tensor.clone()
        tensor = tensor if self.keep_grad else tensor.detach()
        if self.consume is not None:
            # outside inference mode, as if it ran after the pass: states the work creates stay ordinary tensors
            with torch.inference_mode(False):
                self.consume(self._by_point[point], tensor)
            self._captured[point] = None  # fired (the missing-hook check and the early stop count it), not kept
        else:
            self._captured[point] = tensor
        if self.stop_early and len(self._captured) == len(self._by_point):
            raise _StopForward

    def _pre_hook(self, point: HookPoint):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._nth(point):
                self._store(point, input_tensor(args, kwargs))

        return hook

    def _post_hook(self, point: HookPoint):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self._nth(point):
                self._store(point, output_tensor(output))

        return hook

    def _hidden_states_hook(self, point: HookPoint):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self._nth(point):
                entry = output.hidden_states[point.index]
                self._store(point, entry[0] if isinstance(entry, (tuple, list)) else entry)  # PEGASUS-X pairs

        return hook

    def run(self, **inputs: Any) -> dict[Hashable, torch.Tensor]:
        """Run the model once; return the captured tensor of every address (and set ``self.outputs``).

        Runs under ``torch.inference_mode`` unless ``keep_grad`` is set.
        """
        self.clear()
        with torch.inference_mode(not self.keep_grad):
            try:
                self.outputs = self.runner(**inputs)
            except _StopForward:
                pass
        return self.tensors()

    def clear(self) -> None:
        """Forget what the previous forward pass captured."""
        self._captured = {}
        self._calls = {}
        self.outputs = None

    def tensors(self) -> dict[Hashable, torch.Tensor]:
        """The tensor of every address captured by the latest forward pass; an error names any that never fired."""
        missing = [str(a) for p, addrs in self._by_point.items() if p not in self._captured for a in addrs]
        self._calls = {}
        if missing:
            raise RuntimeError(f"hooks for {', '.join(missing)} never fired during the forward pass")
        out = {addr: self._captured[point] for addr, point in self.points.items()
               if self._captured[point] is not None}  # a consumed tensor was handed over, not kept
        self._captured = {}
        return out

    # For callers that run the model themselves inside ``with Capture(model, points, stop_early=False)`` (the
    # lm-eval integration reads the forward pass lm-eval makes): take what that pass captured.
    take = tensors
