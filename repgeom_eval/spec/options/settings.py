"""Settings read from a mapping (a YAML file, ``--set`` overrides, a Python dict) into frozen option dataclasses,
and checked in one place.

A *group* is a frozen dataclass whose fields are declared with :func:`setting`: an
:func:`repgeom_eval.spec.option_fields.option` (its help, whether the results record it) plus what its value must be.
:func:`from_mapping` builds a group from a mapping, refusing an unknown key with the closest valid one; every group's
``__post_init__`` calls :func:`check`, the one validation place: it reshapes shorthand values (``normalise``), turns
nested mappings into their groups and checks each field against its condition (``must``, a
:class:`~repgeom_eval.spec.option_fields.Must`: the same check mechanism as the command line's options and lm-eval's
settings) or, without one, its type annotation. :func:`recorded` gives a group's plain JSON form for the results' ``config`` block.

A :class:`ConfigError` names the culprit by its dotted key (``data.domains.prose.train must be a file path, got
3``); the groups it sits in complete the key as it travels up.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.spec.option_fields import Must, excerpt, field_problem, is_integer, is_number, option


class ConfigError(RepgeomError):
    """A config value that is wrong; ``location`` is the dotted key it was found under (empty: the top level)."""

    def __init__(self, clause: str, location: str = "", joiner: str = " "):
        self.clause, self.location, self.joiner = clause, location, joiner
        super().__init__(f"{location}{joiner}{clause}" if location else clause)

    def inside(self, key: str) -> "ConfigError":
        """The same error, seen from the group that holds ``key``."""
        return ConfigError(self.clause, f"{key}.{self.location}" if self.location else key, self.joiner)


NON_EMPTY_STRING = Must("a non-empty string", lambda v: isinstance(v, str) and bool(v.strip()))


def setting(default: Any = MISSING, *, help: str, must: Must | None = None,  # noqa: A002 - argparse's name
            normalise: Callable[[Any], Any] | None = None, config: bool = True, in_file: bool = True,
            then: Sequence[str] = (), default_factory: Any = MISSING) -> Any:
    """A group's field: :func:`~repgeom_eval.spec.option_fields.option`'s metadata (``help``, ``config``: recorded in the
    results) plus ``must`` (its condition; default: its type annotation), ``normalise`` (shorthand → canonical
    value, applied before the check), ``in_file`` (``False``: not a key of the config file) and ``then`` (entries
    the run resolves from this setting, recorded right after it: see :func:`config_block`)."""
    declared = option(default, config=config, default_factory=default_factory, help=help, check=must)
    meta = {**declared.metadata, "normalise": normalise, "in_file": in_file, "then": tuple(then)}
    if declared.default_factory is not MISSING:
        return field(default_factory=declared.default_factory, metadata=meta)
    return field(default=declared.default, metadata=meta)


def file_keys(cls: type) -> list[str]:
    """The keys a config file may give for group ``cls``."""
    return [f.name for f in fields(cls) if f.init and f.metadata.get("in_file", True)
            and f.name != getattr(cls, "OTHER_KEYS", None)]


def help_of(f: Any) -> str:
    return f.metadata.get("cli", {}).get("help", "")


def from_mapping(cls: type, mapping: Any, handled: Sequence[str] = ()) -> Any:
    """Group ``cls`` from a mapping of its file keys (``handled``: keys the caller reads itself, valid but left out).

    A group with ``OTHER_KEYS = "name"`` collects the keys it does not declare into that field (e.g. the GPT-2
    config keys of ``from_scratch``) instead of refusing them."""
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"must be a mapping, got {type(mapping).__name__}: {excerpt(mapping)}")
    keys = file_keys(cls)
    other_field = getattr(cls, "OTHER_KEYS", None)
    values: dict[str, Any] = {}
    other: dict[str, Any] = {}
    for key, value in mapping.items():
        if key in handled:
            continue
        if key in keys:
            values[key] = value
        elif other_field:
            other[str(key)] = value
        else:
            close = difflib.get_close_matches(str(key), [*keys, *handled], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown key {key!r}{hint} (valid: {', '.join([*keys, *handled])})", joiner=": ")
    for f in fields(cls):
        if f.init and f.default is MISSING and f.default_factory is MISSING and f.name not in values:
            raise ConfigError(f"no {f.name} ({help_of(f)})", joiner=" has ")
    if other_field:
        values[other_field] = other
    return cls(**values)


def check(group: Any) -> None:
    """The one validation place, called by each group's ``__post_init__``: normalise, build nested groups, check."""
    hints = typing.get_type_hints(type(group))
    for f in fields(group):
        value = given = getattr(group, f.name)
        try:
            normalise = f.metadata.get("normalise")
            if normalise is not None:
                value = normalise(value)
            nested = _group_in(hints[f.name])
            if nested is not None and value is not None and not isinstance(value, nested):
                value = from_mapping(nested, value)
            elif is_dataclass(value):
                check_types(value)  # a group declared elsewhere (ModelOptions) checks its rules, not its types
        except ConfigError as exc:
            raise exc.inside(f.name) from None
        object.__setattr__(group, f.name, value)  # frozen: normalised once, here
        if f.metadata.get("check") is not None:
            problem = field_problem(f, value, shown=given)
        else:  # no condition declared: the type annotation is the condition
            problem = None if conforms(value, hints[f.name]) else f"must be {describe(hints[f.name])}, got {excerpt(given)}"
        if problem:
            raise ConfigError(problem, f.name)


