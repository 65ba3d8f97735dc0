"""``repgeom slices``: the controlled-slice experiment and, with ``--calibrate``, its calibration
(docs/metrics.md#hardness-slices).

Two perplexities per slice, where the input has them: the gold answer's (per token, given the prompt: what
lm-eval scores) and the prompt's own (its tokens after the first, from the same forward pass)."""

from __future__ import annotations

import argparse
import json

from repgeom_eval.spec.options.analyses import SlicesCommand

ANSWER_PPL = ("the gold answer's per-token perplexity given the prompt (the correct choice, as lm-eval scores it), "
              "averaged over the slice's queries")
PROMPT_PPL = ("the prompt's own per-token perplexity (its tokens after the first, each given the ones before, from "
              "the same forward pass), averaged over the slice's queries")


configure = SlicesCommand.add_arguments


def run(args: argparse.Namespace) -> int:
    import warnings

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from pathlib import Path

    from repgeom_eval import __version__
    from repgeom_eval.analyses.queries import from_samples, from_vector_file
    from repgeom_eval.analyses.slices import calibrate, controlled_slices
    from repgeom_eval.spec.errors import RepgeomError
    from repgeom_eval.output.console import fmt_number as fmt
    from repgeom_eval.output.files import check_outputs, check_writable, commit_together, jsonable, write_json

    cfg = SlicesCommand.from_args(args)
    source = Path(cfg.source)
    samples = sorted(str(p) for p in source.rglob("samples_*.jsonl")) if source.is_dir() else [cfg.source]
    check_outputs({"--output": cfg.output, "--plot": cfg.plot},
                  inputs={"SAMPLES": samples, "--vectors": cfg.vectors})
    for path in (cfg.output, cfg.plot):
        if path:
            check_writable(path)
    notes: list[str] = []
    with warnings.catch_warnings(record=True) as caught:  # what the inputs and the slices say, kept as notes
        warnings.simplefilter("always")
        if cfg.vectors:
            queries = from_vector_file(cfg.source, cfg.vectors, cfg.correct_field, cfg.ppl_field,
                                       cfg.prompt_ppl_field)
        else:
            queries = from_samples(cfg.source, cfg.task)
        curve = controlled_slices(queries.vectors, queries.correct, queries.ppl, size=cfg.size, seeds=cfg.seeds,
                                  seed=cfg.seed, prompt_ppl=queries.prompt_ppl)
        calibration = None
        if cfg.calibrate:
            try:
                calibration = calibrate(queries.vectors, queries.correct, size=cfg.size, seeds=cfg.seeds,
                                        seed=cfg.seed)
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
        "config": {"size": cfg.size, "seeds": cfg.seeds, "seed": cfg.seed, "fractions": curve.fractions,
                   "slice_dispersion": "D across the slice's pooled vectors (docs/metrics.md#hardness-slices)",
                   "slice_perplexity": ANSWER_PPL if queries.ppl is not None else None,
                   "slice_prompt_perplexity": PROMPT_PPL if queries.prompt_ppl is not None else None,
                   "version": __version__},
        "slices": curve.to_dict(),
        "calibration": calibration.to_dict() if calibration else None,
        "notes": notes,
    }
    with commit_together([cfg.output, cfg.plot]):  # both, or neither
        if cfg.output:
            write_json(cfg.output, result)
        if cfg.plot:
            from repgeom_eval.output.plotting import plot_slices

            plot_slices(curve.to_dict(), cfg.plot)
    if cfg.json:
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
        row = [f"{100 * f:.0f}%", fmt(curve.dispersion_mean[i], se=curve.dispersion_se[i])]
        if curve.perplexity_mean is not None:
            row.append(fmt(curve.perplexity_mean[i], se=curve.perplexity_se[i]))
        if curve.prompt_perplexity_mean is not None:
            row.append(fmt(curve.prompt_perplexity_mean[i], se=curve.prompt_perplexity_se[i]))
        table.add_row(*row)
    console.print(table)
    if curve.perplexity_mean is not None:
        console.print(f"answer perplexity: {ANSWER_PPL}")
    if curve.prompt_perplexity_mean is not None:
        console.print(f"prompt perplexity: {PROMPT_PPL}")
    console.print(f"Spearman ρ(fraction correct, slice dispersion) = {fmt(curve.spearman)} "
                  f"(over all {len(curve.fractions) * curve.seeds} slices: {fmt(curve.spearman_all_slices)})")
    if curve.perplexity_mean is not None:
        console.print(f"Spearman ρ(fraction correct, slice answer perplexity) = {fmt(curve.spearman_perplexity)}")
    if curve.prompt_perplexity_mean is not None:
        console.print("Spearman ρ(fraction correct, slice prompt perplexity) = "
                      f"{fmt(curve.spearman_prompt_perplexity)}")
    if calibration:
        chosen = ", ".join(f"{name} ×{calibration.chosen.count(name)}" for name in dict.fromkeys(calibration.chosen))
        console.print(f"Calibration MAE on test slices = {fmt(calibration.mae_mean, se=calibration.mae_se)} over "
                      f"{calibration.seeds} seeds ({calibration.size} per slice; chosen on validation: {chosen})")
    return 0
