"""``repgeom knnlm``: a real kNN-LM (faiss datastore + interpolation) to check a key choice."""

from __future__ import annotations

import argparse
import os

from repgeom_eval.spec.options.model import ModelOptions
from repgeom_eval.spec.options.analyses import KnnlmCommand, KnnlmConfig

from .common import run_analysis, wide_console


configure = KnnlmCommand.add_arguments


def run(args: argparse.Namespace) -> int:
    from rich.markup import escape
    from rich.table import Table

    from repgeom_eval.analyses.knnlm import knnlm
    from repgeom_eval.output.console import fmt_number
    from repgeom_eval.output.files import check_creatable_dir

    cfg = KnnlmCommand.from_args(args)
    store = []
    if cfg.store_dir:
        check_creatable_dir(cfg.store_dir, "kNN store folder (--store-dir)")
        # the files every store holds (keys_*.npy and index_*.faiss are named after the key addresses)
        store = [os.path.join(cfg.store_dir, name) for name in ("manifest.json", "values.npy")]
    result, _ = run_analysis(
        cfg, lambda: knnlm(cfg.model, cfg.datastore, cfg.eval, KnnlmConfig.of(cfg),
                           model_options=ModelOptions.of(cfg)),
        "knnlm", inputs={"--datastore": cfg.datastore, "--eval": cfg.eval}, outputs={"--store-dir": store})
    res = result.results
    lambdas = result.config["lambdas"]
    console = wide_console()
    table = Table(title=escape(f"{result.model['name']} · kNN-LM perplexity on {res['n_eval_tokens']} tokens · "
                               f"k={result.config['k']}, T={result.config['temperature']}"))
    table.add_column("key", style="bold")
    table.add_column("store", justify="right")
    for lam in lambdas:
        table.add_column(f"ppl λ={lam:g}", justify="right")
    table.add_column("target in k-NN", justify="right")
    table.add_row("(LM alone)", "", *[fmt_number(res["base_ppl"], 3, missing="inf") for _ in lambdas], "")
    for name, r in res["keys"].items():
        store = r["datastore"]
        table.add_row(escape(name), f"{store['n_keys']} {store['index']}",
                      *[fmt_number(r["ppl"][str(lam)], 3, missing="inf") for lam in lambdas], f"{r['hit_rate']:.1%}")
    console.print(table)
    if cfg.output:
        console.print(f"results: {escape(cfg.output)}", soft_wrap=True)
    return 0
