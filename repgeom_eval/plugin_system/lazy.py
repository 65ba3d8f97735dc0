"""Deferred imports for modules that must stay cheap to import (plugins, the metric API, the command line).

``repgeom --help`` and ``repgeom plugins`` import every plugin module and run its registration hooks; none of that
needs torch, so a plugin module binds its heavy names with :func:`lazy` instead of importing them::

    from repgeom_eval.plugin_system.lazy import lazy

    torch = lazy("torch")                                          # import torch
    unit = lazy("repgeom_eval.functional.dispersion:unit")         # from ... import unit
    VARIANTS = lazy("repgeom_eval.functional.entropy:VARIANTS")    # constants too

The stand-in imports its target the first time it is used (an attribute, a call, ``in``, iteration, ``repr`` ...)
and then replaces itself, in the module that created it, by the real object, so later uses cost nothing extra and
``isinstance``/identity checks see the real thing. Code using the names reads as if they had been imported.

Only *uses* can be deferred: a name needed while the module itself runs (a default argument value, a base class, a
decorator) must be imported normally. ``tests/test_startup.py`` checks that the start-up paths stay free of torch.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

__all__ = ["lazy", "is_lazy", "resolve"]


class _Lazy:
    """A stand-in for a module or a module attribute, imported on first use (see :func:`lazy`)."""

    __slots__ = ("_lazy_target", "_lazy_namespace", "_lazy_value")

    def __init__(self, target: str, namespace: dict[str, Any] | None):
        object.__setattr__(self, "_lazy_target", target)
        object.__setattr__(self, "_lazy_namespace", namespace)

    def _lazy_resolve(self) -> Any:
        try:
            return object.__getattribute__(self, "_lazy_value")
        except AttributeError:
            pass
        target = object.__getattribute__(self, "_lazy_target")
        module_name, _, attr = target.partition(":")
        value: Any = importlib.import_module(module_name)
        for part in filter(None, attr.split(".")):
            value = getattr(value, part)
        object.__setattr__(self, "_lazy_value", value)
        namespace = object.__getattribute__(self, "_lazy_namespace")
        if namespace is not None:  # rebind the creating module's names: later look-ups skip the stand-in
            for key in [k for k, v in list(namespace.items()) if v is self]:
                namespace[key] = value
        return value

    # attribute access (``torch.zeros``) and the protocols that constants and functions are used through
    def __getattr__(self, name: str) -> Any:
        return getattr(self._lazy_resolve(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._lazy_resolve(), name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._lazy_resolve()(*args, **kwargs)

    def __iter__(self):
        return iter(self._lazy_resolve())

    def __contains__(self, item: Any) -> bool:
        return item in self._lazy_resolve()

    def __len__(self) -> int:
        return len(self._lazy_resolve())

    def __getitem__(self, key: Any) -> Any:
        return self._lazy_resolve()[key]

    def __bool__(self) -> bool:
        return bool(self._lazy_resolve())

    def __eq__(self, other: Any) -> bool:
        return self._lazy_resolve() == other

    def __ne__(self, other: Any) -> bool:
        return self._lazy_resolve() != other

    def __hash__(self) -> int:
        return hash(self._lazy_resolve())

    def __str__(self) -> str:
        return str(self._lazy_resolve())

    def __format__(self, spec: str) -> str:
        return format(self._lazy_resolve(), spec)

    def __instancecheck__(self, obj: Any) -> bool:
        return isinstance(obj, self._lazy_resolve())

    def __subclasscheck__(self, cls: Any) -> bool:
        return issubclass(cls, self._lazy_resolve())

    def __repr__(self) -> str:
        try:
            return repr(object.__getattribute__(self, "_lazy_value"))
        except AttributeError:
            return f"<lazy {object.__getattribute__(self, '_lazy_target')!r}, not imported yet>"


def lazy(target: str) -> Any:
    """A stand-in for ``import MODULE`` (``target="MODULE"``) or ``from MODULE import NAME``
    (``target="MODULE:NAME"``; ``NAME`` may be dotted) that imports on first use.

    Bind it to a module-level name; on first use it rebinds every name of the calling module that holds it to the
    real object. An import error surfaces at that first use, not at import time.
    """
    if not isinstance(target, str) or not target.partition(":")[0]:
        raise ValueError(f"lazy() takes 'module' or 'module:attribute', got {target!r}")
    try:
        namespace = sys._getframe(1).f_globals
    except (AttributeError, ValueError):  # pragma: no cover - interpreters without frames: no rebinding
        namespace = None
    return _Lazy(target, namespace)


def is_lazy(obj: Any) -> bool:
    """Whether ``obj`` is a stand-in made by :func:`lazy` (it may have been imported already)."""
    return type(obj) is _Lazy


def resolve(obj: Any) -> Any:
    """The real object behind a stand-in (importing it now if needed); anything else is returned as it is."""
    return obj._lazy_resolve() if type(obj) is _Lazy else obj
