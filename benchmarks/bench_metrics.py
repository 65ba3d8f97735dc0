"""Benchmark: what every metric costs, as a fraction of the forward pass that feeds it.

Question: every metric at every ``resid_post`` layer of SmolLM2-135M (30 blocks, D = 576) over 1,000 texts, metric
time / forward time; and the eigen-based metrics on a synthetic D = 4096 case. Done literally that is hours on 2 CPU
cores (LiDAR alone adds 16 augmented forward passes per text), so the two costs are measured apart and scaled:

(1) Forward. A sample of ``python_doc_paragraphs`` (default 48 texts; pydoc_data has only 718 paragraphs, so 1,000
    distinct texts do not exist here), max_length 128, batch 8, tokenized once outside the timings as ``measure()``
    batches them. One pass = ``Capture`` at all ``resid_post:*`` addresses with early stop, ``cap.run`` timed per
    batch: what ``measure()`` counts in ``timings['forward_s']``. Median of ``--repeats`` passes, per text, times
    1,000 (EXTRAPOLATED). The multi-view metrics need forward passes of augmented texts besides the originals:
    view 0 of every sample text (``Augmenter``, seed 0) is timed the same way, interleaved with the originals;
    q views cost q x that. Reported on its own: it is forward cost, not metric cost.
(2) Metrics. The sample's hidden states are captured once and kept per layer (float64, pads zeroed, ``mean`` and
    ``last`` pooled beforehand: pooling is pipeline work, see bench_capture.py). Per layer, a fresh instance of each
    metric (default parameters, default pooling) gets ``update`` on ceil(1000 / 8) batches cycling through the
    sample's batches, then ``compute()``; both are timed per call and summed over the 30 layers (~3,750 update
    calls per metric: one run, no repeats). Repeated texts get Gaussian noise on their pooled vectors (5 % of each
    dimension's spread over the sample) so the Grams are not rank-deficient; the token metrics work text by text,
    so their token tensors are reused as they are. Views [B, 16, D] are the real mean-pooled vector plus noise
    (30 % of that spread) per view; infonce and dime get the first 2, as in ``measure()``.
(3) D = 4096. The eigen-based metrics on random Gaussian data, N = 1,000 texts (64 tokens each for prompt_entropy),
    one layer, then x 32 layers. A metric's updates stop once they pass ``--budget-4096`` s and are extrapolated
    linearly (marked ``~``). A 7B-class forward (32 blocks, D = 4096, 6.5e9 non-embedding parameters) cannot run
    here: it is ESTIMATED as 2 * 6.5e9 * tokens FLOP at the float32 GEMM rate measured on this machine, a lower
    bound on the real forward time, so those fractions are upper bounds.

    .venv/bin/python benchmarks/bench_metrics.py             # SmolLM2-135M, about 5 to 10 minutes on 2 cores
    .venv/bin/python benchmarks/bench_metrics.py --quick     # smaller everything, about a minute
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

from repgeom_eval.addresses import parse_layers, resolve  # noqa: E402
from repgeom_eval.augment import Augmenter  # noqa: E402
from repgeom_eval.capture import Capture  # noqa: E402
from repgeom_eval.demo import python_doc_paragraphs, smollm2_path  # noqa: E402
from repgeom_eval.errors import RepgeomError  # noqa: E402
from repgeom_eval.metric import Consumes, LayerBatch  # noqa: E402
from repgeom_eval.models import load_model  # noqa: E402
from repgeom_eval.pipeline import _context_length  # noqa: E402  (private: the same context as measure())
from repgeom_eval.plugin_host import get_host  # noqa: E402
from repgeom_eval.pooling import pool  # noqa: E402
from repgeom_eval.testing import make_tiny_model  # noqa: E402

ALL = ("dispersion", "token_dispersion", "massive_activations", "curvature", "condensation", "prompt_entropy",
       "dataset_entropy", "effective_rank", "vendi", "infonce", "dime", "lidar")
EIGEN = ("prompt_entropy", "dataset_entropy", "effective_rank", "vendi", "infonce", "dime", "lidar")
PARAMS_7B, LAYERS_7B = 6.5e9, 32
F64 = torch.float64


def load(tiny: bool, tmpdir: str):
    if not tiny:
        try:
            t0 = time.perf_counter()
            loaded = load_model(str(smollm2_path()))
            print(f"model: SmolLM2-135M-Instruct (GGUF), loaded in {time.perf_counter() - t0:.0f} s")
            return loaded
        except RepgeomError as exc:
            print(f"SmolLM2-135M not available ({exc}); FALLING BACK to a tiny random llama")
    print("model: tiny random llama, 4 blocks, width 64 (repgeom_eval.testing.make_tiny_model)")
    return load_model(str(make_tiny_model("llama", tmpdir, n_layers=4, width=64)))


def encode(loaded, texts, batch_size, context):
    """Tokenize once, the way measure() does: longest first, right padding, truncation, position_ids."""
    tok = loaded.tokenizer
    tok.padding_side = "right"
    lengths = [len(x) for x in tok(texts, verbose=False)["input_ids"]]
    order = sorted(range(len(texts)), key=lambda i: -lengths[i])
    batches = []
    for start in range(0, len(order), batch_size):
        enc = dict(tok([texts[i] for i in order[start:start + batch_size]], padding=True, truncation=True,
                       max_length=context, return_tensors="pt", verbose=False))
        if loaded.spec.position_ids_from_mask:
            enc["position_ids"] = (enc["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)
        batches.append(enc)
    return batches


def forward_pass(loaded, points, batches, keep=None) -> float:
    """Seconds of one pass (``cap.run`` per batch, as measure()); with ``keep``, store each layer's batches."""
    total = 0.0
    with Capture(loaded.model, points, stop_early=True) as cap:
        for enc in batches:
            t0 = time.perf_counter()
            captured = cap.run(**enc, use_cache=False)
            total += time.perf_counter() - t0
            for addr, h in captured.items() if keep is not None else ():
                mask = enc["attention_mask"].bool()
                h = h.double().masked_fill(~mask.unsqueeze(-1), 0.0)
                keep.setdefault(addr, []).append({"hidden": h, "mask": mask, "mean": pool(h, mask, "mean")[0],
                                                  "last": pool(h, mask, "last")[0]})
    return total


