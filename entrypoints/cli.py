"""The ``repgeom`` command. Sub-commands come from plugins (``repgeom_register_commands``), built-ins included.

``repgeom -p no:NAME COMMAND ...`` switches plugin NAME off for this command (as pytest's ``-p no:NAME``), on top of
those listed in ``REPGEOM_DISABLE_PLUGINS``; the switch reaches the processes the command starts through that
variable (docs/plugins.md#switching-a-plugin-off).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence

from repgeom_eval import __version__
from repgeom_eval.errors import RepgeomError


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


def build_parser(host) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="repgeom",
        description="Representation-geometry metrics for language models (dispersion, entropy, ...).",
        epilog="Run `repgeom COMMAND --help` for a command's options; `repgeom plugins` lists installed plugins.",
    )
    parser.add_argument("--version", action="version", version=f"repgeom-eval {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    parser.add_argument("-p", dest="disabled_plugins", action="append", type=_plugin_switch, default=[],
                        metavar="no:NAME", help="switch plugin NAME off for this command, without uninstalling it "
                        "(repeatable; `repgeom plugins` shows each item's plugin; also REPGEOM_DISABLE_PLUGINS=A,B)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in host.commands:
        try:
            cmd = host.commands.get(name)
            p = sub.add_parser(name, help=cmd.help, description=cmd.help)
            cmd.configure(p)
            p.set_defaults(_run=cmd.run)
        except Exception as exc:  # noqa: BLE001 - a broken command plugin must not hide the others
            entry = host.commands.entry(name)
            warnings.warn(f"command {name!r} from plugin {entry.plugin!r} is unavailable: {exc}")
    return parser


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
    try:
        disabled = disabled_by_flags(args_list)
        if disabled:  # through the variable, so that the processes this command starts see it too
            os.environ[DISABLE_ENV] = ",".join(dict.fromkeys([*disabled_from_env(), *disabled]))
        from repgeom_eval.plugin_system.host import get_host

        host = get_host()
        parser = build_parser(host)
        args = parser.parse_args(args_list)
        if not getattr(args, "_run", None):
            parser.print_help()
            return 0
        from repgeom_eval.modeling.loading import LoadingPolicy, use_loading_policy

        policy = LoadingPolicy(trust_remote_code=bool(getattr(args, "trust_remote_code", False)),
                               allow_random_init=bool(getattr(args, "allow_random_init", False)))
        with use_loading_policy(policy):
            rc = args._run(args)
        return int(rc or 0)
    except RepgeomError as exc:
        if debug:
            raise
        print(f"repgeom: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("repgeom: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is None:
            os.environ.pop(DISABLE_ENV, None)
        else:
            os.environ[DISABLE_ENV] = previous


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
