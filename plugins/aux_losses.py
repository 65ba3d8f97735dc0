"""Built-in auxiliary training losses: paper A's push-away and its squeeze ablation
(docs/metrics.md#push_away-and-squeeze), and paper C's dispersion-loss family
(docs/metrics.md#paper-c-losses-common-settings). The math lives in :mod:`repgeom_eval.functional.losses`; these
classes gather the inputs, sub-sample tokens and record their hyper-parameters.

The objective is always ``L_CE + weight · L_aux``, so each loss's value is signed to be *minimized*:

=================  ==================================================  =================================
name               L_aux (per layer; averaged over the layers)          paper λ
=================  ==================================================  =================================
push_away          −d, d = mean pairwise cosine distance of the batch    0.1 (single), 0.01 (cross-domain)
squeeze            +d (the sign-flipped ablation, paper A B.4.2)         as push_away
angular_spread     log-mean-exp of −arccos(cos)/(πτ) per sequence        0.1
decorrelation      mean squared token–token correlation                  0.1
l2_repel           log-mean-exp of −‖z_i − z_j‖²/τ + 0.1·mean(z²)         0.1
orthogonalization  mean hinge² of (margin − angular distance)            0.1
=================  ==================================================  =================================
"""

from __future__ import annotations

from collections.abc import Sequence

from repgeom_eval import hookimpl
from repgeom_eval.plugin_system.lazy import lazy
from repgeom_eval.training.auxloss import AuxLoss
from repgeom_eval.spec.names import LOSS_VARIANTS
from repgeom_eval.spec.poolings import POOLINGS, check_pooling

# Heavy names are imported on first use, so listing the plugins needs no torch (repgeom_eval.plugin_system.lazy).
torch = lazy("torch")
angular_spread = lazy("repgeom_eval.functional.losses:angular_spread")
decorrelation = lazy("repgeom_eval.functional.losses:decorrelation")
l2_repel = lazy("repgeom_eval.functional.losses:l2_repel")
orthogonalization = lazy("repgeom_eval.functional.losses:orthogonalization")
push_away = lazy("repgeom_eval.functional.losses:push_away")
subsample_tokens = lazy("repgeom_eval.functional.losses:subsample_tokens")

GRANULARITIES = ("token", "sequence")


# -- paper A -------------------------------------------------------------------------------------------------------

class PushAway(AuxLoss):
    """Push-away (paper A): L_aux = −d, d = mean pairwise cosine distance of the batch's vectors, in O(N·d).

    ``granularity="token"`` (default): every non-pad token vector of the batch, flattened across batch and sequence
    (cross-sequence pairs count). ``"sequence"``: one pooled vector per sequence (``pooling``: last, mean, first).
    ``cross_domain=True``: only pairs of vectors from different domains count (``1 − ū_A·ū_B`` for two domains; with
    more, the mean over all cross-domain vector pairs); each example then needs a domain label. Never builds an
    N×N matrix (docs/metrics.md#push_away-and-squeeze).
    """

    name = "push_away"
    default_layers = "final"
    paper_weight = "0.1 single-domain, 0.01 cross-domain"
    sign = -1.0

    def __init__(self, *, granularity: str = "token", cross_domain: bool = False, pooling: str = "last",
                 eps: float = 1e-12, **base):
        super().__init__(**base)
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        if not isinstance(cross_domain, bool):
            raise ValueError(f"cross_domain must be true or false, got {cross_domain!r}")
        pooling = check_pooling(pooling)
        if pooling == "tokens":
            raise ValueError(f"pooling applies to granularity 'sequence' and must be one of "
                             f"{[p for p in POOLINGS if p != 'tokens']}; for every token use granularity 'token'")
        if not eps > 0:
            raise ValueError(f"eps must be positive, got {eps!r}")
        self.granularity, self.cross_domain, self.pooling, self.eps = granularity, cross_domain, pooling, float(eps)
        self.uses_domains = cross_domain

    def compute_loss_from_hidden(self, hidden, mask, domains):
        d = self.distance(hidden, mask, domains if self.cross_domain else None)
        return None if d is None else self.sign * d

    def distance(self, hidden: torch.Tensor, mask: torch.Tensor | None,
                 domains: torch.Tensor | Sequence | None) -> torch.Tensor | None:
        """d, or ``None`` if the batch has fewer than two vectors (or no cross-domain pair)."""
        if mask is None:
            mask = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
        mask = mask.bool()
        if self.granularity == "sequence":
            from repgeom_eval.measurement.pooling import pool

            keep = mask.any(1)
            vectors, _ = pool(hidden, mask, self.pooling)
            hidden, mask = vectors[keep].unsqueeze(1), keep[keep].unsqueeze(1)
            if domains is not None:
                domains = [x for x, k in zip(_labels(domains), keep.tolist()) if k]
        if domains is None:
            if int(mask.sum()) < 2:
                return None
        else:
            labels = _labels(domains)
            per_seq = mask.sum(1).tolist()
            if len({x for x, n in zip(labels, per_seq) if n > 0}) < 2:
                return None
        return push_away(hidden, mask, domains=domains, eps=self.eps)


