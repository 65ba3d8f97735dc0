"""Loading plugins from the ``repgeom_eval`` entry-point group, one at a time, failures recorded not fatal.

pluggy's own ``load_setuptools_entrypoints`` stops at the first plugin that fails to import, which would let one
broken third-party package take the whole tool down; this loader records each failure instead and carries on.
"""

from __future__ import annotations

import difflib
import importlib.metadata as md
import os
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pluggy

from repgeom_eval import hookspecs
from repgeom_eval.errors import PluginError
from repgeom_eval.plugin_system.kinds import Command, Registry

ENTRY_POINT_GROUP = "repgeom_eval"
STRICT_ENV = "REPGEOM_STRICT_PLUGINS"
BUILTIN_DISTRIBUTION = "repgeom-eval"

HOOK_NAMES = sorted(n for n in dir(hookspecs) if n.startswith("repgeom_"))


class PluginLoadWarning(UserWarning):
    """A plugin could not be loaded; the others keep working."""


@dataclass
class PluginFailure:
    plugin: str
    distribution: str | None
    stage: str  # "import", "validate" or the hook name
    error: str


@dataclass
class PluginInfo:
    name: str
    distribution: str | None
    module: str


def _strict_from_env() -> bool:
    return os.environ.get(STRICT_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def _check_metric(obj: Any) -> str | None:
    from repgeom_eval.metric import Metric

    if not (isinstance(obj, type) and issubclass(obj, Metric)):
        return f"expected a subclass of repgeom_eval.Metric, got {obj!r}"
    return None


def _check_architecture(obj: Any) -> str | None:
    from repgeom_eval.modeling.architectures import ArchitectureSpec

    return None if isinstance(obj, ArchitectureSpec) else f"expected an ArchitectureSpec, got {obj!r}"


def _check_callable(obj: Any) -> str | None:
    return None if callable(obj) else f"expected a callable, got {obj!r}"


def _check_command(obj: Any) -> str | None:
    return None if isinstance(obj, Command) else f"expected a repgeom_eval.plugin_system.kinds.Command, got {obj!r}"


def _check_token_set(obj: Any) -> str | None:
    if callable(obj) or isinstance(obj, (list, tuple, frozenset, set)):
        return None
    return f"expected a callable or a collection of strings, got {obj!r}"


class PluginHost:
    """All registries, filled from the entry points (or from an explicit list, for tests)."""

    def __init__(
        self,
        entry_points: Iterable[md.EntryPoint] | None = None,
        strict: bool | None = None,
        extra_plugins: Iterable[tuple[str, ModuleType]] = (),
    ):
        self.strict = _strict_from_env() if strict is None else strict
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.failures: list[PluginFailure] = []
        self.plugins: list[PluginInfo] = []
        self._dists: dict[str, str | None] = {}

        self.metrics: Registry = Registry("metric", _check_metric, "see `repgeom plugins` for installed metrics")
        self.architectures: Registry = Registry(
            "architecture (config.model_type)",
            _check_architecture,
            "add an ArchitectureSpec through a plugin (docs/plugins.md) to support it",
        )
        self.layer_selectors: Registry = Registry("layer selector", _check_callable)
        self.aux_losses: Registry = Registry("aux loss", _check_callable)
        self.token_sets: Registry = Registry("token set", _check_token_set)
        self.commands: Registry = Registry("command", _check_command)
        self._registries = {
            "repgeom_register_metrics": self.metrics,
            "repgeom_register_architectures": self.architectures,
            "repgeom_register_layer_selectors": self.layer_selectors,
            "repgeom_register_aux_losses": self.aux_losses,
            "repgeom_register_token_sets": self.token_sets,
            "repgeom_register_commands": self.commands,
        }

        eps = list(md.entry_points(group=ENTRY_POINT_GROUP)) if entry_points is None else list(entry_points)
        # Built-ins first, so a third party re-using a built-in name is the one reported as the duplicate.
        eps.sort(key=lambda ep: (_dist_name(ep) != BUILTIN_DISTRIBUTION, _dist_name(ep) or "", ep.name))
        for ep in eps:
            self._load_entry_point(ep)
        for name, module in extra_plugins:
            self._register_module(name, None, module)
        self._call_registration_hooks()

    # -- loading -------------------------------------------------------------------------------------------------
    def _fail(self, plugin: str, dist: str | None, stage: str, exc: BaseException | str) -> None:
        error = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        failure = PluginFailure(plugin, dist, stage, error)
        self.failures.append(failure)
        where = f" (from {dist})" if dist else ""
        message = f"repgeom-eval plugin {plugin!r}{where} failed at {stage}: {error}"
        if self.strict:
            raise PluginError(message + f" [{STRICT_ENV} is set]") from (
                exc if isinstance(exc, BaseException) else None
            )
        warnings.warn(message + f"; the other plugins are loaded (set {STRICT_ENV}=1 to make this fatal)",
                      PluginLoadWarning, stacklevel=3)

    def _load_entry_point(self, ep: md.EntryPoint) -> None:
        dist = _dist_name(ep)
        try:
            module = ep.load()
        except Exception as exc:  # noqa: BLE001 - any import-time error of a plugin is its own failure
            self._fail(ep.name, dist, "import", exc)
            return
        self._register_module(ep.name, dist, module)

    def _register_module(self, name: str, dist: str | None, module: Any) -> None:
        problem = self._unknown_hooks(module)
        if problem:
            self._fail(name, dist, "validate", problem)
            return
        if self.pm.has_plugin(name) or name in self._dists:
            self._fail(name, dist, "validate", f"another plugin is already registered under the name {name!r}")
            return
        try:
            self.pm.register(module, name=name)
        except Exception as exc:  # pluggy validation (wrong argument names ...)
            self._fail(name, dist, "validate", exc)
            return
        self._dists[name] = dist
        self.plugins.append(PluginInfo(name, dist, getattr(module, "__name__", repr(module))))

    def _unknown_hooks(self, module: Any) -> str | None:
        problems = []
        for attr in dir(module):
            marked = self.pm.parse_hookimpl_opts(module, attr) is not None
            if marked and attr not in HOOK_NAMES:
                close = difflib.get_close_matches(attr, HOOK_NAMES, n=1)
                problems.append(f"unknown hook {attr!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            elif not marked and attr in HOOK_NAMES and callable(getattr(module, attr)):
                problems.append(f"{attr!r} is not decorated with @repgeom_eval.hookimpl, so it would never be called")
        return "; ".join(problems) or None

    def _call_registration_hooks(self) -> None:
        for hook_name, registry in self._registries.items():
            caller = getattr(self.pm.hook, hook_name)
            for impl in caller.get_hookimpls():
                bound = registry.bound(impl.plugin_name, self._dists.get(impl.plugin_name))
                try:
                    impl.function(*[bound for _ in impl.argnames])
                    bound.commit()
                except Exception as exc:  # noqa: BLE001 - one plugin's bug must not take down the others
                    if hasattr(exc, "add_note"):
                        exc.add_note(f"raised inside {hook_name} of repgeom-eval plugin {impl.plugin_name!r}")
                    self._fail(impl.plugin_name, self._dists.get(impl.plugin_name), hook_name, exc)

    # -- reading -------------------------------------------------------------------------------------------------
    def listing(self) -> list[dict[str, Any]]:
        """Every registered item and every failed plugin, as plain dicts (``repgeom plugins --json``)."""
        rows: list[dict[str, Any]] = []
        kinds = {
            "metric": self.metrics,
            "architecture": self.architectures,
            "layer_selector": self.layer_selectors,
            "aux_loss": self.aux_losses,
            "token_set": self.token_sets,
            "command": self.commands,
        }
        for kind, registry in kinds.items():
            for e in registry.entries():
                rows.append({"name": e.name, "kind": kind, "plugin": e.plugin,
                             "distribution": e.distribution, "description": e.description})
        for f in self.failures:
            rows.append({"name": f.plugin, "kind": "plugin", "plugin": f.plugin, "distribution": f.distribution,
                         "description": f"failed at {f.stage}", "error": f.error})
        return rows


def _dist_name(ep: md.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return getattr(dist, "name", None) if dist is not None else None


_HOST: PluginHost | None = None
_LOCK = threading.Lock()


def get_host() -> PluginHost:
    """The process-wide plugin host, loaded on first use."""
    global _HOST
    with _LOCK:
        if _HOST is None:
            _HOST = PluginHost()
        return _HOST


def reset_host() -> None:
    """Forget the loaded plugins (tests; after installing a plugin in-process)."""
    global _HOST
    with _LOCK:
        _HOST = None
