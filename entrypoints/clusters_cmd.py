"""``repgeom clusters``: contexts sharing an n-gram continuation, within/between-cluster distances (paper A §2.3)."""

from __future__ import annotations

import argparse
import math

from repgeom_eval.modeling.options import ModelOptions
from .ppl_bins_cmd import add_output_args, guard_outputs, plot_dir, plot_files, positive_int, progress


def configure(p: argparse.ArgumentParser) -> None:
    from repgeom_eval import defaults as d

    p.add_argument("--model", "-m", required=True, nargs="+",
                   help="one model, or a series of checkpoints sharing a tokenizer (measured on the same contexts)")
    ModelOptions.add_arguments(p)  # --dtype, --device, --revision, --peft ... (repgeom_eval/modeling/options.py)
    p.add_argument("--data", "-d", required=True, help=".jsonl with a text field per line, or .txt, one text a line")
    p.add_argument("--text-field", default="text", help="field of each .jsonl record to read (default: text)")
    p.add_argument("--layers", "-l", nargs="+", default=["all"], help="layer addresses (default: all)")
    p.add_argument("--ngram", type=positive_int, default=d.CLUSTERS_NGRAM,
                   help=f"length of the shared continuation (default: {d.CLUSTERS_NGRAM})")
    p.add_argument("--min-count", type=positive_int, default=d.CLUSTERS_MIN_COUNT,
                   help=f"occurrences an n-gram needs to form a cluster (default: {d.CLUSTERS_MIN_COUNT})")
    p.add_argument("--contexts", type=positive_int, default=d.CLUSTERS_CONTEXTS,
                   help=f"contexts sampled per cluster (default: {d.CLUSTERS_CONTEXTS})")
    p.add_argument("--context-len", type=positive_int, default=d.CLUSTERS_CONTEXT_LEN,
                   help=f"tokens of left context (default: {d.CLUSTERS_CONTEXT_LEN})")
    p.add_argument("--clusters", type=positive_int, default=d.CLUSTERS_CLUSTERS,
                   help=f"most frequent n-grams kept (default: {d.CLUSTERS_CLUSTERS})")
    p.add_argument("--seed", type=int, default=0, help="seed of the context sampling (default: 0)")
    p.add_argument("--batch-size", "-b", type=positive_int, default=16)
    add_output_args(p)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from repgeom_eval.analyses.clusters import clusters
    from repgeom_eval.analyses.plots import figure_clusters, save_png
    from repgeom_eval.output.files import commit_together

    figures = plot_files(args, "clusters", [""])
    outputs = guard_outputs(args, {"--output": args.output, "--plot-dir": figures}, {"--data": args.data}, args.model)
    layers = args.layers[0] if len(args.layers) == 1 else args.layers
    with commit_together(outputs):  # every output, or none
        result = clusters(args.model, args.data, layers=layers, ngram=args.ngram, min_count=args.min_count,
                          contexts=args.contexts, context_len=args.context_len, n_clusters=args.clusters,
                          seed=args.seed, text_field=args.text_field, batch_size=args.batch_size, dtype=args.dtype,
                          device=args.device, progress=progress(args))
        if args.output:
            result.write(args.output)
        if figures:
            plot_dir(args)
            save_png(figure_clusters(result.to_dict()), figures[0])
    console = Console(width=max(Console().width, 100))
    res = result.results
    table = Table(title=escape(f"{len(res['clusters'])} clusters · {result.data['n_contexts']} contexts · "
                               "cosine distances"))
    table.add_column("model", style="bold")
    table.add_column("address")
    for col in ("within", "between", "between / within"):
        table.add_column(col, justify="right")
    for label, m in res["models"].items():
        for i, a in enumerate(m["layers"]):
            table.add_row(escape(label) if i == 0 else "", escape(a), _fmt(m["within"][i]), _fmt(m["between"][i]),
                          _fmt(m["ratio"][i]))
    console.print(table)
    for path in figures:
        console.print(f"plot:    {escape(str(path))}", soft_wrap=True)
    if args.output:
        console.print(f"results: {escape(args.output)}", soft_wrap=True)
    return 0


def _fmt(v: float | None) -> str:
    return "nan" if v is None or math.isnan(v) else f"{v:.4f}"
