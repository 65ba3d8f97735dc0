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
    changed = row.clone()  # the probe text with its last token changed
    changed[0, -1] = ids[1, 0] if int(ids[1, 0]) != int(row[0, -1]) else ids[1, 1]
    # The text and its changed copy in one forward pass (each pass reads every weight once: at a large width that is
    # the load check's cost); where the two rows are not computed independently, each runs alone, as before.
    both = run(torch.cat([row, changed]), torch.cat([full, full]), False)
    alone = _rows(both, 0) if both is not None else run(row, full, False)
    layout.position_ids = "position_ids" in layout.accepted_inputs and same(run(row, full, True), alone)
    # causal attention: changing the last token leaves the earlier positions alone
    earlier = lambda t: t[..., :-1, :]  # noqa: E731 - [..., batch, tokens, width]
    layout.causal = both is not None and same(alone, _rows(both, 1), earlier, earlier)
    if not layout.causal:
        layout.causal = same(alone, run(changed, full, layout.position_ids), earlier, earlier)
    # padding: a short text in a batch with a longer one keeps the hidden states it has alone
    short = ids[1:2, : ids.shape[1] - 3]
    short_alone = run(short, torch.ones_like(short), layout.position_ids)
    pad = ids.shape[1] - short.shape[1]
    filler = torch.full((1, pad), pad_id, dtype=ids.dtype)
    real, gap = torch.ones_like(short), torch.zeros((1, pad), dtype=short.dtype)
    padded = {"right": (torch.cat([short, filler], 1), torch.cat([real, gap], 1), slice(0, short.shape[1])),
              "left": (torch.cat([filler, short], 1), torch.cat([gap, real], 1), slice(pad, None))}

    def fits(got: tuple | None, at: int, side: str) -> bool:
        # [..., batch, tokens, width]: Gemma 3n stacks its AltUp streams in front
        keep = padded[side][2]
        return same(got, short_alone, lambda g: g[..., at:at + 1, keep, :]) and same(
            got, alone, lambda g: g[..., :1, :, :])

    # Both sides in one pass (the long text, the short one padded right, then left); a side that does not hold
    # there is tried alone, as a batch of the long text and that one padded text.
    both = run(torch.cat([row, padded["right"][0], padded["left"][0]]),
               torch.cat([full, padded["right"][1], padded["left"][1]]), layout.position_ids)
    ok = []
    for at, side in ((1, "right"), (2, "left")):
        if fits(both, at, side) or fits(run(torch.cat([row, padded[side][0]]), torch.cat([full, padded[side][1]]),
                                            layout.position_ids), 1, side):
            ok.append(side)
    layout.padding_sides = tuple(ok)


def _rows(states: tuple, row: int) -> tuple:
    """Row ``row`` of every hidden state (kept as a batch of one; [..., batch, tokens, width])."""
    return tuple(h[..., row:row + 1, :, :] for h in states)
