"""``repgeom lm-eval ARGS…``: lm-eval's own command line with repgeom-eval's tasks and metrics loaded.

Every argument goes to lm-eval unchanged (``repgeom lm-eval --help`` shows lm-eval's help). The task folder is
added to lm-eval's search path whatever ``REPGEOM_LM_EVAL_AUTOLOAD`` says, and the metrics, the hidden-state
capture and the ``repgeom-hf`` model name are registered before lm-eval parses its arguments.
"""

from __future__ import annotations

import argparse
import sys


def configure(p: argparse.ArgumentParser) -> None:
    p.usage = "repgeom lm-eval [lm-eval arguments ...]"
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="passed to lm-eval unchanged")
    # Every word belongs to lm-eval, options included: with no option prefix of its own, argparse hands them all
    # to lm_eval_args instead of rejecting `--model` as unknown (this also routes -h/--help to lm-eval).
    p.prefix_chars = "\0"


def run(args: argparse.Namespace) -> int:
    from _repgeom_lm_eval_hook import patch_task_manager, when_imported

    from repgeom_eval.errors import RepgeomError

    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        raise RepgeomError("lm-eval is not installed: pip install 'repgeom-eval[lmeval]'") from None
    when_imported("lm_eval.tasks.manager", patch_task_manager)
    import repgeom_eval.lmeval.model  # noqa: F401  (metrics, capture, repgeom-hf)

    argv = sys.argv
    sys.argv = ["lm-eval", *args.lm_eval_args]
    try:
        cli_evaluate()
    except SystemExit as exc:  # argparse and lm-eval exit through SystemExit
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = argv
    return 0
