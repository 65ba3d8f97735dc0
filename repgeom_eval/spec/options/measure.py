"""The run configuration of ``measure``: one frozen, typed object built by the CLI and by the Python API alike.

Each option is declared once, as a field below or in a shared group (repgeom_eval/spec/options/groups.py), with its
command-line flag and help. From these declarations come ``repgeom measure``'s flags, the object built from them
and a ``--config`` file, the resume key of a checkpointed run (:meth:`RunConfig.checkpoint_key`) and the ``config``
block of the results file (:meth:`RunConfig.config_block`). Adding an option means adding a field. The field
machinery is in repgeom_eval/spec/option_fields.py (torch-free).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.spec.option_fields import option, option_like, positive
from repgeom_eval.spec.poolings import POOLING_ALIASES, POOLINGS, check_pooling
from repgeom_eval.spec.options.groups import (DataGroup, JsonGroup, LayersGroup, ModelGroup, OutputGroup, RunGroup,
                                             TextsGroup)

DEFAULT_SHARD_SIZE = 1024  # texts read, batched and checkpointed together
PREPROCESS_METHODS = ("none", "center", "standardize", "whiten")
POOLING_CHOICES = (*POOLINGS, *POOLING_ALIASES)  # the pooling names, and cls (= first)


def _metric_param(text: str) -> tuple[str, str, object]:
    """``name.key=value`` → (name, key, value parsed as JSON when possible)."""
    lhs, sep, raw = text.partition("=")
    metric, dot, key = lhs.partition(".")
    if not sep or not dot or not metric or not key:
        raise argparse.ArgumentTypeError(f"expected METRIC.PARAM=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return metric, key, value


def _params_from_cli(items: Sequence[tuple[str, str, object]]) -> dict[str, dict[str, object]]:
    params: dict[str, dict[str, object]] = {}
    for metric, key, value in items:
        params.setdefault(metric, {})[key] = value
    return params


def split_names(items: str | Sequence[str]) -> tuple[str, ...]:
    """``"a,b"`` or ``["a", "b,c"]`` → ``("a", "b", "c")`` (spaces and commas both separate)."""
    items = [items] if isinstance(items, str) else list(items)
    return tuple(m.strip() for item in items for m in str(item).split(",") if m.strip())


@dataclass(frozen=True, kw_only=True)
class RunConfig(TextsGroup, LayersGroup, RunGroup):
    """Every option of a ``measure`` run (the model and the data are given beside it)."""

    group_title = "measurement"

    layers: str | tuple[str, ...] = option_like(
        LayersGroup, "layers", "final", cli_default=["final"], key=False,  # the resolved addresses are keyed
        help="layer addresses: resid_post:11, mlp_in:-1, resid_mid:*, resid_post:[0,5,-1], embed, final, a bare "
             "hidden-state index, or a selector (all, blocks, knn_keys). Default: final")
    metrics: tuple[str, ...] = option(
        ("dispersion",), "--metrics", nargs="+", cli_default=["dispersion"], key=False, config=False,
        help="metric names (space or comma separated); `repgeom plugins` lists them. Default: dispersion")
    metric_params: Mapping[str, Mapping[str, Any]] = option(
        None, "--metric-param", action="append", type=_metric_param, cli_default=[], metavar="METRIC.PARAM=VALUE",
        from_cli=_params_from_cli, key=False, config=False,
        help="set a metric parameter, e.g. dispersion.per_text=true (repeatable)")
    pooling: str | None = option(
        None, "--pooling", choices=list(POOLING_CHOICES), key=False,  # keyed through each metric's configuration
        help="one vector per text for every metric: last non-pad token, mean, first (= cls), or tokens (every token "
             "vector). Default: each metric's own (last for dispersion, mean for the Layer-by-Layer metrics); "
             "METRIC.pooling=... sets one metric's")
    seed: int = option_like(RunGroup, "seed", help="seed of the augmented views (multi-view metrics)")
    preprocess: str = option(
        "none", "--preprocess", choices=list(PREPROCESS_METHODS), config=False,
        help="transform the vectors before every metric (default none, as in the papers); statistics from the same "
             "data (one extra forward pass) unless --preprocess-stats is given")
    preprocess_stats: str | None = option(
        None, "--preprocess-stats", metavar="FILE", config=False,
        help="reference statistics written earlier with --save-preprocess-stats")
    save_preprocess_stats: str | None = option(
        None, "--save-preprocess-stats", metavar="FILE", key=False, config=False, writes="file",
        help="write the preprocessing statistics of this run (safetensors) for reuse")
    allow_other_stats: bool = option(
        False, "--allow-other-stats", action="store_true",
        help="apply --preprocess-stats computed on another model (or recording none); recorded in the output")
    batch_size: int = option_like(RunGroup, "batch_size", 16, help=None)
    max_length: int | None = option(None, "--max-length", type=int, check=positive,
                                    help="truncate texts to this many tokens (default: the model context)")
    padding_side: str = option("right", "--padding-side", choices=["right", "left"])
    per_text: bool = option(False, key=False)  # on when --per-text OUT.jsonl is given
    massive_share_warning: float = option(0.5, key=False)
    shard_size: int = option(
        DEFAULT_SHARD_SIZE, "--shard-size", type=int, check=positive,
        help="texts read, batched and checkpointed together (memory: one shard + metric states)")
    run_dir: str | None = option(
        None, "--run-dir", metavar="DIR", key=False, writes="folder",
        help="checkpoint the metric states here after every shard, so a killed run can --resume")
    state_device: str = option(
        "model", "--state-device", choices=["model", "cpu"], key=False,
        help="where the metric states live: with the model (default), or cpu: in host memory, so that only the "
             "pooled vectors leave the GPU (the Grams of a wide model with --layers all may not fit beside it); "
             "token metrics keep their few numbers per text with the model")
    resume: bool = option(False, "--resume", action="store_true", key=False, config=False,
                          help="continue the run checkpointed in --run-dir (same model, data and options)")

    def __post_init__(self) -> None:
        self._set("metrics", split_names(self.metrics))
        self._set("metric_params", MappingProxyType(
            {m: MappingProxyType(dict(p)) for m, p in dict(self.metric_params or {}).items()}))
        for name in ("run_dir", "preprocess_stats", "save_preprocess_stats"):
            value = getattr(self, name)
            self._set(name, None if value in (None, "") else str(value))
        if self.pooling is not None:
            self._set("pooling", check_pooling(self.pooling))
        super().__post_init__()  # the groups' normalisation, every field's check and choices
        if self.resume and not self.run_dir:
            raise RepgeomError("resume needs the run directory of the run to continue (--run-dir DIR)")
        if not self.metrics:
            raise RepgeomError("no metric requested")
        if self.allow_other_stats and not self.preprocess_stats:
            raise RepgeomError("--allow-other-stats applies to a --preprocess-stats file; give one (or drop the flag)")
        if self.preprocess == "none" and (self.preprocess_stats or self.save_preprocess_stats):
            flag = "--preprocess-stats" if self.preprocess_stats else "--save-preprocess-stats"
            raise RepgeomError(f"{flag} has no effect without preprocessing; add --preprocess center, standardize "
                               "or whiten (or drop the flag)")



_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
          "t": 1000 ** 4, "tb": 1000 ** 4, "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "tib": 1024 ** 4}


def parse_size(text: str) -> int:
    """``--state-memory SIZE``: bytes from ``8GB``, ``512MiB``, ``2.5G``, ``1000000``."""
    found = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = found.group(2).lower() if found else None
    if not found or unit not in _UNITS or float(found.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give a number with a unit, e.g. 8GB, 512MiB or "
                                         "2.5G")
    return int(float(found.group(1)) * _UNITS[unit])


# -- repgeom measure ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class MeasureCommand(ModelGroup, DataGroup, RunConfig, OutputGroup, JsonGroup):
    """Every option of ``repgeom measure``: the model, the data, the run (RunConfig) and the outputs."""

    model: str | tuple[str, ...] = option_like(
        ModelGroup, "model", check=None,
        help="hub id, local model directory, or .gguf file; repeat (-m A -m B) to measure several models one after "
             "the other, with {model} in the output paths (-o out-{model}.json): one result file per model")
    data: str = option_like(DataGroup, "data", help=".jsonl with a text field per line, .txt with one text per line, "
                            "or a Hugging Face datasets stream hf:NAME?split=train (e.g. "
                            "hf:json?data_files=big.jsonl); read in shards")
    per_text_path: str | None = option(None, "--per-text", writes="file", metavar="OUT.jsonl", key=False, config=False,
                                       help="also write per-text scores (c_i, token dispersion) to this JSONL file")
    dry_run: bool = option(False, "--dry-run", action="store_true", key=False, config=False,
                           help="print the memory the run will hold (every metric state per address, per 1,000 "
                                "texts, the device of each, the weights) from the model's config alone, and stop")
    state_memory: int | None = option(None, "--state-memory", type=parse_size, metavar="SIZE", key=False,
                                      help="refuse to start when the metric states would need more than SIZE (e.g. "
                                           "8GB, 512MiB), estimated as --dry-run does, naming what to drop")
