"""``repgeom perturb``: prompt entropy and dispersion by layer under repetition, random tokens, length (paper B)."""

from __future__ import annotations

import argparse

from repgeom_eval.spec.options.analyses import PerturbCommand, PerturbConfig

from .common import run_configured, say_written, wide_console


configure = PerturbCommand.add_arguments


def run(args: argparse.Namespace) -> int:
    from rich.markup import escape
    from rich.table import Table

    from repgeom_eval.analyses.perturb import perturb
    from repgeom_eval.analyses.plots import figure_perturb
    from repgeom_eval.output.console import fmt_number

    cfg, result, figures = run_configured(PerturbCommand, args, perturb, PerturbConfig,
                                          "perturb", {"": figure_perturb}, layers=True)
    res = result.results
    last = res["layers"][-1]
    console = wide_console()
    table = Table(title=escape(f"{result.model['name']} · {result.data['n_prompts']} prompts · at {last}"))
    for col in ("sweep", "value", "prompt entropy", "token dispersion"):
        table.add_column(col, justify="left" if col == "sweep" else "right")
    for sweep, r in res["sweeps"].items():
        for j, v in enumerate(r["values"]):
            table.add_row(sweep if j == 0 else "", f"{v:g}", fmt_number(r["prompt_entropy"][j][-1]),
                          fmt_number(r["token_dispersion"][j][-1]))
    console.print(table)
    say_written(console, cfg, figures)
    return 0
