"""The checks of the ``repgeom_*`` settings that need no model, run before lm-eval loads one.

``repgeom-hf`` runs them on its model arguments before ``from_pretrained``; the start-up hook
(``_repgeom_lm_eval_hook.patch_config``) runs them on a command line's merged ``--model_args`` and ``--metadata``
when lm-eval prepares its tasks, which it does before it loads the model. Each error names the key, the metric, the
parameter or the plugin.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def check_settings(given: Mapping[str, Any], partial: bool = False) -> None:
    """Unknown keys, every value, the metric names (a switched-off or failing plugin included), their parameters and
    pooling, and the layer addresses' syntax (their range is checked on the model, before its first forward pass).

    ``partial``: ``given`` is only one of the two places settings come from (``repgeom-hf``'s model arguments;
    ``--metadata`` may hold the rest, docs/lmeval.md#settings---metadata), so a setting that needs another one
    (``repgeom_layers`` needs ``repgeom_metrics``) is not refused here: the merged check decides."""
    from repgeom_eval.lmeval.registered import MetricRequest, check_layers, request_items
    from repgeom_eval.spec.options.lmeval import Settings

    settings = Settings.from_metadata(given, "any")
    check_layers(request_items(str(settings.layer), "repgeom_layer"), key="repgeom_layer")
    if partial and settings.metrics in (None, [], ""):
        if settings.layers is not None:
            check_layers(request_items(settings.layers, "repgeom_layers"), key="repgeom_layers")
        return
    MetricRequest.from_settings(settings)
