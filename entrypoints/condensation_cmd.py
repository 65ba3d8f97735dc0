"""``repgeom condensation``: per-layer cosine histograms and the depth trend, one or several models (paper C Fig. 2)."""

from __future__ import annotations

import argparse
import math

from repgeom_eval.modeling.options import ModelOptions
from .ppl_bins_cmd import add_output_args, guard_outputs, plot_dir, plot_files, positive_int, progress


def configure(p: argparse.ArgumentParser) -> None:
    from repgeom_eval.defaults import CONDENSATION_BINS as DEFAULT_BINS, CONDENSATION_MAX_LENGTH as DEFAULT_MAX_LENGTH

    p.add_argument("--model", "-m", required=True, nargs="+",
                   help="one or more models (hub ids, directories, .gguf files), shown side by side")
    ModelOptions.add_arguments(p)  # --dtype, --device, --revision, --peft ... (repgeom_eval/modeling/options.py)
    p.add_argument("--data", "-d", required=True, help=".jsonl with a text field per line, or .txt, one text a line")
    p.add_argument("--text-field", default="text", help="field of each .jsonl record to read (default: text)")
    p.add_argument("--layers", "-l", nargs="+", default=["all"],
                   help="layer addresses, at least 3 (default: all = every hidden state)")
    p.add_argument("--bins", type=positive_int, default=DEFAULT_BINS,
                   help=f"histogram bins over [-1, 1] (default: {DEFAULT_BINS})")
    p.add_argument("--max-length", type=positive_int, default=DEFAULT_MAX_LENGTH,
                   help=f"tokens per text (paper C: 512; default: {DEFAULT_MAX_LENGTH})")
    p.add_argument("--n-texts", type=positive_int, default=None, help="use the first N texts (default: all)")
    p.add_argument("--batch-size", "-b", type=positive_int, default=4)
    add_output_args(p)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from repgeom_eval.analyses.condensation import condensation
    from repgeom_eval.analyses.plots import figure_condensation, save_png
    from repgeom_eval.output.files import commit_together

    figures = plot_files(args, "condensation", [""])
    outputs = guard_outputs(args, {"--output": args.output, "--plot-dir": figures}, {"--data": args.data}, args.model)
    layers = args.layers[0] if len(args.layers) == 1 else args.layers
    with commit_together(outputs):  # every output, or none
        result = condensation(args.model, args.data, layers=layers, bins=args.bins, max_length=args.max_length,
                              n_texts=args.n_texts, text_field=args.text_field, batch_size=args.batch_size,
                              dtype=args.dtype, device=args.device, progress=progress(args))
        if args.output:
            result.write(args.output)
        if figures:
            plot_dir(args)
            save_png(figure_condensation(result.to_dict()), figures[0])
    console = Console(width=max(Console().width, 100))
    table = Table(title=escape(f"embedding condensation · {result.data['n_texts']} texts · mean token cosine"))
    table.add_column("model", style="bold")
    table.add_column("first", justify="right")
    table.add_column("min", justify="right")
    table.add_column("max", justify="right")
    table.add_column("last", justify="right")
    table.add_column("Spearman ρ", justify="right")
    table.add_column("Kendall τ", justify="right")
    for label, m in result.results["models"].items():
        v = m["mean_cosine"]
        table.add_row(escape(label), *[_fmt(x) for x in (v[0], min(v), max(v), v[-1], m["spearman"], m["kendall"])])
    console.print(table)
    for path in figures:
        console.print(f"plot:    {escape(str(path))}", soft_wrap=True)
    if args.output:
        console.print(f"results: {escape(args.output)}", soft_wrap=True)
    return 0


def _fmt(v: float | None) -> str:
    return "nan" if v is None or math.isnan(v) else f"{v:.3f}"
