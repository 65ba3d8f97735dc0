"""lm-eval-harness integration: hardness tasks whose results table shows geometry next to accuracy.

Modules, in the order a run meets them:

* ``_repgeom_lm_eval_hook`` (top level, standard library only, run at start-up by ``repgeom_lm_eval.pth``): adds
  the ``task_configs`` folder to every lm-eval ``TaskManager``, the ``repgeom-hf`` model name, one-line errors and
  the settings check before the model loads.
* the ``repgeom_*`` keys of ``--metadata`` (and ``--model_args``) are declared once on the torch-free floor,
  :mod:`repgeom_eval.spec.options.lmeval`.
* ``documents``: ``custom_dataset`` loader (upstream Hub dataset, or a local file through ``--metadata``).
* ``task``: the task classes the YAMLs name; importing it registers the metrics and installs ``session``.
* ``session``: wraps ``lm_eval.evaluator.evaluate`` so that a run with repgeom tasks reads hidden states.
* ``fused``: the capture of HFLM's own forward pass: each task's (address, pooling) read from the rows it scores.
* ``scored``: what HFLM scores for one request (a row, its token keys and spans) and the results that carry it.
* ``feeding``: the registered metrics' banks (``registered``), fed from the same rows.
* ``extra_pass``: the one extra forward pass, for rows the capture did not read and for augmented views.
* ``metrics``: the per-query items and lm-eval aggregations (dispersion, AUROC, deciles, slice Spearman).
* ``registered``: any registered metric at any layers (``repgeom_metrics``): the request and its states.
* ``ranks``: lm-eval's data-parallel ranks, for the sums and states gathered in ``apply_filters``.
* ``model``: ``repgeom-hf`` (plain ``lm_eval`` knows it through the start-up hook, a lazy placeholder).
* ``precheck``: every check of the ``repgeom_*`` settings that needs no model, run before the model loads.
* ``any_task``: the registered metrics added to every other task of a ``repgeom-hf`` run (stock tasks, groups,
  a user's YAML; loglikelihood, multiple-choice, rolling and generation).
* ``diagnostics``: ``repgeom measure``'s warnings (degenerate numbers, a massive dimension) for those metrics.
"""

SUPPORTED_LM_EVAL = ((0, 4, 13), (0, 5, 0))  # [lowest tested, first unsupported): HFLM's private call order
