"""The load check's input checks: position ids from the mask only where they reproduce the model's own positions,
the padding sides that leave every real token's hidden states unchanged, and causal attention — each decided on a
few tiny forward passes, none assumed (docs/metrics.md#how-an-address-is-found)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from repgeom_eval.modeling.layout import Layout
from repgeom_eval.modeling.probe import build_inputs, close, few_logits, hidden_states_of


def pad_id_of(model: nn.Module, config: Any, ids: torch.Tensor) -> int:
    """The id padding uses: the config's pad token where it has one in the vocabulary (RoBERTa derives positions
    from it), else any real token (only the attention mask may matter)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None) or getattr(config, "vocab_size", None) or 0
    pad = getattr(config, "pad_token_id", None)
    return pad if isinstance(pad, int) and 0 <= pad < vocab else int(ids[0, 0])


def check_inputs(runner: nn.Module, layout: Layout, ids: torch.Tensor, device: torch.device, pad_id: int) -> None:
    """Decide position ids, check padding sides and causal attention on the probe (a few tiny forward passes). A
    check whose forward pass fails counts as failed (Funnel cannot run some lengths alone): nothing is assumed."""

    def run(input_ids: torch.Tensor, mask: torch.Tensor, position_ids: bool) -> tuple | None:
        kw = build_inputs(device, input_ids, mask, accepted=layout.accepted_inputs, position_ids=position_ids)
        kw.update(few_logits(layout.accepted_inputs))
        try:
            return hidden_states_of(runner(**kw, output_hidden_states=True, return_dict=True)) or None
        except Exception:  # noqa: BLE001 - the model's own code, on a legal input
            return None

    def same(a: tuple | None, b: tuple | None, pick_a=lambda t: t, pick_b=lambda t: t) -> bool:
        return a is not None and b is not None and len(a) == len(b) and all(
            close(pick_a(x), pick_b(y)) for x, y in zip(a, b))

    row = ids[:1]
    full = torch.ones_like(row)
    alone = run(row, full, False)
    layout.position_ids = "position_ids" in layout.accepted_inputs and same(run(row, full, True), alone)
    # causal attention: changing the last token leaves the earlier positions alone
    changed = row.clone()
    changed[0, -1] = ids[1, 0] if int(ids[1, 0]) != int(row[0, -1]) else ids[1, 1]
    earlier = lambda t: t[..., :-1, :]  # noqa: E731 - [..., batch, tokens, width]
    layout.causal = same(alone, run(changed, full, layout.position_ids), earlier, earlier)
    # padding: a short text in a batch with a longer one keeps the hidden states it has alone
    short = ids[1:2, : ids.shape[1] - 3]
    short_alone = run(short, torch.ones_like(short), layout.position_ids)
    ok = []
    for side in ("right", "left"):
        pad = ids.shape[1] - short.shape[1]
        filler = torch.full((1, pad), pad_id, dtype=ids.dtype)
        batch_ids = torch.cat([row, torch.cat([short, filler], 1) if side == "right" else torch.cat([filler, short], 1)])
        real = torch.ones_like(short)
        gap = torch.zeros((1, pad), dtype=real.dtype)
        mask = torch.cat([full, torch.cat([real, gap], 1) if side == "right" else torch.cat([gap, real], 1)])
        got = run(batch_ids, mask, layout.position_ids)
        keep = slice(0, short.shape[1]) if side == "right" else slice(pad, None)
        # [..., batch, tokens, width]: Gemma 3n stacks its AltUp streams in front
        if same(got, short_alone, lambda g: g[..., 1:2, keep, :]) and same(got, alone, lambda g: g[..., :1, :, :]):
            ok.append(side)
    layout.padding_sides = tuple(ok)
