"""Options declared once: a dataclass field per option carrying its command-line flag, its help, its check and where
it is recorded. A command's configuration is a frozen dataclass composed of shared groups (model, data, layers, run,
output: repgeom_eval/spec/options/groups.py) and its own fields; from the declarations come

* the CLI flags, grouped, with their help (:meth:`Options.add_arguments`, :func:`add_option_arguments`);
* the object built from parsed flags and an optional ``--config FILE`` of YAML values, the flags given on the
  command line winning (:meth:`Options.from_args`, docs/configuration.md);
* the Python API: ``Config(**keywords)``, or ``Config.build(config, keywords)`` in functions that take either;
* the resume key and the output's ``config`` block (:meth:`Options.checkpoint_key`, :meth:`Options.config_block`).

Standard library only, so that every command's ``--help`` stays instant.

Field metadata (see :func:`option`):

* ``flags`` / ``cli``: the argparse flags and keyword arguments (no ``flags``: not on the command line; a flag without
  a leading dash is a positional argument);
* ``from_cli``: turns the parsed value into the field's value; ``cli_default``: the value the command line starts
  from when neither a flag nor the ``--config`` file gives one (default: the field's default);
* ``check``: a function of the value that returns what is wrong with it (``None``: nothing); ``choices`` are
  checked too, in the config, so that the Python API and YAML files get the same errors as the command line;
* ``key``: part of a run's resume key (everything that changes the numbers);
* ``config``: written into the results' ``config`` block (``False``: not written); ``config_name``: under which name.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar

from repgeom_eval.spec.errors import RepgeomError

CONFIG_HELP = ("read option values from this YAML file (keys are the option names, e.g. batch_size: 8); flags "
               "given on the command line win (docs/configuration.md)")


def option(default: Any = MISSING, *flags: str, key: bool = True, config: bool = True, from_cli: Any = None,
           default_factory: Any = MISSING, check: Callable[[Any], str | None] | None = None,
           config_name: str | None = None, writes: str | None = None, **cli: Any) -> Any:
    """A configuration field: its default, command-line flags, check and where it is recorded (module docstring).

    No default (``MISSING``) makes the option required. ``writes``: ``"file"`` or ``"folder"`` for an option that
    names an output (every one goes through the output guard of repgeom_eval/output/files.py; tests enumerate them)."""
    meta = {"flags": flags, "cli": cli, "key": key, "config": config, "from_cli": from_cli, "check": check,
            "config_name": config_name, "writes": writes}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def option_like(cls: type, name: str, default: Any = MISSING, **changes: Any) -> Any:
    """Field ``name`` of ``cls`` declared again with a new ``default`` and/or metadata ``changes`` (``help``,
    ``flags``, ``cli_default``, ``key`` ...): one declaration, a command-specific default."""
    original = next(f for f in fields(cls) if f.name == name)
    meta = {**original.metadata, "cli": dict(original.metadata["cli"])}
    for k, v in changes.items():
        if k in meta:
            meta[k] = v
        else:
            meta["cli"][k] = v
    if default is MISSING:
        default = original.default
    return field(default=default, metadata=meta)


# -- checks ---------------------------------------------------------------------------------------------------------
# One validation mechanism for every door (CLI flags, YAML files, lm-eval settings, Python keywords): a field's
# ``check`` is a function of its value that returns what is wrong with it, or ``None``. :class:`Must` is such a
# function with its condition in words; :func:`field_problem` applies a field's ``choices`` and ``check``, and
# :func:`check_options` raises the first problem, named as the door names the field.

def is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Must:
    """A check whose condition is said in words: ``Must("a positive integer", test)(0)`` is
    ``"must be a positive integer, got 0"``; a value ``test`` holds for has no problem."""

    says: str
    holds: Callable[[Any], bool]

    def __call__(self, value: Any, shown: Any = MISSING) -> str | None:
        """What is wrong with ``value`` (``shown``: the value as the user gave it, if it was reshaped first)."""
        if self.holds(value):
            return None
        return f"must be {self.says}, got {excerpt(value if shown is MISSING else shown)}"


def integer_at_least(low: int) -> Must:
    return Must("a positive integer" if low == 1 else f"an integer >= {low}", lambda v: is_integer(v) and v >= low)


def positive(value: Any) -> str | None:
    """A positive integer (or ``None``: not given)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return None
    return f"expected a positive integer, got {value!r}"


