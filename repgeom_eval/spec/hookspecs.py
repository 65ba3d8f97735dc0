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

from typing import TYPE_CHECKING

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
    """Register ``repgeom`` sub-commands as :class:`repgeom_eval.plugin_system.kinds.Command` objects."""
