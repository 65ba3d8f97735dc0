"""Per-architecture tables that map layer-address sites to modules (TransformerBridge-style, as data).

A site is read either from a module's input (forward pre-hook) or from its output (forward hook). The tables
are registered by plugins (``repgeom_register_architectures``) under Hugging Face ``config.model_type`` names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from repgeom_eval.modeling.hook_point import HookPoint

SITES = ("resid_pre", "attn_out", "resid_mid", "mlp_in", "mlp_out", "resid_post")

SITE_MEANING = {
    "resid_pre": "block input (residual stream before the block)",
    "attn_out": "attention contribution, before the residual add",
    "resid_mid": "residual stream after the attention add",
    "mlp_in": "what the feed-forward block reads (after its norm on pre-LN models)",
    "mlp_out": "feed-forward contribution, before the residual add",
    "resid_post": "block output (raw, no final norm)",
    "embed": "embedding output = hidden_states[0]",
    "final": "last_hidden_state (after the final norm where the model has one)",
}


@dataclass(frozen=True)
class ArchitectureSpec:
    """How to find every layer-address site in one family of models.

    Attributes:
        name: short family name shown to users.
        blocks: dotted path, relative to ``model.base_model``, of the ``ModuleList`` of blocks.
        sites: site name → :class:`~repgeom_eval.HookPoint` relative to a block.
        final_norm: dotted path (relative to ``model.base_model``) of the final norm, or ``None`` when
            ``last_hidden_state`` is the raw output of the last block (BERT).
        causal: decoder-only language model (loaded with ``AutoModelForCausalLM``) or encoder (``AutoModel``).
        position_ids_from_mask: pass ``position_ids = cumsum(mask) - 1`` so left padding does not shift
            positions; ``False`` for models that derive positions themselves (RoBERTa).
        unavailable: ``config → {site: reason}`` for sites a particular configuration lacks.
    """

    name: str
    blocks: str
    sites: Mapping[str, HookPoint]
    final_norm: str | None
    causal: bool = True
    position_ids_from_mask: bool = True
    unavailable: Callable[[Any], dict[str, str]] | None = field(default=None, compare=False)
    description: str = ""

    def missing_sites(self, config: Any) -> dict[str, str]:
        out = {s: f"the {self.name} table has no hook for it" for s in SITES if s not in self.sites}
        if self.unavailable is not None:
            out.update(self.unavailable(config))
        return out


def pre_ln_decoder(name: str, blocks: str, attn: str, ln2: str, mlp: str, final_norm: str, **kw: Any) -> ArchitectureSpec:
    """Table for a pre-LN decoder block: ``a = x + attn(ln1(x)); y = a + mlp(ln2(a))``."""
    sites = {
        "resid_pre": HookPoint("", "input"),
        "attn_out": HookPoint(attn, "output"),
        "resid_mid": HookPoint(ln2, "input"),
        "mlp_in": HookPoint(mlp, "input"),
        "mlp_out": HookPoint(mlp, "output"),
        "resid_post": HookPoint("", "output"),
    }
    return ArchitectureSpec(name=name, blocks=blocks, sites=sites, final_norm=final_norm, **kw)


def post_ln_encoder(name: str, blocks: str = "encoder.layer", **kw: Any) -> ArchitectureSpec:
    """Table for a BERT-style post-LN encoder layer."""
    sites = {
        "resid_pre": HookPoint("", "input"),
        "attn_out": HookPoint("attention.output.dense", "output"),
        "resid_mid": HookPoint("attention", "output"),
        "mlp_in": HookPoint("intermediate", "input"),
        "mlp_out": HookPoint("output.dense", "output"),
        "resid_post": HookPoint("", "output"),
    }
    return ArchitectureSpec(name=name, blocks=blocks, sites=sites, final_norm=None, causal=False, **kw)
