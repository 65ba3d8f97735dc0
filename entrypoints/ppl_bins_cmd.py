"""``repgeom ppl-bins``: perplexity vs token dispersion over chunks of a corpus (paper A Fig. 3 and Fig. 5)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .measure_cmd import add_model_args


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def group_size_arg(text: str) -> int | str:
    """``auto`` or a positive integer."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or auto, got {text!r}") from None


def add_corpus_args(p: argparse.ArgumentParser, chunk_len: int = 512) -> None:
    p.add_argument("--data", "-d", required=True,
                   help=".jsonl with a text field (and optionally a source field) per line, or .txt with one "
                        "document per line")
    p.add_argument("--text-field", default="text", help="field of each .jsonl record to read (default: text)")
    p.add_argument("--chunk-len", type=positive_int, default=chunk_len,
                   help=f"tokens per chunk (default: {chunk_len})")
    p.add_argument("--packing", choices=["concat", "document"], default="concat",
                   help="concat: join each source's documents into one token stream and cut it (paper A's "
                        "Wikitext protocol, default); document: cut each document on its own")


def add_output_args(p: argparse.ArgumentParser, plots: bool = True) -> None:
    p.add_argument("--output", "-o", default=None, help="results JSON (written atomically)")
    if plots:
        p.add_argument("--plot-dir", default=None,
                       help="write the figures (PNG) here; default: next to --output, none without it")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def plot_dir(args: argparse.Namespace, create: bool = True) -> Path | None:
    if getattr(args, "plot_dir", None):
        d = Path(args.plot_dir)
        if create:
            d.mkdir(parents=True, exist_ok=True)
        return d
    if args.output:
        return Path(args.output).resolve().parent
    return None


def plot_files(args: argparse.Namespace, default_stem: str, suffixes: list[str]) -> list[Path]:
    """The figure files a command writes (``STEM{suffix}.png`` in :func:`plot_dir`), named before the run so that
    they are checked against the inputs and committed with the other outputs; nothing is created."""
    where = plot_dir(args, create=False)
    if where is None:
        return []
    return [where / f"{stem(args, default_stem)}{suffix}.png" for suffix in suffixes]


def guard_outputs(args: argparse.Namespace, outputs: dict, data: dict, models: list[str] | str) -> list:
    """The checks every analysis command runs before any compute: no output replaces an input or lands in a model
    folder (repgeom_eval/output/files.py), every output can be written. Returns the output paths, for
    ``commit_together``."""
    from repgeom_eval.modeling.loading import model_inputs
    from repgeom_eval.output.files import check_creatable_dir, check_outputs, check_writable

    if getattr(args, "plot_dir", None):
        check_creatable_dir(args.plot_dir, "--plot-dir")
    model_files, model_dirs = model_inputs(models)
    check_outputs(outputs, inputs={**data, "--model": model_files}, folders={"--model": model_dirs})
    paths = [p for value in outputs.values() for p in (value if isinstance(value, list) else [value]) if p]
    for label in ("--output", "--per-chunk", "--plot"):
        if outputs.get(label):
            check_writable(outputs[label])
    return paths


def stem(args: argparse.Namespace, default: str) -> str:
    return Path(args.output).stem if args.output else default


def progress(args: argparse.Namespace) -> bool:
    return not args.no_progress and sys.stderr.isatty()


