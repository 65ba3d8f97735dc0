"""Old module paths and names, kept working for one release: importing one warns and gives what lives there now.

The package was regrouped by what each module holds (plugin_system/, modeling/, measurement/, training/, output/).
Code written against the old layout (``from repgeom_eval.auxloss import AuxLoss``) keeps running, with a
``DeprecationWarning`` naming the new path; better still, import the name from ``repgeom_eval`` itself, whose
``__all__`` is the stable API (docs/plugins.md#the-public-api).
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

#: old module path → where it lives now
MOVED = {
    "repgeom_eval.auxloss": "repgeom_eval.training.auxloss",
    "repgeom_eval.trainer": "repgeom_eval.training.trainer",
    "repgeom_eval.pipeline": "repgeom_eval.measurement.engine",
    "repgeom_eval.models": "repgeom_eval.modeling.loading",
    "repgeom_eval.addresses": "repgeom_eval.modeling.addresses",
    "repgeom_eval.architectures": "repgeom_eval.modeling.architectures",
    "repgeom_eval.capture": "repgeom_eval.modeling.hooks",
    "repgeom_eval.plugin_host": "repgeom_eval.plugin_system.host",
    "repgeom_eval.registry": "repgeom_eval.plugin_system.kinds",
    "repgeom_eval.pooling": "repgeom_eval.measurement.pooling",
    "repgeom_eval.preprocess": "repgeom_eval.measurement.preprocess",
    "repgeom_eval.augment": "repgeom_eval.measurement.augment",
    "repgeom_eval.distributed": "repgeom_eval.measurement.distributed",
    "repgeom_eval.data": "repgeom_eval.measurement.texts",
    "repgeom_eval.runstate": "repgeom_eval.measurement.checkpoint",
    "repgeom_eval.io": "repgeom_eval.output.files",
    "repgeom_eval.report": "repgeom_eval.output.console",
    "repgeom_eval.plotting": "repgeom_eval.output.plotting",
    "repgeom_eval.queries": "repgeom_eval.analyses.queries",
    "repgeom_eval.slices": "repgeom_eval.analyses.slices",
}


def moved_names(old_module: str, new_homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``old_module`` serving each name of ``new_homes`` (name → the module it
    lives in now, or ``module:new_name`` where it was renamed too) with a warning; any other missing name is the
    usual ``AttributeError``."""

    def __getattr__(name: str) -> Any:
        home = new_homes.get(name)
        if home is None:
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        module, _, new_name = home.partition(":")
        where = f"{module} as {new_name}" if new_name else module
        warnings.warn(f"{old_module}.{name} has moved: import it from {where} ({old_module} stops providing it in "
                      "the next release)", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), new_name or name)

    return __getattr__


class _MovedLoader:
    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def create_module(self, spec: Any) -> Any:
        warnings.warn(f"{self.old} moved to {self.new}: import from there, or the name from repgeom_eval itself; "
                      "the old path goes in the next release", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:
        """The module is the one at its new path, already executed; the import system gave it the old path's spec,
        which is put back (reloading and pickling go by the real one)."""
        module.__spec__ = self.spec


class _MovedFinder:
    """A meta-path finder that answers only for the old paths (real modules are found first)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        new = MOVED.get(fullname)
        if new is None:
            return None
        from importlib.util import spec_from_loader

        return spec_from_loader(fullname, _MovedLoader(fullname, new))


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
