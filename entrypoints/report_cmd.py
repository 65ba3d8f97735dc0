"""``repgeom report``: the JSON outputs of the other commands as one self-contained, offline HTML page."""

from __future__ import annotations

import argparse

from repgeom_eval.spec.options.commands import ReportCommand


configure = ReportCommand.add_arguments


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from repgeom_eval.analyses.html_report import result_files, write_report
    from repgeom_eval.output.files import check_outputs, check_writable

    cfg = ReportCommand.from_args(args)
    check_outputs({"--output": cfg.output}, inputs={"RESULT": [str(p) for p in result_files(list(cfg.results))]})
    check_writable(cfg.output)
    path = write_report(list(cfg.results), cfg.output, cfg.title)
    Console().print(f"report: {escape(str(path))} ({path.stat().st_size / 1024:.0f} KiB, self-contained)",
                    soft_wrap=True)
    return 0
