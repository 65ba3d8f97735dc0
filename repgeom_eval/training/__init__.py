"""Training with auxiliary losses on hidden states (``repgeom train``), one idea per module:

* :mod:`~repgeom_eval.spec.options.train`: the settings (``TrainConfig``, read from YAML, checked in one place by
  :mod:`~repgeom_eval.spec.options.settings`);
* :mod:`~repgeom_eval.training.data`: each domain's texts packed into token blocks;
* :mod:`~repgeom_eval.training.model`: the model trained (a checkpoint, or a GPT-2 from scratch);
* :mod:`~repgeom_eval.training.loop`: the run (``train``); :mod:`~repgeom_eval.training.results`: what it reports;
* :mod:`~repgeom_eval.training.auxloss`: the ``AuxLoss`` interface; :mod:`~repgeom_eval.training.trainer`: the
  ``AuxLossTrainer``; :mod:`~repgeom_eval.training.geometry`: the ``GeometryCallback`` (G and probe dispersion at
  every saved checkpoint).

The public names are importable from here (``from repgeom_eval.training import train, read_config``); each loads its
module on first use, so importing the package (as every aux-loss plugin does) costs nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

_CONFIG = "repgeom_eval.spec.options.train"  # the settings are declared on the torch-free floor
_HOMES = {
    "TrainConfig": _CONFIG, "DataOptions": _CONFIG, "Domain": _CONFIG, "ScratchModel": _CONFIG,
    "read_config": _CONFIG, "parse_config": _CONFIG, "set_dotted": _CONFIG,
    "split_texts": "data", "pack_blocks": "data",
    "build_model": "model", "train_tokenizer": "model",
    "train": "loop", "check_train_outputs": "loop", "TrainResult": "results",
    "AuxLoss": "auxloss", "build_aux_loss": "auxloss",
    "AuxLossTrainer": "trainer", "EvaluateAtSteps": "trainer",
    "GeometryProbe": _CONFIG, "GeometryCallback": "geometry", "pick_checkpoint": "geometry",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home if "." in home else f"{__name__}.{home}"), name)