def layer_batch(metric, index, hidden, mask, pooled, views) -> LayerBatch:
    """What the pipeline hands this metric: token tensors, its default pooling, or its first n_views views."""
    if metric.consumes == Consumes.TOKENS:
        return LayerBatch("bench", index, hidden=hidden, mask=mask)
    if metric.consumes == Consumes.VIEWS:
        return LayerBatch("bench", index, views=views[:, : metric.n_views])
    return LayerBatch("bench", index, pooled=pooled[metric.default_pooling])


def time_layers(classes, layers, n_texts, batch_size, gen):
    """{metric: [update s, compute s]} summed over ``layers`` (each: the kept sample batches of one address)."""
    out = {name: [0.0, 0.0] for name in classes}
    for kept in layers:
        spread = {p: torch.cat([b[p] for b in kept]).std(0) for p in ("mean", "last")}
        metrics = {name: cls() for name, cls in classes.items()}
        done, step = 0, 0
        while done < n_texts:
            src = kept[step % len(kept)]
            k = min(src["mask"].shape[0], n_texts - done)
            pooled = {p: src[p][:k] + 0.05 * spread[p] * torch.randn(k, spread[p].numel(), generator=gen, dtype=F64)
                      for p in spread}
            views = src["mean"][:k, None] + 0.3 * spread["mean"] * torch.randn(k, 16, spread["mean"].numel(),
                                                                                generator=gen, dtype=F64)
            index = torch.arange(done, done + k)
            for name, m in metrics.items():
                b = layer_batch(m, index, src["hidden"][:k], src["mask"][:k], pooled, views)
                t0 = time.perf_counter()
                m.update(b)
                out[name][0] += time.perf_counter() - t0
            done, step = done + k, step + 1
        for name, m in metrics.items():
            t0 = time.perf_counter()
            m.compute()
            out[name][1] += time.perf_counter() - t0
    return out