def check_types(group: Any) -> None:
    """Each field of a group declared elsewhere against its type annotation (a YAML ``"no"`` is not ``false``)."""
    hints = typing.get_type_hints(type(group))
    for f in fields(group):
        value = getattr(group, f.name)
        if not conforms(value, hints[f.name]):
            raise ConfigError(f"must be {describe(hints[f.name])}, got {value!r}", f.name)


def _group_in(hint: Any) -> type | None:
    """The dataclass a field's annotation names (``ScratchModel | None`` → ``ScratchModel``), if any."""
    if isinstance(hint, type) and is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next((h for h in typing.get_args(hint) if isinstance(h, type) and is_dataclass(h)), None)
    return None


def conforms(value: Any, hint: Any) -> bool:
    """Whether ``value`` has the annotated type (the simple annotations settings use)."""
    if hint is Any:
        return True
    if hint is type(None) or hint is None:
        return value is None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, h) for h in typing.get_args(hint))
    if origin is tuple:
        return isinstance(value, tuple) and all(conforms(v, typing.get_args(hint)[0]) for v in value)
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        key_type, value_type = typing.get_args(hint)
        return isinstance(value, Mapping) and all(conforms(k, key_type) and conforms(v, value_type)
                                                  for k, v in value.items())
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return is_integer(value)
    if hint is float:
        return is_number(value)
    return isinstance(value, hint)


def describe(hint: Any) -> str:
    """An annotation as an error message says it: ``str | None`` → ``a string or null``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(describe(h) for h in typing.get_args(hint))
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", Path: "a path",
             type(None): "null"}
    origin = typing.get_origin(hint)
    if (isinstance(hint, type) and is_dataclass(hint)) or (isinstance(origin, type) and issubclass(origin, Mapping)):
        return "a mapping"
    if origin is tuple:
        return "a list"
    return names.get(hint, f"a {getattr(hint, '__name__', hint)}")


def recorded(value: Any) -> Any:
    """Plain JSON form: a group as ``{field: value}`` of its recorded fields (``OTHER_KEYS`` spread in), mappings
    as dicts, tuples as lists, paths as strings."""
    if is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        for f in fields(value):
            if not f.metadata.get("config", True):
                continue
            item = getattr(value, f.name)
            if f.name == getattr(type(value), "OTHER_KEYS", None):
                out.update(recorded(item))
            else:
                out[f.name] = recorded(item)
        return out
    if isinstance(value, Mapping):
        return {k: recorded(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [recorded(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def config_block(group: Any, resolved: Mapping[str, Any]) -> dict[str, Any]:
    """The results' ``config`` block: every recorded setting in declaration order, replaced by what the run
    resolved it to where ``resolved`` has it; a setting's ``then`` entries follow it, and the rest of ``resolved``
    comes last."""
    out: dict[str, Any] = {}
    for f in fields(group):
        if f.metadata.get("config", True):
            out[f.name] = resolved[f.name] if f.name in resolved else recorded(getattr(group, f.name))
        out.update({key: resolved[key] for key in f.metadata.get("then", ()) if key in resolved})
    out.update({k: v for k, v in resolved.items() if k not in out})
    return out
