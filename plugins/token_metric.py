"""What the built-in token metrics share (condensation, token_dispersion, prompt_entropy, curvature): they read each
text's token vectors (``Consumes.TOKENS``) through ``update_tokens`` and, with ``per_text``, keep one value (or row)
per text with its index. Not a plugin: the metrics' own modules register them."""

from __future__ import annotations

from typing import Any

from repgeom_eval import Consumes, LayerBatch, Metric
from repgeom_eval.plugin_system.lazy import lazy

torch = lazy("torch")  # imported on first use, so listing the plugins needs no torch


class TokenMetric(Metric):
    """A metric of each text's token vectors: implement ``update_tokens(index, block)``; ``update`` (the public
    ``LayerBatch`` route) hands it the batch as a :class:`~repgeom_eval.functional.tokens.TokenBlock`, as the
    measurement pipeline does."""

    consumes = Consumes.TOKENS

    def add_per_text_states(self, width: int | None = None) -> None:
        """``values`` (one number, or ``width`` numbers, per text) and ``index`` (which text), gathered by "cat"."""
        self.add_state("values", [], "cat", shape=("N",) if width is None else ("N", width))
        self.add_state("index", [], "cat", shape=("N",))

    def keep_per_text(self, index: Any, values: Any) -> None:
        """With ``per_text``: keep ``values`` (one entry per text of the batch) under the texts' ``index``."""
        if self.per_text:
            self.values.append(values)
            self.index.append(index.to(device=values.device, dtype=torch.float64, non_blocking=True))

    def fold_texts(self, index: Any, values: Any, kept: Any) -> None:
        """Add one batch's per-text ``values`` [B, k] (a NaN in column 0: a text without a value, skipped and
        counted) to the ``sums``, ``count`` and ``skipped`` states where they live, reading nothing back to the
        host (on a GPU the host runs ahead: docs/how-to/large-models.md#host-synchronisations); with
        ``per_text``, keep ``kept`` for each text."""
        ok = ~torch.isnan(values[:, 0])
        self.sums = self.sums + torch.where(ok.unsqueeze(1), values, torch.zeros_like(values)).sum(0)
        self.count = self.count + ok.sum()
        self.skipped = self.skipped + (~ok).sum()
        self.keep_per_text(index, kept)

    def kept_per_text(self) -> tuple[Any, Any] | None:
        """``(text index, values)`` of every text kept so far, in host memory; None without ``per_text`` or before
        any text."""
        if not self.per_text or not self.values:
            return None
        return torch.cat(self.index).long().cpu(), torch.cat(self.values).cpu()

    def update(self, batch: LayerBatch) -> None:
        assert batch.hidden is not None and batch.mask is not None, f"{self.name} consumes TOKENS"
        from repgeom_eval.functional.tokens import TokenBlock

        self.update_tokens(batch.index, TokenBlock.padded(batch.hidden, batch.mask))

    def update_tokens(self, index: Any, block: Any) -> None:
        raise NotImplementedError
