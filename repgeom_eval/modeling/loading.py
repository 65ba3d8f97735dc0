"""Loading a model and its tokenizer from a hub id, a local directory or a ``.gguf`` file."""

from __future__ import annotations

import os
import pickle
import re
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from repgeom_eval.spec.errors import RepgeomError, first_line
from repgeom_eval.modeling.gguf_cache import check_gguf_packages, convert_gguf, gguf_cache_dir, quiet_transformers
from repgeom_eval.modeling.adapters import adapter_base, apply_adapter
from repgeom_eval.modeling.layout import Layout, text_config
from repgeom_eval.modeling.weights_check import check_loading_report, check_safetensors
from repgeom_eval.spec.options.model import ModelOptions

__all__ = ["LoadedModel", "ModelInfo", "ModelOptions", "auto_class", "load_model",
           "locate_model", "model_files", "wrap_model"]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelInfo:
    """What the results file records about the model."""

    name: str
    model_type: str
    architecture: str
    n_layers: int
    hidden_size: int
    dtype: str
    n_parameters: int
    vocab_size: int | None
    max_positions: int | None
    source: str  # "directory", "gguf", "hub" or "memory"
    random_init_tensors: list[str] = field(default_factory=list)  # only with --allow-random-init
    n_hidden_states: int | None = None  # entries of the model's own hidden_states (L + 1 on nearly every model)
    # how the layers were found (modeling/discovery.py): blocks, table, block kinds, refused sites, notes
    layers: dict[str, Any] = field(default_factory=dict)
    # checkpoint tensors that no measured hidden state reads and that stay randomly initialised (a pooler, an LM head
    # of another class): harmless for geometry, refused where logits are needed
    unused_random_tensors: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)  # model options other than their defaults (--peft ...)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("random_init_tensors", "unused_random_tensors", "layers", "options"):
            if not out[key]:  # the normal case: the checkpoint filled every tensor
                del out[key]
        return out


@dataclass
class LoadedModel:
    model: Any  # transformers.PreTrainedModel
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    layout: Layout  # every layer-address site, found and checked when the model loaded
    info: ModelInfo
    device: torch.device
    #: where ``load_model`` spent its time: reading the files, the load check (layer discovery), the weights check
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def runner(self) -> Any:
        """The module a measurement calls: the model, or the encoder of an encoder-decoder model."""
        return self.model.get_submodule(self.layout.runner) if self.layout.runner else self.model

    def check_logits(self, what: str) -> None:
        """Refuse to compute ``what`` from logits the model does not make, or makes from random tensors."""
        if not self.layout.logits:
            raise RepgeomError(f"{what} needs next-token logits, but model {self.info.name!r} "
                               f"({self.info.model_type}) has no language-model head in this form")
        if self.info.unused_random_tensors:
            shown = ", ".join(self.info.unused_random_tensors[:3])
            raise RepgeomError(f"{what} needs next-token logits, but model {self.info.name!r} lacks the tensors "
                               f"{shown} in its checkpoint, so its logits would be random; save the model with "
                               "its language-model head")


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    try:
        return DTYPES[dtype]
    except KeyError:
        raise RepgeomError(f"unknown dtype {dtype!r} (valid: auto, {', '.join(DTYPES)})") from None


