"""Registries: named objects contributed by plugins, with the plugin that contributed each one."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from repgeom_eval.spec.errors import PluginError, UnknownNameError

T = TypeVar("T")


@dataclass
class Entry:
    """One registered item."""

    name: str
    kind: str
    target: Any  # the object, or a lazy "module:attr" string
    plugin: str  # entry-point name of the plugin that registered it
    distribution: str | None  # pip distribution that ships the plugin
    description: str = ""

    def load(self) -> Any:
        if isinstance(self.target, str):
            module, _, attr = self.target.partition(":")
            try:
                obj = importlib.import_module(module)
                for part in attr.split("."):
                    obj = getattr(obj, part)
            except Exception as exc:  # the plugin is at fault, say which
                raise PluginError(
                    f"{self.kind} {self.name!r} from plugin {self.plugin!r} could not be imported "
                    f"from {self.target!r}: {type(exc).__name__}: {exc}"
                ) from exc
            self.target = obj
        return self.target


def _first_doc_line(obj: Any) -> str:
    """A one-line description: ``description``/``help`` attribute, else the object's own docstring."""
    if isinstance(obj, str):  # a lazy target is not imported just to describe it
        return ""
    doc = getattr(obj, "description", None) or getattr(obj, "help", None)
    if not doc:
        doc = getattr(obj, "__doc__", None)
        if not isinstance(obj, type) and doc is getattr(type(obj), "__doc__", None):
            doc = None  # an instance's inherited class docstring says nothing about the instance
    return doc.strip().splitlines()[0] if isinstance(doc, str) and doc.strip() else ""


class Registry(Generic[T]):
    """Name → object table for one kind of plugin item.

    Plugins see a :class:`BoundRegistry` (``registry.add(...)``) that knows which plugin is calling.
    """

    def __init__(self, kind: str, check: Callable[[Any], str | None] | None = None, unknown_hint: str = ""):
        self.kind = kind
        self._entries: dict[str, Entry] = {}
        self._check = check
        self.unknown_hint = unknown_hint
        #: set by the plugin host: for a missing name, the error that says which failed or switched-off plugin may
        #: be the reason (None: the plain "unknown" error)
        self.explain_missing: Callable[[str], Exception | None] | None = None

    # -- reading -------------------------------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        return [self._entries[n] for n in self.names()]

    def entry(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except KeyError:
            pass
        explained = self.explain_missing(name) if self.explain_missing is not None else None
        raise explained or UnknownNameError(self.kind, name, self._entries, self.unknown_hint) from None

    def get(self, name: str) -> T:
        entry = self.entry(name)
        obj = entry.load()
        self._validate(entry, obj)
        return obj

    # -- writing (used by the plugin host) ------------------------------------------------------------------------
    def _validate(self, entry: Entry, obj: Any) -> None:
        if self._check is None or isinstance(entry.target, str) and obj is entry.target:
            return
        problem = self._check(obj)
        if problem:
            raise PluginError(f"plugin {entry.plugin!r} registered an invalid {self.kind} {entry.name!r}: {problem}")

    def bound(self, plugin: str, distribution: str | None) -> "BoundRegistry[T]":
        return BoundRegistry(self, plugin, distribution)

    def _commit(self, entries: list[Entry]) -> None:
        for e in entries:
            self._entries[e.name] = e


class BoundRegistry(Generic[T]):
    """What a plugin's ``repgeom_register_*`` hook receives. Items are committed only if the hook succeeds."""

    def __init__(self, registry: Registry[T], plugin: str, distribution: str | None):
        self.registry, self.plugin, self.distribution = registry, plugin, distribution
        self.kind = registry.kind
        self.staged: list[Entry] = []

    def add(self, obj: Any, name: str | None = None, description: str | None = None) -> None:
        """Register ``obj`` (or a lazy ``"module:attr"`` string) under ``name`` (default: ``obj.name``)."""
        if name is None:
            name = getattr(obj, "name", None)
            if not isinstance(name, str) or not name:
                raise PluginError(
                    f"plugin {self.plugin!r}: cannot register {obj!r} as a {self.kind} without a name; "
                    f"set a `name` attribute or pass name=..."
                )
        if description is None:
            description = _first_doc_line(obj)
        entry = Entry(name, self.kind, obj, self.plugin, self.distribution, description)
        if not isinstance(obj, str):
            self.registry._validate(entry, obj)
        clash = self.registry._entries.get(name) or next((e for e in self.staged if e.name == name), None)
        if clash is not None:
            raise PluginError(
                f"duplicate {self.kind} name {name!r}: registered by plugin {clash.plugin!r}"
                f" ({clash.distribution or 'unknown distribution'}) and again by plugin {self.plugin!r}"
                f" ({self.distribution or 'unknown distribution'}); rename one of them or uninstall one plugin"
            )
        self.staged.append(entry)

    def commit(self) -> None:
        self.registry._commit(self.staged)
        self.staged = []
