"""Where a tensor is read: the one "where to read" type below an :class:`~repgeom_eval.modeling.addresses.Address`
(an address names a site; a hook point is the module input or output that site resolves to). Torch-free, so that
architecture tables can be declared by plugins that import only :mod:`repgeom_eval`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class HookPoint:
    """A concrete place to read a tensor, by qualified module name inside the model (found and checked by
    :mod:`repgeom_eval.modeling.discovery`). In an architecture table (:class:`~repgeom_eval.ArchitectureSpec`)
    ``module_name`` is relative to one block ("" = the block itself).

    ``direction``: ``"input"`` or ``"output"`` of the module, or ``"hidden_states"``: entry ``index`` of the
    ``hidden_states`` the module returns (models whose blocks cannot be hooked one by one).
    """

    module_name: str
    direction: str
    index: int | None = None
    # which call of the module in one forward pass (0 = the first): a module can run more than once (nanochat's one
    # norm module normalises the embeddings and, later, the last block's output)
    call: int = 0
    # the model changes this tensor in place later in its forward pass (Falcon adds attention into the MLP's
    # output): the hook keeps a copy of it as it was
    copy: bool = field(default=False, compare=False)
    # the module sees the tokens flattened to [B*T, D] (OPT's feed-forward): the hook restores [B, T, D]
    flat: bool = field(default=False, compare=False)

    def __str__(self) -> str:
        where = self.module_name or "<model>"
        if self.direction == "hidden_states":
            return f"hidden_states[{self.index}] of {where}"
        nth = f" (call {self.call + 1})" if self.call else ""
        return f"{self.direction} of {where}{nth}"
