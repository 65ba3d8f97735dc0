"""``repgeom ppl-bins``: perplexity vs token dispersion over chunks of a corpus (paper A Fig. 3 and Fig. 5)."""

from __future__ import annotations

import argparse

from repgeom_eval.spec.options.model import ModelOptions
from repgeom_eval.spec.options.analyses import PplBinsCommand, PplBinsConfig

from .common import run_analysis, wide_console


configure = PplBinsCommand.add_arguments


def run(args: argparse.Namespace) -> int:
    from rich.markup import escape

    from repgeom_eval.analyses.plots import figure_correlation_vs_depth, figure_ppl_vs_dispersion
    from repgeom_eval.analyses.ppl_bins import ppl_bins

    cfg = PplBinsCommand.from_args(args)
    if cfg.run_dir:  # written during the run, not with the result: guarded here, before anything runs
        from repgeom_eval.analyses.chunk_log import run_files
        from repgeom_eval.output.files import check_creatable_dir

        from .common import guard_outputs

        check_creatable_dir(cfg.run_dir, "--run-dir")
        guard_outputs(cfg, {"--run-dir": run_files(cfg.run_dir)}, {"--data": cfg.data}, cfg.model)
    result, figures = run_analysis(
        cfg, lambda: ppl_bins(cfg.model, cfg.data, PplBinsConfig.of(cfg), model_options=ModelOptions.of(cfg)),
        "ppl_bins", {"_scatter": figure_ppl_vs_dispersion, "_by_depth": figure_correlation_vs_depth},
        outputs={"--per-chunk": cfg.per_chunk_path})
    if result is None:
        return 0  # a rank > 0 of a distributed run: rank 0 writes the merged result
    out = result.to_dict()

    table = correlation_table(out)
    need = 4 + sum(max(len(line) for line in str(c.header).splitlines()) + 3 for c in table.columns[1:]) + \
        max(len(a) for a in result.results["layers"]) + 3  # every column as wide as its header, no ellipsis
    console = wide_console(max(100, need))
    console.print(table)
    if cfg.output:
        console.print(f"results: {escape(cfg.output)}", soft_wrap=True)
    for f in figures:
        console.print(f"plot:    {escape(str(f))}", soft_wrap=True)
    return 0


def correlation_table(out: dict):
    """The console table: per address, Pearson r and Spearman ρ of the pooled groups and of every source's."""
    from rich.markup import escape
    from rich.table import Table

    from repgeom_eval.output.console import fmt_number

    res, cfg = out["results"], out["config"]
    pooled = res["pooled"]
    sources = [s for s, r in res.get("by_source", {}).items() if "correlation" in r]
    rule = "" if cfg.get("group_size_rule", "given") == "given" else f" ({cfg['group_size_rule']})"
    table = Table(title=escape(f"{out['model']['name']} · {pooled['n_chunks']} chunks ({cfg.get('sampling')}) · "
                               f"groups of {cfg['group_size']}{rule} · corr(perplexity, dispersion)"),
                  caption="r: Pearson, ρ: Spearman, over the selected groups (selected / complete groups)")
    table.add_column("address", style="bold")
    populations = [("pooled" if sources else "", pooled)] + [(s, res["by_source"][s]) for s in sources]
    for name, r in populations:
        n = f"\n{r['n_selected']}/{r['n_groups']}"
        r_head, rho_head = (f"{escape(name)} r", f"{escape(name)} ρ") if name else ("Pearson r", "Spearman ρ")
        table.add_column(r_head + n, justify="right")
        table.add_column(rho_head + n, justify="right")
    for a in res["layers"]:
        cells = []
        for _, r in populations:
            c = r["correlation"][a]
            cells += [fmt_number(c["pearson"], 3, sign=True), fmt_number(c["spearman"], 3, sign=True)]
        table.add_row(escape(a), *cells)
    return table

