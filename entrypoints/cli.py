"""The ``repgeom`` command. Sub-commands come from plugins (``repgeom_register_commands``), built-ins included.

``repgeom -p no:NAME COMMAND ...`` switches plugin NAME off for this command (as pytest's ``-p no:NAME``), on top of
those listed in ``REPGEOM_DISABLE_PLUGINS``; the switch reaches the processes the command starts through that
variable (docs/plugins.md#switching-a-plugin-off).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence

from repgeom_eval.spec.errors import RepgeomError


# optional dependency (top-level module) → the extra of pyproject.toml that installs it
OPTIONAL = {"lm_eval": "lmeval", "sklearn": "lmeval", "scipy": "lmeval", "mteb": "mteb",
            "sentence_transformers": "mteb", "accelerate": "train", "datasets": "train", "matplotlib": "plot",
            "pandas": "compare", "faiss": "knn", "nlpaug": "aug", "peft": "peft", "gguf": "gguf"}


def extra_for(module: str) -> str | None:
    """The extra that installs ``module`` (``lm_eval.api`` → ``lmeval``), or None for a module of no extra."""
    return OPTIONAL.get(module.partition(".")[0])


def _format_warning(message, category, filename, lineno, line=None) -> str:
    return f"repgeom: warning: {message}\n"


def _plugin_switch(value: str) -> str:
    if not value.startswith("no:") or not value[3:].strip():
        raise argparse.ArgumentTypeError(f"expected no:NAME (switch plugin NAME off), got {value!r}")
    return value[3:].strip()


def disabled_by_flags(argv: Sequence[str]) -> list[str]:
    """The plugin names of the global ``-p no:NAME`` options (those before the command name).

    Read before the parser is built, because the plugins provide the commands the parser knows."""
    names: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-p":
            if i + 1 >= len(argv):
                break  # the parser reports the missing value
            value, i = argv[i + 1], i + 2
        elif arg.startswith("-p") and not arg.startswith("--"):
            value, i = arg[2:].removeprefix("="), i + 1
        elif arg.startswith("-"):
            i += 1
            continue
        else:
            break  # the command: its own options follow
        try:
            names.append(_plugin_switch(value))
        except argparse.ArgumentTypeError as exc:
            raise RepgeomError(f"-p {value}: {exc}") from None
    return names


class _Parser(argparse.ArgumentParser):
    """argparse's parser, with its errors in the one-line form of every other error (no usage block first)."""

    def error(self, message: str):  # type: ignore[override]
        where = self.prog.removeprefix("repgeom").strip()
        self.exit(2, f"repgeom: error: {where + ': ' if where else ''}{message} (`{self.prog} --help` lists the "
                     "options)\n")


class _CommandParsers(argparse._SubParsersAction):
    """The ``COMMAND`` positional: every command's parser exists (``repgeom --help`` lists them with their help
    lines), but a command's options are added, by its ``configure``, only when that command is the one parsed.

    ``configure`` may import the command's module and heavy defaults (torch, an analysis module); doing that for
    every command would make ``repgeom --help`` pay for all of them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pending: dict[str, tuple[Callable[[argparse.ArgumentParser], None], str]] = {}

    def add_command(self, name: str, help: str, configure: Callable[[argparse.ArgumentParser], None],
                    run: Callable[[argparse.Namespace], int | None], plugin: str) -> argparse.ArgumentParser:
        p = self.add_parser(name, help=help, description=help)
        p.set_defaults(_run=run)
        self._pending[name] = (configure, plugin)
        return p

    def configure(self, name: str) -> argparse.ArgumentParser:
        """Add command ``name``'s options now (once); a failing ``configure`` is the command's plugin's error."""
        parser = self._name_parser_map[name]
        pending = self._pending.pop(name, None)
        if pending is not None:
            configure, plugin = pending
            try:
                configure(parser)
            except Exception as exc:  # noqa: BLE001 - a broken command plugin breaks only its own command
                raise RepgeomError(f"command {name!r} from plugin {plugin!r} is unavailable: "
                                   f"{type(exc).__name__}: {exc}") from exc
        return parser

    def __call__(self, parser, namespace, values, option_string=None):
        if values and values[0] in self._name_parser_map:
            self.configure(values[0])
        super().__call__(parser, namespace, values, option_string)


