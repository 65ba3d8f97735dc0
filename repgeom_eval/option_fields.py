"""Options declared once: a dataclass field per option carrying its command-line flag, its help and where it is
recorded. From the declarations come the CLI flags (:func:`add_option_arguments`), the object built from parsed flags
(:func:`options_from_namespace`) and plain JSON values for outputs (:func:`plain`). Used by ``RunConfig``
(measurement/config.py) and ``ModelOptions`` (modeling/options.py). Standard library only, so that every command's
``--help`` stays instant.

Field metadata:

* ``flags`` / ``cli``: the argparse flags and keyword arguments (no ``flags``: not on the command line);
* ``from_cli``: turns the parsed value into the field's value;
* ``key``: part of a run's resume key (everything that changes the numbers);
* ``config``: written into the results' ``config`` block (``False``: not written).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, field, fields
from typing import Any


def option(default: Any = MISSING, *flags: str, key: bool = True, config: bool = True, from_cli: Any = None,
           default_factory: Any = MISSING, **cli: Any) -> Any:
    """A :class:`RunConfig` field: its default, command-line flags and where it is recorded."""
    meta = {"flags": flags, "cli": cli, "key": key, "config": config, "from_cli": from_cli}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def add_option_arguments(cls: type, parser: argparse.ArgumentParser, only: Sequence[str] | None = None) -> None:
    """A flag for every field of the options class ``cls`` (declared with :func:`option`) that has one."""
    for f in fields(cls):
        flags = f.metadata["flags"]
        if not flags or (only is not None and f.name not in only):
            continue
        cli = dict(f.metadata["cli"])
        default = cli.pop("cli_default", f.default)
        if cli.get("action") not in ("store_true", "store_false"):
            cli["default"] = default
        cli.setdefault("dest", f.name)
        parser.add_argument(*flags, **cli)


def options_from_namespace(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The values of the fields of ``cls`` that ``args`` holds (parsed through :func:`add_option_arguments`)."""
    values: dict[str, Any] = {}
    for f in fields(cls):
        if f.metadata["flags"] and hasattr(args, f.name):
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
