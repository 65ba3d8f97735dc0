"""``repgeom demo``: the showcase on an embedded default, no arguments needed.

SmolLM2-135M over text that ships with Python: (1) the dispersion profile by depth, (2) the perplexity-vs-dispersion
law over chunks of the Python docs with its correlation (``ppl-bins``), (3) the condensation heatmap
(``condensation``), (4) everything in one offline HTML page (``report``). Under 10 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from repgeom_eval.spec.options.model import ModelOptions
from repgeom_eval.spec.options.commands import DemoCommand


configure = DemoCommand.add_arguments


def run(args: argparse.Namespace) -> int:
    import sys

    from rich.console import Console

    from repgeom_eval.testing.demo import python_doc_paragraphs, smollm2_path
    from repgeom_eval.modeling.loading import load_model
    from repgeom_eval.measurement.engine import measure
    from repgeom_eval.output.plotting import plot_profile
    from repgeom_eval.output.console import results_table

    from repgeom_eval.modeling.loading import model_files
    from repgeom_eval.output.files import check_outputs

    cfg = DemoCommand.from_args(args)
    console = Console(soft_wrap=True)  # long paths stay whole (copyable), lines are never hard-wrapped
    out = Path(cfg.output_dir)
    model = cfg.model or str(smollm2_path())
    weight_files, model_dirs = model_files(model)
    written = ["results.json", "dispersion_profile.png", "ppl_bins.json", "ppl_bins_scatter.png",
               "ppl_bins_by_depth.png", "condensation.json", "condensation.png", "report.html"]
    check_outputs({"--output-dir": [out / name for name in written]}, inputs={"--model": weight_files},
                  folders={"--model": model_dirs})
    out.mkdir(parents=True, exist_ok=True)
    texts = python_doc_paragraphs(cfg.n_texts)
    console.print(f"[bold]repgeom demo[/bold]: {Path(model).name} over {len(texts)} paragraphs of the Python docs "
                  f"(pydoc_data.topics), every hidden state, pooling=last")
    loaded = load_model(model, options=ModelOptions.of(cfg))  # once, for every step
    result = measure(loaded, texts, layers="all", metrics=["dispersion", "token_dispersion"], pooling="last",
                     batch_size=cfg.batch_size, max_length=cfg.max_length, dtype=cfg.dtype,
                     progress=_progress(cfg))
    result.data["path"] = "pydoc_data.topics (paragraphs)"
    result.write(out / "results.json")
    plot = plot_profile(result.to_dict(), out / "dispersion_profile.png")
    console.print(results_table(result.results, title=f"dispersion by depth · {result.timings['total_s']:.0f}s"))
    console.print(f"results: {out / 'results.json'}\nplot:    {plot}")
    if cfg.profile_only:
        return 0
    _analyses(cfg, loaded, texts, out, console)
    return 0


def depth_profile_line(layers: list[str], correlation: dict) -> str:
    """One line on the whole depth profile, not only ``final``: where the correlation is negative, its strongest
    negative layer, and what paper A predicts (a newcomer who sees only the last layer's sign reads a positive value
    as the tool or the paper being wrong)."""
    import math

    pearson = {a: correlation[a]["pearson"] for a in layers if not math.isnan(correlation[a]["pearson"])}
    negative = [a for a in layers if pearson.get(a, 0.0) < 0]
    line = ("paper A predicts a negative correlation (harder, higher-perplexity text has less dispersed hidden "
            "states); ")
    if not negative:
        return line + f"here it is positive at every one of the {len(layers)} depths (see ppl_bins_by_depth.png)."
    strongest = min(negative, key=pearson.__getitem__)
    c = correlation[strongest]
    return (line + f"here it is negative at {len(negative)} of {len(layers)} depths, most strongly at {strongest} "
            f"(Pearson {c['pearson']:+.3f}, Spearman {c['spearman']:+.3f}); the whole profile: ppl_bins_by_depth.png.")


def _analyses(cfg: DemoCommand, loaded, texts: list[str], out: Path, console) -> None:
    """Steps 2-4 on the same model, loaded once: the perplexity-vs-dispersion law, condensation, the report."""
    import sys

    from pydoc_data.topics import topics

    from repgeom_eval.analyses.condensation import condensation
    from repgeom_eval.analyses.html_report import write_report
    from repgeom_eval.analyses.plots import (
        figure_condensation,
        figure_correlation_vs_depth,
        figure_ppl_vs_dispersion,
        save_png,
    )
    from repgeom_eval.analyses.ppl_bins import ppl_bins

    show = _progress(cfg)
    console.print(f"\n[bold]perplexity vs dispersion[/bold] (paper A): {cfg.ppl_chunks} chunks of "
                  f"{cfg.chunk_len} tokens of the Python docs, groups of {cfg.group_size}")
    docs = [topics[k] for k in sorted(topics)]
    law = ppl_bins(loaded, docs, layers="all", chunk_len=cfg.chunk_len, n_chunks=cfg.ppl_chunks,
                   group_size=cfg.group_size, n_bins=max(2, cfg.ppl_chunks // cfg.group_size),
                   batch_size=cfg.batch_size, progress=show)
    law.data["path"] = "pydoc_data.topics (all topics, concatenated)"
    law.write(out / "ppl_bins.json")
    d = law.to_dict()
    save_png(figure_ppl_vs_dispersion(d), out / "ppl_bins_scatter.png")
    save_png(figure_correlation_vs_depth(d), out / "ppl_bins_by_depth.png")
    pooled = law.results["pooled"]
    last = law.results["layers"][-1]
    c = pooled["correlation"][last]
    console.print(f"{pooled['n_selected']} perplexity groups; at {last}: Pearson {c['pearson']:+.3f}, "
                  f"Spearman {c['spearman']:+.3f} between group perplexity and token dispersion "
                  f"({law.timings['total_s']:.0f}s)")
    console.print(depth_profile_line(law.results["layers"], pooled["correlation"]))

    console.print(f"\n[bold]condensation[/bold] (paper C): cosine histograms of {len(texts)} paragraphs, every layer")
    cond = condensation([loaded], texts, max_length=cfg.max_length, batch_size=cfg.batch_size, progress=show)
    cond.data["path"] = "pydoc_data.topics (paragraphs)"
    cond.write(out / "condensation.json")
    save_png(figure_condensation(cond.to_dict()), out / "condensation.png")
    m = next(iter(cond.results["models"].values()))
    console.print(f"mean token cosine {m['mean_cosine'][0]:.3f} (embeddings) → {m['mean_cosine'][-1]:.3f} (final); "
                  f"Spearman ρ with depth {m['spearman']:+.3f}, Kendall τ {m['kendall']:+.3f} "
                  f"({cond.timings['total_s']:.0f}s)")

    report = write_report([out / "results.json", out / "ppl_bins.json", out / "condensation.json"],
                          out / "report.html", title="repgeom demo: SmolLM2-135M on the Python docs")
    console.print(f"\nreport:  {report} (one self-contained page, opens offline)")


def _progress(cfg: DemoCommand) -> str:
    return "never" if cfg.no_progress else cfg.progress
