"""``repgeom slices``: the controlled-slice experiment and, with ``--calibrate``, its calibration
(docs/metrics.md#hardness-slices).

Two perplexities per slice, where the input has them: the gold answer's (per token, given the prompt: what
lm-eval scores) and the prompt's own (its tokens after the first, from the same forward pass)."""

from __future__ import annotations

import argparse
import json
import math

from .ppl_bins_cmd import positive_int  # one argparse type for every command

ANSWER_PPL = ("the gold answer's per-token perplexity given the prompt (the correct choice, as lm-eval scores it), "
              "averaged over the slice's queries")
PROMPT_PPL = ("the prompt's own per-token perplexity (its tokens after the first, each given the ones before, from "
              "the same forward pass), averaged over the slice's queries")


def configure(p: argparse.ArgumentParser) -> None:
    from repgeom_eval.defaults import SLICES_SEEDS as SEEDS, SLICES_SLICE_SIZE as SLICE_SIZE

    p.add_argument("source", metavar="SAMPLES",
                   help="lm-eval --log_samples output of a repgeom_hardness_* task (a samples_*.jsonl file or the "
                        "--output_path folder), or, with --vectors, a JSONL with one record per query")
    p.add_argument("--task", default=None, help="task whose samples to read when the folder holds several")
    p.add_argument("--vectors", default=None, metavar="FILE",
                   help="per-query vectors (.npy [N, d] or .safetensors), row i = record i of SAMPLES")
    p.add_argument("--correct-field", default="correct", help="field of each record holding correctness (with "
                                                              "--vectors; default: correct)")
    p.add_argument("--ppl-field", default="ppl", help="field holding the gold answer's perplexity given the prompt, "
                                                      "optional (with --vectors; default: ppl)")
    p.add_argument("--prompt-ppl-field", default="prompt_ppl",
                   help="field holding the prompt's own perplexity, optional (with --vectors; default: prompt_ppl)")
    p.add_argument("--size", type=positive_int, default=SLICE_SIZE,
                   help=f"queries per slice (default {SLICE_SIZE}; reduced, with a warning, if the pool is smaller)")
    p.add_argument("--seeds", type=positive_int, default=SEEDS, help=f"slices per fraction (default {SEEDS})")
    p.add_argument("--seed", type=int, default=0, help="base random seed (default 0)")
    p.add_argument("--calibrate", action="store_true",
                   help="also predict slice accuracy from slice dispersion: 20/10/70 %% calibration/validation/test "
                        "split, 2 %% slices, isotonic/linear/polynomial chosen on validation; prints the test MAE")
    p.add_argument("--output", "-o", default=None, help="results JSON (written atomically)")
    p.add_argument("--plot", default=None, metavar="PNG", help="plot of the slice curves")
    p.add_argument("--json", action="store_true", help="print the results JSON instead of a table")


def _fmt(value: float | None, se: float | None = None) -> str:
    if value is None or not math.isfinite(value):
        return "nan"
    if se is None:
        return f"{value:.4f}"
    return f"{value:.4f} ± {se:.4f}" if math.isfinite(se) else f"{value:.4f}"


