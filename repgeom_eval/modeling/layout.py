"""What the load check found on one model: every layer-address site, where it is read and how it was checked
(docs/metrics.md#how-an-address-is-found)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from repgeom_eval.modeling.architectures import SITES
from repgeom_eval.modeling.hooks import HookPoint


@dataclass(frozen=True)
class Site:
    """One site at one block: where it is read (``None`` when refused) and how it was checked, or why not.

    A refused site is either ``absent`` (the block has no such tensor: no ``resid_mid`` in a parallel block, no
    ``attn_out`` in a Mamba block) or unverified (the load check could not confirm it, so it is not guessed). A site
    is served without verification only where a registered architecture table names it (``verified`` False): every
    output that reads it carries a warning, and ``repgeom addresses`` marks it."""

    point: HookPoint | None
    note: str
    absent: bool = False
    width: int | None = None  # the vectors' width on the probe (a saved state's "D" is checked against it)
    verified: bool = True  # False: read where a plugin's table says, which the load check could not confirm

    @property
    def ok(self) -> bool:
        return self.point is not None


@dataclass
class Layout:
    """What discovery found on one model: every site's hook point, each checked on the probe input."""

    model_type: str
    runner: str  # qualified name of the module called for a measurement ("" = the model; the encoder of a seq2seq)
    blocks: str  # qualified name of the ModuleList of blocks
    n_layers: int
    embed: Site
    final: Site
    hidden_states: tuple[str | None, ...]  # canonical address of hidden_states[k] (None: matches no address)
    sites: list[dict[str, Site]]  # per block: every site of SITES → Site
    block_kinds: list[str]
    causal: bool
    logits: bool
    accepted_inputs: frozenset[str]
    position_ids: bool  # pass position_ids = cumsum(mask) - 1
    padding_sides: tuple[str, ...]  # padding sides that leave every real token's hidden states unchanged
    depends_on: frozenset[str] = frozenset()  # modules that run before `final` is read (what the hidden states use)
    after_final: frozenset[str] = frozenset()  # modules that run only after it (a pooler, the LM head)
    notes: list[str] = field(default_factory=list)
    table: str | None = None  # the registered architecture table applied on top, if any

    def site(self, name: str, layer: int) -> Site:
        return self.sites[layer][name]

    def width(self, address: Any) -> int | None:
        """The width of the vectors an address reads (``None`` if unknown)."""
        if address.site in ("embed", "final"):
            return getattr(self, address.site).width
        return self.sites[address.layer][address.site].width

    def unverified_sites(self) -> dict[str, str]:
        """Sites served from a registered table without verification, with the first such block's note."""
        out = {}
        for s in SITES:
            notes = [block[s].note for block in self.sites if block[s].ok and not block[s].verified]
            if notes:
                out[s] = notes[0]
        return out

    def missing_sites(self) -> dict[str, str]:
        """Sites refused at every block, with the first block's reason (what ``repgeom addresses`` lists)."""
        out = {}
        for s in SITES:
            if not any(block[s].ok for block in self.sites):
                out[s] = self.sites[0][s].note if self.sites else "the model has no blocks"
        return out


def describe(layout: Layout) -> Mapping[str, Any]:
    """A JSON-able summary (results files, ``repgeom addresses --json``)."""
    return {
        "model_type": layout.model_type, "blocks": layout.blocks, "n_layers": layout.n_layers,
        "runner": layout.runner or "<model>", "table": layout.table, "causal": layout.causal,
        "position_ids_from_mask": layout.position_ids, "padding_sides": list(layout.padding_sides),
        "block_kinds": sorted(set(layout.block_kinds)), "hidden_states": list(layout.hidden_states),
        "refused": layout.missing_sites(), "unverified": layout.unverified_sites(), "notes": list(layout.notes),
        "last_block_sites": [s for s, site in layout.sites[-1].items() if site.ok] if layout.sites else [],
    }


def text_config(config: Any) -> Any:
    """The part of ``config`` that describes the text model: the config itself, a multimodal model's text config, or
    for a model with several text configs (an audio model's text encoder and decoder) its decoder's, the part whose
    hidden states a causal model's run reads. A config transformers cannot answer for stands for itself."""
    if not hasattr(config, "get_text_config"):
        return config
    for ask in ({}, {"decoder": True}):
        try:
            return config.get_text_config(**ask)
        except (ValueError, TypeError):
            continue
    return config