def time_synthetic(classes, n, d, n_tokens, batch_size, budget, gen):
    """{metric: (update s, compute s, partial)} for ONE layer of random data at width ``d``."""
    out = {}
    for name, cls in classes.items():
        m, upd, done = cls(), 0.0, 0
        while done < n and not (done and upd > budget):
            k = min(batch_size, n - done)
            kind = cls.consumes
            hidden = torch.randn(k, n_tokens, d, generator=gen, dtype=F64) if kind == Consumes.TOKENS else None
            mask = torch.ones(k, n_tokens, dtype=torch.bool)
            base = torch.randn(k, d, generator=gen, dtype=F64)
            views = (base[:, None] + 0.3 * torch.randn(k, m.n_views, d, generator=gen, dtype=F64)
                     if kind == Consumes.VIEWS else None)
            b = layer_batch(m, torch.arange(done, done + k), hidden, mask, {"mean": base, "last": base}, views)
            t0 = time.perf_counter()
            m.update(b)
            upd += time.perf_counter() - t0
            done += k
        t0 = time.perf_counter()
        m.compute()
        out[name] = (upd * n / done, time.perf_counter() - t0, done < n)
        print(f"  D={d} {name}: update {out[name][0]:.2f} s{' (extrapolated)' if done < n else ''}, "
              f"compute {out[name][1]:.2f} s", flush=True)
    return out


def gemm_rate(d: int, rows: int = 512) -> float:
    """float32 FLOP/s of a [rows, d] x [d, d] matmul, the bulk of a transformer forward (median of 3)."""
    a, w = torch.randn(rows, d), torch.randn(d, d)
    a @ w
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        a @ w
        times.append(time.perf_counter() - t0)
    return 2 * rows * d * d / statistics.median(times)