class Squeeze(PushAway):
    """Squeeze (paper A's ablation B.4.2): L_aux = +d, pulls the batch's vectors together (same options as push_away)."""

    name = "squeeze"
    sign = 1.0


def _labels(domains: torch.Tensor | Sequence) -> list:
    return domains.reshape(-1).tolist() if isinstance(domains, torch.Tensor) else list(domains)


# -- paper C -------------------------------------------------------------------------------------------------------

class _TokenSetLoss(AuxLoss):
    """Shared by paper C's losses: per-sequence token sets, sub-sampled to ``max_tokens`` with a seeded generator.

    Without padding the batch is handled at once, with one random subset of positions shared by all sequences and
    drawn afresh for every layer and step (as the reference code, but seeded). With padding each sequence is taken
    on its own real tokens (the reference trains on packed blocks and takes no mask); sequences with fewer than two
    tokens are skipped. See docs/metrics.md#paper-c-losses-common-settings.
    """

    default_layers = "all_but_embed"
    paper_weight = "0.1"

    def __init__(self, *, max_tokens: int | None = 256, seed: int = 0, **base):
        super().__init__(**base)
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 2):
            raise ValueError(f"max_tokens must be an integer >= 2 or null (no sub-sampling), got {max_tokens!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.max_tokens, self.seed = max_tokens, seed
        self._generator = torch.Generator().manual_seed(seed)

    def loss_on_tokens(self, z: torch.Tensor) -> torch.Tensor:
        """The pure loss on ``z`` [B, L, F] (every position real)."""
        raise NotImplementedError  # pragma: no cover - abstract

    def _sample(self, z: torch.Tensor) -> torch.Tensor:
        return z if self.max_tokens is None else subsample_tokens(z, self.max_tokens, self._generator)

    def compute_loss_from_hidden(self, hidden, mask, domains):
        if mask is None or bool(mask.all()):
            return self.loss_on_tokens(self._sample(hidden)) if hidden.shape[1] >= 2 else None
        mask = mask.bool()
        per_seq = [self.loss_on_tokens(self._sample(h[m].unsqueeze(0)))
                   for h, m, n in zip(hidden, mask, mask.sum(1).tolist()) if n >= 2]
        return torch.stack(per_seq).mean() if per_seq else None


def _check_tau(tau: float) -> float:
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0:
        raise ValueError(f"tau must be a positive number, got {tau!r}")
    return float(tau)


def _check_variant(variant: str) -> str:
    if variant not in LOSS_VARIANTS:
        raise ValueError(f"variant must be one of {LOSS_VARIANTS}, got {variant!r}")
    return variant


def _check_override(value: float | None, name: str, upper: float) -> float | None:
    """``clamp``/``eps``: null (the variant's value) or a number in [0, upper)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < upper:
        raise ValueError(f"{name} must be null (the variant's default) or a number in [0, {upper}), got {value!r}")
    return float(value)


class AngularSpread(_TokenSetLoss):
    """Angular spread (paper C's "dispersion" loss): per sequence, log-mean over pairs of exp(−arccos(cos)/(πτ)).

    ``variant="paper"`` (default): the paper's formula. ``"reference"``: the LM-Dispersion code (cosine of
    z/(‖z‖+ε), cosines clamped to [−1+t, 1−t] with a straight-through gradient, +ε inside the logsumexp; t = 0.25,
    ε = 0.01 unless ``clamp``/``eps`` say otherwise; the GPT-2 script used t = 0.1).
    """

    name = "angular_spread"

    def __init__(self, *, tau: float = 1.0, variant: str = "paper", clamp: float | None = None,
                 eps: float | None = None, **base):
        super().__init__(**base)
        self.tau, self.variant = _check_tau(tau), _check_variant(variant)
        self.clamp, self.eps = _check_override(clamp, "clamp", 1.0), _check_override(eps, "eps", 1.0)

    def loss_on_tokens(self, z):
        return angular_spread(z, tau=self.tau, variant=self.variant, clamp=self.clamp, eps=self.eps)


class Decorrelation(_TokenSetLoss):
    """Decorrelation (paper C): mean over token pairs of the squared Pearson correlation between token vectors."""

    name = "decorrelation"

    def loss_on_tokens(self, z):
        return decorrelation(z)


class L2Repel(_TokenSetLoss):
    """ℓ2-repel (paper C): per sequence, log-mean over all pairs of exp(−‖z_i − z_j‖²/τ), plus 0.1·mean(z²).

    ``variant="paper"``: no additive ε in the logsumexp; ``"reference"``: +ε (0.01 unless ``eps`` says otherwise),
    as the LM-Dispersion code. Both keep the code's i = j terms and norm penalty (``norm_weight``).
    """

    name = "l2_repel"

    def __init__(self, *, tau: float = 1.0, variant: str = "paper", eps: float | None = None,
                 norm_weight: float = 0.1, **base):
        super().__init__(**base)
        self.tau, self.variant, self.eps = _check_tau(tau), _check_variant(variant), _check_override(eps, "eps", 1.0)
        if isinstance(norm_weight, bool) or not isinstance(norm_weight, (int, float)) or norm_weight < 0:
            raise ValueError(f"norm_weight must be a number >= 0, got {norm_weight!r}")
        self.norm_weight = float(norm_weight)

    def loss_on_tokens(self, z):
        eps = self.eps if self.eps is not None else (0.01 if self.variant == "reference" else 0.0)
        return l2_repel(z, tau=self.tau, eps=eps, norm_weight=self.norm_weight)


class Orthogonalization(_TokenSetLoss):
    """Orthogonalization (paper C): mean over token pairs of max(0, margin − angular distance)², margin 0.5 = 90°.

    ``variant`` as for angular_spread (``reference``: the code's clamp t = 0.25 and ε = 0.01 cosine).
    """

    name = "orthogonalization"

    def __init__(self, *, margin: float = 0.5, variant: str = "paper", clamp: float | None = None,
                 eps: float | None = None, **base):
        super().__init__(**base)
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 < margin <= 1:
            raise ValueError(f"margin must be in (0, 1] (an angular distance; 0.5 = orthogonal), got {margin!r}")
        self.margin, self.variant = float(margin), _check_variant(variant)
        self.clamp, self.eps = _check_override(clamp, "clamp", 1.0), _check_override(eps, "eps", 1.0)

    def loss_on_tokens(self, z):
        return orthogonalization(z, margin=self.margin, variant=self.variant, clamp=self.clamp, eps=self.eps)


AUX_LOSSES = (PushAway, Squeeze, AngularSpread, Decorrelation, L2Repel, Orthogonalization)


@hookimpl
def repgeom_register_aux_losses(registry):
    for cls in AUX_LOSSES:
        registry.add(cls)
