"""``repgeom perturb``: prompt entropy and dispersion by layer under repetition, random tokens, length (paper B)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from repgeom_eval.modeling.options import ModelOptions
from repgeom_eval.analyses.configs import PerturbConfig
from repgeom_eval.modeling.option_groups import DataGroup, ModelGroup, PlotsGroup

from .common import guard_outputs, plot_dir, plot_files, wide_console


@dataclass(frozen=True, kw_only=True)
class PerturbCommand(ModelGroup, DataGroup, PerturbConfig, PlotsGroup):
    """Every option of ``repgeom perturb``: model, texts, the analysis (PerturbConfig) and its outputs."""


def configure(p: argparse.ArgumentParser) -> None:
    PerturbCommand.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    from rich.markup import escape
    from rich.table import Table

    from repgeom_eval.analyses.perturb import perturb
    from repgeom_eval.analyses.plots import figure_perturb, save_png
    from repgeom_eval.output.console import fmt_number
    from repgeom_eval.output.files import commit_together

    cfg = PerturbCommand.from_args(args)
    figures = plot_files(cfg, "perturb", [""])
    outputs = guard_outputs(cfg, {"--output": cfg.output, "--plot-dir": figures}, {"--data": cfg.data}, cfg.model)
    with commit_together(outputs):  # every output, or none
        result = perturb(cfg.model, cfg.data, PerturbConfig.of(cfg, layers=cfg.layer_request),
                         model_options=ModelOptions.of(cfg))
        if cfg.output:
            result.write(cfg.output)
        if figures:
            plot_dir(cfg)
            save_png(figure_perturb(result.to_dict()), figures[0])
    res = result.results
    last = res["layers"][-1]
    console = wide_console()
    table = Table(title=escape(f"{result.model['name']} · {result.data['n_prompts']} prompts · at {last}"))
    for col in ("sweep", "value", "prompt entropy", "token dispersion"):
        table.add_column(col, justify="left" if col == "sweep" else "right")
    for sweep, r in res["sweeps"].items():
        for j, v in enumerate(r["values"]):
            table.add_row(sweep if j == 0 else "", f"{v:g}", fmt_number(r["prompt_entropy"][j][-1]),
                          fmt_number(r["token_dispersion"][j][-1]))
    console.print(table)
    for path in figures:
        console.print(f"plot:    {escape(str(path))}", soft_wrap=True)
    if cfg.output:
        console.print(f"results: {escape(cfg.output)}", soft_wrap=True)
    return 0
