"""Label-free layer picks: rules that choose one layer from the geometry of a task's own texts (docs/picks.md).

A rule is a subclass of :class:`LayerPick`, registered by a plugin through ``repgeom_register_layer_picks`` and
chosen with ``repgeom mteb run --layer auto --layer-pick NAME --layer-pick-param KEY=VALUE``. The host builds it with
the parameters (``rule = Rule(**params)``; unknown names and wrong types are one-line errors), gives
:meth:`LayerPick.score` the pooled vectors of the task's texts at every candidate layer (one forward pass per batch
for all of them) and lets :meth:`LayerPick.choose` pick from the scores (by default the lowest or highest score,
``direction``). Nothing here looks at labels or at scores of the task.

This module imports no mteb and no model code, so a plugin can subclass :class:`LayerPick` at start-up for free.
"""

from __future__ import annotations

import abc
import difflib
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # numpy and torch load when a rule scores, not when plugins load (repgeom --help stays light)
    import numpy as np

from repgeom_eval.spec.errors import RepgeomError

#: parameters every rule has (a rule's own ``defaults`` add to them)
BASE_DEFAULTS: dict[str, Any] = {"include_embed": False}
DIRECTIONS = ("min", "max")


def _coerce(rule: str, key: str, value: Any, default: Any) -> Any:
    """``value`` as the type of ``default`` (command-line values arrive as strings or JSON scalars); a default of
    another type (a string, None, a list) takes the value as it is."""
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        low = str(value).lower()
        if low in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return low in ("true", "yes", "1", "on")
    elif isinstance(default, (int, float)):
        try:
            number = float(value) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError):
            number = math.nan
        if math.isfinite(number) and (isinstance(default, float) or number == int(number)):
            return number if isinstance(default, float) else int(number)
    else:
        return value
    raise RepgeomError(f"layer pick {rule!r}: parameter {key}={value!r} should be of type {type(default).__name__} "
                       f"(default {default!r})")


class LayerPick(abc.ABC):
    """A label-free layer-pick rule (subclass it; docs/picks.md and docs/plugins.md#layer-picks).

    Set ``name``, ``quantity`` (one line: what :meth:`score` measures), ``direction`` (``"min"``: the lowest score
    wins, ``"max"``: the highest) and ``defaults`` (the rule's parameters and their default values; every rule also
    has ``include_embed``, default false: whether the embedding output ``embed`` is a candidate). Implement
    :meth:`score`; override :meth:`choose` for a rule that is not an argmin/argmax. ``self.params`` holds the
    parameters in effect.
    """

    name: ClassVar[str] = ""
    quantity: ClassVar[str] = ""
    direction: ClassVar[str] = "min"
    defaults: ClassVar[dict[str, Any]] = {}
    #: what the rule has been measured to do against ``final`` out of sample (hit rate and mean gain with their
    #: intervals, and where), printed beside every pick; "" = never measured, which is printed too
    evidence: ClassVar[str] = ""

    def __init__(self, **params: Any):
        allowed = {**BASE_DEFAULTS, **self.defaults}
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            close = difflib.get_close_matches(unknown[0], list(allowed), n=1, cutoff=0.5)
            raise RepgeomError(f"layer pick {self.name!r} has no parameter {unknown[0]!r}"
                               + (f"; did you mean {close[0]!r}?" if close else "")
                               + f" (parameters: {', '.join(sorted(allowed))})")
        if self.direction not in DIRECTIONS:
            raise RepgeomError(f"layer pick {self.name!r}: direction must be min or max, got {self.direction!r}")
        self.params = {k: _coerce(self.name, k, params[k], d) if k in params else d for k, d in allowed.items()}
        problem = self.check_params()
        if problem:  # refused here, before any model runs, not after the forward passes
            raise RepgeomError(f"layer pick {self.name!r}: {problem} (set it with --layer-pick-param KEY=VALUE)")

    def check_params(self) -> str | None:
        """What is wrong with ``self.params`` (a value out of its range), or None; override to check a rule's own."""
        return None

    def candidates(self, addresses: Sequence[str]) -> list[str]:
        """The layers the rule chooses among, from every hidden state (``embed``, ``resid_post:0`` ... ``final``)."""
        return [a for a in addresses if self.params["include_embed"] or a != "embed"]

    @abc.abstractmethod
    def score(self, vectors: np.ndarray) -> float:
        """The label-free score of one layer: ``vectors`` is N×D float64, one pooled hidden state per text (every
        rule defines it: a subclass without it cannot be built)."""

    def choose(self, scores: Mapping[str, float]) -> str:
        """The chosen address among ``scores`` (shallowest first): the lowest (``direction="min"``) or highest
        finite score; a tie goes to the shallower layer."""
        finite = [(a, s) for a, s in scores.items() if isinstance(s, (int, float)) and math.isfinite(s)]
        if not finite:
            raise RepgeomError(f"layer pick {self.name!r}: no layer has a finite score ({dict(scores)}); too few "
                               "distinct texts?")
        best = finite[0]
        for a, s in finite[1:]:
            if (s < best[1]) if self.direction == "min" else (s > best[1]):
                best = (a, s)
        return best[0]

    def changed_params(self) -> dict[str, Any]:
        """The parameters that differ from their defaults (part of a layer encoder's identity)."""
        defaults = {**BASE_DEFAULTS, **self.defaults}
        return {k: v for k, v in self.params.items() if v != defaults[k]}


