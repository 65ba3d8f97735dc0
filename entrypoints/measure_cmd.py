"""``repgeom measure``: metrics at layer addresses over a text file."""

from __future__ import annotations

import argparse
import json
import sys

from repgeom_eval.measurement.pooling import POOLING_ALIASES, POOLINGS


def _metric_param(text: str) -> tuple[str, str, object]:
    """``name.key=value`` → (name, key, value parsed as JSON when possible)."""
    lhs, sep, raw = text.partition("=")
    metric, dot, key = lhs.partition(".")
    if not sep or not dot or not metric or not key:
        raise argparse.ArgumentTypeError(f"expected METRIC.PARAM=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return metric, key, value


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", required=True,
                   help="hub id, local model directory, or .gguf file (loaded through transformers)")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, "
                                                   "float16, float64")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 or auto")


def configure(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--data", "-d", required=True,
                   help=".jsonl with a text field per line, .txt with one text per line, or a Hugging Face "
                        "datasets stream hf:NAME?split=train (e.g. hf:json?data_files=big.jsonl); read in shards")
    p.add_argument("--text-field", default="text", help="field of each .jsonl record to read (default: text)")
    p.add_argument("--layers", "-l", nargs="+", default=["final"],
                   help="layer addresses: resid_post:11, mlp_in:-1, resid_mid:*, resid_post:[0,5,-1], embed, "
                        "final, a bare hidden-state index, or a selector (all, blocks, knn_keys). Default: final")
    p.add_argument("--metrics", nargs="+", default=["dispersion"],
                   help="metric names (space or comma separated); `repgeom plugins` lists them. "
                        "Default: dispersion")
    p.add_argument("--metric-param", action="append", type=_metric_param, default=[], metavar="METRIC.PARAM=VALUE",
                   help="set a metric parameter, e.g. dispersion.per_text=true (repeatable)")
    p.add_argument("--pooling", default=None, choices=list(POOLINGS) + list(POOLING_ALIASES),
                   help="one vector per text for every metric: last non-pad token, mean, first (= cls), or tokens "
                        "(every token vector). Default: each metric's own (last for dispersion, mean for the "
                        "Layer-by-Layer metrics); METRIC.pooling=... sets one metric's")
    p.add_argument("--seed", type=int, default=0, help="seed of the augmented views (multi-view metrics)")
    p.add_argument("--preprocess", default="none", choices=["none", "center", "standardize", "whiten"],
                   help="transform the vectors before every metric (default none, as in the papers); statistics "
                        "from the same data (one extra forward pass) unless --preprocess-stats is given")
    p.add_argument("--preprocess-stats", default=None, metavar="FILE",
                   help="reference statistics written earlier with --save-preprocess-stats")
    p.add_argument("--save-preprocess-stats", default=None, metavar="FILE",
                   help="write the preprocessing statistics of this run (safetensors) for reuse")
    p.add_argument("--batch-size", "-b", type=int, default=16)
    p.add_argument("--max-length", type=int, default=None,
                   help="truncate texts to this many tokens (default: the model context)")
    p.add_argument("--padding-side", choices=["right", "left"], default="right")
    p.add_argument("--output", "-o", default=None, help="results JSON (written atomically)")
    p.add_argument("--per-text", default=None, metavar="OUT.jsonl",
                   help="also write per-text scores (c_i, token dispersion) to this JSONL file")
    p.add_argument("--shard-size", type=int, default=1024,
                   help="texts read, batched and checkpointed together (memory: one shard + metric states)")
    p.add_argument("--run-dir", default=None, metavar="DIR",
                   help="checkpoint the metric states here after every shard, so a killed run can --resume")
    p.add_argument("--resume", action="store_true",
                   help="continue the run checkpointed in --run-dir (same model, data and options)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--json", action="store_true", help="print the results JSON to stdout instead of a table")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from repgeom_eval.output.files import check_writable, jsonable
    from repgeom_eval.measurement.engine import measure
    from repgeom_eval.output.console import results_table

    for path in (args.output, args.per_text, args.save_preprocess_stats):
        if path:
            check_writable(path)  # fail before the forward passes, not after
    metrics = [m.strip() for item in args.metrics for m in item.split(",") if m.strip()]
    params: dict[str, dict[str, object]] = {}
    for metric, key, value in args.metric_param:
        params.setdefault(metric, {})[key] = value
    result = measure(
        args.model, args.data, layers=args.layers, metrics=metrics, pooling=args.pooling,
        batch_size=args.batch_size, max_length=args.max_length, padding_side=args.padding_side, dtype=args.dtype,
        device=args.device, per_text=bool(args.per_text), metric_params=params, text_field=args.text_field, seed=args.seed,
        preprocess=args.preprocess, preprocess_stats=args.preprocess_stats,
        save_preprocess_stats=args.save_preprocess_stats, shard_size=args.shard_size, run_dir=args.run_dir,
        resume=args.resume, progress=not args.no_progress and sys.stderr.isatty(),
    )
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