def configure(p: argparse.ArgumentParser) -> None:
    from repgeom_eval.defaults import (PPL_BINS_BINS as DEFAULT_BINS, PPL_BINS_CONFOUND_RATIO as DEFAULT_CONFOUND_RATIO,
                                       PPL_BINS_GROUP_SIZE as DEFAULT_GROUP_SIZE,
                                       PPL_BINS_GROUP_SIZE_MAX as GROUP_SIZE_MAX,
                                       PPL_BINS_GROUPS_PER_SOURCE as GROUPS_PER_SOURCE, PPL_BINS_SEED as DEFAULT_SEED)

    add_model_args(p)
    add_corpus_args(p)
    p.add_argument("--source-field", default="source",
                   help="field naming each record's domain; correlations are then also given per source")
    p.add_argument("--layers", "-l", nargs="+", default=["all"],
                   help="layer addresses (default: all = every hidden state)")
    sampling = p.add_mutually_exclusive_group()
    sampling.add_argument("--n-chunks", type=positive_int, default=None,
                          help="chunks to sample uniformly from the whole corpus (seeded; paper A: 100000), so "
                               "each source gets chunks in proportion to its text. Default: every chunk")
    sampling.add_argument("--per-source", type=positive_int, default=None, metavar="N",
                          help="sample N chunks from every source instead (seeded, each source on its own), so "
                               "sources of very different size weigh the same; an error names any source with "
                               "fewer than N chunks")
    p.add_argument("--group-size", type=group_size_arg, default=DEFAULT_GROUP_SIZE,
                   help=f"chunks per perplexity group, or auto (default: {DEFAULT_GROUP_SIZE} = the smallest "
                        f"source's sampled chunks // {GROUPS_PER_SOURCE}, between 1 and {GROUP_SIZE_MAX}, so "
                        f"every source gets about {GROUPS_PER_SOURCE} groups; paper A used {GROUP_SIZE_MAX}). A "
                        "number is used exactly")
    p.add_argument("--bins", type=positive_int, default=DEFAULT_BINS,
                   help=f"perplexity targets of the uniform selection (default: {DEFAULT_BINS})")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"chunk sampling seed (default: {DEFAULT_SEED})")
    p.add_argument("--max-ppl", type=float, default=None,
                   help="drop groups with mean perplexity at or above this (paper A's plot used 25); default: keep all")
    p.add_argument("--confound-ratio", type=float, default=DEFAULT_CONFOUND_RATIO,
                   help="flag pooling sources whose median perplexities differ by this factor "
                        f"(default: {DEFAULT_CONFOUND_RATIO})")
    p.add_argument("--batch-size", "-b", type=positive_int, default=4)
    p.add_argument("--per-chunk", default=None, metavar="OUT.jsonl",
                   help="also write every chunk's perplexity and dispersions")
    add_output_args(p)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from repgeom_eval.analyses.plots import figure_correlation_vs_depth, figure_ppl_vs_dispersion, save_png
    from repgeom_eval.analyses.ppl_bins import ppl_bins
    from repgeom_eval.output.files import commit_together

    figures = plot_files(args, "ppl_bins", ["_scatter", "_by_depth"])
    outputs = guard_outputs(args, {"--output": args.output, "--per-chunk": args.per_chunk, "--plot-dir": figures},
                            {"--data": args.data}, args.model)
    with commit_together(outputs):  # every output, or none
        result = ppl_bins(args.model, args.data, layers=args.layers, chunk_len=args.chunk_len,
                          n_chunks=args.n_chunks, per_source=args.per_source, group_size=args.group_size,
                          n_bins=args.bins, packing=args.packing,
                          seed=args.seed, max_ppl=args.max_ppl, confound_ratio=args.confound_ratio,
                          text_field=args.text_field, source_field=args.source_field, batch_size=args.batch_size,
                          dtype=args.dtype, device=args.device, per_chunk_path=args.per_chunk,
                          progress=progress(args))
        if not result.is_main:
            return 0  # a rank > 0 of a distributed run: rank 0 writes the merged result
        if args.output:
            result.write(args.output)
        out = result.to_dict()
        if figures:
            plot_dir(args)  # creates --plot-dir
            save_png(figure_ppl_vs_dispersion(out), figures[0])
            save_png(figure_correlation_vs_depth(out), figures[1])

    table = correlation_table(out)
    need = 4 + sum(max(len(line) for line in str(c.header).splitlines()) + 3 for c in table.columns[1:]) + \
        max(len(a) for a in result.results["layers"]) + 3  # every column as wide as its header, no ellipsis
    console = Console(width=max(Console().width, 100, need))
    console.print(table)
    if args.output:
        console.print(f"results: {escape(args.output)}", soft_wrap=True)
    for f in figures:
        console.print(f"plot:    {escape(str(f))}", soft_wrap=True)
    return 0


def correlation_table(out: dict):
    """The console table: per address, Pearson r and Spearman ρ of the pooled groups and of every source's."""
    from rich.markup import escape
    from rich.table import Table

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
            cells += [_fmt(c["pearson"]), _fmt(c["spearman"])]
        table.add_row(escape(a), *cells)
    return table


def _fmt(v: float | None) -> str:
    import math

    return "nan" if v is None or math.isnan(v) else f"{v:+.3f}"