class MinDatasetEntropy(LayerPick):
    """The layer whose task texts have the lowest dataset entropy (paper B's compression; docs/picks.md)."""

    name = "min_dataset_entropy"
    quantity = ("dataset entropy (paper B, the default of docs/metrics.md): von Neumann entropy (alpha) of the Gram of the pooled "
                "vectors centred over all texts and unit-normalised, divided by log min(N, D)")
    direction = "min"
    defaults = {"alpha": 1.0}
    # copied from experiments/which_layer_embeds/results/result.json (data.label_free_pick.quotes, the gallery's
    # primary setting); tests/test_experiments.py checks that it is still what the gallery measured
    evidence = ("gallery, SmolLM2-135M, raw, 12 tasks, a rule fitted to none of them: the pick beats final on 0/12 "
                "tasks (ties 0; hit rate 0.00, exact binomial 95 % CI 0.00 to 0.26); mean pick − final -0.148 (95 %"
                " CI -0.231 to -0.077, percentile bootstrap; Student's t p 0.0042, Holm 0.017), worse than final; "
                "pick = best layer on 0/12, mean gap to the best 0.163. Not a better default than final "
                "(docs/picks.md)")

    def check_params(self) -> str | None:
        alpha = self.params["alpha"]
        return None if alpha > 0 else f"alpha={alpha!r} must be > 0 (the order of a Rényi entropy)"

    def score(self, vectors: np.ndarray) -> float:
        from repgeom_eval.functional.entropy import dataset_entropy

        import numpy as np
        import torch

        return float(dataset_entropy(torch.from_numpy(np.asarray(vectors, dtype=np.float64)),
                                     alpha=self.params["alpha"])["normalized"])


DEFAULT_PICK = MinDatasetEntropy.name


def make_pick(name: str | None, params: Mapping[str, Any] | None = None, host: Any = None) -> LayerPick:
    """The registered rule ``name`` (default :data:`DEFAULT_PICK`) built with ``params``; an unknown name is a
    one-line error with the close names."""
    from repgeom_eval.plugin_system.host import get_host

    host = host or get_host()
    cls = host.layer_picks.get(name or DEFAULT_PICK)
    rule = cls(**dict(params or {}))
    if not rule.name:
        rule.name = name or DEFAULT_PICK  # type: ignore[misc]
    return rule
