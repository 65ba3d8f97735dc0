"""Names that moved to another module keep working from their old home for one release, with a
``DeprecationWarning`` that names the new import (README, "Python API": moved names)."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def moved_names(old_module: str, new_homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``old_module`` serving each name of ``new_homes`` (name → the module it
    lives in now) with a warning; any other missing name is the usual ``AttributeError``."""

    def __getattr__(name: str) -> Any:
        home = new_homes.get(name)
        if home is None:
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        warnings.warn(f"{old_module}.{name} has moved: import it from {home} ({old_module} stops providing it in "
                      "the next release)", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), name)

    return __getattr__
