"""``repgeom knn-keys``: rank kNN-LM key addresses by the dispersion of their last-token vectors (paper A Table 1)."""

from __future__ import annotations

import argparse

from .measure_cmd import add_model_args
from .ppl_bins_cmd import add_corpus_args, add_output_args, guard_outputs, plot_dir, plot_files, positive_int, progress


def configure(p: argparse.ArgumentParser) -> None:
    from repgeom_eval.defaults import (KNN_KEYS_CANDIDATES as DEFAULT_CANDIDATES, KNN_KEYS_NS as DEFAULT_NS,
                                       KNN_KEYS_SEEDS as DEFAULT_SEEDS)

    add_model_args(p)
    add_corpus_args(p)
    p.add_argument("--candidates", "-k", nargs="+", default=list(DEFAULT_CANDIDATES), metavar="ADDRESS",
                   help="candidate key addresses (default: resid_mid:-1 resid_post:-1 mlp_in:-1; any address "
                        "works, e.g. resid_mid:[10,-1] or knn_keys)")
    p.add_argument("--n", type=positive_int, nargs="+", default=list(DEFAULT_NS), metavar="N",
                   help="chunks per sample (default: 10 50 100)")
    p.add_argument("--seeds", type=positive_int, default=DEFAULT_SEEDS,
                   help=f"samples per N (default: {DEFAULT_SEEDS})")
    p.add_argument("--seed", type=int, default=0, help="first seed (default: 0)")
    p.add_argument("--batch-size", "-b", type=positive_int, default=8)
    add_output_args(p)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from repgeom_eval.analyses.knn_keys import knn_keys
    from repgeom_eval.analyses.plots import figure_knn_keys, save_png
    from repgeom_eval.output.files import commit_together

    figures = plot_files(args, "knn_keys", [""])
    outputs = guard_outputs(args, {"--output": args.output, "--plot-dir": figures}, {"--data": args.data}, args.model)
    with commit_together(outputs):  # every output, or none
        result = knn_keys(args.model, args.data, candidates=args.candidates, ns=args.n, n_seeds=args.seeds,
                          seed=args.seed, chunk_len=args.chunk_len, packing=args.packing, text_field=args.text_field,
                          batch_size=args.batch_size, dtype=args.dtype, device=args.device, progress=progress(args))
        if args.output:
            result.write(args.output)
        if figures:
            plot_dir(args)
            save_png(figure_knn_keys(result.to_dict()), figures[0])
    res = result.results
    ns = result.config["ns"]
    console = Console(width=max(Console().width, 100))
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
    for path in figures:
        console.print(f"plot:    {escape(str(path))}", soft_wrap=True)
    if args.output:
        console.print(f"results: {escape(args.output)}", soft_wrap=True)
    return 0
