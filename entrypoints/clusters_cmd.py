"""``repgeom clusters``: contexts sharing an n-gram continuation, within/between-cluster distances (paper A §2.3)."""

from __future__ import annotations

import argparse

from repgeom_eval.spec.options.analyses import ClustersCommand, ClustersConfig

from .common import run_configured, say_written, wide_console


configure = ClustersCommand.add_arguments


def run(args: argparse.Namespace) -> int:
    from rich.markup import escape
    from rich.table import Table

    from repgeom_eval.analyses.clusters import clusters
    from repgeom_eval.analyses.plots import figure_clusters
    from repgeom_eval.output.console import fmt_number

    cfg, result, figures = run_configured(ClustersCommand, args, clusters, ClustersConfig,
                                          "clusters", {"": figure_clusters}, layers=True)
    console = wide_console()
    res = result.results
    table = Table(title=escape(f"{len(res['clusters'])} clusters · {result.data['n_contexts']} contexts · "
                               "cosine distances"))
    table.add_column("model", style="bold")
    table.add_column("address")
    for col in ("within", "between", "between / within"):
        table.add_column(col, justify="right")
    for label, m in res["models"].items():
        for i, a in enumerate(m["layers"]):
            table.add_row(escape(label) if i == 0 else "", escape(a),
                          *[fmt_number(m[key][i]) for key in ("within", "between", "ratio")])
    console.print(table)
    say_written(console, cfg, figures)
    return 0
