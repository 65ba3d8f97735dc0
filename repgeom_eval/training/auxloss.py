"""Auxiliary training losses on hidden states: the interface every aux-loss plugin implements, and building one
from a config mapping.

The shape follows sentence-transformers' losses: the object *gathers* its inputs (the hidden states of the layer
addresses it declares, the attention mask, the per-example domain labels) and hands each layer's tensor to a pure
function of tensors (:mod:`repgeom_eval.functional.losses`); :meth:`AuxLoss.get_config_dict` records the
hyper-parameters. The trainer (:mod:`repgeom_eval.training.trainer`) captures the declared addresses in the same forward
pass that computes the cross-entropy and minimizes ``L_CE + weight · L_aux``.

Aux losses are plugins (``repgeom_register_aux_losses``); ``repgeom plugins`` lists them. This module imports
nothing of the plugin host at module level (``build_aux_loss`` looks the host up when it is called), so that the
host may check a registered class without an import cycle.
"""

from __future__ import annotations

import abc
import inspect
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.plugin_system.lazy import lazy

# Imported on first use: the aux-loss plugin subclasses AuxLoss while `repgeom plugins` runs, which needs no torch.
torch = lazy("torch")
parse_request = lazy("repgeom_eval.modeling.addresses:parse_request")
# the earlier name of parse_request, with the same arguments (README, "Python API": moved names)

if TYPE_CHECKING:  # pragma: no cover
    from repgeom_eval.modeling.addresses import Address
    from repgeom_eval.modeling.loading import ModelInfo
    from repgeom_eval.plugin_system.host import PluginHost


class AuxLoss(abc.ABC):
    """Base class of auxiliary losses. Subclass it, set ``name`` and implement :meth:`compute_loss_from_hidden`.

    Args (every subclass takes them as keywords):
        weight: λ, the multiplier of this loss in ``L_CE + λ·L_aux``. Required: the papers' values are only
            starting points (``paper_weight`` quotes them).
        layers: the layer addresses read, in the address grammar (``final``, ``resid_post:-1``, ``3``, a list, a
            selector such as ``all``, ``last``, ``early_half``, ``all_but_embed``); ``None`` = ``default_layers``.
            With several addresses the loss is the mean of the per-address values (paper C).

    Class attributes:
        name: registry name.
        default_layers: the address spec used when ``layers`` is not given.
        paper_weight: the paper's λ, for error messages and docs.
    """

    name: ClassVar[str] = ""
    default_layers: ClassVar[str] = "final"
    paper_weight: ClassVar[str] = ""

    def __init__(self, *, weight: float, layers: str | Sequence[str] | None = None):
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"weight must be a finite number, got {weight!r}")
        if weight < 0:
            raise ValueError(f"weight must be >= 0, got {weight!r} (a negative weight flips the objective; "
                             "the flipped push_away is the loss `squeeze`)")
        self.weight = float(weight)
        self.layers = self.default_layers if layers is None else layers
        if isinstance(self.layers, (list, tuple)):
            self.layers = [str(x) for x in self.layers]
        elif not isinstance(self.layers, str):
            raise ValueError(f"layers must be an address string or a list of them, got {layers!r}")

    # -- what a subclass provides ------------------------------------------------------------------------------------
    uses_domains: bool = False  # True when the value needs per-example domain labels

    @abc.abstractmethod
    def compute_loss_from_hidden(self, hidden: torch.Tensor, mask: torch.Tensor | None,
                                 domains: torch.Tensor | Sequence | None) -> torch.Tensor | None:
        """The loss on one layer's hidden states ``[B, T, d]`` (``mask`` [B, T] true at real tokens, or ``None``).

        Returns a scalar tensor attached to the graph, or ``None`` when the batch does not define it (fewer than two
        tokens, a single domain in a cross-domain loss ...): the trainer then skips the term for this step. A
        subclass without it cannot be built (``build_aux_loss`` says so in one line).
        """

    # -- gathering -----------------------------------------------------------------------------------------------------
    def __call__(self, hidden: Mapping[Address, torch.Tensor] | torch.Tensor, mask: torch.Tensor | None = None,
                 domains: torch.Tensor | Sequence | None = None) -> torch.Tensor | None:
        """L_aux: the mean over the given layers' tensors of :meth:`compute_loss_from_hidden` (``None`` if no layer
        defines it). ``hidden`` is ``{address: [B, T, d]}`` (the trainer passes exactly this loss's addresses) or
        one tensor."""
        tensors = [hidden] if isinstance(hidden, torch.Tensor) else list(hidden.values())
        if not tensors:
            raise ValueError(f"aux loss {self.name!r} got no hidden states")
        if self.uses_domains and domains is None:
            raise RepgeomError(f"aux loss {self.name!r} is cross-domain and needs a domain label per example; give "
                               "each training data source a `domain` (or set cross_domain: false)")
        values = [v for v in (self.compute_loss_from_hidden(h, mask, domains) for h in tensors) if v is not None]
        if not values:
            return None
        return values[0] if len(values) == 1 else torch.stack(values).mean()

    def addresses(self, info: "ModelInfo", host: "PluginHost | None" = None) -> list[Address]:
        """The canonical addresses of ``layers`` on a model (selectors looked up in the plugin host)."""
        return parse_request(self.layers, info, host)

    # -- configuration -------------------------------------------------------------------------------------------------
    @classmethod
    def parameter_names(cls) -> list[str]:
        names: list[str] = []
        for klass in cls.__mro__:  # a subclass's own parameters first, then the base's weight and layers
            if "__init__" not in vars(klass):
                continue
            for p in list(inspect.signature(vars(klass)["__init__"]).parameters.values())[1:]:
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in names:
                    names.append(p.name)
        return names

    def get_config_dict(self) -> dict[str, Any]:
        """Every hyper-parameter of this instance, as written into the training results."""
        return {"name": self.name, **{n: getattr(self, n) for n in self.parameter_names() if hasattr(self, n)}}

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.get_config_dict().items() if k != "name")
        return f"{type(self).__name__}({params})"


