"""``repgeom perturb``: prompt entropy and dispersion by layer under repetition, random tokens, length (paper B)."""

from __future__ import annotations

import argparse
import math

from .measure_cmd import add_model_args
from .ppl_bins_cmd import add_output_args, guard_outputs, plot_dir, plot_files, positive_int, progress


def configure(p: argparse.ArgumentParser) -> None:
    from repgeom_eval import defaults as d

    add_model_args(p)
    p.add_argument("--data", "-d", required=True, help=".jsonl with a text field per line, or .txt, one text a line")
    p.add_argument("--text-field", default="text", help="field of each .jsonl record to read (default: text)")
    p.add_argument("--layers", "-l", nargs="+", default=["all"], help="layer addresses (default: all)")
    p.add_argument("--sweeps", nargs="+", choices=list(d.PERTURB_SWEEPS), default=list(d.PERTURB_SWEEPS),
                   help="which perturbations to run (default: all three)")
    p.add_argument("--p", dest="ps", type=float, nargs="+", default=list(d.PERTURB_PS), metavar="P",
                   help="replacement probabilities of the repetition and random sweeps (default: 0 .25 .5 .75 1)")
    p.add_argument("--lengths", type=positive_int, nargs="+", default=list(d.PERTURB_LENGTHS), metavar="L",
                   help="prompt lengths in tokens (default: 16 32 64 128); the longest is the prompt size")
    p.add_argument("--n-prompts", type=positive_int, default=d.PERTURB_PROMPTS,
                   help=f"prompts (default: {d.PERTURB_PROMPTS})")
    p.add_argument("--seed", type=int, default=0, help="seed of the perturbations (default: 0)")
    p.add_argument("--batch-size", "-b", type=positive_int, default=8)
    add_output_args(p)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from repgeom_eval.analyses.perturb import perturb
    from repgeom_eval.analyses.plots import figure_perturb, save_png
    from repgeom_eval.output.files import commit_together

    figures = plot_files(args, "perturb", [""])
    outputs = guard_outputs(args, {"--output": args.output, "--plot-dir": figures}, {"--data": args.data}, args.model)
    layers = args.layers[0] if len(args.layers) == 1 else args.layers
    with commit_together(outputs):  # every output, or none
        result = perturb(args.model, args.data, layers=layers, sweeps=args.sweeps, ps=args.ps, lengths=args.lengths,
                         n_prompts=args.n_prompts, seed=args.seed, text_field=args.text_field,
                         batch_size=args.batch_size, dtype=args.dtype, device=args.device, progress=progress(args))
        if args.output:
            result.write(args.output)
        if figures:
            plot_dir(args)
            save_png(figure_perturb(result.to_dict()), figures[0])
    res = result.results
    last = res["layers"][-1]
    console = Console(width=max(Console().width, 100))
    table = Table(title=escape(f"{result.model['name']} · {result.data['n_prompts']} prompts · at {last}"))
    for col in ("sweep", "value", "prompt entropy", "token dispersion"):
        table.add_column(col, justify="left" if col == "sweep" else "right")
    for sweep, r in res["sweeps"].items():
        for j, v in enumerate(r["values"]):
            table.add_row(sweep if j == 0 else "", f"{v:g}", _fmt(r["prompt_entropy"][j][-1]),
                          _fmt(r["token_dispersion"][j][-1]))
    console.print(table)
    for path in figures:
        console.print(f"plot:    {escape(str(path))}", soft_wrap=True)
    if args.output:
        console.print(f"results: {escape(args.output)}", soft_wrap=True)
    return 0


def _fmt(v: float | None) -> str:
    return "nan" if v is None or math.isnan(v) else f"{v:.4f}"