def build_parser(host) -> argparse.ArgumentParser:
    """The ``repgeom`` parser. Each command's options are added when that command is parsed; call
    ``command_parser(parser, name)`` to get one command's complete parser without parsing."""
    parser = _Parser(
        prog="repgeom",
        description="Representation-geometry metrics for language models (dispersion, entropy, ...).",
        epilog="Run `repgeom COMMAND --help` for a command's options; `repgeom plugins` lists installed plugins.",
    )
    from repgeom_eval.output.versions import version_line

    parser.add_argument("--version", action="version", version=version_line())
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    parser.add_argument("-p", dest="disabled_plugins", action="append", type=_plugin_switch, default=[],
                        metavar="no:NAME", help="switch plugin NAME off for this command, without uninstalling it "
                        "(repeatable; `repgeom plugins` shows each item's plugin; also REPGEOM_DISABLE_PLUGINS=A,B)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", action=_CommandParsers)
    for name in host.commands:
        try:
            cmd = host.commands.get(name)
        except Exception as exc:  # noqa: BLE001 - a broken command plugin must not hide the others
            entry = host.commands.entry(name)
            warnings.warn(f"command {name!r} from plugin {entry.plugin!r} is unavailable: {exc}")
            continue
        sub.add_command(name, cmd.help, cmd.configure, cmd.run, host.commands.entry(name).plugin)
    return parser


def command_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """Command ``name``'s parser from :func:`build_parser`, with its options added (tests, documentation)."""
    for action in parser._actions:
        if isinstance(action, _CommandParsers):
            return action.configure(name)
    raise ValueError("not a parser made by build_parser")


def main(argv: Sequence[str] | None = None) -> int:
    previous_format = warnings.formatwarning
    warnings.formatwarning = _format_warning  # one line per warning, no source echo
    try:
        return _main(argv)
    finally:
        warnings.formatwarning = previous_format


def _main(argv: Sequence[str] | None) -> int:
    args_list = list(argv if argv is not None else sys.argv[1:])
    debug = "--debug" in args_list or bool(os.environ.get("REPGEOM_DEBUG"))
    from repgeom_eval.plugin_system.host import DISABLE_ENV, disabled_from_env

    previous = os.environ.get(DISABLE_ENV)
    previous_debug = os.environ.get("REPGEOM_DEBUG")
    if debug:  # the run's code reads it too: a failing plugin metric then stops the run with its traceback
        os.environ["REPGEOM_DEBUG"] = "1"
    try:
        disabled = disabled_by_flags(args_list)
        if disabled:  # through the variable, so that the processes this command starts see it too
            os.environ[DISABLE_ENV] = ",".join(dict.fromkeys([*disabled_from_env(), *disabled]))
        from repgeom_eval.plugin_system.host import get_host

        host = get_host()
        if not host.commands.names():
            off = disabled_from_env()
            if "commands" in off:  # the built-in plugin that registers every command
                why = "the built-in plugin 'commands' that provides them is switched off; drop -p no:commands " \
                      "(or take it out of REPGEOM_DISABLE_PLUGINS)"
            elif off:
                why = f"the plugins switched off ({', '.join(off)}) include the one that provides them"
            else:
                why = "no installed plugin provides any (reinstall repgeom-eval)"
            raise RepgeomError(f"no command is available: {why}")
        parser = build_parser(host)
        args = parser.parse_args(args_list)
        if not getattr(args, "_run", None):
            parser.print_help()
            return 0
        options_class = getattr(args, "_options_class", None)  # the command's configuration (option_fields.Options)
        if options_class is not None:  # flags and --config FILE, validated once, before anything runs; the command
            options_class.from_args(args)  # reads the same object (from_args builds it once per namespace)
        return int(args._run(args) or 0)
    except RepgeomError as exc:
        message = str(exc)
        if debug:  # the traceback, then the same one line and exit status as without --debug
            traceback.print_exc()
            message = re.sub(r" \((repgeom )?--debug shows the traceback\)", "", message)
        print(f"repgeom: error: {message}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        extra = extra_for(exc.name or "")
        if debug or extra is None:
            raise
        print(f"repgeom: error: this needs the {exc.name.partition('.')[0]} package, which is not installed: "
              f"pip install \"repgeom-eval[{extra}]\"", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("repgeom: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is None:
            os.environ.pop(DISABLE_ENV, None)
        else:
            os.environ[DISABLE_ENV] = previous
        if previous_debug is None:
            os.environ.pop("REPGEOM_DEBUG", None)
        else:
            os.environ["REPGEOM_DEBUG"] = previous_debug


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