def build_aux_loss(spec: Mapping[str, Any], host: "PluginHost | None" = None, where: str = "aux loss") -> AuxLoss:
    """An :class:`AuxLoss` from a config mapping ``{name: push_away, weight: 0.01, layers: final, ...}``.

    Unknown names and parameters, a missing weight and bad values are :class:`RepgeomError` naming the culprit.
    """
    from repgeom_eval.plugin_system.host import get_host

    host = host or get_host()
    if not isinstance(spec, Mapping):
        raise RepgeomError(f"{where}: expected a mapping like {{name: push_away, weight: 0.1}}, got {spec!r}")
    params = dict(spec)
    name = params.pop("name", None)
    if not isinstance(name, str) or not name:
        raise RepgeomError(f"{where}: no `name` (registered aux losses: {', '.join(host.aux_losses.names())})")
    cls = host.aux_losses.get(name)
    accepted = cls.parameter_names() if isinstance(cls, type) and issubclass(cls, AuxLoss) else None
    if accepted is not None:
        bad = sorted(set(params) - set(accepted))
        if bad:
            raise RepgeomError(f"{where} {name!r} has no parameter(s) {bad} (parameters: {', '.join(accepted)})")
        if inspect.isabstract(cls):
            missing = ", ".join(sorted(cls.__abstractmethods__))
            raise RepgeomError(f"{where} {name!r} from plugin {host.aux_losses.entry(name).plugin!r} does not "
                               f"implement {missing}; an AuxLoss subclass must (docs/plugins.md#auxiliary-losses)")
        if "weight" not in params:
            hint = f" (the paper uses {cls.paper_weight})" if cls.paper_weight else ""
            raise RepgeomError(f"{where} {name!r} needs an explicit `weight` (λ){hint}")
    try:
        loss = cls(**params)
    except (TypeError, ValueError) as exc:
        raise RepgeomError(f"{where} {name!r}: {exc}") from None
    if not isinstance(loss, AuxLoss):
        raise RepgeomError(f"{where} {name!r} from plugin {host.aux_losses.entry(name).plugin!r} built "
                           f"{type(loss).__name__}, not a repgeom_eval.training.auxloss.AuxLoss")
    return loss
