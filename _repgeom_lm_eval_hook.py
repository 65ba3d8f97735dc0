"""Startup hook that lets lm-eval find repgeom-eval's tasks (imported by ``repgeom_lm_eval.pth``).

lm-eval 0.4.13 reads no entry points, so an installed package cannot add tasks to it. The wheel therefore ships a
one-line ``.pth`` file (``import _repgeom_lm_eval_hook``), which Python runs at start-up. This module is the whole
of what runs then: it uses the standard library only (modules already loaded at start-up, and the built-in
``_thread``) and registers an import hook; the ``.pth`` line checks the opt-out before importing it, and a missing
module (a half-finished uninstall) is skipped silently. Nothing else happens until a
program imports ``lm_eval.tasks.manager``; right after that module has run, ``patch_task_manager`` adds
repgeom-eval's ``task_configs`` folder to the folders every ``TaskManager`` searches (as if ``--include_path`` had
been given). The tasks themselves load the rest of repgeom-eval when lm-eval builds them.

Two more callbacks make plain ``lm_eval`` a repgeom front end: after ``lm_eval.models`` has run,
``register_model_name`` adds the model name ``repgeom-hf`` to lm-eval's model registry as a lazy placeholder (the
class is imported only when a run asks for it); after ``lm_eval._cli.harness`` has run, ``patch_cli`` makes an error
of repgeom-eval's own (a ``RepgeomError``: an unknown metric, a bad parameter, a failing or switched-off plugin) end
the command with one line on stderr instead of a traceback (``REPGEOM_DEBUG=1`` shows the traceback); and
``patch_config`` checks every ``repgeom_*`` setting of the command line before lm-eval loads the model.

Switch it off with ``REPGEOM_LM_EVAL_AUTOLOAD=0`` (also ``false``, ``no``, ``off``). ``pip uninstall repgeom-eval``
removes the ``.pth`` file and this module with the rest of the package.
"""

import os
import sys
from _thread import RLock  # a built-in module: nothing to import at start-up (threading costs a millisecond)

ENV_VAR = "REPGEOM_LM_EVAL_AUTOLOAD"
_OFF = {"0", "false", "no", "off"}

_callbacks = {}  # module name -> callbacks waiting for it
_searching = set()  # module names a finder is looking up right now (the finder asks the others, never itself)
_lock = RLock()


def enabled():
    """False when ``REPGEOM_LM_EVAL_AUTOLOAD`` switches the automatic task discovery off."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in _OFF


def _warn(message):
    import warnings  # only on the failure path

    warnings.warn(message, RuntimeWarning, stacklevel=3)


def when_imported(name, callback):
    """Call ``callback(module)`` once ``name`` has been imported: now if it already is, else right after it runs."""
    with _lock:
        module = sys.modules.get(name)
        if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
            _callbacks.setdefault(name, []).append(callback)
            if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
                sys.meta_path.insert(0, _PostImportFinder())
            return
    callback(module)


def _run_callbacks(module):
    with _lock:
        pending = _callbacks.pop(module.__name__, [])
    for callback in pending:
        try:
            callback(module)
        except Exception as exc:  # noqa: BLE001 - a failing hook must never break the importing program
            _warn(f"repgeom-eval: its hook for {module.__name__} failed ({type(exc).__name__}: {exc}); "
                  f"set {ENV_VAR}=0 to switch the lm-eval integration off")


class _PostImportFinder:
    """A meta-path finder (duck-typed: importlib.abc would cost ~15 ms at every start-up) that finds nothing itself:
    for a watched module it asks the other finders and wraps the loader they return."""

    def find_spec(self, fullname, path, target=None):
        with _lock:
            if fullname not in _callbacks or fullname in _searching:
                return None
            _searching.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            with _lock:
                _searching.discard(fullname)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _CallbackLoader(spec.loader)
        return spec


class _CallbackLoader:
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        # Hand the module its real loader back (pkgutil, inspect and reloads use it), then run it.
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _run_callbacks(module)

    def __getattr__(self, name):
        return getattr(self.loader, name)


# -- the task folder ---------------------------------------------------------------------------------------------

MARKER = "repgeom_hardness_mmlu.yaml"  # one of the task files: proves a folder is the right one


def tasks_dir():
    """The folder holding repgeom-eval's lm-eval task YAMLs.

    Found next to this module without importing repgeom_eval (which would load torch): ``repgeom_eval/task_configs``
    in an installed wheel, ``task_configs`` in a source checkout (editable install).
    """
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.join(here, "repgeom_eval", "task_configs"), os.path.join(here, "task_configs")):
        if os.path.isfile(os.path.join(candidate, MARKER)):
            return candidate
    import importlib.util  # unusual layout: ask the import system (this imports repgeom_eval)

    spec = importlib.util.find_spec("repgeom_eval.task_configs")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("repgeom-eval's task_configs folder is missing; reinstall repgeom-eval")
    return list(spec.submodule_search_locations)[0]


def _as_list(include_path):
    if include_path is None:
        return []
    if isinstance(include_path, (list, tuple)):
        return list(include_path)
    return [include_path]


def with_tasks_dir(include_path):
    """``include_path`` (None, a path or a list) with repgeom-eval's task folder first, unless already there.

    First, because lm-eval lets later folders override earlier ones: the user's own folders keep the last word.
    A half-uninstalled repgeom-eval (this module left, the package gone) changes nothing, with a warning.
    """
    try:
        ours = tasks_dir()
    except Exception as exc:  # noqa: BLE001 - lm-eval must keep working whatever state repgeom-eval is in
        _warn(f"repgeom-eval: its lm-eval tasks are not available ({exc}); set {ENV_VAR}=0 to silence this")
        return include_path
    paths = _as_list(include_path)
    if any(os.path.realpath(os.fspath(p)) == os.path.realpath(ours) for p in paths):
        return include_path
    return [ours, *paths]


def patch_task_manager(module):
    """Make every ``TaskManager`` of ``module`` (``lm_eval.tasks.manager``) also search the task folder."""
    import functools
    import inspect

    cls = module.TaskManager
    if getattr(cls.__init__, "_repgeom_tasks_dir", False):
        return
    original = cls.__init__
    signature = inspect.signature(original)
    if "include_path" not in signature.parameters:
        raise RuntimeError(f"lm-eval's TaskManager has no include_path parameter (lm-eval "
                           f"{getattr(sys.modules.get('lm_eval'), '__version__', '?')}); repgeom-eval supports 0.4.x")

    @functools.wraps(original)
    def __init__(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["include_path"] = with_tasks_dir(bound.arguments.get("include_path"))
        original(*bound.args, **bound.kwargs)

    __init__._repgeom_tasks_dir = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


# -- the model name and one-line errors ---------------------------------------------------------------------------

MODEL_NAME = "repgeom-hf"
MODEL_TARGET = "repgeom_eval.lmeval.model:RepgeomHFLM"
DEBUG_ENV = "REPGEOM_DEBUG"
_ON = {"1", "true", "yes", "on"}


def register_model_name(module):
    """Register ``repgeom-hf`` in lm-eval's model registry as a lazy placeholder (``module``: ``lm_eval.models``,
    which registers lm-eval's own names the same way)."""
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=MODEL_TARGET)


