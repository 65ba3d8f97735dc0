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


def _option(argv: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in lm-eval's arguments (the last one wins)."""
    value = None
    for i, word in enumerate(argv):
        if word == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif word.startswith(name + "="):
            value = word[len(name) + 1:]
    return value


def check_arguments(argv: list[str]) -> None:
    """One-line errors, before lm-eval starts, for what would otherwise end in a traceback or destroy an input:
    malformed ``--metadata`` JSON, and an ``--output_path`` inside (or holding) the ``pretrained=`` model folder or
    on a ``repgeom_data`` file (given in ``--metadata``, or in ``--model_args`` with ``--model repgeom-hf``)."""
    import json

    from repgeom_eval.spec.errors import RepgeomError
    from repgeom_eval.spec.options.lmeval import key
    from repgeom_eval.modeling.loading import model_files
    from repgeom_eval.output.files import check_outputs

    metadata = _option(argv, "--metadata")
    data_files: list[str] = []
    if metadata is not None:
        try:
            parsed = json.loads(metadata)
        except (ValueError, RecursionError) as exc:
            raise RepgeomError(f"--metadata is not valid JSON ({str(exc)[:80]}); give an object, e.g. "
                               "--metadata '{\"repgeom_data\": \"piqa.jsonl\"}'") from None
        if not isinstance(parsed, dict):
            raise RepgeomError(f"--metadata must be a JSON object ({{...}}), got {type(parsed).__name__}")
        data = parsed.get(key("data"))
        data_files = [str(v) for v in (data.values() if isinstance(data, dict) else [data]) if isinstance(v, str)]
    model_args = (_option(argv, "--model_args") or "").split(",")
    pretrained = [part.split("=", 1)[1] for part in model_args if part.startswith("pretrained=")]
    data_files += [part.split("=", 1)[1] for part in model_args if part.startswith(key("data") + "=")]  # repgeom-hf
    output = _option(argv, "--output_path")
    if output:
        files, folders = model_files(pretrained)
        check_outputs({"--output_path": output}, inputs={key("data"): data_files, "pretrained": files},
                      folders={"pretrained": folders})


def run(args: argparse.Namespace) -> int:
    from _repgeom_lm_eval_hook import install

    from repgeom_eval.spec.errors import RepgeomError

    check_arguments(list(args.lm_eval_args))

    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        raise RepgeomError("lm-eval is not installed: pip install 'repgeom-eval[lmeval]'") from None
    install()  # the task folder, the repgeom-hf name and one-line errors, whatever REPGEOM_LM_EVAL_AUTOLOAD says
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
