"""The labels of a series of models (checkpoints) that one analysis measures side by side."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from repgeom_eval.modeling.loading import LoadedModel


def model_label(model: str | LoadedModel) -> str:
    """The last part of a model's path or hub id (a loaded model: of the name it was loaded under)."""
    name = model.info.name if isinstance(model, LoadedModel) else str(model)
    return Path(name.rstrip("/")).name or name


def series_labels(models: Sequence[str | LoadedModel]) -> list[str]:
    """One label per model, in order; when two would read alike (checkpoints named alike), all are numbered."""
    labels = [model_label(m) for m in models]
    if len(set(labels)) != len(labels):
        labels = [f"{i + 1}:{lab}" for i, lab in enumerate(labels)]
    return labels
