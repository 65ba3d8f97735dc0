"""Loading plugins from the ``repgeom_eval`` entry-point group, one at a time, failures recorded not fatal.

pluggy's own ``load_setuptools_entrypoints`` stops at the first plugin that fails to import, which would let one
broken third-party package take the whole tool down; this loader records each failure instead and carries on
(``REPGEOM_STRICT_PLUGINS=1``: every failure, then one error listing them all). Plugins named in
``REPGEOM_DISABLE_PLUGINS`` (or ``repgeom -p no:NAME``) are not imported at all. Each loaded plugin keeps its
distribution and version, which every output records (:meth:`PluginHost.provenance`; docs/plugins.md#provenance).
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

from repgeom_eval.spec import hookspecs
from repgeom_eval.spec.errors import PluginError, PluginUnavailableError, UnknownNameError
from repgeom_eval.plugin_system.kinds import Registry
from repgeom_eval.spec.hookspecs import KINDS

ENTRY_POINT_GROUP = "repgeom_eval"
STRICT_ENV = "REPGEOM_STRICT_PLUGINS"
DISABLE_ENV = "REPGEOM_DISABLE_PLUGINS"
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
    version: str | None = None
    staged: tuple[str, ...] = ()  # names the failed hook had added before it failed (dropped with it)

    def describe(self) -> str:
        return f"{origin(self.plugin, self.distribution, self.version)} failed at {self.stage}: {self.error}"


@dataclass
class PluginInfo:
    name: str
    distribution: str | None
    module: str
    version: str | None = None


def origin(plugin: str, distribution: str | None, version: str | None) -> str:
    """``plugin 'example' (from repgeom-example-metric 0.1.0)``: how messages name a plugin."""
    if not distribution:
        return f"plugin {plugin!r}" + (f" (version {version})" if version else "")
    return f"plugin {plugin!r} (from {distribution}{' ' + version if version else ''})"


def _strict_from_env() -> bool:
    return os.environ.get(STRICT_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def disabled_from_env() -> tuple[str, ...]:
    """The plugin names listed in ``REPGEOM_DISABLE_PLUGINS`` (commas or spaces between them)."""
    raw = os.environ.get(DISABLE_ENV, "")
    return tuple(dict.fromkeys(n for n in raw.replace(",", " ").split() if n))


class PluginHost:
    """All registries, filled from the entry points (or from an explicit list, for tests)."""

    def __init__(
        self,
        entry_points: Iterable[md.EntryPoint] | None = None,
        strict: bool | None = None,
        extra_plugins: Iterable[tuple[str, ModuleType]] = (),
        disable: Iterable[str] | None = None,
    ):
        """``entry_points``: default, the installed ones; ``strict``: default ``REPGEOM_STRICT_PLUGINS``;
        ``extra_plugins``: ``(name, module)`` pairs registered after them (trying a plugin before packaging it);
        ``disable``: plugin names not to load, default ``REPGEOM_DISABLE_PLUGINS``."""
        self.strict = _strict_from_env() if strict is None else strict
        self.disable: tuple[str, ...] = disabled_from_env() if disable is None else tuple(disable)
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.failures: list[PluginFailure] = []
        self.plugins: list[PluginInfo] = []
        self.disabled: list[PluginInfo] = []  # switched off: never imported
        self._dists: dict[str, str | None] = {}
        self._versions: dict[str, str | None] = {}
        self._compatible: dict[str, str] = {}  # plugin → the earlier release whose states and numbers it keeps
        self._first_exc: BaseException | None = None  # the cause of a strict-mode error (--debug shows it)

        # one registry per plugin kind, all described by the one table (KINDS, repgeom_eval/spec/hookspecs.py)
        self._registries: dict[str, Registry] = {}
        for k in KINDS:
            registry: Registry = Registry(k.label, k.check, k.unknown_hint)
            setattr(self, k.attribute, registry)
            self._registries[k.hook] = registry

        for hook_name, registry in self._registries.items():
            registry.explain_missing = self._explainer(hook_name, registry)

        eps = list(md.entry_points(group=ENTRY_POINT_GROUP)) if entry_points is None else list(entry_points)
        # Built-ins first, so a third party re-using a built-in name is the one reported as the duplicate.
        eps.sort(key=lambda ep: (_dist_name(ep) != BUILTIN_DISTRIBUTION, _dist_name(ep) or "", ep.name))
        extra_plugins = list(extra_plugins)
        for ep in eps:
            if ep.name in self.disable:
                self.disabled.append(PluginInfo(ep.name, _dist_name(ep), ep.value, _dist_version(ep)))
                continue
            self._load_entry_point(ep)
        for name, module in extra_plugins:
            if name in self.disable:
                self.disabled.append(PluginInfo(name, None, getattr(module, "__name__", repr(module)),
                                                _module_version(module)))
                continue
            self._register_module(name, None, module, _module_version(module))
        self._call_registration_hooks()
        known = {ep.name for ep in eps} | {name for name, _ in extra_plugins}
        unknown = [n for n in self.disable if n not in known]
        if unknown:
            warnings.warn(f"{DISABLE_ENV} / -p no:NAME names no installed plugin: {', '.join(map(repr, unknown))} "
                          f"(plugins: {', '.join(sorted(known)) or 'none'}; `repgeom plugins` shows each item's "
                          "plugin)", PluginLoadWarning, stacklevel=2)
        if self.strict and self.failures:
            self._raise_strict()

    # -- loading -------------------------------------------------------------------------------------------------
    def _fail(self, plugin: str, dist: str | None, stage: str, exc: BaseException | str, version: str | None = None,
              staged: tuple[str, ...] = ()) -> None:
        error = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        error = " ".join(error.split())  # one line, whatever the plugin's message looked like
        failure = PluginFailure(plugin, dist, stage, error, version, staged)
        self.failures.append(failure)
        if isinstance(exc, BaseException) and self._first_exc is None:
            self._first_exc = exc
        if self.strict:
            return  # every failure is collected, then one error lists them all (_raise_strict)
        warnings.warn(f"repgeom-eval {failure.describe()}; the other plugins are loaded (set {STRICT_ENV}=1 to make "
                      "this fatal)", PluginLoadWarning, stacklevel=3)

    def _raise_strict(self) -> None:
        if len(self.failures) == 1:
            message = f"repgeom-eval {self.failures[0].describe()}"
        else:
            message = f"{len(self.failures)} repgeom-eval plugins failed to load: " + "; ".join(
                f"({i}) {f.describe()}" for i, f in enumerate(self.failures, 1))
        raise PluginError(f"{message} [{STRICT_ENV} is set]") from self._first_exc

    def _load_entry_point(self, ep: md.EntryPoint) -> None:
        dist, version = _dist_name(ep), _dist_version(ep)
        try:
            module = ep.load()
        except Exception as exc:  # noqa: BLE001 - any import-time error of a plugin is its own failure
            self._fail(ep.name, dist, "import", exc, version)
            return
        self._register_module(ep.name, dist, module, version)

    def _register_module(self, name: str, dist: str | None, module: Any, version: str | None = None) -> None:
        problem = self._unknown_hooks(module)
        if problem:
            self._fail(name, dist, "validate", problem, version)
            return
        if self.pm.has_plugin(name) or name in self._dists:
            self._fail(name, dist, "validate", f"another plugin is already registered under the name {name!r}",
                       version)
            return
        try:
            self.pm.register(module, name=name)
        except Exception as exc:  # pluggy validation (wrong argument names ...)
            self._fail(name, dist, "validate", exc, version)
            return
        version = self._code_version(name, module, version)
        self._dists[name] = dist
        self._versions[name] = version
        compatible = _declared(module, "repgeom_compatible_with")
        if compatible is not None:
            self._compatible[name] = str(compatible)
        self.plugins.append(PluginInfo(name, dist, getattr(module, "__name__", repr(module)), version))

    def _code_version(self, name: str, module: Any, version: str | None) -> str | None:
        """The version of the code that runs: the plugin's ``__version__`` (its module's, else its package's) over
        the distribution metadata, which a ``pip install --target --upgrade`` can leave stale beside new code."""
        code = _declared(module, "__version__")
        if code is None or str(code) == version:
            return version
        if version is not None:
            warnings.warn(f"repgeom-eval plugin {name!r}: its code says version {code} but the installed metadata "
                          f"says {version} (a stale .dist-info left by an upgrade?); recording {code}",
                          PluginLoadWarning, stacklevel=4)
        return str(code)

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
                plugin = impl.plugin_name
                bound = registry.bound(plugin, self._dists.get(plugin))
                try:
                    impl.function(*[bound for _ in impl.argnames])
                    bound.commit()
                except Exception as exc:  # noqa: BLE001 - one plugin's bug must not take down the others
                    if hasattr(exc, "add_note"):
                        exc.add_note(f"raised inside {hook_name} of repgeom-eval plugin {plugin!r}")
                    staged = tuple(e.name for e in bound.staged)
                    self._fail(plugin, self._dists.get(plugin), hook_name, exc, self._versions.get(plugin), staged)

    # -- unknown names ---------------------------------------------------------------------------------------------
    def _explainer(self, hook_name: str, registry: Registry):
        """What ``registry.entry(name)`` raises for a missing name when a plugin failed or is switched off."""

        def explain(name: str) -> Exception | None:
            kind = registry.kind
            for f in self.failures:
                if f.stage == hook_name and name in f.staged:
                    return PluginUnavailableError(kind, name, (
                        f"{kind} {name!r} is unavailable: {f.describe()}, so nothing it registers is loaded; fix or "
                        "uninstall that plugin (`repgeom plugins` lists the failures)"), registry.names())
            failed = [(f.plugin, f.describe()) for f in self.failures if f.stage in ("import", "validate", hook_name)]
            off = [(p.name, f"{origin(p.name, p.distribution, p.version)} is switched off ({DISABLE_ENV} or "
                            f"-p no:{p.name})") for p in self.disabled]
            if not failed and not off:
                return None
            named = [text for plugin, text in failed + off if plugin == name]  # e.g. -p no:dispersion
            suspects = named or [text for _, text in failed[:3] + off[:3]]
            close = difflib.get_close_matches(name, registry.names(), n=3, cutoff=0.5)
            if close and not named:  # most likely a typo: the usual message, the suspects as a hint
                return UnknownNameError(kind, name, registry.names(),
                                        f"{registry.unknown_hint + '. ' if registry.unknown_hint else ''}"
                                        f"Not loaded, and perhaps providing it: {'; '.join(suspects)}")
            return PluginUnavailableError(kind, name, (
                f"{kind} {name!r} is not registered, and a plugin that may provide it is not loaded: "
                f"{'; '.join(suspects)} (`repgeom plugins` lists every plugin)"), registry.names())

        return explain

    # -- reading -------------------------------------------------------------------------------------------------
    KINDS = tuple(k.kind for k in KINDS)

    def registry(self, kind: str) -> Registry:
        """The registry of one kind: ``metric``, ``architecture``, ``layer_selector``, ``aux_loss``, ``token_set``
        or ``command`` (the ``kind`` column of ``repgeom plugins``)."""
        registries = {k.kind: getattr(self, k.attribute) for k in KINDS}
        if kind not in registries:
            raise UnknownNameError("plugin kind", kind, registries)
        return registries[kind]

    def provenance(self, kind: str, names: Iterable[str]) -> dict[str, dict[str, str | None]]:
        """Where each named item comes from: ``{name: {"plugin", "distribution", "version"}}``.

        What every output records next to the items it used, and what a resume key compares (a plugin upgraded
        between a run and its resume changes the numbers). Unknown names raise as ``registry.entry`` does.
        """
        registry = self.registry(kind)
        out: dict[str, dict[str, str | None]] = {}
        for name in dict.fromkeys(names):
            entry = registry.entry(name)
            out[name] = {"plugin": entry.plugin, "distribution": entry.distribution,
                         "version": self._versions.get(entry.plugin)}
        return out

    def state_identity(self, kind: str, names: Iterable[str]) -> dict[str, dict[str, str | None]]:
        """:meth:`provenance` as a resume key compares it: a plugin that declares ``repgeom_compatible_with =
        "0.1.0"`` (its release keeps that one's state format and numbers) is keyed by that release, so a bug-fix
        release does not throw saved runs away (docs/plugins.md#versions-and-saved-runs)."""
        out = self.provenance(kind, names)
        for item in out.values():
            compatible = self._compatible.get(str(item["plugin"]))
            if compatible is not None:
                item["version"] = compatible
        return out

    def plugin_versions(self) -> dict[str, dict[str, str | None]]:
        """Every loaded plugin: ``{plugin: {"distribution", "version"}}`` (the analyses' ``config["plugins"]``)."""
        return {p.name: {"distribution": p.distribution, "version": p.version}
                for p in sorted(self.plugins, key=lambda p: p.name)}

    def listing(self) -> list[dict[str, Any]]:
        """Every registered item, every failed plugin and every switched-off plugin, as plain dicts
        (``repgeom plugins --json``)."""
        rows: list[dict[str, Any]] = []
        for kind in self.KINDS:
            for e in self.registry(kind).entries():
                rows.append({"name": e.name, "kind": kind, "plugin": e.plugin, "distribution": e.distribution,
                             "version": self._versions.get(e.plugin), "description": e.description})
        for f in self.failures:
            rows.append({"name": f.plugin, "kind": "plugin", "plugin": f.plugin, "distribution": f.distribution,
                         "version": f.version, "description": f"failed at {f.stage}", "error": f.error})
        for p in self.disabled:
            rows.append({"name": p.name, "kind": "plugin", "plugin": p.name, "distribution": p.distribution,
                         "version": p.version, "description": f"switched off ({DISABLE_ENV} or -p no:{p.name})",
                         "disabled": True})
        return rows


def _declared(module: Any, attribute: str) -> Any:
    """``module.<attribute>``, else the same attribute of its top-level package (None if neither has it)."""
    value = getattr(module, attribute, None)
    if value is None:
        import sys

        package = sys.modules.get(str(getattr(module, "__name__", "")).split(".")[0])
        value = getattr(package, attribute, None) if package is not None and package is not module else None
    return value


def _dist_name(ep: md.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return getattr(dist, "name", None) if dist is not None else None


def _dist_version(ep: md.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    try:
        return getattr(dist, "version", None) if dist is not None else None
    except Exception:  # noqa: BLE001 - broken metadata: the version is unknown, the plugin may still load
        return None


def _module_version(module: Any) -> str | None:
    version = getattr(module, "__version__", None)
    return version if isinstance(version, str) else None


_HOST: PluginHost | None = None
_HOST_SETTINGS: tuple | None = None
_LOCK = threading.Lock()


def get_host() -> PluginHost:
    """The process-wide plugin host, loaded on first use (and again if ``REPGEOM_DISABLE_PLUGINS`` or
    ``REPGEOM_STRICT_PLUGINS`` changed since)."""
    global _HOST, _HOST_SETTINGS
    with _LOCK:
        settings = (disabled_from_env(), _strict_from_env())
        if _HOST is None or settings != _HOST_SETTINGS:
            _HOST, _HOST_SETTINGS = None, None
            _HOST = PluginHost()
            _HOST_SETTINGS = settings
        return _HOST


def reset_host() -> None:
    """Forget the loaded plugins (tests; after installing a plugin in-process)."""
    global _HOST
    with _LOCK:
        _HOST = None
