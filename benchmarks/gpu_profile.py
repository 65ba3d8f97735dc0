"""Where the layer-wise suite's time goes on a GPU: a companion of benchmarks/gpu_check.py for the lent machine.

At the 8B shape (random init, all 32 blocks, bfloat16, 512 tokens, batches of 8) it measures:

1. **Each metric alone and the suites**, on 1 batch and on 4 batches of texts: the loop's wall time over the
   forward-only loop's, split as ``per_batch_s`` (the slope: what every further batch costs) and ``fixed_s``
   (the intercept: the end-of-run compute, the states' set-up), with the device timer's per-batch split.
2. **The kernels and the host ops** of one suite run (``torch.profiler``), the top rows by device time and by
   host time, written as text (``profile_*.txt`` beside ``--out``).
3. **Where the host waits for the device**: ``torch.cuda.set_sync_debug_mode("warn")`` with each warning's call
   site in this package, counted over 2 and 6 batches (tiny model), per suite.

    sh benchmarks/gpu_check.sh --profile --out $OUT/gpu_profile.json     # on the GPU machine (installs, then runs)
    .venv/bin/python benchmarks/gpu_profile.py --device cpu --quick --out /tmp/gpu_profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))  # last: an installed repgeom-eval wins (gpu_check.py)

A2 = {"prompt_entropy": {"alpha": 2.0}}
HOST = {"prompt_entropy": {"spectra": "host"}}
GRAMS = ["dataset_entropy", "effective_rank", "vendi"]
SYNC_SUITES = (("pooled", ["dispersion", *GRAMS], None),
               ("pooled+tokens", ["dispersion", *GRAMS, "token_dispersion", "prompt_entropy", "curvature"], A2),
               ("prompt_entropy_alpha1_host", ["prompt_entropy"], HOST),
               ("condensation", ["condensation"], None))
CONFIGS = {  # name: (metrics, metric_params)
    "dispersion": (["dispersion"], None),
    "curvature": (["curvature"], None),
    "prompt_entropy_alpha2": (["prompt_entropy"], A2),
    "prompt_entropy_alpha1_device": (["prompt_entropy"], None),
    "prompt_entropy_alpha1_host": (["prompt_entropy"], HOST),
    "dataset_entropy": (["dataset_entropy"], None),
    "effective_rank": (["effective_rank"], None),
    "vendi": (["vendi"], None),
    "three_grams": (GRAMS, None),
    "suite_alpha2": (["prompt_entropy", *GRAMS, "curvature"], A2),
    "suite_alpha1_device": (["prompt_entropy", *GRAMS, "curvature"], None),
    "suite_alpha1_host": (["prompt_entropy", *GRAMS, "curvature"], HOST),
}


def failure(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)[-4:]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))
    return f"{type(exc).__name__}: {exc}"[:600] + f" [at {where}]"


def timed_measure(model, tokenizer, texts, metrics, params, batch, tokens, device) -> dict:
    import torch

    import repgeom_eval as rg

    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = rg.measure(model, texts, tokenizer=tokenizer, layers="all", metrics=metrics, batch_size=batch,
                            max_length=tokens, progress=False, pooling="mean", metric_params=params or {})
    sync()
    t = result.timings
    return {"loop_s": t["forward_s"] + t["metrics_s"], "wall_s": time.perf_counter() - t0,
            "compute_s": t.get("compute_s"), "forward_device_s": t.get("forward_device_s"),
            "metrics_device_s": t.get("metrics_device_s")}


def per_config(model, tokenizer, texts, batch, tokens, device, bar_per_batch: float, quick: bool) -> dict:
    out = {}
    few, many = texts[:batch], texts[: 4 * batch]
    for name, (metrics, params) in CONFIGS.items():
        if quick and name not in ("dispersion", "suite_alpha2", "prompt_entropy_alpha1_host"):
            continue
        try:
            timed_measure(model, tokenizer, few, metrics, params, batch, tokens, device)  # warm
            one = timed_measure(model, tokenizer, few, metrics, params, batch, tokens, device)
            four = timed_measure(model, tokenizer, many, metrics, params, batch, tokens, device)
        except Exception as exc:  # noqa: BLE001 - a finding, not a crash, on a machine lent for minutes
            out[name] = {"error": failure(exc)}
            print(f"{name}: FAILED {out[name]['error']}", flush=True)
            continue
        per_batch = (four["loop_s"] - one["loop_s"]) / 3
        row = {"metrics": metrics, "params": params, "one_batch": one, "four_batches": four,
               "per_batch_s": per_batch, "fixed_s": one["loop_s"] - per_batch,
               "per_batch_over_forward_only": per_batch / bar_per_batch - 1}
        if four["metrics_device_s"] is not None:
            row["metrics_over_forward_device"] = four["metrics_device_s"] / four["forward_device_s"]
        out[name] = row
        print(f"{name}: per batch {per_batch * 1e3:.1f} ms ({row['per_batch_over_forward_only']:+.3f} over the "
              f"forward-only batch), fixed {row['fixed_s'] * 1e3:.0f} ms, device metrics/forward "
              f"{row.get('metrics_over_forward_device')}", flush=True)
    return out


def profile(model, tokenizer, texts, metrics, params, batch, tokens, device, out_path: Path | None) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if str(device).startswith("cuda") else [])
    with torch_profile(activities=activities) as prof:
        timed_measure(model, tokenizer, texts, metrics, params, batch, tokens, device)
    table = prof.key_averages()
    by_device = table.table(sort_by="self_cuda_time_total" if len(activities) > 1 else "self_cpu_time_total",
                            row_limit=35, max_name_column_width=70)
    by_host = table.table(sort_by="self_cpu_time_total", row_limit=35, max_name_column_width=70)
    text = f"# by device time\n{by_device}\n\n# by host time\n{by_host}\n"
    if out_path is not None:
        out_path.write_text(text)
    return {"file": out_path.name if out_path else None, "head": by_device[:3000]}


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def synchronisations(run) -> Counter:
    """Each call of ``run()`` that makes the host wait for the device, by the innermost frames of this package
    around it. Counted from the profiler's CUDA runtime calls (every one of them, unlike the once-per-line warnings
    of ``torch.cuda.set_sync_debug_mode``), each charged to the innermost operation enclosing it on its thread."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        run()
    events = [e for e in prof.events() if e.device_type.name == "CPU"]
    sites: Counter = Counter()
    for e in events:
        if e.name not in SYNC_CALLS:
            continue
        owner = e.cpu_parent
        if owner is None:  # the innermost event around it on its thread
            start, end = e.time_range.start, e.time_range.end
            around = [o for o in events if o is not e and o.thread == e.thread and o.time_range.start <= start
                      and o.time_range.end >= end]
            owner = min(around, key=lambda o: o.time_range.end - o.time_range.start) if around else None
        frames, op = [], owner.name if owner is not None else "?"
        while owner is not None:  # with_stack: the Python calls are events too, "path(line): function"
            if "repgeom_eval" in owner.name or "plugins/" in owner.name:
                frames.append(owner.name.split("/")[-1])
            owner = owner.cpu_parent
        sites[f"{op} at " + " <- ".join(frames[:3]) if frames else op] += 1
    return sites