def resolve_device(device: str | torch.device | None, planned: bool = False) -> torch.device:
    """``device`` as a torch device, checked. ``planned``: for a plan made elsewhere (``--dry-run`` on a machine
    without the GPU the run will have), a CUDA device need not be present here."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from repgeom_eval.spec.options.model import device_problem

    if (problem := device_problem(str(device))) is not None:
        raise RepgeomError(f"--device {problem}")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise RepgeomError(f"bad device {device!r}: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available() and not planned:
        raise RepgeomError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    return dev


def locate_model(name: str) -> tuple[str, dict[str, Any], str]:
    """Where a model name points, without reading it: (path or hub id for ``from_pretrained``, extra kwargs such
    as ``gguf_file``, source kind ``"directory"``, ``"gguf"`` or ``"hub"``). A path that does not exist, or is not a
    model directory or .gguf file, is a RepgeomError."""
    path = Path(os.path.expanduser(name))
    if path.is_file():
        if path.suffix != ".gguf":
            raise RepgeomError(f"model {name!r} is a file but not a .gguf file; pass a model directory, "
                               "a .gguf file or a Hugging Face hub id")
        return str(path.parent), {"gguf_file": path.name}, "gguf"
    if path.is_dir():
        if not (path / "config.json").exists():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return str(path), {"gguf_file": ggufs[0].name}, "gguf"
            if (path / "adapter_config.json").is_file():
                raise RepgeomError(f"{name!r} is a PEFT adapter folder (adapter_config.json), not a model: pass its "
                                   f"base model as --model and the folder as --peft {name}"
                                   + adapter_base(path / "adapter_config.json"))
            raise RepgeomError(f"model directory {name!r} has no config.json"
                               + (f" and {len(ggufs)} .gguf files; pass one of them" if ggufs else ""))
        return str(path), {}, "directory"
    looks_like_path = name.startswith((".", "/", "~")) or name.endswith(".gguf") or name.count("/") > 1
    if looks_like_path:
        raise RepgeomError(f"model path {name!r} does not exist")
    return name, {}, "hub"


def model_files(names: str | Sequence[str]) -> tuple[list[str], list[str]]:
    """(files, folders) that loading ``names`` reads, for :func:`repgeom_eval.output.files.check_outputs`: a
    ``.gguf`` file is a file input, a model directory a folder nothing may be written into; a hub id (or a path
    that does not exist: loading reports it) is neither."""
    files: list[str] = []
    folders: list[str] = []
    for name in [names] if isinstance(names, str) else list(names):
        if isinstance(name, LoadedModel):
            continue
        path = Path(os.path.expanduser(str(name)))
        if path.is_file():
            files.append(str(name))
        elif path.is_dir():
            folders.append(str(name))
    return files, folders


def load_model(
    name: str,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    host: Any = None,
    *,
    options: ModelOptions | None = None,
) -> LoadedModel:
    """Load model + tokenizer, find and check its layers (:mod:`~repgeom_eval.modeling.discovery`), put the model in
    eval mode on its device.

    ``options`` (a :class:`~repgeom_eval.spec.options.model.ModelOptions`; default: its defaults) say how: revision, dtype, device or device map, remote code, random initialisation, a
    PEFT adapter, quantization, other ``from_pretrained`` keywords; ``dtype`` and ``device``, when given, win.

    The checkpoint is measured as saved or refused: tensors that the measured hidden states read but the files lack,
    tensors the files hold in the modules those states come from but the architecture has no place for, and tensors
    of the wrong shape are a :class:`RepgeomError` naming them, unless ``allow_random_init``. Tensors no hidden state
    reads (a pooler, the LM head of another class) are listed in ``info.unused_random_tensors`` instead, and refused
    only where logits are needed. A model that needs its own Python code loads only with ``trust_remote_code``.
    """
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    from repgeom_eval.plugin_system.host import get_host

    host = host or get_host()
    t_read = time.perf_counter()
    opts = (options or ModelOptions()).replace(dtype=dtype, device=device)
    dev = resolve_device(opts.device)
    torch_dtype = resolve_dtype(opts.dtype, dev)
    target, extra, source = locate_model(name)
    if opts.revision and source != "hub":
        raise RepgeomError(f"--revision {opts.revision!r} names a version on the Hugging Face Hub, but {name!r} is a "
                           "local model; drop --revision")
    remote = {"trust_remote_code": opts.trust_remote_code}
    if opts.revision:
        remote["revision"] = opts.revision
    weights = _weights_options(opts, name) | dict(opts.model_args or {})
    cache = gguf_cache_dir(Path(target) / extra["gguf_file"]) if source == "gguf" else None
    if source == "gguf" and (cache is None or not (cache / "config.json").is_file()):
        check_gguf_packages(name)  # a converted copy in the cache loads without them
    if cache is not None and not (cache / "config.json").is_file():
        convert_gguf(target, extra, remote, cache, lambda c: auto_class(c, host))  # one float32 copy, whatever dtype is asked for
    from_cache = cache is not None and (cache / "config.json").is_file()
    if from_cache:
        target, extra = str(cache), {}
    try:
        config = AutoConfig.from_pretrained(target, **extra, **remote)
    except Exception as exc:  # noqa: BLE001 - a config.json of the wrong types raises huggingface_hub's own errors
        bad = _bad_config(name, exc)
        if bad is not None:
            raise bad from None
        if not isinstance(exc, (OSError, ValueError)):
            raise
        _refuse_remote_code(name, exc)
        if source == "hub":
            raise RepgeomError(
                f"model {name!r} is not a local directory or .gguf file, and it could not be fetched from the "
                f"Hugging Face Hub or found in its cache ({first_line(exc)}); pass a local model directory"
            ) from None
        raise RepgeomError(f"cannot read the model config of {name!r}: {first_line(exc)}") from None
    auto = auto_class(config, host)
    if source == "directory" or from_cache:
        check_safetensors(Path(target), name)
    try:
        with quiet_transformers():
            try:
                tokenizer = AutoTokenizer.from_pretrained(target, **extra, **remote)
            except (OSError, ValueError, TypeError, AttributeError, KeyError, RuntimeError) as exc:
                _refuse_remote_code(name, exc)
                raise RepgeomError(f"model {name!r}: its tokenizer is missing or unusable ({first_line(exc)[:160]}); "
                                   "put the model's tokenizer files (tokenizer.json, tokenizer_config.json, vocab ...) "
                                   "in its folder") from None
            try:
                model, report = auto.from_pretrained(target, dtype=torch_dtype, output_loading_info=True, **extra,
                                                     **remote, **weights)
            except RuntimeError as exc:
                if "ignore_mismatched_sizes" not in str(exc):
                    raise
                # Tensors of the wrong shape: load again to learn which (the check below refuses them by name).
                model, report = auto.from_pretrained(target, dtype=torch_dtype, output_loading_info=True,
                                                     ignore_mismatched_sizes=True, **extra, **remote, **weights)
    except Exception as exc:  # noqa: BLE001 - sorted below: a user's broken files get one line, bugs a traceback
        bad = _bad_config(name, exc)
        if bad is not None:
            raise bad from None
        if not isinstance(exc, (OSError, ValueError, ImportError, RuntimeError, TypeError, EOFError,
                                pickle.UnpicklingError)) and type(exc).__name__ != "SafetensorError":
            raise
        _refuse_remote_code(name, exc)
        raise RepgeomError(f"cannot load model {name!r}: {first_line(exc)}") from None
    if "device_map" not in weights:  # a device map or a quantized model is already where accelerate put it
        model.to(dev)
    model.eval().requires_grad_(False)
    if opts.peft:
        model = apply_adapter(model, opts.peft, name)
    if tokenizer.pad_token is None:
        # Only the attention mask matters for padded positions; any existing token will do.
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token or tokenizer.bos_token
    if tokenizer.pad_token is None:
        raise RepgeomError(f"model {name!r}: its tokenizer defines no pad, eos, unk or bos token, so texts of "
                           "different lengths cannot be batched; name one in its tokenizer_config.json (e.g. "
                           "\"pad_token\": \"<pad>\")")
    check_tokenizer(tokenizer, name)
    t_check = time.perf_counter()
    loaded = wrap_model(model, tokenizer, name=name, source=source, host=host)
    t_weights = time.perf_counter()
    random_init, unused = check_loading_report(name, report, opts, model, loaded.layout)
    loaded.timings = {"read_s": t_check - t_read, "load_check_s": t_weights - t_check,
                      "weights_check_s": time.perf_counter() - t_weights}
    loaded.info.random_init_tensors = random_init
    loaded.info.unused_random_tensors = unused
    loaded.info.options = opts.non_default()
    for note in loaded.layout.notes:
        if "encoder is measured" in note or "multimodal" in note:
            warnings.warn(f"model {name!r}: {note}", stacklevel=2)
    return loaded


def _weights_options(opts: ModelOptions, name: str) -> dict[str, Any]:
    """``from_pretrained`` keywords for a device map and quantization (both through accelerate/bitsandbytes)."""
    import importlib.util

    out: dict[str, Any] = {}
    if opts.device_map:
        if importlib.util.find_spec("accelerate") is None:
            raise RepgeomError("--device-map needs the accelerate package: pip install accelerate")
        out["device_map"] = opts.device_map
    if opts.quantization:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise RepgeomError(f"--quantization {opts.quantization} needs the bitsandbytes package: "
                               "pip install bitsandbytes")
        from transformers import BitsAndBytesConfig

        bits = {"8bit": {"load_in_8bit": True}, "4bit": {"load_in_4bit": True}}[opts.quantization]
        out["quantization_config"] = BitsAndBytesConfig(**bits)
        out.setdefault("device_map", "auto")
    return out


TOKENIZER_PROBE = "The quick brown fox jumps over the lazy dog, twice: 1 2 3."


def check_tokenizer(tokenizer: Any, name: str) -> None:
    """Refuse a tokenizer that cannot read ordinary text: missing files make transformers build an empty one that
    turns every word into the unknown token, and every text would then measure the same."""
    try:
        ids = list(tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"])
    except Exception as exc:  # noqa: BLE001 - a broken tokenizer raises anything
        raise RepgeomError(f"model {name!r}: its tokenizer fails on ordinary text ({first_line(exc)}); put the "
                           f"model's own tokenizer files beside it") from None
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    unk = getattr(tokenizer, "unk_token_id", None)
    known = [i for i in ids if i not in special and i != unk]
    if len(known) < 3:
        raise RepgeomError(f"model {name!r}: its tokenizer is missing or unusable (ordinary text becomes "
                           f"{len(ids) - len(known)} unknown or special token(s) of {len(ids)}; vocabulary of "
                           f"{len(tokenizer)}); put the model's tokenizer files (tokenizer.json, tokenizer_config.json, "
                           "vocab ...) in its folder")


def auto_class(config: Any, host: Any = None) -> Any:
    """The transformers Auto class a checkpoint is loaded with: causal LMs with their head (for logits), encoders
    and encoder-decoder models (whose encoder is measured) as the bare model, multimodal wrappers with theirs."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    model_type = config.model_type
    spec = host.architectures.get(model_type) if host is not None and model_type in host.architectures else None
    if spec is not None:
        return transformers.AutoModelForCausalLM if spec.causal else transformers.AutoModel
    auto_map = getattr(config, "auto_map", None) or {}
    saved_as = (getattr(config, "architectures", None) or [None])[0]
    if isinstance(saved_as, str) and saved_as.endswith("EncoderModel") and hasattr(transformers, saved_as):
        return getattr(transformers, saved_as)  # T5EncoderModel and kin: the encoder alone, saved as such
    if getattr(config, "is_encoder_decoder", False):
        return transformers.AutoModel
    encoder = model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)
    if (model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or "AutoModelForCausalLM" in auto_map) and not encoder:
        return transformers.AutoModelForCausalLM
    if model_type in getattr(auto, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", {}):
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModel


def _bad_config(name: str, exc: BaseException) -> RepgeomError | None:
    """A config.json value of the wrong type (``"hidden_size": "32"``), which transformers 5 validates through
    huggingface_hub's strict dataclasses: one line naming the field, or None for any other error."""
    if not any(c.__name__.startswith("StrictDataclass") for c in type(exc).__mro__):
        return None
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    detail = lines[-1] if lines else type(exc).__name__
    detail = detail.removeprefix("TypeError: ").removeprefix("ValueError: ").split(". Errors:")[0]
    detail = re.sub(r"<class '(?:\w+\.)*(\w+)'>", r"\1", detail)  # <class 'int'> -> int
    return RepgeomError(f"model {name!r}: its config.json does not fit its architecture: {detail}; fix config.json")


def _refuse_remote_code(name: str, exc: BaseException) -> None:
    """A model that needs its own code, loaded without ``--trust-remote-code``: one line that says so."""
    text = str(exc)
    if "trust_remote_code" in text:
        raise RepgeomError(f"model {name!r} needs its own Python code to load; pass --trust-remote-code if you "
                           "trust its source (it runs on this machine)") from None


def wrap_model(model: Any, tokenizer: Any = None, name: str | None = None, source: str = "memory",
               host: Any = None) -> LoadedModel:
    """A :class:`LoadedModel` for a model already in memory (e.g. one being trained), left as it is.

    Its layers are found and checked by :func:`~repgeom_eval.modeling.discovery.discover` (once per model object),
    with the architecture table registered for its ``config.model_type``, if any, on top.
    """
    from repgeom_eval.modeling.discovery import describe, discover
    from repgeom_eval.plugin_system.host import get_host

    host = host or get_host()
    config = model.config
    model_type = getattr(config, "model_type", "")
    spec = host.architectures.get(model_type) if model_type in host.architectures else None
    layout = discover(model, spec, model_type if spec is not None else None)
    param = next(model.parameters(), None)
    text = text_config(config)
    info = ModelInfo(
        name=name or getattr(config, "_name_or_path", "") or type(model).__name__,
        model_type=model_type,
        architecture=type(model).__name__,
        n_layers=layout.n_layers,
        hidden_size=int(getattr(text, "hidden_size", 0) or getattr(text, "n_embd", 0)
                        or getattr(text, "d_model", 0) or 0),
        dtype=str(param.dtype if param is not None else torch.get_default_dtype()).replace("torch.", ""),
        n_parameters=sum(p.numel() for p in model.parameters()),
        vocab_size=getattr(text, "vocab_size", None),
        max_positions=_positive(getattr(text, "max_position_embeddings", None)
                                or getattr(text, "n_positions", None)),  # XLNet says -1: no limit
        source=source,
        n_hidden_states=len(layout.hidden_states),
        layers=dict(describe(layout)),
    )
    from repgeom_eval.modeling.probe import input_device

    return LoadedModel(model=model, tokenizer=tokenizer, layout=layout, info=info, device=input_device(model))




def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
