"""``repgeom-hf``: lm-eval's HFLM, registered under a name of its own for lm-eval's ``lm_eval.models`` entry points.

It behaves like ``--model hf``; the geometry comes from the run's repgeom tasks either way. What the name adds:

* with an lm-eval that reads the ``lm_eval.models`` entry points, ``--model repgeom-hf`` loads repgeom-eval's lm-eval
  integration (metrics, hidden-state capture) even when ``REPGEOM_LM_EVAL_AUTOLOAD=0`` keeps the start-up hook off
  (with lm-eval 0.4.13 it is registered when this module is imported; ``repgeom lm-eval`` does that);
* the tasks' settings may be given in ``--model_args`` (``pretrained=...,repgeom_layer=resid_post:-1``): lm-eval
  merges the model arguments into the metadata every task receives, and ``repgeom-hf`` checks their keys and keeps
  them from the model's ``from_pretrained``, where HFLM sends any argument it does not know
  (docs/lmeval.md#settings---metadata).
"""

from __future__ import annotations

from typing import Any

from lm_eval.api.registry import model_registry, register_model
from lm_eval.models.huggingface import HFLM

from repgeom_eval.lmeval import metrics, session  # noqa: F401  (registers the metrics; wraps lm-eval's evaluate)
from repgeom_eval.lmeval.settings import PREFIX, settings_in

NAME = "repgeom-hf"


class RepgeomHFLM(HFLM):
    """HFLM under the name ``repgeom-hf`` (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        settings_in({k: kwargs.pop(k) for k in list(kwargs) if k.startswith(PREFIX)})  # unknown keys fail here
        super().__init__(*args, **kwargs)


if NAME not in model_registry:
    register_model(NAME)(RepgeomHFLM)
session.install()
