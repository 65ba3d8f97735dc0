"""Benchmark: repgeom-eval at the shapes people measure (Llama-3-8B, D = 4096; a 70B-class width, D = 8192).

The models are random-init, built from the real configs' widths (hidden size, feed-forward size, heads, key-value
heads) with only ``--blocks`` blocks and a small vocabulary (the byte-level tokenizer of
``repgeom_eval.testing.make_tokenizer``), so they fit a CPU; the costs this script reports are per block and per
address, then extrapolated to the full depth (32 and 80 blocks), and it says so in its output. Per shape:

* **forward**: a forward-only loop over the same batches (``output_hidden_states=True``, no metric), the bar;
* **measure**: ``repgeom_eval.measure`` with ``--layers all``, once with ``dispersion`` alone and once with the
  layer-wise suite (prompt_entropy, dataset_entropy, effective_rank, curvature, vendi); its own
  ``timings.metrics_s / timings.forward_s``, the measured ratio at ``--blocks`` blocks and the ratio extrapolated
  to the full depth (metric time per address × (L + 1) ÷ (forward time per block × L)); and the added time,
  (``forward_s + metrics_s`` − the forward-only loop) ÷ the forward-only loop, the figure that holds on a GPU, where
  the work is queued without waiting and the host's two timers split the device's time arbitrarily;
* **state memory**: ``measure --dry-run``'s estimate at the full depth (from a config of the full depth: no weights
  read) and the run's own ``state_bytes`` at ``--blocks`` blocks;
* **load** (``--load``, first shape only): ``load_model`` (read, weights check, load check) against a plain
  ``from_pretrained`` of the same saved model.

Per context length (``--contexts``, first shape): the layer-wise suite's cost against the forward, and where
prompt_entropy's per-text eigendecomposition (min(T, D)³) makes it grow; then the same suite with prompt_entropy at
alpha 2, which reads two traces of each text's Gram instead of its spectrum.

    .venv/bin/python benchmarks/bench_scale.py --write                  # 8B and 70B widths, results JSON
    .venv/bin/python benchmarks/bench_scale.py --quick                  # seconds: small widths, checks the script
    python benchmarks/bench_scale.py --device cuda --dtype bfloat16 --blocks 32 --shapes 8b   # on a GPU

Results go to benchmarks/results/bench_scale.json with the machine named (``--write``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

SHAPES = {  # real widths; depth and vocabulary are set by the script
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
               full_depth=32, name="Llama-3-8B width"),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                full_depth=80, name="70B-class width (Llama-3-70B)"),
    "quick": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                  full_depth=4, name="small (script check)"),
}
DISPERSION = ["dispersion"]
LAYERWISE = ["prompt_entropy", "dataset_entropy", "effective_rank", "curvature", "vendi"]


def machine() -> dict:
    import torch

    out = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
           "cpus": os.cpu_count(), "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def texts_of(n: int, tokens: int, tokenizer) -> list[str]:
    """``n`` texts of real prose (Python's own documentation), each at least ``tokens`` tokens long."""
    from repgeom_eval.testing.demo import python_doc_paragraphs

    paragraphs = python_doc_paragraphs(4 * n + 8)
    out, i = [], 0
    while len(out) < n:
        text = ""
        while len(tokenizer(text)["input_ids"]) < tokens:
            text += " " + paragraphs[i % len(paragraphs)]
            i += 1
        out.append(text.strip())
    return out


def build(shape: str, blocks: int, dtype, device, vocab: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = {k: v for k, v in SHAPES[shape].items() if k not in ("full_depth", "name")}
    config = LlamaConfig(**spec, num_hidden_layers=blocks, vocab_size=vocab, max_position_embeddings=8192,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval().requires_grad_(False), config


def forward_only(model, tokenizer, texts: list[str], batch: int, tokens: int, device) -> float:
    """Seconds of the bar: tokenize, one forward per batch with every hidden state, nothing else."""
    import torch

    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(texts), batch):
            enc = tokenizer(texts[i:i + batch], return_tensors="pt", padding=True, truncation=True,
                            max_length=tokens).to(device)
            out = model.model(**enc, output_hidden_states=True)
            _ = [h.sum() for h in out.hidden_states]
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def run_measure(model, tokenizer, texts, metrics, batch, tokens, device, metric_params=None, keep=None) -> dict:
    """The run's timings and memory; ``keep``, a list, receives the MeasureResult too."""
    import torch

    import repgeom_eval as rg

    if str(device).startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = rg.measure(model, texts, tokenizer=tokenizer, layers="all", metrics=metrics, batch_size=batch,
                            max_length=tokens, progress=False, pooling="mean", metric_params=metric_params or {})
    t = result.timings
    if keep is not None:
        keep.append(result)
    # forward_s + metrics_s: the hot loop from the first batch to the computed results, which read every state back,
    # so on a GPU it has waited for all the queued work; the split between the two is the host's, not the device's
    return {"forward_s": t["forward_s"], "metrics_s": t["metrics_s"], "total_s": t["total_s"],
            "loop_s": t["forward_s"] + t["metrics_s"],
            # on one GPU, the device's own split of the same loop (CUDA events; measurement/device_timer.py)
            "forward_device_s": t.get("forward_device_s"), "metrics_device_s": t.get("metrics_device_s"),
            "state_bytes": t["state_bytes"], "peak_rss_bytes": t["peak_rss_bytes"],
            "cuda_max_memory_allocated_bytes": t.get("cuda_max_memory_allocated_bytes"),
            "n_addresses": len(result.results)}


def dry_run_bytes(shape: str, metrics: list[str], vocab: int, depth: int) -> dict:
    """``--dry-run``'s estimate for ``--layers all`` at the given depth, from a config alone."""
    from transformers import LlamaConfig

    from repgeom_eval.spec.options.measure import RunConfig
    from repgeom_eval.measurement.estimate import estimate

    spec = {k: v for k, v in SHAPES[shape].items() if k not in ("full_depth", "name")}
    with tempfile.TemporaryDirectory() as tmp:
        LlamaConfig(**spec, num_hidden_layers=depth, vocab_size=vocab).save_pretrained(tmp)
        est = estimate(tmp, RunConfig(layers="all", metrics=tuple(metrics), pooling="mean"))
    return {"state_bytes": est.state_bytes, "per_1000_texts_bytes": est.per_1000_texts_bytes,
            "per_address_state_bytes": est.state_bytes // est.n_addresses, "addresses": est.n_addresses,
            "one_gram_bytes": 8 * est.width ** 2, "notes": est.notes}


def per_shape(shape: str, args, tokenizer, device, dtype, extra=None) -> dict:
    """One shape's rows; ``extra(model, tokenizer, texts, bar, rows)``, when given, runs more measurements on the built
    model (the GPU check's routes and context lengths, saved as they finish) and may add to ``rows``."""
    import torch

    vocab = len(tokenizer) + 16
    t0 = time.perf_counter()
    model, _ = build(shape, args.blocks, dtype, device, vocab)
    build_s = time.perf_counter() - t0
    texts = texts_of(args.texts, args.tokens, tokenizer)
    bars = []
    if not args.load_only:
        forward_only(model, tokenizer, texts[: args.batch], args.batch, args.tokens, device)  # warm-up
        bars = [forward_only(model, tokenizer, texts, args.batch, args.tokens, device) for _ in range(args.repeats)]
    bar = statistics.median(bars) if bars else float("nan")
    if str(device).startswith("cuda") and not args.load_only:  # warm: cuBLAS/cuSOLVER handles, kernels, workspaces
        run_measure(model, tokenizer, texts[: args.batch], LAYERWISE, args.batch, args.tokens, device)
    full = SHAPES[shape]["full_depth"]
    suites = {}
    for suite, metrics in (("dispersion", DISPERSION), ("layerwise", LAYERWISE)) if not args.load_only else ():
        runs = [run_measure(model, tokenizer, texts, metrics, args.batch, args.tokens, device)
                for _ in range(args.repeats)]
        m = {k: statistics.median([r[k] for r in runs]) for k in ("forward_s", "metrics_s", "total_s", "loop_s")}
        if runs[0]["forward_device_s"] is not None:
            m |= {k: statistics.median([r[k] for r in runs]) for k in ("forward_device_s", "metrics_device_s")}
            m["metrics_over_forward_device"] = m["metrics_device_s"] / m["forward_device_s"]
        n_addr = runs[0]["n_addresses"]
        per_address = m["metrics_s"] / n_addr
        per_block = bar / args.blocks  # embedding and the small head are included: an upper bound per block
        suites[suite] = {
            "metrics": metrics, **m, "forward_only_s": bar,
            "metrics_over_forward": m["metrics_s"] / m["forward_s"],
            "measure_over_forward_only": m["total_s"] / bar,
            "added_over_forward_only": (m["loop_s"] - bar) / bar,
            "metrics_over_forward_extrapolated_full_depth": per_address * (full + 1) / (per_block * full),
            "state_bytes_run": runs[0]["state_bytes"], "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs),
            "cuda_max_memory_allocated_bytes": runs[0]["cuda_max_memory_allocated_bytes"],
            "dry_run_full_depth": dry_run_bytes(shape, metrics, vocab, full),
            "dry_run_measured_depth": dry_run_bytes(shape, metrics, vocab, args.blocks),
        }
        print(f"{shape} {suite}: metrics/forward {suites[suite]['metrics_over_forward']:.3f} (added time over the "
              f"forward-only loop {suites[suite]['added_over_forward_only']:.3f}) at {args.blocks} "
              f"block(s), {suites[suite]['metrics_over_forward_extrapolated_full_depth']:.3f} extrapolated to {full}; "
              f"state {runs[0]['state_bytes'] / 2**20:.1f} MiB run, dry run "
              f"{suites[suite]['dry_run_measured_depth']['state_bytes'] / 2**20:.1f} MiB", flush=True)
    out = {"shape": SHAPES[shape]["name"], **{k: v for k, v in SHAPES[shape].items() if k != "name"},
           "blocks_built": args.blocks, "vocab": vocab, "texts": args.texts, "tokens": args.tokens,
           "batch": args.batch, "build_s": build_s, "forward_only_s": bars, "suites": suites,
           "extrapolation": f"measured with {args.blocks} block(s); full-depth ratios scale the metric time per "
                            f"address to {full + 1} addresses and the forward per block to {full} blocks"}
    if args.contexts and shape == args.shapes[0]:
        out["contexts"] = contexts(model, tokenizer, args, device)
    if args.load and shape == args.shapes[0]:
        out["load"] = load_times(model, tokenizer, args)
    if extra is not None:
        extra(model, tokenizer, texts, bar, out)
    del model
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def device_ratio(run: dict) -> dict:
    """On one GPU, the metric updates' device time over the forward's (empty elsewhere)."""
    if run.get("forward_device_s") is None:
        return {}
    return {"metrics_over_forward_device": run["metrics_device_s"] / run["forward_device_s"]}


def contexts(model, tokenizer, args, device) -> list[dict]:
    rows = []
    for tokens in args.contexts:
        texts = texts_of(args.context_texts, tokens, tokenizer)
        bar = forward_only(model, tokenizer, texts, args.context_batch, tokens, device)
        run = run_measure(model, tokenizer, texts, LAYERWISE, args.context_batch, tokens, device)
        # the same suite with prompt_entropy at alpha 2, which reads two traces instead of a T×T spectrum
        alpha2 = run_measure(model, tokenizer, texts, LAYERWISE, args.context_batch, tokens, device,
                             metric_params={"prompt_entropy": {"alpha": 2.0}})
        rows.append({"tokens": tokens, "texts": len(texts), "forward_only_s": bar, **run,
                     "metrics_over_forward": run["metrics_s"] / run["forward_s"],
                     "measure_over_forward_only": run["total_s"] / bar,
                     "added_over_forward_only": (run["loop_s"] - bar) / bar,
                     **device_ratio(run),
                     "prompt_entropy_alpha2": {
                         "metrics_s": alpha2["metrics_s"], "forward_s": alpha2["forward_s"],
                         "metrics_over_forward": alpha2["metrics_s"] / alpha2["forward_s"],
                         "measure_over_forward_only": alpha2["total_s"] / bar,
                         "added_over_forward_only": (alpha2["loop_s"] - bar) / bar, **device_ratio(alpha2)}})
        print(f"context {tokens}: layer-wise metrics/forward {rows[-1]['metrics_over_forward']:.3f} "
              f"({rows[-1]['prompt_entropy_alpha2']['metrics_over_forward']:.3f} with prompt_entropy at alpha 2), "
              f"measure/forward-only {rows[-1]['measure_over_forward_only']:.2f}; added time over the forward-only "
              f"loop {rows[-1]['added_over_forward_only']:.3f} "
              f"({rows[-1]['prompt_entropy_alpha2']['added_over_forward_only']:.3f} at alpha 2)", flush=True)
    return rows


def load_times(model, tokenizer, args) -> dict:
    """Save the built model, then time a plain from_pretrained and load_model, twice each: the first load_model
    probes the model (the load check), the repeated one reads the check's cache."""
    import torch
    from transformers import AutoModelForCausalLM

    from repgeom_eval.modeling.loading import load_model

    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as cache:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # an empty load-check cache: the first load_model probes (and fills it), the second reads it
        os.environ["REPGEOM_CACHE"] = cache
        out: dict = {"plain_s": [], "plain_with_first_forward_s": [], "load_model_s": [], "load_model_parts": [],
                     "runs": ["first (probes)", "repeated (cached)"]}
        for _ in range(2):
            t0 = time.perf_counter()
            plain = AutoModelForCausalLM.from_pretrained(tmp, dtype="float32")
            out["plain_s"].append(time.perf_counter() - t0)
            # weights are memory-mapped: a plain load reads them at the first forward pass, so that is timed too
            with torch.inference_mode():
                plain.model(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10, 11]]))
            out["plain_with_first_forward_s"].append(time.perf_counter() - t0)
            del plain
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loaded = load_model(tmp, dtype="float32", device="cpu")
            out["load_model_s"].append(time.perf_counter() - t0)
            out["load_model_parts"].append(dict(getattr(loaded, "timings", {}) or {}))
        out["ratio_warm"] = out["load_model_s"][-1] / out["plain_s"][-1]
        parts = out["load_model_parts"][-1]
        out["load_check_over_plain_repeated"] = parts.get("load_check_s", float("nan")) / out["plain_s"][-1]
        out["load_check_over_plain_with_first_forward_repeated"] = (parts.get("load_check_s", float("nan"))
                                                                    / out["plain_with_first_forward_s"][-1])
        print(f"load: load_model {out['load_model_s'][-1]:.1f} s against from_pretrained {out['plain_s'][-1]:.1f} s "
              f"({out['ratio_warm']:.2f}×)", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["8b", "70b"], choices=sorted(SHAPES))
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--texts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--contexts", type=int, nargs="*", default=[128, 256, 512, 1024])
    p.add_argument("--context-texts", type=int, default=2)
    p.add_argument("--context-batch", type=int, default=2)
    p.add_argument("--load", action="store_true", help="also time load_model against a plain from_pretrained")
    p.add_argument("--load-only", action="store_true", help="with --load: time the loads and nothing else")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quick", action="store_true", help="small widths and sizes: checks the script in seconds")
    p.add_argument("--out", default=None, help="write the results JSON here")
    p.add_argument("--write", action="store_true", help="write benchmarks/results/bench_scale.json")
    args = p.parse_args(argv)
    if args.quick:
        args.shapes, args.texts, args.tokens, args.contexts, args.context_texts = ["quick"], 6, 32, [32, 64], 2
    import torch

    from repgeom_eval.testing import make_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.model_max_length = 1 << 20
    tokenizer.pad_token = tokenizer.eos_token
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    doc = {"benchmark": "bench_scale", "machine": machine(), "device": args.device, "dtype": args.dtype,
           "argv": sys.argv[1:] if argv is None else argv, "shapes": {}}
    t0 = time.perf_counter()
    for shape in args.shapes:
        doc["shapes"][shape] = per_shape(shape, args, tokenizer, device, dtype)
    doc["wall_s"] = time.perf_counter() - t0
    out = args.out or (Path(__file__).parent / "results" / "bench_scale.json" if args.write else None)
    if out:
        from repgeom_eval.output.files import write_json

        write_json(Path(out), doc)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
