"""Benchmark: what one batch's captured hidden states cost in memory, fed during the pass or after it.

Question (issue 32): a run that feeds each address to its metrics as the forward pass reaches it (``measure`` on a
GPU, on one thread, or with a third-party metric) should hold one address's hidden states at a time, where feeding
them after the pass holds every address's (float32 copies of a bfloat16 model's). How much does the peak rise by, in
each case, against what ``--dry-run`` says (``captured hidden states per batch``)?

Method: a random-init Llama in bfloat16 built from transformers' own config class (width 1024, 32 blocks: 33
addresses), ``--layers all``, ``dispersion`` and ``prompt_entropy`` (alpha 2: the token vectors are read, with no
eigendecomposition), 16 texts of 512 tokens in batches of 8. Each case runs in a fresh process that loads the model,
touches every weight (a mapped file's pages count once read), returns what loading freed to the system, resets its
peak RSS (``/proc/self/clear_refs``) and reports how far the peak (``VmHWM``) rose during ``measure``: "during the pass" with one metric thread (streamed), "after the pass"
with two (every address held, then fed in two threads, as on this CPU by default), and, as the bar, the same batches
through the model's own forward with nothing captured (its activations). Printed: each rise above the bar's (the
allocator reuses what the model's own pass freed, so these are rough), the estimate's captured bytes for the same
run, and what feeding during the pass saves (the difference of the two runs' rises) against the estimate's
difference.

    .venv/bin/python benchmarks/bench_capture_memory.py          # about 2 minutes on 2 cores
    .venv/bin/python benchmarks/bench_capture_memory.py --write  # also benchmarks/results/bench_capture_memory.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_state_memory import _kib, build  # noqa: E402  (the same model builder and peak reader)

CASES = {"forward only (the model's own pass, no hooks)": 0, "during the pass (1 metric thread)": 1,
         "after the pass (2 metric threads)": 2}
METRICS = ["dispersion", "prompt_entropy"]
PARAMS = {"prompt_entropy": {"alpha": 2.0}}


def texts(n: int) -> list[str]:
    from pydoc_data.topics import topics

    long = sorted((t for t in topics.values() if len(t.split()) > 800), key=len)
    return [" ".join(long[i % len(long)].split()[i:i + 800]) for i in range(n)]


def child(model: str, threads: int, n: int, batch: int, tokens: int) -> None:
    import torch
    import transformers  # noqa: F401  - imported first: the baseline holds them

    from repgeom_eval.measurement import engine
    from repgeom_eval.measurement.estimate import estimate
    from repgeom_eval.modeling.loading import load_model
    from repgeom_eval.spec.options.measure import RunConfig
    from repgeom_eval.spec.options.model import ModelOptions

    torch.set_num_threads(max(threads, 1))  # the engine feeds in threads only with 2 or more (MeasureRun._metric_threads)
    config = RunConfig(layers="all", metrics=METRICS, metric_params=PARAMS, batch_size=batch, max_length=tokens,
                       dtype="bfloat16", progress=False)
    est = estimate(model, config)
    data = texts(n)
    loaded = load_model(model, options=ModelOptions(dtype="bfloat16"))
    with torch.inference_mode():  # weights read from a mapped file are resident only once touched: touch them now
        for tensor in [*loaded.model.parameters(), *loaded.model.buffers()]:
            tensor.float().sum()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM: the peak below is the run's, not the load's
    base = _kib("VmRSS")
    if threads == 0:  # the bar: the same batches through the model's own forward, nothing captured
        tok = loaded.tokenizer
        with torch.inference_mode():
            for start in range(0, n, batch):
                enc = tok(data[start:start + batch], padding=True, truncation=True, max_length=tokens,
                          return_tensors="pt")
                loaded.model.model(**enc, use_cache=False)
        print(json.dumps({"rise_bytes": (_kib("VmHWM") - base) * 1024}))
        return
    result = engine.measure(loaded, data, config)
    print(json.dumps({"rise_bytes": (_kib("VmHWM") - base) * 1024, "estimate_captured_bytes":
                      est.batch_hidden_bytes, "addresses": len(result.results)}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=32)
    p.add_argument("--texts", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--write", action="store_true")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "THREADS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.texts, args.batch, args.tokens)
        return 0
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp) / "m", args.width, args.blocks, positions=1024, dtype="bfloat16")
        env = {**os.environ, "MALLOC_ARENA_MAX": "1"}  # glibc: one arena, so freed memory is reused, not kept
        common = ["--texts", str(args.texts), "--batch", str(args.batch), "--tokens", str(args.tokens)]
        # a first, discarded run: the load check of a new model runs (and caches) its forward passes once
        subprocess.run([sys.executable, __file__, *common, "--child", model, "1"], capture_output=True, text=True,
                       check=True, env=env)
        for case, threads in CASES.items():
            out = subprocess.run([sys.executable, __file__, *common, "--child", model, str(threads)],
                                 capture_output=True, text=True, check=True, env=env)
            row = rows[case] = json.loads(out.stdout.strip().splitlines()[-1])
            if threads:
                row["rise_over_forward_only_bytes"] = row["rise_bytes"] - rows[next(iter(CASES))]["rise_bytes"]
                print(f"{case}: peak rose {row['rise_over_forward_only_bytes'] / 2**20:.1f} MiB above the forward "
                      f"alone's; the dry run counts {row['estimate_captured_bytes'] / 2**20:.1f} MiB of captured "
                      "hidden states", flush=True)
            else:
                print(f"{case}: peak rose {row['rise_bytes'] / 2**20:.1f} MiB", flush=True)
    forward, during, after = (rows[c]["rise_bytes"] for c in CASES)
    one_address = args.batch * args.tokens * args.width * 4
    n_addresses = rows[list(CASES)[1]]["addresses"]
    saved = after - during
    saved_est = rows[list(CASES)[2]]["estimate_captured_bytes"] - rows[list(CASES)[1]]["estimate_captured_bytes"]
    print(f"feeding during the pass saved {saved / 2**20:.1f} MiB of peak; the dry run's difference is "
          f"{saved_est / 2**20:.1f} MiB (ratio {saved / saved_est:.2f}); one address's float32 batch is "
          f"{one_address / 2**20:.1f} MiB, every address's ({n_addresses}) {one_address * n_addresses / 2**20:.1f} MiB")
    doc = {"benchmark": "bench_capture_memory", "machine": {"platform": platform.platform(),
                                                             "python": platform.python_version()},
           "model": {"width": args.width, "blocks": args.blocks, "dtype": "bfloat16"}, "texts": args.texts,
           "batch": args.batch, "tokens": args.tokens, "metrics": METRICS, "metric_params": PARAMS,
           "one_address_float32_bytes": one_address, "runs": rows,
           "peak_saved_bytes": saved, "estimate_saved_bytes": saved_est,
           "saved_over_estimate": round(saved / saved_est, 3),
           "method": "rise of peak RSS during measure (model loaded before, VmHWM reset), fresh process per case; "
                     "what feeding during the pass saves is the after-the-pass rise minus the during-the-pass rise"}
    if args.write:
        out = HERE / "results" / "bench_capture_memory.json"
        out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