def main() -> None:
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes everywhere (about a minute)")
    ap.add_argument("--tiny", action="store_true", help="use the tiny random model instead of SmolLM2-135M")
    ap.add_argument("--n-texts", type=int, default=None, help="texts the costs are reported for (default 1000)")
    ap.add_argument("--sample", type=int, default=None, help="texts actually run through the model (default 48)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=None, help="default 128")
    ap.add_argument("--repeats", type=int, default=None, help="forward passes timed (default 3)")
    ap.add_argument("--skip-4096", action="store_true", help="skip part (3), the synthetic D = 4096 case")
    ap.add_argument("--budget-4096", type=float, default=60.0, help="update seconds per metric before extrapolating")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    q = args.quick
    n_texts = args.n_texts or (200 if q else 1000)
    n_sample, max_length = args.sample or (16 if q else 48), args.max_length or (64 if q else 128)
    repeats = args.repeats or (1 if q else 3)
    d_syn, n_syn, tok_syn = (1024, 200, 32) if q else (4096, n_texts, 64)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*exceeds the model context.*")
    gen = torch.Generator().manual_seed(0)
    host = get_host()
    classes = {name: host.metrics.get(name) for name in ALL}

    with tempfile.TemporaryDirectory() as tmpdir:
        loaded = load(args.tiny, tmpdir)
        n_layers = loaded.info.n_layers
        points = resolve(parse_layers("resid_post:*", n_layers), loaded)
        context = _context_length(loaded, max_length)
        texts = python_doc_paragraphs(n_sample)
        augmenter = Augmenter(seed=0)
        views = [augmenter.view(t, i, 0) for i, t in enumerate(texts)]
        orig_b, view_b = encode(loaded, texts, args.batch_size, context), encode(loaded, views, args.batch_size, context)
        n_tok = sum(int(e["attention_mask"].sum()) for e in orig_b)
        print(f"sample: {n_sample} texts, {n_tok} tokens (context {context}), batch {args.batch_size}, "
              f"{len(points)} addresses resid_post:0..{n_layers - 1}, torch threads {args.threads}", flush=True)
        forward_pass(loaded, points, orig_b[:1])  # warm-up
        keep: dict = {}
        t_orig, t_view = [], []
        for r in range(repeats):  # originals and views alternate, so load from other processes falls on both
            t_orig.append(forward_pass(loaded, points, orig_b, keep if r == 0 else None))
            t_view.append(forward_pass(loaded, points, view_b))
        width = keep[next(iter(keep))][0]["mean"].shape[-1]
    fwd = statistics.median(t_orig) / n_sample * n_texts
    view_ratio = statistics.median(v / o for v, o in zip(t_view, t_orig))
    print(f"forward, {repeats} passes over the sample: median {statistics.median(t_orig):.2f} s "
          f"(min {min(t_orig):.2f}), views/originals {view_ratio:.3f}; timing the metrics ...", flush=True)

    costs = time_layers(classes, list(keep.values()), n_texts, args.batch_size, gen)
    del keep

    syn = {}
    if not args.skip_4096:
        print(f"synthetic D = {d_syn}, N = {n_syn} ({tok_syn} tokens per text), one layer:", flush=True)
        syn = time_synthetic({n: classes[n] for n in EIGEN}, n_syn, d_syn, tok_syn, args.batch_size,
                             args.budget_4096, gen)
        rate = gemm_rate(d_syn)
        fwd_syn = 2 * PARAMS_7B * n_syn * tok_syn / rate

    # -- tables ------------------------------------------------------------------------------------------------------
    print(f"\n(1) forward, Capture at {n_layers} resid_post layers + early stop: {fwd / n_texts * 1e3:.1f} ms/text "
          f"(median of {repeats} passes over {n_sample} texts) -> {n_texts} texts: {fwd:.1f} s (EXTRAPOLATED)")
    print(f"    augmented views: {view_ratio:.3f} x the forward of an original; extra forward for {n_texts} texts: "
          f"2 views (infonce, dime) {2 * view_ratio * fwd:.1f} s, 16 views (lidar) {16 * view_ratio * fwd:.1f} s "
          "(one measure() call runs max(n_views) views for all of them)")
    print(f"\n(2) metric cost, {n_layers} layers x {n_texts} texts (D = {width}; sample batches tiled), seconds; "
          f"'/ fwd' = total / forward of {n_texts} texts ({fwd:.1f} s)")
    head = f"{'metric':<20} | {'consumes':<8} | {'update':>8} | {'compute':>8} | {'total':>8} | {'/ fwd':>7} | note"
    print(head + "\n" + "-" * (len(head) + 12))
    for name, (u, c) in costs.items():
        flag = "ABOVE 10 %" if u + c > 0.1 * fwd else ""
        print(f"{name:<20} | {classes[name].consumes.value:<8} | {u:>8.2f} | {c:>8.2f} | {u + c:>8.2f} | "
              f"{(u + c) / fwd:>7.1%} | {flag}")
    total = sum(u + c for u, c in costs.values())
    print(f"{'all ' + str(len(costs)) + ' metrics':<20} | {'':<8} | {sum(u for u, _ in costs.values()):>8.2f} | "
          f"{sum(c for _, c in costs.values()):>8.2f} | {total:>8.2f} | {total / fwd:>7.1%} |")
    if syn:
        print(f"\n(3) synthetic D = {d_syn}, N = {n_syn}, {tok_syn} tokens/text, seconds; forward ESTIMATED for a "
              f"7B-class model ({LAYERS_7B} blocks, {PARAMS_7B:.1e} params) at the measured float32 GEMM rate "
              f"{rate / 1e9:.0f} GFLOP/s: {fwd_syn:.0f} s for {n_syn} texts (a lower bound: fractions are upper bounds)")
        head = (f"{'metric':<16} | {'update':>8} | {'compute':>8} | {'per layer':>9} | {'x ' + str(LAYERS_7B) + ' layers':>11}"
                f" | {'/ est. fwd':>10} | note")
        print(head + "\n" + "-" * (len(head) + 12))
        for name, (u, c, partial) in syn.items():
            mark = "~" if partial else " "
            per = u + c
            note = ("updates extrapolated; " if partial else "") + ("ABOVE 10 %" if per * LAYERS_7B > 0.1 * fwd_syn
                                                                   else "")
            print(f"{name:<16} | {mark}{u:>7.2f} | {c:>8.2f} | {mark}{per:>8.2f} | {mark}{per * LAYERS_7B:>10.1f} | "
                  f"{per * LAYERS_7B / fwd_syn:>10.1%} | {note}")
    busy = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\ntotal benchmark runtime: {time.perf_counter() - t_start:.0f} s; load average at the end {busy} "
          f"(on {os.cpu_count()} cores: above that, other processes slowed these timings)")


if __name__ == "__main__":
    main()
