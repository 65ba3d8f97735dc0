"""``repgeom train --config FILE.yaml``: train (or continue training) a causal LM with auxiliary losses."""

from __future__ import annotations

import argparse
import json

from repgeom_eval.spec.option_fields import add_option_arguments, options_from_namespace
from repgeom_eval.spec.options.train import TrainCommand


def configure(p: argparse.ArgumentParser) -> None:
    from repgeom_eval.spec.options.train import config_keys_help

    # The keys of the config file, listed from their declarations (repgeom_eval/spec/options/train.py).
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = config_keys_help()
    add_option_arguments(TrainCommand, p)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from repgeom_eval.spec.options.train import GEOMETRY_FILE, read_config
    from repgeom_eval.training.loop import check_train_outputs, train

    command = TrainCommand(**options_from_namespace(TrainCommand, args))
    cfg = read_config(command.config, command.overrides)
    check_train_outputs(cfg, command.overwrite, config_file=command.config)
    result = train(cfg, progress="never" if command.no_progress else command.progress, overwrite=command.overwrite)
    if command.json:
        print(json.dumps(result.perplexity_table(), indent=2))
        return 0
    console = Console()
    if not console.is_terminal:
        console = Console(width=140)
    objective = result.config["objective"]
    table = Table(title=escape(f"evaluation perplexity per domain · {objective}"))
    table.add_column("step", justify="right")
    domains = list(result.data)
    for name in domains:
        table.add_column(escape(name), justify="right")
    for row in result.perplexity_table():
        table.add_row(str(row["step"]), *[f"{row[d]:.2f}" if d in row else "-" for d in domains])
    console.print(table)
    last = result.train_log[-1] if result.train_log else {}
    parts = [f"{k} {last[k]:.4f}" for k in ("ce", "dispersion", "dispersion_cross") if k in last]
    parts += [f"{k} {v:.4f}" for k, v in last.items() if k.startswith("aux/") and not k.endswith("skipped")]
    if parts:
        console.print(f"last step ({last.get('step')}): " + ", ".join(parts), soft_wrap=True)
    console.print(f"{result.timings['steps']} steps in {result.timings['train_s']:.1f} s; results: "
                  f"{escape(str(cfg.output_dir / 'results.json'))}", soft_wrap=True)
    geometry_file = cfg.output_dir / GEOMETRY_FILE
    if cfg.geometry_probe is not None and geometry_file.is_file():
        geometry = json.loads(geometry_file.read_text(encoding="utf-8"))
        pick = geometry["pick"]
        chosen = (f"step {pick['step']} (G cosine {pick['G_cosine']:.4f})" if pick["step"] is not None
                  else f"none (no checkpoint at or after step {pick['first_eligible_step']})")
        console.print(f"geometry at {len(geometry['checkpoints'])} checkpoint(s); label-free pick: {chosen}; "
                      f"{escape(str(geometry_file))}", soft_wrap=True)
    return 0
