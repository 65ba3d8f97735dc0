"""``repgeom-hf``: lm-eval's HFLM, registered under a name of its own for lm-eval's ``lm_eval.models`` entry points.

It behaves exactly like ``--model hf``; the geometry comes from the run's repgeom tasks either way. What the name
adds: with an lm-eval that reads the ``lm_eval.models`` entry points, ``--model repgeom-hf`` loads repgeom-eval's
lm-eval integration (metrics, hidden-state capture) even when ``REPGEOM_LM_EVAL_AUTOLOAD=0`` keeps the start-up
hook off. With lm-eval 0.4.13 it is registered when this module is imported (``repgeom lm-eval`` does that).
"""

from __future__ import annotations

from lm_eval.api.registry import model_registry, register_model
from lm_eval.models.huggingface import HFLM

from . import metrics, session  # noqa: F401  (registers the metrics; wraps lm-eval's evaluate)

NAME = "repgeom-hf"


class RepgeomHFLM(HFLM):
    """HFLM under the name ``repgeom-hf`` (see the module docstring)."""


if NAME not in model_registry:
    register_model(NAME)(RepgeomHFLM)
session.install()
