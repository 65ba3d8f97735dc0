"""Token-id batches through the model, one forward pass each, every requested address captured by hooks.

The analyses work on token ids (chunks, perturbed prompts), not strings, so they cannot go through
:func:`repgeom_eval.measurement.engine.measure`'s tokenizer step; they share its pieces instead: layer addresses
(:func:`~repgeom_eval.modeling.addresses.parse_layers`, :func:`~repgeom_eval.modeling.addresses.resolve`) and
:class:`~repgeom_eval.modeling.hooks.Capture`. When logits are needed the pass runs to the end; otherwise it stops after the
deepest requested module.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from repgeom_eval.modeling.addresses import Address, parse_layers, resolve
from repgeom_eval.modeling.hooks import Capture
from repgeom_eval.modeling.loading import LoadedModel
from repgeom_eval.plugin_system.host import get_host


def parse_addresses(loaded: LoadedModel, layers: str | Sequence[str], host: Any = None) -> list[Address]:
    """Canonical addresses in depth order (selectors such as ``all`` expanded); unknown ones raise."""
    host = host or get_host()

    def selector(name: str):
        return host.layer_selectors.get(name) if name in host.layer_selectors else None

    addrs = parse_layers(layers, loaded.info.n_layers, selector, loaded.info)
    addrs.sort(key=lambda a: a.depth_key(loaded.info.n_layers))
    resolve(addrs, loaded)  # fail now, naming the valid sites, if the model lacks one
    return addrs


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` [B, T] and ``attention_mask`` [B, T] (long)."""
    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), t), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


class TokenRunner:
    """Context manager: hooks at ``addresses`` on ``loaded.model``; :meth:`run` feeds one batch of token ids.

    Example::

        with TokenRunner(loaded, addrs, logits=True) as runner:
            out = runner.run([[5, 6, 7], [8, 9]])
            out.hidden[addr]   # [B, T, D] float32 (float16/bfloat16 upcast), pad positions as computed
            out.logits         # [B, T, V] or None
    """

    def __init__(self, loaded: LoadedModel, addresses: Sequence[Address], logits: bool = False):
        self.loaded = loaded
        self.addresses = list(addresses)
        self.need_logits = logits
        self._capture = Capture(loaded.model, resolve(self.addresses, loaded), stop_early=not logits)
        tok = loaded.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0

    def __enter__(self) -> "TokenRunner":
        self._capture.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._capture.__exit__(*exc)

    def run(self, seqs: Sequence[Sequence[int]]) -> "Batch":
        ids, mask = pad_batch(seqs, self.pad_id)
        dev = self.loaded.device
        inputs: dict[str, Any] = {"input_ids": ids.to(dev), "attention_mask": mask.to(dev)}
        if self.loaded.spec.position_ids_from_mask:
            inputs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0).to(dev)
        if self.loaded.spec.causal:
            inputs["use_cache"] = False
        captured = self._capture.run(**inputs)
        hidden = {a: (h.float() if h.dtype in (torch.float16, torch.bfloat16) else h) for a, h in captured.items()}
        logits = None
        if self.need_logits:
            outputs = self._capture.outputs
            logits = outputs.logits if hasattr(outputs, "logits") else outputs[0]
        return Batch(ids, mask.bool(), hidden, logits)


class Batch:
    def __init__(self, ids: torch.Tensor, mask: torch.Tensor, hidden: dict[Address, torch.Tensor],
                 logits: torch.Tensor | None):
        self.ids, self.mask, self.hidden, self.logits = ids, mask, hidden, logits


def next_token_logprobs(logits: torch.Tensor, ids: torch.Tensor,
                        mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(token t+1 | tokens ≤ t) for every position of every row, and where it is defined.

    Returns ``(logprob [B, T-1] float64, valid [B, T-1] bool)``; valid where both t and t+1 are real tokens. The
    log-softmax runs one row at a time in float32, so memory stays at one [T, V] copy beyond the logits.
    """
    b, t = ids.shape
    out = torch.zeros((b, max(t - 1, 0)), dtype=torch.float64)
    for i in range(b):
        lp = torch.log_softmax(logits[i, :-1].float(), dim=-1)
        target = ids[i, 1:].to(lp.device)
        out[i] = lp.gather(-1, target.unsqueeze(-1)).squeeze(-1).double().cpu()
    valid = (mask[:, 1:] & mask[:, :-1]).cpu()
    return out.masked_fill(~valid, 0.0), valid


def batches(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for lo in range(0, len(items), size):
        yield items[lo:lo + size]
