"""The plugin interface of repgeom-eval: every hook a plugin may implement.

A plugin is any module exposed through the ``repgeom_eval`` entry-point group that defines one or more of the
functions below, decorated with :data:`repgeom_eval.hookimpl`::

    import repgeom_eval

    @repgeom_eval.hookimpl
    def repgeom_register_metrics(registry):
        registry.add(MyMetric)

Each ``repgeom_register_*`` hook receives a *registry object* bound to the calling plugin, so a duplicate name can
be reported naming both plugins and a wrong kind of object is refused with the plugin's name. A hook that raises
disables only the plugin that raised (see ``repgeom plugins``); ``REPGEOM_STRICT_PLUGINS=1`` makes it fatal.
``REPGEOM_DISABLE_PLUGINS=NAME,...`` (or ``repgeom -p no:NAME``) switches a plugin off without importing it
(docs/plugins.md#switching-a-plugin-off).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # pragma: no cover - imported for annotations only
    from repgeom_eval.plugin_system.kinds import Registry

PROJECT = "repgeom_eval"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def repgeom_register_metrics(registry: "Registry") -> None:
    """Register metric classes (subclasses of :class:`repgeom_eval.Metric`).

    ``registry.add(cls)`` uses ``cls.name``; ``registry.add("pkg.module:Class", name=...)`` registers lazily, so the
    class is imported only when the metric is used.
    """


@hookspec
def repgeom_register_architectures(registry: "Registry") -> None:
    """Register :class:`repgeom_eval.ArchitectureSpec` tables that map layer addresses to modules.

    The registered name is the Hugging Face ``config.model_type`` (one spec may be added under several names).
    """


@hookspec
def repgeom_register_layer_selectors(registry: "Registry") -> None:
    """Register named layer selections usable wherever addresses are accepted (``--layers all``).

    A selector is a callable ``(model_info: ModelInfo) -> list[str]`` returning layer addresses; its docstring's
    first line is shown by ``repgeom plugins``.
    """


@hookspec
def repgeom_register_aux_losses(registry: "Registry") -> None:
    """Register auxiliary training losses (push-away, dispersion losses ...) for ``repgeom train``.

    Each is a subclass of :class:`repgeom_eval.training.auxloss.AuxLoss` (the class, not an instance or a loss
    function): the trainer builds it with a config entry's parameters and calls the instance on the hidden states
    (docs/plugins.md#auxiliary-losses).
    """


@hookspec
def repgeom_register_token_sets(registry: "Registry") -> None:
    """Register named token sets (``digits``, ``python_keywords`` ...) used by the dispersion gap.

    A token set is a collection of words or a callable ``fn(vocab, *, exclude, seed, size) -> (ids, missing)``
    (optionally ``(ids, missing, config)``) over a :class:`repgeom_eval.analyses.gap.vocabulary.Vocabulary`; see
    ``repgeom_eval.analyses.gap.vocabulary``.
    """


@hookspec
def repgeom_register_layer_picks(registry: "Registry") -> None:
    """Register label-free layer-pick rules for ``--layer auto`` (``repgeom mteb run --layer-pick NAME``).

    Each is a subclass of :class:`repgeom_eval.spec.layer_pick.LayerPick` (the class): the host builds it with the
    ``--layer-pick-param`` values, scores every candidate layer on a task's own texts and lets it choose
    (docs/picks.md, docs/plugins.md#layer-picks).
    """


@hookspec
def repgeom_register_commands(registry: "Registry") -> None:
    """Register ``repgeom`` sub-commands as :class:`repgeom_eval.Command` objects (declared below)."""


@dataclass
class Command:
    """A ``repgeom`` sub-command: ``configure(parser)`` adds arguments, ``run(args)`` returns an exit code."""

    name: str
    help: str
    configure: Callable[[Any], None]
    run: Callable[[Any], int | None]


# -- the plugin kinds, in one table ---------------------------------------------------------------------------------


def _derives_from(cls: type, base: str) -> bool:
    """Whether ``base`` (``"module:Class"``) is among ``cls``'s bases, by name: a plugin item is checked without
    importing the module that defines the base (the host imports no training or modeling code)."""
    return any(f"{c.__module__}:{c.__qualname__}" == base for c in getattr(cls, "__mro__", ()))


def _check_subclass(base: str, what: str, hint: str = "") -> Callable[[Any], str | None]:
    """A check that the object is a subclass of ``base``."""

    def check(obj: Any) -> str | None:
        if isinstance(obj, type) and _derives_from(obj, base):
            return None
        return f"expected a subclass of {what}, got {obj!r}" + (f"; {hint}" if hint else "")

    return check


def _check_instance(base: str, what: str) -> Callable[[Any], str | None]:
    def check(obj: Any) -> str | None:
        return None if _derives_from(type(obj), base) else f"expected {what}, got {obj!r}"

    return check


def _check_callable(obj: Any) -> str | None:
    return None if callable(obj) else f"expected a callable, got {obj!r}"


def _check_token_set(obj: Any) -> str | None:
    if callable(obj) or isinstance(obj, (list, tuple, frozenset, set)):
        return None
    return f"expected a callable or a collection of strings, got {obj!r}"


@dataclass(frozen=True)
class PluginKind:
    """One kind of thing a plugin registers: everything the host, ``repgeom plugins`` and the docs say about it."""

    kind: str  # the ``kind`` column of ``repgeom plugins`` and ``PluginHost.registry(kind)``
    attribute: str  # the host's registry attribute (``host.metrics``)
    hook: str  # the hookspec that registers it (repgeom_eval/spec/hookspecs.py)
    label: str  # how messages name one item
    check: Callable[[Any], str | None]  # why an object is not a valid item (None: it is)
    unknown_hint: str = ""  # appended to "unknown <label> ..." errors


KINDS: tuple[PluginKind, ...] = (
    PluginKind("metric", "metrics", "repgeom_register_metrics", "metric",
               _check_subclass("repgeom_eval.spec.metric:Metric", "repgeom_eval.Metric"),
               "see `repgeom plugins` for installed metrics"),
    PluginKind("architecture", "architectures", "repgeom_register_architectures", "architecture (config.model_type)",
               _check_instance("repgeom_eval.modeling.architectures:ArchitectureSpec", "an ArchitectureSpec"),
               "add an ArchitectureSpec through a plugin (docs/plugins.md) to support it"),
    PluginKind("layer_selector", "layer_selectors", "repgeom_register_layer_selectors", "layer selector",
               _check_callable),
    PluginKind("aux_loss", "aux_losses", "repgeom_register_aux_losses", "aux loss",
               _check_subclass("repgeom_eval.training.auxloss:AuxLoss", "repgeom_eval.AuxLoss",
                               "`repgeom train` builds the class with the config's parameters and calls the instance "
                               "on the hidden states, so register the class, not a loss function "
                               "(docs/plugins.md#auxiliary-losses)")),
    PluginKind("token_set", "token_sets", "repgeom_register_token_sets", "token set", _check_token_set),
    PluginKind("layer_pick", "layer_picks", "repgeom_register_layer_picks", "layer pick",
               _check_subclass("repgeom_eval.spec.layer_pick:LayerPick", "repgeom_eval.spec.layer_pick.LayerPick",
                               "`--layer auto` builds the class with the --layer-pick-param values, so register the "
                               "class (docs/plugins.md#layer-picks)"),
               "See `repgeom plugins --kind layer_pick`, or docs/picks.md"),
    PluginKind("command", "commands", "repgeom_register_commands", "command",
               _check_instance("repgeom_eval.spec.hookspecs:Command", "a repgeom_eval.Command")),
)
