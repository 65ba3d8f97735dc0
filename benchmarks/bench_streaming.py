"""Benchmark: memory of a streamed run does not grow with the number of texts.

Question: does ``measure()`` over 100,000 texts hold more than over 1,000? It should not for sum-based metrics:
texts are read shard by shard (``--shard-size``, default 1024) and metric states are sums of fixed size.

Method: a tiny random Llama (2 blocks, width 32, from ``repgeom_eval.testing``) and a ``.jsonl`` of N short
sentences generated from the words of Python's own documentation (``pydoc_data.topics``), N = 1,000 and 100,000.
Each run is a fresh subprocess (``--child``) that imports everything first, then reports its peak RSS (``VmHWM``)
and the RSS right after the imports; the difference is what the run itself held. Metrics: ``dispersion``,
``token_dispersion``, ``massive_activations``, ``effective_rank`` at ``embed``, ``resid_post:*`` and ``final``.
Target: peak RSS at N = 100k within 10 % of N = 1k.

    .venv/bin/python benchmarks/bench_streaming.py            # N = 1k and 100k, about 2 to 4 minutes on 2 cores
    .venv/bin/python benchmarks/bench_streaming.py --sizes 1000 20000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METRICS = ["dispersion", "token_dispersion", "massive_activations", "effective_rank"]


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def child(model: str, data: str) -> None:
    import torch  # noqa: F401  - imports first, so that the baseline includes them
    import transformers  # noqa: F401

    from repgeom_eval.measurement.engine import measure

    torch.set_num_threads(2)
    base = _kib("VmRSS")
    t0 = time.perf_counter()
    result = measure(model, data, layers="all", metrics=METRICS, batch_size=64, progress=False)
    elapsed = time.perf_counter() - t0
    print(json.dumps({"base_kib": base, "peak_kib": _kib("VmHWM"), "seconds": elapsed,
                      "n_texts": result.data["n_texts"], "dispersion": result.results["final"]["dispersion"]}))


def corpus(path: Path, n: int) -> None:
    from pydoc_data.topics import topics

    words = " ".join(topics.values()).split()
    rng = random.Random(0)
    with path.open("w", encoding="utf-8") as fh:
        for i in range(n):
            start = rng.randrange(len(words) - 40)
            fh.write(json.dumps({"text": " ".join(words[start:start + rng.randint(5, 30)])}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 100_000])
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "DATA"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    from repgeom_eval.testing import make_tiny_model

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model("llama", Path(tmp) / "model"))
        for n in args.sizes:
            data = Path(tmp) / f"texts-{n}.jsonl"
            corpus(data, n)
            out = subprocess.run([sys.executable, __file__, "--child", model, str(data)], capture_output=True,
                                 text=True, env=env, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append((n, row))
            print(f"N = {n:>7}: {row['seconds']:7.1f} s, peak RSS {row['peak_kib'] / 1024:7.1f} MiB "
                  f"(imports {row['base_kib'] / 1024:.1f} MiB, run {(row['peak_kib'] - row['base_kib']) / 1024:.1f} "
                  f"MiB), D(final) = {row['dispersion']:.6f}", flush=True)
    (n0, first), (n1, last) = rows[0], rows[-1]
    ratio = last["peak_kib"] / first["peak_kib"]
    run_ratio = (last["peak_kib"] - last["base_kib"]) / max(first["peak_kib"] - first["base_kib"], 1)
    print(f"\npeak RSS N = {n1} / N = {n0}: {ratio:.3f} (what the run held above the imports: {run_ratio:.2f}x); "
          f"target <= 1.10: {'MET' if ratio <= 1.10 else 'NOT MET'}")
    print(f"metrics: {', '.join(METRICS)} at every hidden state of a tiny llama (D = 32); batch 64, shard 1024")


if __name__ == "__main__":
    main()