def each(check: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    """``check`` applied to every item of a list."""
    def check_items(values: Any) -> str | None:
        for v in ([values] if isinstance(values, (str, int, float)) else values or ()):
            problem = check(v)
            if problem:
                return problem
        return None
    return check_items


def label(f: Field) -> str:
    """How an option is named in errors: its long flag, else its field name."""
    flags = f.metadata.get("flags") or ()
    long = [x for x in flags if x.startswith("--")]
    return long[0] if long else (flags[0].upper() if flags else f.name)


def field_problem(f: Field, value: Any, shown: Any = MISSING) -> str | None:
    """What is wrong with ``value`` as field ``f``'s value: outside its ``choices``, or its ``check``'s problem
    (``shown``: the value as given, for a :class:`Must` to quote when the value was reshaped first)."""
    choices = f.metadata.get("cli", {}).get("choices") if f.metadata else None
    if choices is not None and value is not None:  # plain values only: the API also takes e.g. a torch.dtype
        values = value if isinstance(value, (list, tuple)) else [value]
        bad = [v for v in values if isinstance(v, (str, int, float)) and v not in choices]
        if bad:
            return f"unknown value {bad[0]!r} (valid: {', '.join(map(str, choices))})"
    check = f.metadata.get("check") if f.metadata else None
    if isinstance(check, Must):
        return check(value, shown)
    return check(value) if check else None


def check_options(obj: Any, name: Callable[[Field], str] = label) -> None:
    """Every field's ``choices`` and ``check``, as one-line errors naming the field as ``name`` says (default: its
    flag): ``--batch-size: expected a positive integer, got 0``, ``repgeom_capture must be fused or extra, got 'x'``."""
    for f in fields(obj):
        problem = field_problem(f, getattr(obj, f.name))
        if problem:
            joiner = " " if problem.startswith("must be ") else ": "
            raise RepgeomError(f"{name(f)}{joiner}{problem}")


# -- the command line ---------------------------------------------------------------------------------------------

def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def add_option_arguments(cls: type, parser: argparse.ArgumentParser, only: Sequence[str] | None = None,
                         explicit_only: bool = False) -> None:
    """A flag for every field of the options class ``cls`` (declared with :func:`option`) that has one.

    ``explicit_only``: parsed values hold only the flags given (argparse's ``SUPPRESS`` default), so that a
    ``--config`` file fills in the others (:meth:`Options.from_args`). ``{default}`` in a help text is replaced by
    the field's default."""
    groups: dict[str, Any] = {}
    if explicit_only:  # one heading per group, in the order the configuration lists its groups
        for klass in cls.__mro__:
            title = klass.__dict__.get("group_title")
            if title and title not in groups:
                groups[title] = parser.add_argument_group(title)
    required_first = sorted(fields(cls), key=lambda f: f.default is not MISSING or f.default_factory is not MISSING)
    for f in required_first:
        flags = f.metadata.get("flags")
        if not flags or (only is not None and f.name not in only):
            continue
        cli = dict(f.metadata["cli"])
        default = cli.pop("cli_default", f.default)
        if cli.get("help"):
            cli["help"] = cli["help"].replace("{default}", _shown(default))
            if f.default is MISSING and f.default_factory is MISSING:  # type: ignore[misc]
                cli["help"] += " (required)"
        if explicit_only:
            cli["default"] = argparse.SUPPRESS
        elif cli.get("action") not in ("store_true", "store_false"):
            cli["default"] = default
        target = groups.get(_group_title(cls, f.name), parser) if explicit_only else parser
        if flags[0].startswith("-"):
            cli.setdefault("dest", f.name)
            target.add_argument(*flags, **cli)
        else:  # positional: optional on the command line, so that --config can give it
            if cli.get("nargs") in (None, "?"):
                cli["nargs"] = "?"
            elif cli.get("nargs") == "+":
                cli["nargs"] = "*"
            target.add_argument(f.name, metavar=cli.pop("metavar", flags[0]), **cli)


def _group_title(cls: type, name: str) -> str | None:
    """The heading of field ``name``: the ``group_title`` of the nearest class in ``cls``'s hierarchy that declares
    it and has one (``None``: the command's own options)."""
    for klass in cls.__mro__:
        if name in klass.__dict__.get("__annotations__", {}) and klass.__dict__.get("group_title"):
            return klass.__dict__["group_title"]
    return None


def options_from_namespace(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The values of the fields of ``cls`` that ``args`` holds (parsed through :func:`add_option_arguments`)."""
    values: dict[str, Any] = {}
    for f in fields(cls):
        if f.metadata.get("flags") and hasattr(args, f.name):
            value = getattr(args, f.name)
            convert = f.metadata["from_cli"]
            values[f.name] = convert(value) if convert else value
    return values


def plain(value: Any) -> Any:
    """Tuples and read-only mappings as JSON-ready lists and dicts."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    return value


# -- YAML files -----------------------------------------------------------------------------------------------------

MAX_YAML_BYTES = 16 * 2**20  # a configuration or tasks file larger than this is a mistake (or /dev/zero)


def excerpt(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error quotes a value, never a whole file's worth of it."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def parse_yaml(text: str, what: str) -> Any:
    """YAML text read safely: no Python objects (``safe_load``) and no aliases (``*name``), which let a 1 KB file
    expand to billions of entries. A syntax error is one line naming ``what``."""
    import yaml  # a dependency of repgeom-eval; imported here, so that --help without --config does not pay for it

    class Loader(yaml.SafeLoader):
        def fetch_alias(self) -> None:
            raise RepgeomError(f"{what} uses a YAML alias (*name) at line {self.get_mark().line + 1}; aliases are not "
                               "read (they can expand a small file without bound): write the values out")

    try:
        return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise RepgeomError(f"{what} is not valid YAML: {str(exc).splitlines()[0]}") from None


def read_yaml_file(path: str | Path, what: str) -> Any:
    """A YAML (or JSON) file read safely (:func:`parse_yaml`): a regular file of at most 16 MiB, UTF-8."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise RepgeomError(f"{what} is a directory; pass the file")
    if not p.exists():
        raise RepgeomError(f"{what} does not exist")
    if not p.is_file():
        raise RepgeomError(f"{what} is not a regular file (a device or a pipe?); pass the file")
    if p.stat().st_size > MAX_YAML_BYTES:
        raise RepgeomError(f"{what} holds {p.stat().st_size / 2**20:.0f} MiB, more than the "
                           f"{MAX_YAML_BYTES // 2**20} MiB a configuration may; pass the right file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RepgeomError(f"{what} is not valid UTF-8 (byte {exc.start}); re-encode it as UTF-8") from None
    return parse_yaml(text, what)


def read_config_file(path: str | Path, cls: type, command: str = "") -> dict[str, Any]:
    """The option values of a YAML file: a mapping from option names (``batch_size`` or ``batch-size``) to values.
    An unknown name is a one-line error naming it and the closest option."""
    data = read_yaml_file(path, f"--config {str(path)!r}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RepgeomError(f"--config {str(path)!r} must hold a mapping of option names to values, got "
                           f"{type(data).__name__}")
    names = [f.name for f in fields(cls) if f.metadata.get("flags")]
    values = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f" (valid: {', '.join(sorted(names))})"
            where = f" of repgeom {command}" if command else ""
            raise RepgeomError(f"--config {str(path)!r}: unknown option {key!r}{where}{hint}")
        values[name] = tuple(value) if isinstance(value, list) else value
    return values


# -- the base class of every configuration --------------------------------------------------------------------------

class Options:
    """Base of the configurations: mixed into ``@dataclass(frozen=True, kw_only=True)`` classes whose fields are
    declared with :func:`option`. A group sets ``group_title`` (the heading of its flags in ``--help``)."""

    group_title: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        check_options(self)

    def _set(self, name: str, value: Any) -> None:
        """Normalise a field once, in ``__post_init__`` (the object is frozen afterwards)."""
        object.__setattr__(self, name, value)

    # -- building ---------------------------------------------------------------------------------------------------
    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, only: Sequence[str] | None = None) -> None:
        """The flags of every field that has one, grouped, and ``--config FILE``; :meth:`from_args` reads them."""
        add_option_arguments(cls, parser, only, explicit_only=True)
        parser.add_argument("--config", dest="_config_file", metavar="FILE.yaml", default=None, help=CONFIG_HELP)
        parser.set_defaults(_options_class=cls)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any):
        """The configuration of parsed flags (:meth:`add_arguments`): field defaults, then the ``--config`` file,
        then the flags given, then ``overrides``. Built once per namespace."""
        built = getattr(args, "_options", None)
        if type(built) is cls and not overrides:
            return built
        config_file = getattr(args, "_config_file", None)
        values = read_config_file(config_file, cls, getattr(args, "command", "") or "") if config_file else {}
        for f in fields(cls):
            if not f.metadata.get("flags"):
                continue
            convert = f.metadata["from_cli"]
            if hasattr(args, f.name):
                value = getattr(args, f.name)
                values[f.name] = convert(value) if convert else value
            elif f.name not in values and "cli_default" in f.metadata["cli"]:
                value = f.metadata["cli"]["cli_default"]
                values[f.name] = convert(value) if convert else value
        values.update(overrides)
        missing = [f for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING  # type: ignore
                   and f.name not in values]
        if missing:
            f = missing[0]
            raise RepgeomError(f"{label(f)} is required: give it on the command line, or as {f.name}: in a "
                               "--config file")
        built = cls(**values)
        if not overrides:
            args._options = built
        return built

    @classmethod
    def from_namespace(cls, args: argparse.Namespace, **overrides: Any):
        """The earlier name of :meth:`from_args`."""
        return cls.from_args(args, **overrides)

    @classmethod
    def of(cls, other: Any, **overrides: Any):
        """This configuration's fields taken from ``other`` (a larger configuration holding them, e.g. a command's)."""
        return cls(**({f.name: getattr(other, f.name) for f in fields(cls) if hasattr(other, f.name)} | overrides))

    @classmethod
    def build(cls, config: Any = None, keywords: Mapping[str, Any] | None = None):
        """The configuration of a function that takes one whole (``config``) or its fields as keywords."""
        if config is None:
            return cls(**dict(keywords or {}))
        if keywords:
            raise RepgeomError(f"give the options either as a {cls.__name__} or as keywords, not both "
                               f"({sorted(keywords)})")
        return config if isinstance(config, cls) else cls.of(config)

    def replace(self, **changes: Any):
        return replace(self, **changes)

    # -- what a run records ------------------------------------------------------------------------------------------
    def checkpoint_key(self, resolved: Mapping[str, Any]) -> dict[str, Any]:
        """The resume key: every option that changes the numbers, with resolved values (``resolved``: the run's
        model and data fingerprints, addresses, metric configurations, context length, dtype, ...) taking
        precedence over the requested ones."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("key", True)}
        return plain(out | dict(resolved or {}))

    def config_block(self, resolved: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The ``config`` block of a results file: the options as requested (each under its ``config_name``),
        overridden and completed by what the run resolved them to."""
        out = {(f.metadata.get("config_name") or f.name): getattr(self, f.name)
               for f in fields(self) if f.metadata.get("config", True)}
        return plain(out | dict(resolved or {}))


# -- the calling convention of a configured function ----------------------------------------------------------------

def takes_options(config_cls: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The calling convention every analysis shares, declared once: ``f(*inputs, config=None, /, *, <keyword-only
    parameters of its own>, **options)``, where ``config`` is a whole ``config_cls`` and ``options`` its fields as
    keywords (one or the other: :meth:`Options.build`, which checks every value before anything runs).

    The decorated function is written as ``f(*inputs, cfg, /, *, ...)`` and receives the checked configuration in
    the place of ``cfg``; its public signature (``help()``, :func:`inspect.signature`) is the convention's."""
    def decorate(run: Callable[..., Any]) -> Callable[..., Any]:
        declared = inspect.signature(run)
        params = list(declared.parameters.values())
        n_inputs = [p.name for p in params].index("cfg")
        own = [p for p in params[n_inputs + 1:] if p.kind is inspect.Parameter.KEYWORD_ONLY]
        own_names = {p.name for p in own}

        @functools.wraps(run)
        def call(*args: Any, **keywords: Any) -> Any:
            if len(args) not in (n_inputs, n_inputs + 1):
                raise TypeError(f"{run.__name__}() takes {n_inputs} positional input(s) and, optionally, a "
                                f"{config_cls.__name__}; got {len(args)} positional arguments")
            passed = {name: keywords.pop(name) for name in own_names & set(keywords)}
            cfg = config_cls.build(args[n_inputs] if len(args) > n_inputs else None, keywords)
            return run(*args[:n_inputs], cfg, **passed)

        call.__doc__ = (f"{(run.__doc__ or '').rstrip()}\n\n    The options: a :class:`~{config_cls.__module__}."
                        f"{config_cls.__qualname__}`, or its fields as keywords.")
        positional = inspect.Parameter.POSITIONAL_ONLY
        call.__signature__ = declared.replace(parameters=[  # type: ignore[attr-defined]
            *(p.replace(kind=positional) for p in params[:n_inputs]),
            inspect.Parameter("config", positional, default=None, annotation=f"{config_cls.__name__} | None"),
            *own,
            inspect.Parameter("options", inspect.Parameter.VAR_KEYWORD, annotation="Any")])
        return call
    return decorate
