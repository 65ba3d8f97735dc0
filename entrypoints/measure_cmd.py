"""``repgeom measure``: metrics at layer addresses over a text file."""

from __future__ import annotations

import argparse
import json


def add_model_args(p: argparse.ArgumentParser, nargs: str | None = None) -> None:
    """``--model`` and the model options every command that loads a model shares (repgeom_eval/modeling/options.py)."""
    from repgeom_eval.modeling.options import ModelOptions

    kw = {"nargs": nargs} if nargs else {}
    p.add_argument("--model", "-m", required=True, **kw,
                   help="hub id, local model directory, or .gguf file (loaded through transformers)")
    ModelOptions.add_arguments(p)


def add_loading_args(p: argparse.ArgumentParser, random_init: bool = True) -> None:
    """The model options of a command that reads a model's files (tokenizer, weights) without loading it whole."""
    from repgeom_eval.modeling.options import ModelOptions

    ModelOptions.add_arguments(p, only=["trust_remote_code"] + (["allow_random_init"] if random_init else []))


def configure(p: argparse.ArgumentParser) -> None:
    from repgeom_eval.measurement.config import RunConfig

    add_model_args(p)
    p.add_argument("--data", "-d", required=True,
                   help=".jsonl with a text field per line, .txt with one text per line, or a Hugging Face "
                        "datasets stream hf:NAME?split=train (e.g. hf:json?data_files=big.jsonl); read in shards")
    RunConfig.add_arguments(p)  # every run option, declared once in repgeom_eval/measurement/config.py
    p.add_argument("--output", "-o", default=None, help="results JSON (written atomically)")
    p.add_argument("--per-text", default=None, metavar="OUT.jsonl",
                   help="also write per-text scores (c_i, token dispersion) to this JSONL file")
    p.add_argument("--json", action="store_true", help="print the results JSON to stdout instead of a table")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from repgeom_eval.output.files import check_creatable_dir, check_outputs, check_writable, commit_together, jsonable
    from repgeom_eval.measurement.config import RunConfig
    from repgeom_eval.measurement.engine import measure
    from repgeom_eval.measurement.texts import source_files
    from repgeom_eval.modeling.loading import model_inputs
    from repgeom_eval.output.console import results_table

    if args.run_dir:
        check_creatable_dir(args.run_dir, "--run-dir")
    outputs = {"--output": args.output, "--per-text": args.per_text,
               "--save-preprocess-stats": args.save_preprocess_stats, "--run-dir": run_dir_files(args.run_dir)}
    model_files, model_dirs = model_inputs(args.model)
    check_outputs(outputs, inputs={"--data": source_files(args.data), "--preprocess-stats": args.preprocess_stats,
                                   "--model": model_files}, folders={"--model": model_dirs})
    for path in (args.output, args.per_text, args.save_preprocess_stats):
        if path:
            check_writable(path)  # fail before the forward passes, not after
    config = RunConfig.from_namespace(args, dtype=args.dtype, device=args.device, per_text=bool(args.per_text))
    with commit_together([args.output, args.per_text, args.save_preprocess_stats]):  # all of them, or none
        result = measure(args.model, args.data, config)
        if not result.is_main:
            return 0  # a rank > 0 of a distributed run: the merged results and the files belong to rank 0
        if args.output or args.per_text:
            if args.output:
                result.write(args.output, args.per_text)
            else:
                from repgeom_eval.output.files import write_jsonl

                write_jsonl(args.per_text, result.per_text)
    if args.json:
        print(json.dumps(jsonable(result.to_dict()), indent=2))
        return 0
    # Wide enough for every metric column: a results table truncated to "1.…" is useless.
    names = {m for per_metric in result.results.values() for m in per_metric}
    needed = 18 + sum(max(len(m), 9) + 3 for m in names)
    console = Console(width=max(Console().width, needed))
    t = result.timings
    title = f"{result.model['name']} · {result.data['n_texts']} texts · {t['total_s']:.1f}s"
    console.print(results_table(result.results, title=title))
    if args.output:
        console.print(f"results: {args.output}" + (f", per-text scores: {args.per_text}" if args.per_text else ""))
    return 0


def run_dir_files(run_dir: str | None) -> list[str]:
    """The files a checkpointed run writes into ``--run-dir`` (repgeom_eval/measurement/checkpoint.py): its key and
    one state file per process."""
    if not run_dir:
        return []
    import os

    world = max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))
    return [os.path.join(run_dir, "run.json")] + [os.path.join(run_dir, f"state.rank{r}-of-{world}.pt")
                                                   for r in range(world)]
