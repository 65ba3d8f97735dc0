"""How a model is loaded: one group of options, declared once, shared by every command that loads a model.

The fields carry their command-line flags (``--revision``, ``--dtype``, ``--device``, ``--device-map``,
``--trust-remote-code``, ``--allow-random-init``, ``--peft``, ``--quantization``), named after the
``--model_args`` keys lm-eval users know. Every command that loads a model composes its configuration with this group
(with ``--model``: repgeom_eval/spec/options/groups.py); the CLI takes the group out of the command's configuration
(:meth:`~repgeom_eval.spec.option_fields.Options.of`) and passes it on, as an argument, down to
:func:`repgeom_eval.modeling.loading.load_model`; from Python, pass one as
``load_model(name, options=ModelOptions(...))`` (or ``model_options=`` to ``measure``, ``run_layers`` and the analyses). Torch-free, so
that ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.spec.option_fields import Options, option, options_from_namespace

DTYPE_CHOICES = ("auto", "float32", "float64", "bfloat16", "float16")
QUANTIZATION_CHOICES = ("8bit", "4bit")


# Devices that hold no numbers: a model there has shapes only, so every measurement would be meaningless.
NO_DATA_DEVICES = ("meta",)


def device_problem(device: Any) -> str | None:
    """Why ``device`` cannot run a measurement, or None (checked before the model loads; a device torch does not
    know is named by :func:`repgeom_eval.modeling.loading.resolve_device`)."""
    if isinstance(device, str) and device.split(":")[0].strip().lower() in NO_DATA_DEVICES:
        return (f"{device!r} holds tensor shapes but no values, so nothing can be measured there; use cpu, cuda or "
                "auto")
    return None


# from_pretrained keywords that other options set: --model-arg may not set them behind those options' backs
OWN_KEYWORDS = {"dtype": "--dtype", "torch_dtype": "--dtype", "device_map": "--device-map", "revision": "--revision",
                "trust_remote_code": "--trust-remote-code", "quantization_config": "--quantization",
                "gguf_file": "--model FILE.gguf", "output_loading_info": None, "ignore_mismatched_sizes": None,
                "pretrained_model_name_or_path": "--model"}


def _model_arg(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` → (key, value read as JSON where it is JSON: true, 3, 0.5, "x"; else the text)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def _model_args_from_cli(items: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    return dict(items)


def model_args_problem(value: Any) -> str | None:
    """What is wrong with a ``model_args`` mapping (None: nothing)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        return f"expected a mapping of from_pretrained options (KEY=VALUE), got {type(value).__name__}"
    for key in value:
        if not isinstance(key, str) or not key.isidentifier():
            return f"{key!r} is not a keyword name"
        if key in OWN_KEYWORDS:
            flag = OWN_KEYWORDS[key]
            return f"{key} is set by repgeom itself" + (f"; use {flag}" if flag else "")
    return None


@dataclass(frozen=True, kw_only=True)
class ModelOptions(Options):
    """Every option of loading a model (the model itself, a path or hub id, is given beside it)."""

    group_title = "model options"

    dtype: str = option("auto", "--dtype", choices=list(DTYPE_CHOICES),
                        help="auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16, float64")
    device: str = option("cpu", "--device", check=device_problem,
                         help="cpu, cuda, cuda:1 or auto")
    revision: str | None = option(None, "--revision", metavar="REV",
                                  help="hub branch, tag or commit of the model (and its tokenizer)")
    device_map: str | None = option(None, "--device-map", metavar="MAP",
                                    help="spread a large model over devices with accelerate (e.g. auto); "
                                         "replaces --device")
    trust_remote_code: bool = option(False, "--trust-remote-code", action="store_true",
                                     help="allow models that need their own Python code (it runs on this machine); "
                                          "without it such a model is refused")
    allow_random_init: bool = option(False, "--allow-random-init", action="store_true",
                                     help="measure a checkpoint whose tensors do not fill what the measured hidden "
                                          "states read (they stay random; the output's model block lists them); "
                                          "without it such a checkpoint is refused")
    peft: str | None = option(None, "--peft", "--adapter", metavar="ADAPTER",
                              help="a PEFT adapter (LoRA ...) folder applied on top of the model (needs peft)")
    quantization: str | None = option(None, "--quantization", choices=list(QUANTIZATION_CHOICES),
                                      help="load the weights in 8 or 4 bits with bitsandbytes (needs it, and "
                                           "usually a GPU)")
    model_args: Mapping[str, Any] | None = option(None, "--model-arg", action="append", type=_model_arg, cli_default=[],
                                           metavar="KEY=VALUE", from_cli=_model_args_from_cli,
                                           check=model_args_problem,
                                           help="a keyword for the model's from_pretrained, as in lm-eval's "
                                                "--model_args (e.g. experts_implementation=eager, "
                                                "attn_implementation=eager); repeatable")

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES and not hasattr(self.dtype, "is_floating_point"):
            raise RepgeomError(f"unknown dtype {self.dtype!r} (valid: {', '.join(DTYPE_CHOICES)})")
        for name in ("revision", "device_map", "peft"):
            if getattr(self, name) == "":
                self._set(name, None)
        if isinstance(self.model_args, Mapping):
            self._set("model_args", MappingProxyType(dict(self.model_args)) if self.model_args else None)
        super().__post_init__()  # the other groups of a command's configuration, and the choices

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> "ModelOptions":
        """The options among parsed flags (defaults for those absent)."""
        return cls(**options_from_namespace(cls, args))

    def replace(self, **changes: Any) -> "ModelOptions":
        from dataclasses import replace

        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def non_default(self) -> dict[str, Any]:
        """The options that differ from their defaults (recorded in every output's ``model`` block)."""
        out = {}
        for f in fields(ModelOptions):
            value = getattr(self, f.name)
            if f.name not in ("dtype", "device") and value != f.default:
                out[f.name] = dict(value) if isinstance(value, Mapping) else value
        return out