def run(args: argparse.Namespace) -> int:
    import warnings

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from repgeom_eval import __version__
    from repgeom_eval.errors import RepgeomError
    from pathlib import Path

    from repgeom_eval.output.files import check_outputs, check_writable, commit_together, jsonable, write_json
    from repgeom_eval.analyses.queries import from_samples, from_vector_file
    from repgeom_eval.analyses.slices import calibrate, controlled_slices

    source = Path(args.source)
    samples = sorted(str(p) for p in source.rglob("samples_*.jsonl")) if source.is_dir() else [args.source]
    check_outputs({"--output": args.output, "--plot": args.plot},
                  inputs={"SAMPLES": samples, "--vectors": args.vectors})
    for path in (args.output, args.plot):
        if path:
            check_writable(path)
    if args.vectors:
        queries = from_vector_file(args.source, args.vectors, args.correct_field, args.ppl_field,
                                   args.prompt_ppl_field)
    else:
        queries = from_samples(args.source, args.task)
    notes: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        curve = controlled_slices(queries.vectors, queries.correct, queries.ppl, size=args.size, seeds=args.seeds,
                                  seed=args.seed, prompt_ppl=queries.prompt_ppl)
        calibration = None
        if args.calibrate:
            try:
                calibration = calibrate(queries.vectors, queries.correct, size=args.size, seeds=args.seeds,
                                        seed=args.seed)
            except ValueError as exc:
                raise RepgeomError(f"--calibrate: {exc}") from None
    notes += list(dict.fromkeys(str(w.message) for w in caught))  # each note once (sklearn repeats its own)
    if curve.size < 2:
        raise RepgeomError(f"{int(queries.correct.sum())} correct and {int(len(queries.correct) - queries.correct.sum())}"
                           " incorrect queries: slices need at least 2 of each kind at every fraction")
    result = {
        "source": queries.source,
        "n_queries": int(len(queries.correct)),
        "n_correct": int(queries.correct.sum()),
        "dim": int(queries.vectors.shape[1]),
        "config": {"size": args.size, "seeds": args.seeds, "seed": args.seed, "fractions": curve.fractions,
                   "slice_dispersion": "D across the slice's pooled vectors (docs/metrics.md#hardness-slices)",
                   "slice_perplexity": ANSWER_PPL if queries.ppl is not None else None,
                   "slice_prompt_perplexity": PROMPT_PPL if queries.prompt_ppl is not None else None,
                   "version": __version__},
        "slices": curve.to_dict(),
        "calibration": calibration.to_dict() if calibration else None,
        "notes": notes,
    }
    with commit_together([args.output, args.plot]):  # both, or neither
        if args.output:
            write_json(args.output, result)
        if args.plot:
            from repgeom_eval.output.plotting import plot_slices

            plot_slices(curve.to_dict(), args.plot)
    if args.json:
        print(json.dumps(jsonable(result), indent=2))
        return 0
    console = Console()
    for note in notes:
        console.print(f"[yellow]note:[/] {escape(note)}")
    table = Table(title=escape(f"{queries.source}: {result['n_queries']} queries, {result['n_correct']} correct; "
                               f"{curve.size} per slice, {curve.seeds} seeds (mean ± s.e.)"))
    table.add_column("correct", justify="right")
    table.add_column("slice dispersion", justify="right")
    if curve.perplexity_mean is not None:
        table.add_column("answer perplexity", justify="right")
    if curve.prompt_perplexity_mean is not None:
        table.add_column("prompt perplexity", justify="right")
    for i, f in enumerate(curve.fractions):
        row = [f"{100 * f:.0f}%", _fmt(curve.dispersion_mean[i], curve.dispersion_se[i])]
        if curve.perplexity_mean is not None:
            row.append(_fmt(curve.perplexity_mean[i], curve.perplexity_se[i]))
        if curve.prompt_perplexity_mean is not None:
            row.append(_fmt(curve.prompt_perplexity_mean[i], curve.prompt_perplexity_se[i]))
        table.add_row(*row)
    console.print(table)
    if curve.perplexity_mean is not None:
        console.print(f"answer perplexity: {ANSWER_PPL}")
    if curve.prompt_perplexity_mean is not None:
        console.print(f"prompt perplexity: {PROMPT_PPL}")
    console.print(f"Spearman ρ(fraction correct, slice dispersion) = {_fmt(curve.spearman)} "
                  f"(over all {len(curve.fractions) * curve.seeds} slices: {_fmt(curve.spearman_all_slices)})")
    if curve.perplexity_mean is not None:
        console.print(f"Spearman ρ(fraction correct, slice answer perplexity) = {_fmt(curve.spearman_perplexity)}")
    if curve.prompt_perplexity_mean is not None:
        console.print("Spearman ρ(fraction correct, slice prompt perplexity) = "
                      f"{_fmt(curve.spearman_prompt_perplexity)}")
    if calibration:
        chosen = ", ".join(f"{name} ×{calibration.chosen.count(name)}" for name in dict.fromkeys(calibration.chosen))
        console.print(f"Calibration MAE on test slices = {_fmt(calibration.mae_mean, calibration.mae_se)} over "
                      f"{calibration.seeds} seeds ({calibration.size} per slice; chosen on validation: {chosen})")
    return 0
