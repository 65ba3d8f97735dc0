"""Augmented views of a text for the multi-view metrics (InfoNCE, LiDAR, DiME; docs/metrics.md#augmented-views).

The recipe is nlpaug's character-level chain used by the Layer-by-Layer code — ``SplitAug``, ``RandomCharAug``
and ``KeyboardAug`` with their defaults (p = 0.3) — with two fixes: each view is seeded from (seed, text index,
view index), so identical seeds give identical views whatever the batching, and the augmented string itself is
used (the reference code tokenized the ``str()`` of a one-element list).
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

from repgeom_eval.spec.errors import RepgeomError

RECIPES = ("char_chain",)


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """nlpaug draws from the global ``random`` and ``numpy.random`` states: seed them, then restore them."""
    py_state, np_state = random.getstate(), np.random.get_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


class Augmenter:
    """``Augmenter(seed=0).view(text, index=i, view=v)`` → the v-th augmented view of text i."""

    def __init__(self, seed: int = 0, recipe: str = "char_chain"):
        if recipe not in RECIPES:
            raise RepgeomError(f"unknown augmentation recipe {recipe!r} (valid: {', '.join(RECIPES)})")
        try:
            import nlpaug.augmenter.char as nac
            import nlpaug.augmenter.word as naw
            import nlpaug.flow as naf
        except ImportError:
            raise RepgeomError("augmented views need nlpaug: pip install 'repgeom-eval[aug]'") from None
        self.seed, self.recipe = seed, recipe
        self._flow: Any = naf.Sequential([naw.SplitAug(), nac.RandomCharAug(), nac.KeyboardAug()])

    def view(self, text: str, index: int, view: int) -> str:
        state = np.random.SeedSequence([self.seed, index, view]).generate_state(1)[0]
        with _seeded(int(state)):
            out = self._flow.augment(text, n=1)
        out = out[0] if isinstance(out, list) and out else out
        return out if isinstance(out, str) and out.strip() else text  # nlpaug may return nothing for tiny texts

    def config(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "seed": self.seed, "chain": "SplitAug>RandomCharAug>KeyboardAug", "p": 0.3}
