"""``repgeom report``: the JSON outputs of the other commands as one self-contained, offline HTML page."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass

from repgeom_eval.spec.option_fields import Options, option


@dataclass(frozen=True, kw_only=True)
class ReportCommand(Options):
    """Every option of ``repgeom report``."""

    results: tuple[str, ...] = option(MISSING, "RESULT", nargs="+",
                                      help="results .json files written with --output by measure, gap, ppl-bins, "
                                           "knn-keys, knnlm, condensation, clusters, perturb, ...; a directory "
                                           "stands for its *.json files")
    output: str = option("report.html", "--output", "-o", writes="file", help="the HTML page (default: {default})")
    title: str = option("repgeom-eval report", "--title", help="page title")


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
