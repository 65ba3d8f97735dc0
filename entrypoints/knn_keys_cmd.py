"""``repgeom knn-keys``: rank kNN-LM key addresses by the dispersion of their last-token vectors (paper A Table 1)."""

from __future__ import annotations

import argparse

from repgeom_eval.spec.options.analyses import KnnKeysCommand, KnnKeysConfig

from .common import run_configured, say_written, wide_console


configure = KnnKeysCommand.add_arguments


def run(args: argparse.Namespace) -> int:
    from rich.markup import escape
    from rich.table import Table

    from repgeom_eval.analyses.knn_keys import knn_keys
    from repgeom_eval.analyses.plots import figure_knn_keys

    cfg, result, figures = run_configured(KnnKeysCommand, args, knn_keys, KnnKeysConfig,
                                          "knn_keys", {"": figure_knn_keys})
    res = result.results
    ns = result.config["ns"]
    console = wide_console()
    table = Table(title=escape(f"{result.model['name']} · dispersion of last-token keys, mean ± std over "
                               f"{result.config['n_seeds']} seeds · chunks of {result.config['chunk_len']} tokens"))
    table.add_column("candidate", style="bold")
    for n in ns:
        table.add_column(f"N={n}", justify="right")
    for name in res["candidates"]:
        cells = []
        for n in ns:
            row = next(r for r in res["table"] if r["address"] == name and r["N"] == n)
            cells.append(f"{row['mean']:.4f} ± {row['std']:.4f}")
        table.add_row(escape(name) + (" *" if name == res["recommended"] else ""), *cells)
    console.print(table)
    console.print(f"recommended key (most dispersed at N={ns[-1]}): [bold]{escape(res['recommended'])}[/]"
                  + ("" if res["consistent_across_N"] else " — the ranking changes with N"), soft_wrap=True)
    say_written(console, cfg, figures)
    return 0