def sync_sites(device: str) -> dict:
    """The host's waits for the device per suite over 2 and 6 batches (tiny model): what grows with the batches is
    the hot loop's."""
    if not device.startswith("cuda"):
        return {"skipped": "CUDA only"}
    import repgeom_eval as rg
    from repgeom_eval.testing.demo import python_doc_paragraphs

    texts = python_doc_paragraphs(24)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = rg.save_tiny("llama", Path(tmp) / "llama", kind="causal")
        loaded = rg.load_model(str(path), device=device)
        for suite, metrics, params in SYNC_SUITES:
            row = {}
            for n_batches in (2, 6):
                def run():
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        rg.measure(loaded, texts[: 4 * n_batches], layers="all", metrics=metrics, batch_size=4,
                                   progress=False, metric_params=params or {})
                try:
                    row[f"{n_batches}_batches"] = dict(synchronisations(run).most_common(30))
                except Exception as exc:  # noqa: BLE001
                    row["error"] = failure(exc)
                    break
            if "error" not in row:
                few, many = row["2_batches"], row["6_batches"]
                row["per_batch"] = (sum(many.values()) - sum(few.values())) / 4
                row["growing_sites"] = {k: (many.get(k, 0) - few.get(k, 0)) / 4 for k in set(few) | set(many)
                                        if many.get(k, 0) != few.get(k, 0)}
                print(f"syncs {suite}: {sum(few.values())} over 2 batches, {sum(many.values())} over 6: "
                      f"{row['per_batch']:g} per batch; growing: {row['growing_sites']}", flush=True)
            out[suite] = row
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--no-syncs", action="store_true", help="skip the synchronisation sites (gpu_check.py counts them)")
    args = p.parse_args(argv)
    import torch

    import bench_scale
    from repgeom_eval.testing import make_tokenizer

    out_path = Path(args.out) if args.out else None
    doc = {"check": "gpu_profile", "machine": bench_scale.machine(), "device": args.device, "quick": args.quick}

    def save() -> None:
        doc["wall_s"] = time.perf_counter() - t0
        if out_path is not None:
            from repgeom_eval.output.files import write_json

            out_path.parent.mkdir(parents=True, exist_ok=True)
            write_json(out_path, doc)

    t0 = time.perf_counter()
    if not args.no_syncs:
        try:
            doc["sync_sites"] = sync_sites(args.device)
        except Exception as exc:  # noqa: BLE001
            doc["sync_sites"] = {"error": failure(exc)}
        save()
    shape, blocks = ("quick", 2) if args.quick else ("8b", 32)
    tokens, batch = (32, 3) if args.quick else (512, 8)
    dtype = torch.float32 if args.quick else torch.bfloat16
    tokenizer = make_tokenizer()
    tokenizer.model_max_length = 1 << 20
    tokenizer.pad_token = tokenizer.eos_token
    device = torch.device(args.device)
    model, _ = bench_scale.build(shape, blocks, dtype, device, len(tokenizer))
    texts = bench_scale.texts_of(4 * batch, tokens, tokenizer)
    bench_scale.forward_only(model, tokenizer, texts, batch, tokens, device)  # warm
    bar = bench_scale.forward_only(model, tokenizer, texts, batch, tokens, device) / 4
    doc.update(shape=shape, blocks=blocks, tokens=tokens, batch=batch, forward_only_per_batch_s=bar)
    print(f"forward-only: {bar * 1e3:.1f} ms per batch", flush=True)
    doc["configs"] = per_config(model, tokenizer, texts, batch, tokens, device, bar, args.quick)
    save()
    for name in ("suite_alpha2", "dispersion"):
        metrics, params = CONFIGS[name]
        target = out_path.parent / f"profile_{name}.txt" if out_path else None
        try:
            doc[f"profile_{name}"] = profile(model, tokenizer, texts[: 2 * batch], metrics, params, batch, tokens,
                                             device, target)
        except Exception as exc:  # noqa: BLE001
            doc[f"profile_{name}"] = {"error": failure(exc)}
        save()
    print(json.dumps({k: round(v["per_batch_over_forward_only"], 4) for k, v in doc["configs"].items()
                      if "per_batch_over_forward_only" in v}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
