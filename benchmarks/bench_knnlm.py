"""Benchmark: the kNN-LM datastore — exact vs IVF index, float32 vs float16 keys.

What is measured, on N synthetic keys of width d = 576 (SmolLM2-135M's hidden size) held in an on-disk ``.npy``
memmap as :mod:`repgeom_eval.analyses.knnlm` writes them, with values drawn from a 1000-token vocabulary and
queries = stored keys plus small noise (so every query has a true near neighbour, as in a kNN-LM evaluated on text
close to its datastore):

* index build time and the index's size in memory (faiss ``serialize_index`` bytes);
* search time for Q queries at k neighbours (Khandelwal's k = 1024 by default);
* recall@k of each approximate index against the exact float32 one, and the largest |Δ log p_kNN(target)|.

    .venv/bin/python benchmarks/bench_knnlm.py                  # N = 100000, Q = 500, k = 1024
    .venv/bin/python benchmarks/bench_knnlm.py --n 20000 --q 200   # quick
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

D = 576


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=100_000, help="datastore keys")
    ap.add_argument("--q", type=int, default=500, help="queries")
    ap.add_argument("--k", type=int, default=1024, help="neighbours")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import faiss

    from repgeom_eval.analyses.knnlm import Datastore, build_index, knn_logprob

    faiss.omp_set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        keys = {}
        for dtype in (np.float32, np.float16):
            mm = np.lib.format.open_memmap(Path(tmp) / f"keys_{np.dtype(dtype).name}.npy", mode="w+", dtype=dtype,
                                           shape=(args.n, D))
            g = np.random.default_rng(1)
            for lo in range(0, args.n, 20_000):  # written in chunks, as the datastore builder does
                hi = min(args.n, lo + 20_000)
                mm[lo:hi] = (g.standard_normal((hi - lo, D), dtype=np.float32) + 0.3).astype(dtype)
            mm.flush()
            keys[np.dtype(dtype).name] = mm
        values = rng.integers(0, 1000, size=args.n)
        rows = rng.choice(args.n, size=args.q, replace=False)
        queries = np.asarray(keys["float32"][rows], dtype=np.float32)
        queries += 0.1 * rng.standard_normal(queries.shape, dtype=np.float32)
        targets = values[rows]

        print(f"N = {args.n} keys × d = {D}, Q = {args.q} queries, k = {args.k}, {args.threads} threads")
        print(f"keys on disk: float32 {keys['float32'].nbytes / 2**20:.0f} MiB, "
              f"float16 {keys['float16'].nbytes / 2**20:.0f} MiB")
        print(f"{'index':<14}{'build s':>9}{'index MiB':>11}{'search s':>10}{'recall@k':>10}{'max |Δlog p|':>14}")
        reference = None
        variants = (("flat fp32", "flat", False, "float32"), ("flat fp16", "flat", True, "float16"),
                    ("ivf fp32", "ivf", False, "float32"), ("ivf fp16", "ivf", True, "float16"))
        for label, kind, fp16, store in variants:
            t0 = time.perf_counter()
            index, used, params = build_index(keys[store], kind, fp16=fp16)
            t_build = time.perf_counter() - t0
            size = faiss.serialize_index(index).nbytes / 2**20
            st = Datastore("bench", keys[store], values, index, used, params)
            t0 = time.perf_counter()
            _, ids = index.search(queries, args.k)
            lp, _ = knn_logprob(st, queries, targets, k=args.k)
            t_search = time.perf_counter() - t0
            if reference is None:
                reference = (ids, lp)
                recall, delta = 1.0, 0.0
            else:
                recall = np.mean([len(set(a) & set(b)) / args.k for a, b in zip(ids, reference[0])])
                both = np.isfinite(lp) & np.isfinite(reference[1])
                delta = float(np.max(np.abs(lp[both] - reference[1][both]))) if both.any() else float("nan")
            extra = f" (nlist {params['nlist']}, nprobe {params['nprobe']})" if used == "ivf" else ""
            print(f"{label:<14}{t_build:>9.2f}{size:>11.0f}{t_search:>10.2f}{recall:>10.3f}{delta:>14.2e}{extra}")


if __name__ == "__main__":
    main()
