"""What a ``repgeom train`` run reports: the per-domain evaluations grouped by step, the per-step training log and
``results.json`` (the config with every default, the trained model's description, the data, the timings)."""

from __future__ import annotations

import math
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from repgeom_eval.spec.options.train import TrainConfig


@dataclass
class TrainResult:
    """What ``repgeom train`` writes to ``results.json``."""

    config: dict[str, Any]
    model: dict[str, Any]
    data: dict[str, Any]
    evaluations: list[dict[str, Any]]
    train_log: list[dict[str, Any]]
    timings: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "model": self.model, "data": self.data, "evaluations": self.evaluations,
                "train_log": self.train_log, "timings": self.timings}

    def perplexity_table(self) -> list[dict[str, Any]]:
        """One row per evaluation: {step, DOMAIN: perplexity, ...}."""
        return [{"step": e["step"], **e["perplexity"]} for e in self.evaluations]


def evaluations(history: list[dict[str, Any]], domains: Sequence[str]) -> list[dict[str, Any]]:
    """Group the Trainer's per-dataset eval logs by step: [{step, loss: {domain: ..}, perplexity: {domain: ..}}]."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in history:
        for name in domains:
            key = f"eval_{name}_loss"
            if key in row:
                entry = by_step.setdefault(row["step"], {"step": row["step"], "loss": {}, "perplexity": {}})
                entry["loss"][name] = row[key]
                entry["perplexity"][name] = math.exp(row[key]) if row[key] < 700 else math.inf
    return [by_step[s] for s in sorted(by_step)]


def train_log(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-step training rows (loss, CE, each aux loss, the batch dispersion) of the Trainer's log."""
    return [row for row in history if "loss" in row and "ce" in row]


def model_block(model: Any, cfg: TrainConfig, source: dict[str, Any], host: Any) -> dict[str, Any]:
    """``results.json``'s ``model``: the trained model as measuring it would describe it, with the model options
    that differ from their defaults (as every command records them)."""
    from repgeom_eval.modeling.loading import wrap_model

    info = wrap_model(model, name=cfg.model or "gpt2 (from scratch)", source=source["kind"], host=host).info
    info.options = cfg.model_options.non_default()
    return info.to_dict()


def config_block(cfg: TrainConfig, *, source: dict[str, Any], losses: Sequence[Any], host: Any,
                 training_arguments: dict[str, Any], evaluate_at: list[int]) -> dict[str, Any]:
    """``results.json``'s ``config``: the settings, completed by what the run resolved them to."""
    import torch
    import transformers

    from repgeom_eval import __version__

    return cfg.config_block({
        "source": source,
        "aux_losses": [loss.get_config_dict() for loss in losses],
        "plugins": host.provenance("aux_loss", [loss.name for loss in losses]),  # docs/plugins.md#provenance
        "objective": "CE + " + " + ".join(f"{loss.weight}·{loss.name}" for loss in losses) if losses else "CE",
        "training": {k: v for k, v in training_arguments.items() if k != "output_dir"},
        "evaluate_at": evaluate_at,
        "torch_threads": cfg.torch_threads or torch.get_num_threads(),
        "versions": {"repgeom_eval": __version__, "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
    })
