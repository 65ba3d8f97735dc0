"""The configuration of ``repgeom train``: one frozen, typed object, read from a YAML file or built in Python.

Each setting is declared once, as a field below (the machinery is in :mod:`repgeom_eval.spec.options.settings`). From
the declarations come the keys a config file may give (an unknown one is refused with the closest valid key), the
check of every value, the list of keys in ``repgeom train --help`` (:func:`config_keys_help`) and the ``config``
block of ``results.json`` (:meth:`TrainConfig.config_block`). A config file looks like::

    model: ./my-model                 # continued training (a directory, .gguf or cached hub id), or, with options:
    # model: {name: org/model, revision: v1, trust_remote_code: true}   # the keys of the model options group
    # from_scratch: {n_layer: 4, n_embd: 128, n_head: 4, vocab_size: 4096}   # GPT-2; BPE trained on the data
    data:
      block_size: 128
      domains:                        # one label per domain; blocks never mix domains
        prose: {train: prose.jsonl, eval: prose_test.jsonl}
        code: {train: code.jsonl}     # no eval file: eval_fraction of its texts is held out
    aux_losses:
      - {name: push_away, weight: 0.01, cross_domain: true}
    training: {max_steps: 200, per_device_train_batch_size: 8, learning_rate: 5.0e-4}   # TrainingArguments
    evaluate_at: [100, 200]
    geometry_probe: {texts: probe.jsonl, layers: [final, 2]}   # G and probe dispersion at every saved checkpoint
    output_dir: runs/push_away

Relative paths are relative to the config file. Every default is written into ``results.json``'s ``config``.
"""

from __future__ import annotations

import copy
import os
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from repgeom_eval.spec.options.analyses import GapConfig
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.spec.options.model import ModelOptions
from repgeom_eval.spec.option_fields import (Must, excerpt, integer_at_least, is_integer, is_number, option,
                                             option_like, parse_yaml, read_yaml_file)
from repgeom_eval.spec.options.settings import (NON_EMPTY_STRING, ConfigError, check, check_types, config_block,
                                            from_mapping, help_of, setting)
from repgeom_eval.spec.options.groups import RunGroup

# Our defaults for TrainingArguments (the user's `training:` wins): log every step, no checkpoints, no wandb.
TRAINING_DEFAULTS: dict[str, Any] = {"logging_steps": 1, "save_strategy": "no", "report_to": "none",
                                     "eval_strategy": "no", "per_device_eval_batch_size": 8}
# A trained model loads in float32 whatever the device: mixed precision is the Trainer's (training: {bf16: true}),
# which keeps float32 master weights; ModelOptions' own "auto" would load bfloat16 weights on a GPU.
TRAINING_MODEL_OPTIONS = ModelOptions(dtype="float32", device="cpu")  # the Trainer moves the model to its device

GEOMETRY_FILE = "geometry_by_checkpoint.json"  # what GeometryCallback writes into its output folder
GAP_DEFAULTS = GapConfig()  # G's token sets default as in `repgeom gap` (declared there once)
FILE_PATH = Must("a file path", lambda v: isinstance(v, str) and bool(v.strip()))


def _frozen_mapping(value: Any) -> Any:
    return MappingProxyType(dict(value)) if isinstance(value, Mapping) else value


def _training_arguments(value: Any) -> Any:
    """The ``training`` mapping, with YAML 1.1's ``no`` (read as false) given back as the string ``"no"`` where
    TrainingArguments wants one: ``save_strategy: no``, ``eval_strategy: no`` ..."""
    if isinstance(value, Mapping):
        value = {k: "no" if str(k).endswith("_strategy") and value[k] is False else value[k] for k in value}
    return _frozen_mapping(value)


@dataclass(frozen=True, kw_only=True)
class Domain:
    """One domain's text files (a config file may give just the training file: ``prose: prose.jsonl``)."""

    train: str = setting(help="its training texts: .jsonl, .txt ...", must=FILE_PATH)
    eval: str | None = setting(None, help="its evaluation texts; without them data.eval_fraction of its training "
                                          "texts is held out", must=Must("a file path or null",
                                                                         lambda v: v is None or FILE_PATH.holds(v)))

    def __post_init__(self) -> None:
        check(self)


