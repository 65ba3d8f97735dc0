"""``repgeom tasks-dir``: print the folder of repgeom-eval's lm-eval task YAMLs (for ``--include_path``)."""

from __future__ import annotations

import argparse

from repgeom_eval.spec.options.commands import TasksDirCommand


def configure(p: argparse.ArgumentParser) -> None:
    TasksDirCommand.add_arguments(p)
    p.epilog = "Example: lm_eval --include_path \"$(repgeom tasks-dir)\" --tasks repgeom_hardness_mmlu ..."


def run(args: argparse.Namespace) -> int:
    from _repgeom_lm_eval_hook import tasks_dir

    print(tasks_dir())
    return 0
