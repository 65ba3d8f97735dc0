"""``repgeom report``: the JSON outputs of the other commands as one self-contained, offline HTML page."""

from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", metavar="RESULT",
                   help="results .json files written with --output by measure, gap, ppl-bins, knn-keys, knnlm, "
                        "condensation, clusters, perturb, ...; a directory stands for its *.json files")
    p.add_argument("--output", "-o", default="report.html", help="the HTML page (default: report.html)")
    p.add_argument("--title", default="repgeom-eval report", help="page title")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from repgeom_eval.analyses.html_report import result_files, write_report
    from repgeom_eval.output.files import check_outputs, check_writable

    check_outputs({"--output": args.output}, inputs={"RESULT": [str(p) for p in result_files(args.results)]})
    check_writable(args.output)
    path = write_report(args.results, args.output, args.title)
    Console().print(f"report: {escape(str(path))} ({path.stat().st_size / 1024:.0f} KiB, self-contained)",
                    soft_wrap=True)
    return 0