def _domains(value: Any) -> Any:
    if not isinstance(value, Mapping):
        return value  # the check says what it must be
    out = {}
    for name, entry in value.items():
        try:
            out[str(name)] = (Domain(train=entry) if isinstance(entry, str)
                              else entry if isinstance(entry, Domain) else from_mapping(Domain, entry))
        except ConfigError as exc:
            raise exc.inside(str(name)) from None
    return MappingProxyType(out)


@dataclass(frozen=True, kw_only=True)
class DataOptions:
    """The training texts, per domain, and how they are cut into blocks."""

    block_size: int = setting(128, help="tokens per block (texts are joined by EOS and cut)", must=integer_at_least(2))
    text_field: str = setting("text", help="field of each .jsonl record to read", must=NON_EMPTY_STRING)
    eval_fraction: float = setting(0.1, help="share of a domain's texts held out for evaluation when it has no eval "
                                             "file", must=Must("a number in [0, 1)", lambda v: is_number(v)
                                                               and 0 <= v < 1))
    balance: bool = setting(False, help="train on as many blocks of each domain as the smallest domain has")
    domains: Mapping[str, Domain] = setting(
        help="NAME: {train: FILE, eval: FILE} (or NAME: FILE), one label per domain; blocks never mix domains",
        normalise=_domains, must=Must("a mapping of one or more domains, e.g. {text: {train: texts.jsonl}}",
                                      lambda v: isinstance(v, Mapping) and len(v) > 0))

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True, kw_only=True)
class ScratchModel:
    """A small GPT-2 trained from scratch; any other key of the mapping is a ``transformers.GPT2Config`` key."""

    OTHER_KEYS = "gpt2"

    n_layer: int = setting(4, help="transformer blocks", must=integer_at_least(1))
    n_embd: int = setting(128, help="width of the hidden states", must=integer_at_least(1))
    n_head: int = setting(4, help="attention heads (n_embd must be divisible by it)", must=integer_at_least(1))
    vocab_size: int = setting(4096, help="vocabulary of the byte-level BPE trained on the training texts",
                              must=integer_at_least(1))
    tokenizer: str | None = setting(None, help="an existing tokenizer (folder or hub id) instead of training one")
    gpt2: Mapping[str, Any] = setting(default_factory=dict, normalise=_frozen_mapping, in_file=False,
                                      help="other GPT2Config keys (resid_pdrop ...), given beside the ones above")

    def __post_init__(self) -> None:
        check(self)
        if self.n_embd % self.n_head:
            raise ConfigError(f"({self.n_embd}) must be divisible by n_head ({self.n_head})", "n_embd")


def model_options(value: Any, handled: Sequence[str] = ()) -> Any:
    """The model options group from a mapping of its keys, float32 unless it says otherwise (anything else is
    left for the check to refuse)."""
    if not isinstance(value, Mapping):
        return value
    try:
        options = from_mapping(ModelOptions, {"dtype": TRAINING_MODEL_OPTIONS.dtype, **value}, handled=handled)
    except ConfigError:
        raise
    except RepgeomError as exc:  # ModelOptions' own checks (an unknown dtype ...)
        raise ConfigError(str(exc), joiner=": ") from None
    check_types(options)
    return options


def _aux_losses(value: Any) -> Any:
    if value is None:
        return ()
    if isinstance(value, Mapping):
        value = [value]
    if isinstance(value, (list, tuple)) and all(isinstance(a, Mapping) for a in value):
        return tuple(MappingProxyType(dict(a)) for a in value)
    return value


