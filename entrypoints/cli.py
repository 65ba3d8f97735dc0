"""The ``repgeom`` command. Sub-commands come from plugins (``repgeom_register_commands``), built-ins included."""

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


def build_parser(host) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="repgeom",
        description="Representation-geometry metrics for language models (dispersion, entropy, ...).",
        epilog="Run `repgeom COMMAND --help` for a command's options; `repgeom plugins` lists installed plugins.",
    )
    parser.add_argument("--version", action="version", version=f"repgeom-eval {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
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
    debug = "--debug" in (argv if argv is not None else sys.argv[1:]) or bool(os.environ.get("REPGEOM_DEBUG"))
    try:
        from repgeom_eval.plugin_system.host import get_host

        host = get_host()
        parser = build_parser(host)
        args = parser.parse_args(argv)
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
