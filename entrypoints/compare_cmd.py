"""``repgeom compare``: results of several models (or layers, or tools) as one table, a CSV and overlaid depth
profiles. The reader is repgeom_eval/output/results_table.py (``repgeom_eval.load_results`` from Python)."""

from __future__ import annotations

import argparse

from repgeom_eval.spec.options.commands import CompareCommand


configure = CompareCommand.add_arguments


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from repgeom_eval.output.console import fmt_number
    from repgeom_eval.output.files import check_outputs, check_writable
    from repgeom_eval.output.results_table import COLUMNS, read_results, wide

    cfg = CompareCommand.from_args(args)
    outputs = {"--csv": cfg.csv, "--plot": cfg.plot}
    check_outputs(outputs, inputs={"RESULT": [p for p in cfg.results]})
    for path in (cfg.csv, cfg.plot):
        if path:
            check_writable(path)
    if cfg.plot:  # a missing matplotlib is said before the table, not after it
        from repgeom_eval.output.plotting import pyplot

        pyplot()
    rows, warnings = read_results(list(cfg.results))
    if cfg.metrics:
        rows = [r for r in rows if r["metric"] in cfg.metrics]
        if not rows:
            from repgeom_eval.spec.errors import RepgeomError

            raise RepgeomError(f"--metrics {' '.join(cfg.metrics)}: no such metric in the results")
    labels, table_rows = wide(rows)
    table = Table(title=f"{len(labels)} model(s) · {len({r['path'] for r in rows})} result file(s)")
    for name in ("source", "task", "metric", "address"):
        table.add_column(name, style="bold" if name == "metric" else None)
    for label in labels:
        table.add_column(escape(label), justify="right")
    for (source, task, split, recipe, metric, address), values in table_rows:
        where = " ".join(x for x in (task, split, recipe) if x)
        table.add_row(source, escape(where), escape(metric), escape(address),
                      *[fmt_number(values.get(label), missing="—") for label in labels])
    cells = [(k[0], " ".join(x for x in k[1:4] if x), k[4], k[5]) for k, _ in table_rows]
    needed = sum(max([len(c[i]) for c in cells] + [7]) + 3 for i in range(4)) + sum(max(len(x), 9) + 3
                                                                                  for x in labels)
    console = Console(width=max(Console().width, needed + 1))  # never truncate a cell to "…"
    console.print(table)
    for path, items in warnings.items():
        for w in items:
            console.print(f"[yellow]warning[/yellow] ({escape(path)}): {escape(w)}", soft_wrap=True)
    if cfg.csv:
        import csv

        from repgeom_eval.output.files import atomic_open

        with atomic_open(cfg.csv, "w") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(COLUMNS), lineterminator="\n")
            writer.writeheader()
            writer.writerows({k: "" if v is None else v for k, v in r.items()} for r in rows)
        console.print(f"csv: {escape(cfg.csv)} ({len(rows)} rows)", soft_wrap=True)
    if cfg.plot:
        from repgeom_eval.output.plotting import plot_depth_profiles

        plot_depth_profiles(rows, cfg.plot, x=cfg.x)
        console.print(f"plot: {escape(cfg.plot)}", soft_wrap=True)
    return 0