def _probe_texts(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _probe_layers(value: Any) -> Any:
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        value = [value]
    if isinstance(value, (list, tuple)):
        return tuple(str(v) if is_integer(v) else v for v in value)
    return value


PROBE_TEXTS = Must("a file of texts (.jsonl, .txt) or a list of at least 2 non-empty texts",
                   lambda v: FILE_PATH.holds(v) or (isinstance(v, tuple) and len(v) >= 2
                                                    and all(NON_EMPTY_STRING.holds(t) for t in v)))


@dataclass(frozen=True, kw_only=True)
class GeometryProbe:
    """What :class:`~repgeom_eval.training.geometry.GeometryCallback` measures at every saved checkpoint: the
    dispersion gap G of the output embeddings (token sets as in ``repgeom gap``) and the dispersion of a fixed set
    of probe texts at some layers (as ``repgeom measure --metrics dispersion``), and the rule of its pick."""

    texts: str | tuple[str, ...] = setting(
        help="the probe texts: a .jsonl/.txt file (relative to the config file) or a list of texts",
        normalise=_probe_texts, must=PROBE_TEXTS)
    text_field: str = setting("text", help="field of each .jsonl record to read", must=NON_EMPTY_STRING)
    layers: tuple[str, ...] = setting(
        ("final",), help="layer addresses of the probe dispersion (final, resid_post:1, 2, all ...)",
        normalise=_probe_layers, must=Must("a layer address or a list of them",
                                           lambda v: isinstance(v, tuple) and len(v) > 0
                                           and all(NON_EMPTY_STRING.holds(a) for a in v)))
    pooling: str = setting("last", help="one vector per probe text: last, mean or first (as repgeom measure)",
                           must=Must("one of last, mean, first", lambda v: v in ("last", "mean", "first")))
    max_length: int | None = setting(None, help="tokens per probe text (default: the model's context)",
                                     must=Must("a positive integer or null",
                                               lambda v: v is None or (is_integer(v) and v >= 1)))
    batch_size: int = setting(16, help="probe texts per forward pass", must=integer_at_least(1))
    domain: str = setting(GAP_DEFAULTS.domain, help="token set T of G (as repgeom gap --domain)",
                          must=NON_EMPTY_STRING)
    reference: str = setting(GAP_DEFAULTS.reference, help="token set T̄ of G (as repgeom gap --reference)",
                             must=NON_EMPTY_STRING)
    size: int = setting(GAP_DEFAULTS.size, help="sample size of sampled token sets (general)",
                        must=integer_at_least(1))
    seed: int = setting(GAP_DEFAULTS.seed, help="seed of sampled token sets")
    burn_in: float = setting(0.5, help="the pick ignores checkpoints before this fraction of max_steps",
                             must=Must("a number in [0, 1)", lambda v: is_number(v) and 0 <= v < 1))

    def __post_init__(self) -> None:
        check(self)


def _steps(value: Any) -> Any:
    if value is None:
        return ()
    if is_integer(value):
        value = [value]
    if isinstance(value, (list, tuple)) and all(is_integer(s) for s in value):
        return tuple(sorted(set(value)))
    return value


def _directory(value: Any) -> Any:
    return Path(value) if isinstance(value, str) and value.strip() else value


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything ``repgeom train`` does (see the module docstring). Build one from a file with
    :func:`read_config`, from a mapping with :func:`parse_config` (relative paths taken from a folder), or directly:
    ``TrainConfig(model="m", data={"domains": {"text": "t.jsonl"}}, training={"max_steps": 10}, output_dir="o")``.
    """

    model: str | None = setting(
        None, help="continued training: a model folder, .gguf file or cached hub id; or {name: ..., and the model "
                   "options below}",
        must=Must("a model path or hub id", lambda v: v is None or NON_EMPTY_STRING.holds(v)))
    model_options: ModelOptions = setting(default_factory=lambda: TRAINING_MODEL_OPTIONS, in_file=False, config=False,
                                          normalise=model_options,
                                          help="how the model loads (the model: mapping's keys beside its name)")
    from_scratch: ScratchModel | None = setting(
        None, help="instead of model: a small GPT-2 trained from scratch, e.g. {n_layer: 4, n_embd: 128, n_head: 4, "
                   "vocab_size: 4096} (other keys: GPT2Config's)", then=("source",))
    data: DataOptions = setting(help="the texts: data.domains and how they are cut into blocks")
    aux_losses: tuple[Mapping[str, Any], ...] = setting(
        (), help="auxiliary losses, e.g. [{name: push_away, weight: 0.01}] (`repgeom plugins` lists them)",
        normalise=_aux_losses, must=Must("a list of mappings like {name: push_away, weight: 0.1}",
                                         lambda v: isinstance(v, tuple) and all(isinstance(a, Mapping) for a in v)),
        then=("plugins", "objective"))
    training: Mapping[str, Any] = setting(
        default_factory=dict, normalise=_training_arguments,
        help="transformers.TrainingArguments fields: max_steps (or num_train_epochs) and any other")
    evaluate_at: tuple[int, ...] = setting(
        (), help="steps at which each domain's evaluation perplexity is measured (and at the end)", normalise=_steps,
        must=Must("a list of positive step counts", lambda v: isinstance(v, tuple) and all(is_integer(s) and s >= 1 for s in v)))
    geometry_probe: GeometryProbe | None = setting(
        None, help="at every saved checkpoint: G of the output embeddings and the dispersion of probe texts, into "
                   "output_dir/geometry_by_checkpoint.json, e.g. {texts: probe.jsonl, layers: [final, 2]}")
    dispersion_layer: str = setting("final", help="layer address whose batch dispersion is logged every step",
                                    normalise=lambda v: str(v) if is_integer(v) else v, must=NON_EMPTY_STRING)
    seed: int = setting(0, help="seed of the held-out split, the model's initialisation and the Trainer")
    torch_threads: int | None = setting(None, help="CPU threads of torch (default: torch's own choice)",
                                        must=Must("a positive integer or null",
                                                  lambda v: v is None or (is_integer(v) and v >= 1)))
    output_dir: Path = setting(help="where results.json, the trained model/ and trainer/ checkpoints are written",
                               normalise=_directory, must=Must("a folder path", lambda v: isinstance(v, Path)))
    save_model: bool = setting(True, help="save the trained model and its tokenizer to output_dir/model")

    def __post_init__(self) -> None:
        if isinstance(self.model, Mapping):
            self._read_model_mapping(self.model)
        check(self)
        if (self.model is None) == (self.from_scratch is None):
            raise ConfigError("give exactly one of `model` (continued training of a local directory, a .gguf file "
                              "or a hub id) or `from_scratch` (a small GPT-2: {n_layer, n_embd, ...})")
        for key in ("output_dir", "seed"):
            if key in self.training:
                raise ConfigError(f"set {key} at the top level of the config, not under training")
        if "max_steps" not in self.training and "num_train_epochs" not in self.training:
            raise ConfigError("needs max_steps (or num_train_epochs)", "training")
        if self.geometry_probe is not None and self.training.get("save_strategy", "no") == "no":
            raise ConfigError("measures at every saved checkpoint, and none is saved: set training.save_strategy "
                              "(steps) and training.save_steps", "geometry_probe", ": ")

    def _read_model_mapping(self, mapping: Mapping[str, Any]) -> None:
        """``model: {name: ..., revision: ..., ...}``: the name, and the model options group from the other keys."""
        try:
            options = model_options(mapping, handled=("name",))
        except ConfigError as exc:
            raise exc.inside("model") from None
        if "name" not in mapping:
            raise ConfigError("no name (a model folder, .gguf file or hub id)", "model", " has ")
        object.__setattr__(self, "model", mapping["name"])
        object.__setattr__(self, "model_options", options)

    def with_paths_from(self, base_dir: str | Path) -> "TrainConfig":
        """The config with its relative paths taken from ``base_dir`` (a config file's folder); a model name that
        is not a path there stays a hub id."""
        base = Path(base_dir)

        def file(value: str) -> str:
            return str((base / os.path.expanduser(value)).resolve()) if not os.path.isabs(value) else value

        def model_path(value: str | None) -> str | None:
            if value is None:
                return None
            local = base / os.path.expanduser(value)
            return str(local.resolve()) if (value.startswith((".", "/", "~")) or local.exists()) else value

        scratch = self.from_scratch
        if scratch is not None and scratch.tokenizer is not None:
            local = base / os.path.expanduser(scratch.tokenizer)
            scratch = replace(scratch, tokenizer=str(local.resolve()) if local.exists() else scratch.tokenizer)
        domains = {name: Domain(train=file(d.train), eval=file(d.eval) if d.eval is not None else None)
                   for name, d in self.data.domains.items()}
        probe = self.geometry_probe
        if probe is not None and isinstance(probe.texts, str):
            probe = replace(probe, texts=file(probe.texts))
        return replace(self, model=model_path(self.model), geometry_probe=probe,
                       model_options=replace(self.model_options, peft=model_path(self.model_options.peft)),
                       from_scratch=scratch, data=replace(self.data, domains=domains),
                       output_dir=Path(file(str(self.output_dir))))

    def config_block(self, resolved: Mapping[str, Any]) -> dict[str, Any]:
        """``results.json``'s ``config``: every setting (defaults included), overridden and completed by what the
        run resolved (the model's source, the aux losses' full parameters, the TrainingArguments used ...)."""
        return config_block(self, resolved)


def set_dotted(raw: dict[str, Any], assignment: str) -> None:
    """Apply one ``--set a.b.c=VALUE`` override (VALUE parsed as YAML) to a config mapping."""
    key, sep, text = assignment.partition("=")
    if not sep or not key.strip():
        raise RepgeomError(f"--set expects KEY=VALUE (e.g. training.max_steps=100), got {assignment!r}")
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise RepgeomError(f"--set {assignment!r}: {part!r} is not a mapping in the config")
        node = child
    node[parts[-1]] = parse_yaml(text, f"--set {excerpt(assignment)}")


def read_config(path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read and check a training config file; ``overrides`` are ``a.b=VALUE`` strings applied first."""
    raw = read_yaml_file(path, f"training config {str(path)!r}")
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        raise RepgeomError(f"training config {str(path)!r} must be a mapping, got {type(raw).__name__}: "
                           f"{excerpt(raw)}")
    if isinstance(raw.get("model"), str) and any(a.startswith("model.") for a in overrides):
        raw["model"] = {"name": raw["model"]}  # --set model.revision=v1 on `model: NAME`
    for assignment in overrides:
        set_dotted(raw, assignment)
    return parse_config(raw, Path(path).expanduser().resolve().parent, where=str(path))


def parse_config(raw: Mapping[str, Any], base_dir: str | Path = ".", where: str = "training config") -> TrainConfig:
    """Check a config mapping (see the module docstring); relative paths are taken from ``base_dir``."""
    if not isinstance(raw, Mapping):
        raise RepgeomError(f"{where} must be a mapping, got {type(raw).__name__}: {excerpt(raw)}")
    try:
        cfg = from_mapping(TrainConfig, copy.deepcopy(dict(raw)))
    except ConfigError as exc:
        raise RepgeomError(f"{where}: {exc}") from None
    return cfg.with_paths_from(base_dir)


def config_keys_help() -> str:
    """The keys of a config file with their help and defaults, for ``repgeom train --help``."""
    lines = ["config file keys (--set KEY=VALUE overrides any, e.g. --set training.max_steps=50):"]

    def default_of(f: Any, defaults: Any) -> str:
        if f.default is MISSING and f.default_factory is MISSING:
            return " (required)"
        value = getattr(defaults, f.name) if defaults is not None else (
            f.default if f.default is not MISSING else f.default_factory())
        if value in (None, (), {}):
            return ""
        if isinstance(value, tuple):
            value = "[" + ", ".join(str(v) for v in value) + "]"
        return f" (default: {str(value).lower() if isinstance(value, bool) else value})"

    def walk(cls: type, prefix: str, defaults: Any = None) -> None:
        for f in fields(cls):
            if not f.metadata.get("in_file", True) or f.name == getattr(cls, "OTHER_KEYS", None):
                continue
            key = prefix + f.name
            lines.append(textwrap.fill(f"{help_of(f)}{default_of(f, defaults)}", width=118,
                                       initial_indent=f"  {key:<26} ", subsequent_indent=" " * 29))
            if cls is TrainConfig and f.name == "model":
                lines.append(f"  {'model.name':<26} the model, when model: is a mapping of these keys")
                walk(ModelOptions, "model.", TRAINING_MODEL_OPTIONS)
            group = {"from_scratch": ScratchModel, "data": DataOptions, "domains": Domain,
                     "geometry_probe": GeometryProbe}.get(f.name)
            if group is not None:
                walk(group, f"{key}.NAME." if f.name == "domains" else f"{key}.")

    walk(TrainConfig, "")
    return "\n".join(lines)


# -- repgeom train -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrainCommand:
    """The command's own flags; what is trained, and how, is the config file's (TrainConfig, above)."""

    config: str = option(None, "--config", "-c", required=True, metavar="FILE.yaml",
                         help="training config: model or from_scratch, data.domains, aux_losses, training "
                              "(transformers.TrainingArguments), evaluate_at, output_dir (keys below; "
                              "docs/how-to/training.md)")
    overrides: tuple[str, ...] = option((), "--set", action="append", cli_default=[], metavar="KEY=VALUE",
                                        from_cli=tuple,
                                        help="override a config value, e.g. --set training.max_steps=50 --set "
                                             "output_dir=runs/b (VALUE is read as YAML; repeatable)")
    overwrite: bool = option(False, "--overwrite", action="store_true",
                             help="replace the run already in output_dir (its results.json, model/ and trainer/); "
                                  "without it such an output_dir is refused")
    progress: str = option_like(RunGroup, "progress")
    no_progress: bool = option_like(RunGroup, "no_progress")
    json: bool = option(False, "--json", action="store_true", help="print the per-domain perplexities as JSON")
