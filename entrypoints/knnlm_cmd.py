"""``repgeom knnlm``: a real kNN-LM (faiss datastore + interpolation) to check a key choice."""

from __future__ import annotations

import argparse
import math
import os

from .measure_cmd import add_model_args
from .ppl_bins_cmd import add_output_args, guard_outputs, positive_int, progress


def configure(p: argparse.ArgumentParser) -> None:
    from repgeom_eval.defaults import (KNNLM_IVF_THRESHOLD as IVF_THRESHOLD, KNNLM_K as DEFAULT_K,
                                       KNNLM_LAMBDA as DEFAULT_LAMBDA, KNNLM_TEMPERATURE as DEFAULT_TEMPERATURE)

    add_model_args(p)
    p.add_argument("--key", "-k", nargs="+", default=["resid_mid:-1"], metavar="ADDRESS",
                   help="key address(es); several are compared side by side (default: resid_mid:-1)")
    p.add_argument("--datastore", required=True, metavar="FILE",
                   help="text the datastore is built from (.jsonl with a text field, or .txt)")
    p.add_argument("--eval", required=True, metavar="FILE", help="held-out text to measure perplexity on")
    p.add_argument("--text-field", default="text", help="field of each .jsonl record to read (default: text)")
    p.add_argument("--chunk-len", type=positive_int, default=512, help="tokens per chunk (default: 512)")
    p.add_argument("--packing", choices=["concat", "document"], default="concat")
    p.add_argument("--neighbors", type=positive_int, default=DEFAULT_K,
                   help=f"k nearest keys per query (default: {DEFAULT_K})")
    p.add_argument("--lmbda", "--lambda", dest="lambdas", type=float, nargs="+", default=[DEFAULT_LAMBDA],
                   metavar="λ", help=f"interpolation weight(s) of the kNN distribution (default: {DEFAULT_LAMBDA})")
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE,
                   help=f"softmax temperature over negative squared L2 distances (default: {DEFAULT_TEMPERATURE})")
    p.add_argument("--index", choices=["auto", "flat", "ivf"], default="auto",
                   help=f"exact search (flat) or IVF; auto = IVF from {IVF_THRESHOLD} keys on")
    p.add_argument("--nlist", type=positive_int, default=None, help="IVF cells (default: about 4·sqrt(n))")
    p.add_argument("--nprobe", type=positive_int, default=32, help="IVF cells searched per query (default: 32)")
    p.add_argument("--fp16", action="store_true", help="store keys and index codes in float16 (half the memory)")
    p.add_argument("--store-dir", default=None,
                   help="keep the keys (.npy), values and faiss indexes here (default: a temporary directory)")
    p.add_argument("--batch-size", "-b", type=positive_int, default=4)
    p.add_argument("--seed", type=int, default=0, help="seed of the IVF training sample")
    add_output_args(p, plots=False)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from repgeom_eval.analyses.knnlm import knnlm
    from repgeom_eval.output.files import check_creatable_dir, commit_together

    store = []
    if args.store_dir:
        check_creatable_dir(args.store_dir, "kNN store folder (--store-dir)")
        # the files every store holds (keys_*.npy and index_*.faiss are named after the key addresses)
        store = [os.path.join(args.store_dir, name) for name in ("manifest.json", "values.npy")]
    outputs = guard_outputs(args, {"--output": args.output, "--store-dir": store},
                            {"--datastore": args.datastore, "--eval": args.eval}, args.model)
    with commit_together(outputs):
        result = knnlm(args.model, args.datastore, args.eval, keys=args.key, k=args.neighbors, lambdas=args.lambdas,
                       temperature=args.temperature, chunk_len=args.chunk_len, packing=args.packing, fp16=args.fp16,
                       index=args.index, nlist=args.nlist, nprobe=args.nprobe, store_dir=args.store_dir,
                       text_field=args.text_field, batch_size=args.batch_size, seed=args.seed, dtype=args.dtype,
                       device=args.device, progress=progress(args))
        if args.output:
            result.write(args.output)
    res = result.results
    console = Console(width=max(Console().width, 100))
    table = Table(title=escape(f"{result.model['name']} · kNN-LM perplexity on {res['n_eval_tokens']} tokens · "
                               f"k={result.config['k']}, T={result.config['temperature']}"))
    table.add_column("key", style="bold")
    table.add_column("store", justify="right")
    for lam in result.config["lambdas"]:
        table.add_column(f"ppl λ={lam:g}", justify="right")
    table.add_column("target in k-NN", justify="right")
    table.add_row("(LM alone)", "", *[_fmt(res["base_ppl"]) for _ in result.config["lambdas"]], "")
    for name, r in res["keys"].items():
        store = r["datastore"]
        table.add_row(escape(name), f"{store['n_keys']} {store['index']}",
                      *[_fmt(r["ppl"][str(lam)]) for lam in result.config["lambdas"]], f"{r['hit_rate']:.1%}")
    console.print(table)
    if args.output:
        console.print(f"results: {escape(args.output)}", soft_wrap=True)
    return 0


def _fmt(v: float | None) -> str:
    return "inf" if v is None or math.isinf(v) else f"{v:.3f}"
