"""Benchmark: what every metric costs, as a fraction of the forward pass that feeds it.

Question: every metric at every ``resid_post`` layer of SmolLM2-135M (30 blocks, D = 576) over 1,000 texts, metric
time / forward time, and the eigen-based metrics at D = 4096. Done literally that is hours on 2 CPU cores (LiDAR
alone adds 16 augmented forward passes per text), so the two costs are measured apart and scaled:

(1) Forward. A sample of ``python_doc_paragraphs`` (default 32; pydoc_data has only 718 paragraphs), max_length 128,
    batch 8, tokenized once as ``measure()`` does. One pass = ``Capture`` at every ``resid_post`` address with early
    stop, ``cap.run`` timed per batch (``measure()``'s ``forward_s``). ``--repeats`` passes (before, half-way
    through and after the metric loop), median, per text, x 1,000: EXTRAPOLATED. View 0 of each text
    (``Augmenter``, seed 0) is timed after each pass; q views per text cost q x that: forward cost, shown apart.
(2) Metrics. The sample's hidden states are captured once and kept per layer (float64, pads zeroed, ``mean``/``last``
    pooled beforehand: pooling is pipeline work, see bench_capture.py). Per layer, a fresh instance of each metric
    (defaults) gets ``update`` on batches of 8 cycling through the sample, then ``compute()``; every call is timed.
    Pooled and view metrics see all 1,000 texts (their compute grows with N: dime ~N^3). Token metrics fold text by
    text into a few sums, so their cost is linear in N: they see ``--token-texts`` (240) and are scaled (``~``).
    Repeats get Gaussian noise on their pooled vectors (5 % of each dimension's spread) so Grams keep full rank;
    views [B, 16, D] are the real mean-pooled vector + 30 % noise; infonce/dime take the first 2, as ``measure()``.
    Reported: sums over layers, and layers x the median layer (robust to load from other processes), used for the
    ratio. One run, no repeats: each sum has ~3,750 update calls.
(3) D = 4096. The eigen-based metrics on random Gaussian data, N = 1,000 (64 tokens per text for prompt_entropy),
    one layer, x 32 layers. Updates stop after ``--budget-4096`` s and are extrapolated (``~``). A 7B-class forward
    (32 blocks, 6.5e9 non-embedding parameters) cannot run here: it is ESTIMATED as 2 * 6.5e9 * tokens FLOP at the
    float32 GEMM rate measured here, a lower bound on its time, so those ratios are upper bounds.

    .venv/bin/python benchmarks/bench_metrics.py             # SmolLM2-135M, 5 to 10 minutes on 2 cores
    .venv/bin/python benchmarks/bench_metrics.py --quick     # 100 texts, D = 1024: ~1 min, most of it loading
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

from repgeom_eval.modeling.addresses import parse_layers, resolve  # noqa: E402
from repgeom_eval.measurement.augment import Augmenter  # noqa: E402
from repgeom_eval.modeling.hooks import Capture  # noqa: E402
from repgeom_eval.testing.demo import python_doc_paragraphs, smollm2_path  # noqa: E402
from repgeom_eval.spec.errors import RepgeomError  # noqa: E402
from repgeom_eval.spec.metric import Consumes, LayerBatch  # noqa: E402
from repgeom_eval.modeling.loading import load_model  # noqa: E402
from repgeom_eval.measurement.forward import context_length  # noqa: E402  (the same context as measure())
from repgeom_eval.plugin_system.host import get_host  # noqa: E402
from repgeom_eval.measurement.pooling import pool  # noqa: E402
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
        if loaded.layout.position_ids:
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


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def layer_batch(metric, index, hidden, mask, pooled, views) -> LayerBatch:
    """What the pipeline hands this metric: token tensors, its default pooling, or its first n_views views."""
    if metric.consumes == Consumes.TOKENS:
        return LayerBatch("bench", index, hidden=hidden, mask=mask)
    if metric.consumes == Consumes.VIEWS:
        return LayerBatch("bench", index, views=views[:, : metric.n_views])
    return LayerBatch("bench", index, pooled=pooled[metric.default_pooling])


def time_layers(classes, layers, n_texts, token_texts, batch_size, gen, after_layer):
    """{metric: [(update s, compute s) per layer]}; ``layers``: per address, the kept sample batches."""
    out: dict = {name: [] for name in classes}
    for i, kept in enumerate(layers):
        spread = {p: torch.cat([b[p] for b in kept]).std(0) for p in ("mean", "last")}
        metrics = {name: cls() for name, cls in classes.items()}
        upd = dict.fromkeys(classes, 0.0)
        done, step = 0, 0
        while done < n_texts:
            src = kept[step % len(kept)]
            k = min(src["mask"].shape[0], n_texts - done)
            pooled = {p: src[p][:k] + 0.05 * s * torch.randn(k, s.numel(), generator=gen, dtype=F64)
                      for p, s in spread.items()}
            s = spread["mean"]
            views = src["mean"][:k, None] + 0.3 * s * torch.randn(k, 16, s.numel(), generator=gen, dtype=F64)
            for name, m in metrics.items():
                if m.consumes == Consumes.TOKENS and done >= token_texts:
                    continue
                b = layer_batch(m, torch.arange(done, done + k), src["hidden"][:k], src["mask"][:k], pooled, views)
                upd[name] += timed(m.update, b)
            done, step = done + k, step + 1
        for name, m in metrics.items():
            scale = n_texts / min(token_texts, n_texts) if m.consumes == Consumes.TOKENS else 1.0  # linear in N
            out[name].append((upd[name] * scale, timed(m.compute)))
        after_layer(i)
    return out


def time_synthetic(classes, n, d, n_tokens, batch_size, budget, gen):
    """{metric: (update s, compute s, extrapolated)} for ONE layer of random data at width ``d``."""
    out = {}
    for name, cls in classes.items():
        m, upd, done = cls(), 0.0, 0
        while done < n and not (done and upd > budget):
            k = min(batch_size, n - done)
            hidden = torch.randn(k, n_tokens, d, generator=gen, dtype=F64) if cls.consumes == Consumes.TOKENS else None
            base = torch.randn(k, d, generator=gen, dtype=F64)
            views = (base[:, None] + 0.3 * torch.randn(k, m.n_views, d, generator=gen, dtype=F64)
                     if cls.consumes == Consumes.VIEWS else None)
            b = layer_batch(m, torch.arange(done, done + k), hidden, torch.ones(k, n_tokens, dtype=torch.bool),
                            {"mean": base, "last": base}, views)
            upd += timed(m.update, b)
            done += k
        out[name] = (upd * n / done, timed(m.compute), done < n)
        print(f"  D = {d} {name}: update {out[name][0]:.2f} s{' (extrapolated)' * (done < n)}, "
              f"compute {out[name][1]:.2f} s", flush=True)
    return out


def gemm_rate(d: int, rows: int = 512) -> float:
    """float32 FLOP/s of a [rows, d] x [d, d] matmul, the bulk of a transformer forward (median of 3)."""
    a, w = torch.randn(rows, d), torch.randn(d, d)
    times = [timed(torch.matmul, a, w) for _ in range(4)]  # the first is a warm-up
    return 2 * rows * d * d / statistics.median(times[1:])


def main() -> None:
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="100 texts, 16 in the sample, D = 1024 in part (3)")
    ap.add_argument("--tiny", action="store_true", help="use the tiny random model instead of SmolLM2-135M")
    ap.add_argument("--n-texts", type=int, help="texts the costs are reported for (default 1000)")
    ap.add_argument("--token-texts", type=int, help="texts the token metrics really see per layer (default 240)")
    ap.add_argument("--sample", type=int, help="texts really run through the model (default 32)")
    ap.add_argument("--max-length", type=int, help="default 128")
    ap.add_argument("--repeats", type=int, help="forward passes timed (default 3)")
    ap.add_argument("--skip-4096", action="store_true", help="skip part (3), the synthetic D = 4096 case")
    ap.add_argument("--budget-4096", type=float, default=60.0, help="update seconds per metric, then extrapolate")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    q = args.quick
    n_texts, token_texts = args.n_texts or (100 if q else 1000), args.token_texts or (32 if q else 240)
    n_sample, max_length = args.sample or (16 if q else 32), args.max_length or (64 if q else 128)
    repeats, batch_size = args.repeats or (1 if q else 3), 8
    d_syn, n_syn, tok_syn = (1024, n_texts, 32) if q else (4096, n_texts, 64)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*exceeds the model context.*")
    gen = torch.Generator().manual_seed(0)
    classes = {name: get_host().metrics.get(name) for name in ALL}

    with tempfile.TemporaryDirectory() as tmpdir:
        loaded = load(args.tiny, tmpdir)
        n_layers = loaded.info.n_layers
        points = resolve(parse_layers("resid_post:*", n_layers), loaded)
        context = context_length(loaded, max_length)
        texts = python_doc_paragraphs(n_sample)
        views = [Augmenter(seed=0).view(t, i, 0) for i, t in enumerate(texts)]
        orig_b, view_b = encode(loaded, texts, batch_size, context), encode(loaded, views, batch_size, context)
        n_tok = sum(int(e["attention_mask"].sum()) for e in orig_b)
        print(f"sample: {n_sample} texts, {n_tok} tokens (context {context}), batch {batch_size}, {len(points)} "
              f"addresses resid_post:0..{n_layers - 1}, torch threads {args.threads}", flush=True)
        forward_pass(loaded, points, orig_b[:1])  # warm-up
        keep: dict = {}
        t_orig, t_view = [], []

        def forward_round(layer: int | None = None) -> None:
            t_orig.append(forward_pass(loaded, points, orig_b, keep if not t_orig else None))
            t_view.append(forward_pass(loaded, points, view_b))
            where = "before the metrics" if layer is None else f"after layer {layer + 1}/{n_layers}"
            print(f"forward pass {len(t_orig)}/{repeats} ({where}): originals {t_orig[-1]:.2f} s, "
                  f"views {t_view[-1]:.2f} s, elapsed {time.perf_counter() - t_start:.0f} s", flush=True)

        forward_round()
        marks = {round(r * n_layers / (repeats - 1)) - 1 for r in range(1, repeats)} if repeats > 1 else set()
        width = next(iter(keep.values()))[0]["mean"].shape[-1]
        costs = time_layers(classes, list(keep.values()), n_texts, token_texts, batch_size, gen,
                            lambda i: forward_round(i) if i in marks else None)
    keep.clear()  # free the kept hidden states before part (3)
    fwd = statistics.median(t_orig) / n_sample * n_texts
    view_ratio = statistics.median(v / o for v, o in zip(t_view, t_orig))

    syn = {}
    if not args.skip_4096:
        print(f"synthetic D = {d_syn}, N = {n_syn} ({tok_syn} tokens per text), one layer:", flush=True)
        syn = time_synthetic({n: classes[n] for n in EIGEN}, n_syn, d_syn, tok_syn, batch_size, args.budget_4096, gen)
        rate = gemm_rate(d_syn)
        fwd_syn = 2 * PARAMS_7B * n_syn * tok_syn / rate

    # -- tables ------------------------------------------------------------------------------------------------------
    print(f"\n(1) forward, Capture at {n_layers} resid_post layers + early stop: {fwd / n_texts * 1e3:.0f} ms/text "
          f"(median of {repeats} passes over {n_sample} texts: {', '.join(f'{t:.3g}' for t in t_orig)} s) -> "
          f"{n_texts} texts: {fwd:.4g} s (EXTRAPOLATED)")
    print(f"    augmented views: {view_ratio:.2f} x the forward of an original; extra forward for {n_texts} texts: "
          f"2 views (infonce, dime) {2 * view_ratio * fwd:.4g} s, 16 views (lidar) {16 * view_ratio * fwd:.4g} s")
    print(f"\n(2) metric cost, {n_layers} layers x {n_texts} texts, D = {width}, seconds summed over the layers; "
          f"'{n_layers} x med' = {n_layers} x the median layer (robust to a busy machine); '/ fwd' = that / forward "
          f"of {n_texts} texts ({fwd:.4g} s); ~ = token metric, update scaled from {min(token_texts, n_texts)} texts")
    head = (f"{'metric':<20} | {'consumes':<8} | {'update':>8} | {'compute':>8} | {'total':>8} | "
            f"{f'{n_layers} x med':>9} | {'/ fwd':>7} | note")
    print(head + "\n" + "-" * (len(head) + 8))
    rows = {name: ([u for u, _ in v], [c for _, c in v]) for name, v in costs.items()}
    rows["all 12 metrics"] = tuple([sum(x) for x in zip(*(r[j] for r in rows.values()))] for j in (0, 1))
    for name, (u, c) in rows.items():
        m = "~" if name in classes and classes[name].consumes == Consumes.TOKENS else " "
        robust = n_layers * statistics.median(a + b for a, b in zip(u, c))
        print(f"{name:<20} | {classes[name].consumes.value if name in classes else '':<8} | {m}{sum(u):>7.2f} | "
              f"{sum(c):>8.2f} | {m}{sum(u) + sum(c):>7.2f} | {m}{robust:>8.2f} | {robust / fwd:>7.1%} | "
              f"{'ABOVE 10 %' if robust > 0.1 * fwd and name in classes else ''}")
    if syn:
        print(f"\n(3) synthetic D = {d_syn}, N = {n_syn}, {tok_syn} tokens/text, seconds; forward ESTIMATED for a "
              f"7B-class model ({LAYERS_7B} blocks, {PARAMS_7B:.2g} params) at the float32 GEMM rate measured here, "
              f"{rate / 1e9:.0f} GFLOP/s: {fwd_syn:.0f} s for {n_syn} texts (a lower bound: '/ fwd' is an upper bound)")
        head = (f"{'metric':<16} | {'update':>8} | {'compute':>8} | {'per layer':>9} | {f'x {LAYERS_7B} layers':>11} | "
                f"{'/ fwd':>7} | note")
        print(head + "\n" + "-" * (len(head) + 8))
        for name, (u, c, partial) in syn.items():
            m, per = "~" if partial else " ", u + c
            note = "updates extrapolated " * partial + "ABOVE 10 %" * (per * LAYERS_7B > 0.1 * fwd_syn)
            print(f"{name:<16} | {m}{u:>7.2f} | {c:>8.2f} | {m}{per:>8.2f} | {m}{per * LAYERS_7B:>10.1f} | "
                  f"{per * LAYERS_7B / fwd_syn:>7.1%} | {note}")
    busy = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\ntotal runtime {time.perf_counter() - t_start:.0f} s; load average at the end {busy} on "
          f"{os.cpu_count()} cores (above about {args.threads}: other processes slowed these timings)")


if __name__ == "__main__":
    main()