def repgeom_error(exc):
    """The RepgeomError in ``exc`` or the exceptions it was raised from, or None (matched by class name: this
    module never imports repgeom_eval)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(c.__name__ == "RepgeomError" for c in type(exc).__mro__):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def one_line(exc):
    """The message of a RepgeomError as one line, without advice that only the ``repgeom`` command can follow."""
    import re

    text = " ".join(str(exc).split())
    text = re.sub(r"`?(?:repgeom )?--debug\b`?", f"{DEBUG_ENV}=1", text)  # the repgeom command's flag: lm_eval has none
    return re.sub(r" or -p no:[\w.-]+", "", text)  # -p no:NAME switches a plugin off on repgeom's command line


def patch_cli(module):
    """Make ``HarnessCLI.execute`` (``module``: ``lm_eval._cli.harness``, behind ``lm_eval`` and ``python -m
    lm_eval``) end on a RepgeomError with ``repgeom: error: MESSAGE`` and exit status 2."""
    import functools

    cls = module.HarnessCLI
    if getattr(cls.execute, "_repgeom_errors", False):
        return
    original = cls.execute

    @functools.wraps(original)
    def execute(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except Exception as exc:
            found = repgeom_error(exc)
            if found is None or os.environ.get(DEBUG_ENV, "").strip().lower() in _ON:
                raise
            print(f"repgeom: error: {one_line(found)}", file=sys.stderr)
            raise SystemExit(2) from None

    execute._repgeom_errors = True  # type: ignore[attr-defined]
    cls.execute = execute


def patch_config(module):
    """Check every ``repgeom_*`` key of a command line's merged ``--model_args`` and ``--metadata`` when lm-eval
    prepares its tasks, which it does before it loads the model (``module``: ``lm_eval.config.evaluate_config``)."""
    import functools

    cls = module.EvaluatorConfig
    if getattr(cls.process_tasks, "_repgeom_checked", False):
        return
    original = cls.process_tasks

    @functools.wraps(original)
    def process_tasks(self, metadata=None, *args, **kwargs):
        merged = metadata if isinstance(metadata, dict) else getattr(self, "metadata", None)
        given = {k: v for k, v in (merged or {}).items() if isinstance(k, str) and k.startswith("repgeom_")}
        if given or getattr(self, "model", None) == MODEL_NAME:
            from repgeom_eval.lmeval.precheck import check_settings

            check_settings(given)
        return original(self, metadata, *args, **kwargs)

    process_tasks._repgeom_checked = True  # type: ignore[attr-defined]
    cls.process_tasks = process_tasks


def install():
    """The callbacks (each runs now if its module is already imported)."""
    when_imported("lm_eval.tasks.manager", patch_task_manager)
    when_imported("lm_eval.models", register_model_name)
    when_imported("lm_eval._cli.harness", patch_cli)
    when_imported("lm_eval.config.evaluate_config", patch_config)


if enabled():
    install()
