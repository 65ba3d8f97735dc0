"""lm-eval-harness integration: hardness tasks whose results table shows geometry next to accuracy.

Modules, in the order a run meets them:

* ``_repgeom_lm_eval_hook`` (top level, standard library only, run at start-up by ``repgeom_lm_eval.pth``): adds
  the ``task_configs`` folder to every lm-eval ``TaskManager``.
* ``documents``: ``custom_dataset`` loader (upstream Hub dataset, or a local file through ``--metadata``).
* ``task``: the task classes the YAMLs name; importing it registers the metrics and installs ``session``.
* ``session``: wraps ``lm_eval.evaluator.evaluate`` so that a run with repgeom tasks reads hidden states.
* ``fused``: the hidden states of HFLM's own forward pass (fused), or of an extra pass (fallback).
* ``metrics``: the per-query items and lm-eval aggregations (dispersion, AUROC, deciles, slice Spearman).
* ``registered``: any registered metric at any layers (``repgeom_metrics``), fed from the same capture.
* ``model``: ``repgeom-hf`` for lm-eval's upcoming ``lm_eval.models`` entry points.
"""

SUPPORTED_LM_EVAL = ((0, 4, 13), (0, 5, 0))  # [lowest tested, first unsupported): HFLM's private call order
