"""``repgeom condensation``: per-layer cosine histograms and the depth trend, one or several models (paper C Fig. 2)."""

from __future__ import annotations

import argparse

from repgeom_eval.spec.options.analyses import CondensationCommand, CondensationConfig

from .common import run_configured, say_written, wide_console


configure = CondensationCommand.add_arguments


def run(args: argparse.Namespace) -> int:
    from rich.markup import escape
    from rich.table import Table

    from repgeom_eval.analyses.condensation import condensation
    from repgeom_eval.analyses.plots import figure_condensation
    from repgeom_eval.output.console import fmt_number

    cfg, result, figures = run_configured(CondensationCommand, args, condensation, CondensationConfig,
                                          "condensation", {"": figure_condensation}, layers=True)
    console = wide_console()
    table = Table(title=escape(f"embedding condensation · {result.data['n_texts']} texts · mean token cosine"))
    table.add_column("model", style="bold")
    for col in ("first", "min", "max", "last", "Spearman ρ", "Kendall τ"):
        table.add_column(col, justify="right")
    for label, m in result.results["models"].items():
        v = m["mean_cosine"]
        table.add_row(escape(label), *[fmt_number(x, 3) for x in (v[0], min(v), max(v), v[-1], m["spearman"],
                                                                  m["kendall"])])
    console.print(table)
    say_written(console, cfg, figures)
    return 0
