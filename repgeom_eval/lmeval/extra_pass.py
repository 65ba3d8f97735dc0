"""The one extra forward pass: token sequences lm-eval's own passes did not give us, run on the model it holds.

Three things need it (docs/lmeval.md#guarantees): rows whose hidden states fused capture did not read (lm-eval
changed its private call order, or ``repgeom_capture=extra``), for the task's own geometry and for the registered
metrics; and the augmented views of VIEWS metrics, which lm-eval never runs. All go through :meth:`ExtraPass.run`,
with lm-eval's batch size and mixed precision.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from repgeom_eval.measurement.forward import Batch, Forward
from repgeom_eval.modeling.addresses import Address
from repgeom_eval.modeling.hooks import HookPoint

DEFAULT_BATCH_SIZE = 16  # when lm-eval's is not a number (batch_size=auto)


class ExtraPass:
    """Forward passes over token sequences on the model of an HFLM instance."""

    def __init__(self, lm: Any, loaded: Any):
        self.lm = lm
        self.loaded = loaded

    @property
    def batch_size(self) -> int:
        size = self.lm.batch_size
        return size if isinstance(size, int) and size > 0 else DEFAULT_BATCH_SIZE

    @torch.no_grad()
    def run(self, seqs: Sequence[Sequence[int]], points: Mapping[Address, HookPoint], row_ids: Sequence[str],
            as_lm_eval: bool = True, logits: bool = False,
            rows_per_batch: int | None = None) -> Iterator[tuple[list[int], Batch]]:
        """Run ``seqs`` in batches; yields (indices into ``seqs``, the batch's :class:`Batch`).

        ``as_lm_eval``: the sequences are rows lm-eval scores, run as ``HFLM._model_call`` runs them (longest first,
        right-padded with zeros, no attention mask), so a row's states are those lm-eval's own pass would have given.
        Otherwise they are texts of their own (augmented views), run in order with their attention mask, as
        ``repgeom measure`` runs texts. ``row_ids`` name each sequence in errors.
        """
        device = next(self.lm.model.parameters()).device
        dtype = getattr(self.lm, "mixed_precision_dtype", None)
        size = rows_per_batch or self.batch_size
        order = sorted(range(len(seqs)), key=lambda k: -len(seqs[k])) if as_lm_eval else list(range(len(seqs)))
        with Forward(self.loaded, points, logits=logits) as fwd:
            for start in range(0, len(order), size):
                chunk = order[start: start + size]
                names = [row_ids[k] for k in chunk]
                with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype is not None):
                    if as_lm_eval:
                        ids = torch.zeros((len(chunk), len(seqs[chunk[0]])), dtype=torch.long)
                        for r, k in enumerate(chunk):
                            ids[r, : len(seqs[k])] = torch.as_tensor(list(seqs[k]), dtype=torch.long)
                        batch = fwd.padded(ids, None, row_ids=names)
                    else:
                        batch = fwd.token_ids([seqs[k] for k in chunk], row_ids=names)
                yield chunk, batch
