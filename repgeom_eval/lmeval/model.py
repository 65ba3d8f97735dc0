"""``repgeom-hf``: lm-eval's HFLM, registered under a name of its own for lm-eval's ``lm_eval.models`` entry points.

Without a ``repgeom_*`` argument it behaves exactly like ``--model hf``. What the name adds:

* ``repgeom_metrics`` (and ``repgeom_layers``, ``repgeom_pooling``, ...) in its model arguments or in ``--metadata``
  add the registered metrics to every task of the run, lm-eval's own tasks included
  (:mod:`repgeom_eval.lmeval.any_task`);
* plain ``lm_eval`` knows the name through the start-up hook (``_repgeom_lm_eval_hook.register_model_name``, a lazy
  placeholder: this module is imported only when a run asks for ``repgeom-hf``); ``repgeom lm-eval`` registers it
  whatever ``REPGEOM_LM_EVAL_AUTOLOAD`` says, and lm-eval versions that read the ``lm_eval.models`` entry points
  will find it there;
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
from repgeom_eval.lmeval.precheck import check_settings
from repgeom_eval.spec.options.lmeval import PREFIX, rejoin_brackets

NAME = "repgeom-hf"


class RepgeomHFLM(HFLM):
    """HFLM under the name ``repgeom-hf`` (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs = rejoin_brackets(kwargs)  # a model-argument string split at the commas of resid_post:[0,1]
        given = {k: kwargs.pop(k) for k in list(kwargs) if k.startswith(PREFIX)}
        check_settings(given, partial=True)  # every repgeom_* setting, before the model loads (--metadata: later)
        self.repgeom_metadata = given  # read by the session: every task of the run gets repgeom_metrics
        super().__init__(*args, **kwargs)


if NAME not in model_registry:
    register_model(NAME)(RepgeomHFLM)
session.install()
