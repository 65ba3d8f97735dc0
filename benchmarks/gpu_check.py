"""The GPU check: one prepared script for the lent GPU machine (torch, transformers, accelerate; no lm-eval, no mteb).

1. **Values on the device equal the CPU's**: tiny random models of several types, every metric of the layer-wise
   suite and dispersion at every address, measured on the CPU and on ``--device`` in float32 (|Δ| ≤ 1e-5), and in
   bfloat16 on the device against float32 on the CPU (within docs/metrics.md#precision's 0.02).
2. **The 8B shape, all 32 blocks, in bfloat16** (random init, Llama-3-8B's widths, the byte-level test tokenizer's
   vocabulary): ``measure --layers all`` with dispersion alone and with the layer-wise suite, timed against a
   forward-only loop over the same batches (benchmarks/bench_scale.py does the timing), per context length (the
   suite as it is, and with prompt_entropy at alpha 2, which needs no per-text eigendecomposition).
3. **Peak GPU memory against the ``--dry-run`` estimate**: ``torch.cuda.max_memory_allocated`` of each run beside
   the estimate of the weights, one batch's captured hidden states and the states that live on the device.
4. **No host synchronisation per batch**: every CUDA runtime call that makes the host wait (stream, device and
   event synchronisations, blocking copies), counted by the profiler during ``measure --layers all`` over 2 and 6
   batches of a tiny model and charged to its call site (benchmarks/gpu_profile.py), for the pooled suite, with the
   token metrics too (prompt_entropy at alpha 2), prompt_entropy's host route, and condensation; what grows with
   the batches is the hot loop's (tests/test_host_syncs.py counts the same on the CPU by call site).
5. **What alpha 1 costs, by route**: a symmetric eigenvalue solve per matrix at the Gram sizes prompt_entropy
   diagonalises, by ``torch.linalg.eigvalsh`` on the device (float64, float32), CuPy's batched solver (where
   installed) and the host's cores (run first: it also predicts each context length's time, and a length that
   would pass ``--budget-s`` runs on fewer texts or is skipped, written down); and the 8B layer-wise suite with
   each route: prompt_entropy's ``spectra: host`` (the package's, overlapped with the GPU) and drop-ins for
   ``serial_eigvalsh`` (CuPy's batched solver, the host's cores waited for at once), with prompt_entropy's values
   against the torch route's.

It must finish in under 8 minutes on one H100/H200; ``--quick`` shrinks everything so that it runs in a minute on a
CPU (``--device cpu --quick``: how the suite checks the script). Results: ``--out FILE`` (JSON, naming the machine),
written after every stage, so a run cut short keeps what it finished (``finished_stages``).

    sh benchmarks/gpu_check.sh --out $OUT/gpu_check.json                  # on the GPU machine (installs, then runs)
    .venv/bin/python benchmarks/gpu_check.py --device cpu --quick --out /tmp/gpu_check.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# last: an installed repgeom-eval (a wheel, where the built-in plugins live under repgeom_eval.plugins) must win
# over the checkout's own repgeom_eval folder, which lacks them
sys.path.append(str(Path(__file__).resolve().parent.parent))

from gpu_profile import failure  # noqa: E402 - the benchmarks folder is on the path from here on

NEEDED = ("torch", "transformers", "pluggy", "yaml", "rich", "tqdm", "safetensors")
TINY_TYPES = ("gpt2", "llama", "qwen2", "opt", "gpt_neox", "bert")
METRICS = ["dispersion", "token_dispersion", "prompt_entropy", "dataset_entropy", "effective_rank", "curvature",
           "vendi"]
BF16_TOLERANCE = 0.02  # docs/metrics.md#precision


def flat(results: dict) -> dict[str, float]:
    out = {}
    for addr, metrics in results.items():
        for name, value in metrics.items():
            if isinstance(value, dict):
                out.update({f"{addr}/{name}.{k}": v for k, v in value.items() if isinstance(v, (int, float))})
            elif isinstance(value, (int, float)):
                out[f"{addr}/{name}"] = value
    return out


def values_check(device: str, types: tuple[str, ...], n_texts: int) -> dict:
    import repgeom_eval as rg
    from repgeom_eval.testing.demo import python_doc_paragraphs

    texts = python_doc_paragraphs(n_texts)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in types:
            kind = "encoder" if model_type == "bert" else "causal"
            path = rg.save_tiny(model_type, Path(tmp) / model_type, kind=kind)
            runs = {}
            try:
                for where, dtype in (("cpu", "float32"), (device, "float32"), (device, "bfloat16")):
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        result = rg.measure(str(path), texts, layers="all", metrics=METRICS, device=where,
                                            dtype=dtype, max_length=64, batch_size=4, progress=False)
                    runs[(where, dtype)] = flat(result.results)
            except Exception as exc:  # noqa: BLE001 - one model type's failure is a finding; the others still run
                rows[model_type] = {"ok": False, "error": failure(exc), "at": f"{where} {dtype}"}
                print(f"values {model_type}: FAILED at {where} {dtype}: {rows[model_type]['error']}", flush=True)
                continue
            base = runs[("cpu", "float32")]

            def worst(other):
                return max(abs(other[k] - v) for k, v in base.items() if v == v and other[k] == other[k])

            f32, bf16 = worst(runs[(device, "float32")]), worst(runs[(device, "bfloat16")])
            rows[model_type] = {"float32_max_abs_diff": f32, "bfloat16_max_abs_diff": bf16,
                                "ok": f32 <= 1e-5 and bf16 <= BF16_TOLERANCE, "n_values": len(base)}
            print(f"values {model_type}: {device} float32 vs cpu {f32:.2e}, bfloat16 {bf16:.2e}", flush=True)
    return rows


def sync_check(device: str) -> dict:
    """The host's waits for the device per suite, over 2 and 6 batches, counted from the profiler's CUDA runtime
    calls and charged to their call sites (benchmarks/gpu_profile.py): none may grow with the batches."""
    if not device.startswith("cuda"):
        return {"skipped": "CUDA only (tests/test_host_syncs.py counts conversions by call site on the CPU)"}
    import gpu_profile

    out = gpu_profile.sync_sites(device)
    for row in out.values():
        if isinstance(row, dict) and "per_batch" in row:
            row["ok"] = row["per_batch"] == 0
    return out


def eigvalsh_timing(device: str, quick: bool) -> dict:
    """Milliseconds per matrix of a symmetric eigenvalue solve at the Gram sizes prompt_entropy diagonalises at
    alpha 1 (8 texts x 33 hidden states = 264 Grams of the text's length per batch at the 8B shape), by route:
    ``torch.linalg.eigvalsh`` on ``device`` (float64, float32: cuSOLVER, one matrix at a time above n = 32), CuPy's
    batched ``eigvalsh`` on the same memory where CuPy is installed (with its largest difference from torch's, over
    the largest eigenvalue), and the host's LAPACK on one thread and on every core (one matrix per thread)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    import torch

    def wait() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def grams_of(n: int, batch: int, dtype, where: str):
        x = torch.randn(batch, n, n // 2 + 1, dtype=dtype, device=where)
        return x @ x.transpose(1, 2)

    def timed(fn, grams) -> float:
        fn(grams[:1])  # warm: the solver's workspace and kernels
        wait()
        t = time.perf_counter()
        fn(grams)
        wait()
        return 1e3 * (time.perf_counter() - t) / len(grams)

    try:
        import cupy
    except ImportError:
        cupy = None
    cores = os.cpu_count() or 1
    # one LAPACK thread in each worker (OpenMP's thread count is per thread: unset, each solve would start a team
    # of its own and the teams would compete; on 2 cores that took 512x512 from 5.5 to 11.8 ms a matrix)
    pool = ThreadPoolExecutor(cores, initializer=torch.set_num_threads, initargs=(1,))
    sizes = [(32, 8), (64, 8)] if quick else [(32, 64), (128, 16), (512, 16), (1024, 8), (4096, 2)]
    rows = []
    threads = torch.get_num_threads()
    for n, batch in sizes:
        grams = grams_of(n, batch, torch.float64, device)
        row = {"n": n, "batch": batch, "device_float64_ms": timed(torch.linalg.eigvalsh, grams),
               "device_float32_ms": timed(torch.linalg.eigvalsh, grams_of(n, batch, torch.float32, device))}
        if cupy is not None and device.startswith("cuda") and n <= 1024:  # Jacobi sweeps at 4096: seconds each
            try:
                def by_cupy(g):
                    return torch.from_dlpack(cupy.linalg.eigvalsh(cupy.from_dlpack(g)))

                row["cupy_batched_float64_ms"] = timed(by_cupy, grams)
                ours = torch.linalg.eigvalsh(grams)
                row["cupy_max_diff_over_largest"] = float(((ours - by_cupy(grams)).abs().amax(1)
                                                           / ours.abs().amax(1)).max())
            except Exception as exc:  # noqa: BLE001 - one route's failure is a finding, not the stage's end
                row["cupy_error"] = f"{type(exc).__name__}: {exc}"[:200]
        if n <= 1024:
            host = grams_of(n, max(batch, min(cores, 32)), torch.float64, "cpu")
            torch.set_num_threads(1)  # one LAPACK thread a matrix: the host route would run them so
            try:
                row["cpu_1_thread_float64_ms"] = timed(torch.linalg.eigvalsh, host[:4])
                row["cpu_all_cores_float64_ms"] = timed(lambda g: list(pool.map(torch.linalg.eigvalsh, g)), host)
                row["cpu_cores"] = cores
            finally:
                torch.set_num_threads(threads)
        print("eigvalsh " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
              flush=True)
        rows.append(row)
    pool.shutdown()
    return {"per_matrix": rows}


def spectrum_routes(device: str):
    """Drop-ins for ``repgeom_eval.functional.entropy.serial_eigvalsh`` that take prompt_entropy's per-text spectra
    (alpha 1) off cuSOLVER's one-matrix-at-a-time loop: CuPy's batched solver on the same device memory (where CuPy
    is installed), and the host's LAPACK with one matrix per core, waited for at once. Not in the package (its own
    host route, ``spectra: host``, overlaps the host's solves with the GPU's next batches; routes_check runs it
    too): this check measures which is worth having (the suite's time, and its values against torch's)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from repgeom_eval.functional import entropy

    torch_route = entropy.serial_eigvalsh
    pool = ThreadPoolExecutor(os.cpu_count() or 1, initializer=torch.set_num_threads, initargs=(1,))

    def each(fn):
        def route(matrices):
            single = isinstance(matrices, torch.Tensor)
            out = [fn(m) for m in ([matrices] if single else list(matrices))]
            return out[0] if single else out
        return route

    def on_host(m):
        host = m.to("cpu")
        values = torch.stack(list(pool.map(torch.linalg.eigvalsh, host))) if host.dim() == 3 else (
            torch.linalg.eigvalsh(host))
        return values.to(m.device, non_blocking=True)

    routes = {"host_cores": each(on_host)}
    if device.startswith("cuda") and importlib.util.find_spec("cupy"):  # CuPy's route where CuPy is installed
        import cupy

        routes["cupy_batched"] = each(lambda m: torch.from_dlpack(cupy.linalg.eigvalsh(cupy.from_dlpack(
            m.contiguous()))) if m.is_cuda else torch_route(m))
    return torch_route, routes, pool


def routes_check(model, tokenizer, texts, bar, device: str, batch: int, tokens: int) -> dict:
    """The layer-wise suite on the built model with each spectrum route (:func:`spectrum_routes`): timings, and
    prompt_entropy's values against the torch route's."""
    import bench_scale
    from repgeom_eval.functional import entropy

    torch_route, routes, pool = spectrum_routes(device)
    out = {}

    def suite(params=None):
        kept: list = []
        timing = bench_scale.run_measure(model, tokenizer, texts, bench_scale.LAYERWISE, batch, tokens, device,
                                         metric_params=params, keep=kept)
        return kept[0], {**timing, "added_over_forward_only": (timing["loop_s"] - bar) / bar,
                         **bench_scale.device_ratio(timing)}

    on_device = {"prompt_entropy": {"spectra": "device"}}  # the routes that replace serial_eigvalsh run there
    base, out["torch"] = suite(on_device)
    # the package's own host route (prompt_entropy's spectra: host), overlapped with the GPU, then the drop-ins
    routes = {"spectra_host": None, **routes}
    try:
        for name, route in routes.items():
            entropy.serial_eigvalsh = route or torch_route
            try:
                result, out[name] = suite({"prompt_entropy": {"spectra": "host"}} if route is None else on_device)
            except Exception as exc:  # noqa: BLE001 - one route's failure is a finding
                out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                continue
            finally:
                entropy.serial_eigvalsh = torch_route
            diffs = [abs(a - b) for addr in base.results for a, b in (
                (base.results[addr]["prompt_entropy"][k], result.results[addr]["prompt_entropy"][k])
                for k in ("raw", "normalized")) if a == a and b == b]
            out[name]["prompt_entropy_max_abs_diff"] = max(diffs)
            print(f"route {name}: layer-wise added time over the forward-only loop "
                  f"{out[name]['added_over_forward_only']:.3f} (torch's "
                  f"{out['torch']['added_over_forward_only']:.3f}), prompt_entropy within {max(diffs):.1e} of torch's",
                  flush=True)
    finally:
        pool.shutdown()
    return out


def predicted_alpha1_s(eig: dict, tokens: int, width: int, texts: int, addresses: int) -> float | None:
    """Seconds the per-text spectra of one context length should take, from the eigvalsh stage's device float64 time
    per matrix at the nearest measured size at or above min(T, D) (None when unknown)."""
    n = min(tokens, width)
    rows = sorted((r for r in eig.get("per_matrix", []) if r["n"] >= n), key=lambda r: r["n"])
    return rows[0]["device_float64_ms"] * texts * addresses / 1e3 if rows else None


def memory_check(scale: dict, shape: str, device: str, dtype: str, tokens: int, batch: int) -> dict:
    """Peak GPU memory of each run against the estimate of what lives on the device."""
    from transformers import LlamaConfig

    from bench_scale import SHAPES
    from repgeom_eval.spec.options.measure import RunConfig
    from repgeom_eval.measurement.estimate import estimate

    spec = {k: v for k, v in SHAPES[shape].items() if k not in ("full_depth", "name")}
    out = {}
    for suite, row in scale["suites"].items():
        with tempfile.TemporaryDirectory() as tmp:
            LlamaConfig(**spec, num_hidden_layers=scale["blocks_built"], vocab_size=scale["vocab"]).save_pretrained(tmp)
            est = estimate(tmp, RunConfig(layers="all", metrics=tuple(row["metrics"]), pooling="mean", dtype=dtype,
                                          device=device, batch_size=batch, max_length=tokens))
        on_device = sum(s.fixed_bytes for states in est.per_address.values() for s in states
                        if "cpu" not in s.device)
        estimated = (est.weights_bytes or 0) + est.batch_hidden_bytes + getattr(est, "working_bytes", 0) + on_device
        peak = row.get("cuda_max_memory_allocated_bytes")
        out[suite] = {"estimate_bytes": estimated, "weights_bytes": est.weights_bytes,
                      "batch_hidden_bytes": est.batch_hidden_bytes, "device_state_bytes": on_device,
                      "working_bytes": getattr(est, "working_bytes", 0),
                      "cuda_peak_bytes": peak, "peak_over_estimate": peak / estimated if peak else None}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the script (e.g. with --device cpu)")
    p.add_argument("--out", default=None)
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="soft limit on the script's seconds: a context length whose alpha-1 spectra would pass it "
                        "runs on fewer texts, or is skipped with the prediction written down (default 420)")
    args = p.parse_args(argv)
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        print(f"gpu_check: missing packages {', '.join(missing)}: pip install {' '.join(missing)}", file=sys.stderr)
        return 2
    import torch

    import bench_scale

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --device cpu --quick to check the script", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    doc = {"check": "gpu_check", "machine": bench_scale.machine(), "device": args.device, "quick": args.quick}

    def save(stage: str) -> None:  # after every stage: a run cut short by the lease keeps what it finished
        doc["finished_stages"] = doc.get("finished_stages", []) + [stage]
        doc["wall_s"] = time.perf_counter() - t0
        if args.out:  # atomically: a run killed mid-write leaves the previous stage's file
            from repgeom_eval.output.files import write_json

            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            write_json(args.out, doc)

    doc["values"] = values_check(args.device, TINY_TYPES[:2] if args.quick else TINY_TYPES, 12 if args.quick else 24)
    doc["ok"] = all(r["ok"] for r in doc["values"].values())
    save("values")
    try:  # first: it is short, and it tells how long the longest context's spectra will take
        doc["eigvalsh"] = eigvalsh_timing(args.device, args.quick)
    except Exception as exc:  # noqa: BLE001 - a report, not a crash, on a machine lent for minutes
        doc["eigvalsh"] = {"error": failure(exc)}
    save("eigvalsh")
    shape, blocks = ("quick", 2) if args.quick else ("8b", 32)
    tokens, texts, batch = (32, 6, 3) if args.quick else (512, 32, 8)
    contexts = [32, 64] if args.quick else [128, 1024, 4096]
    dtype = "float32" if args.quick else "bfloat16"
    scale_args = argparse.Namespace(blocks=blocks, texts=texts, tokens=tokens, batch=batch,
                                    repeats=1 if args.quick else 2, contexts=[], load=False, load_only=False,
                                    shapes=[shape])
    from repgeom_eval.testing import make_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.model_max_length = 1 << 20
    tokenizer.pad_token = tokenizer.eos_token
    device = torch.device(args.device)

    def on_model(model, tokenizer, texts, bar, scale):  # the built model's further rows, each saved as it finishes
        doc["scale"] = scale
        try:
            doc["memory"] = memory_check(scale, shape, args.device, dtype, tokens, batch)
        except Exception as exc:  # noqa: BLE001 - as above
            doc["memory"] = {"error": failure(exc)}
        save("scale and memory")
        try:
            doc["routes"] = routes_check(model, tokenizer, texts, bar, args.device, batch, tokens)
        except Exception as exc:  # noqa: BLE001 - as above
            doc["routes"] = {"error": failure(exc)}
        save("routes")
        scale["contexts"] = []
        for length in contexts:
            n_texts = 2 if args.quick else 4
            width = bench_scale.SHAPES[shape]["hidden_size"]
            for n_texts in (n_texts, 2):  # fewer texts where the spectra would outrun the soft budget
                plan = predicted_alpha1_s(doc["eigvalsh"], length, width, n_texts, blocks + 1)
                if plan is None or time.perf_counter() - t0 + 2 * plan < args.budget_s:
                    break
            else:
                scale["contexts"].append({"tokens": length, "skipped": f"alpha 1's spectra predicted at {plan:.0f} s "
                                          f"for {n_texts} texts, past the {args.budget_s:.0f} s budget"})
                save(f"context {length}")
                continue
            one = argparse.Namespace(contexts=[length], context_texts=n_texts, context_batch=2)
            try:
                scale["contexts"] += bench_scale.contexts(model, tokenizer, one, device)
            except Exception as exc:  # noqa: BLE001 - as above
                scale["contexts"].append({"tokens": length, "skipped": f"failed: {failure(exc)}"})
            save(f"context {length}")

    try:
        scale = bench_scale.per_shape(shape, scale_args, tokenizer, device, getattr(torch, dtype), extra=on_model)
    except Exception as exc:  # noqa: BLE001 - as above
        scale = {"error": failure(exc), "suites": {}}
        doc["scale"] = doc.get("scale") or scale
        doc["scale"]["error"] = scale["error"]
        print(f"scale: FAILED: {scale['error']}", flush=True)
    doc.setdefault("routes", {})
    try:
        doc["syncs"] = sync_check(args.device)
    except Exception as exc:  # noqa: BLE001 - as above
        doc["syncs"] = {"error": failure(exc)}
    save("syncs")
    suites = scale["suites"]
    print(json.dumps({"values_ok": doc["ok"], "wall_s": round(doc["wall_s"], 1),
                      "added_over_forward_only": {k: round(v["added_over_forward_only"], 4) for k, v in suites.items()},
                      "metrics_over_forward": {k: round(v["metrics_over_forward"], 4) for k, v in suites.items()},
                      "metrics_over_forward_device": {k: v.get("metrics_over_forward_device")
                                                      for k, v in suites.items()},
                      "layerwise_by_spectrum_route_added_device": {
                          k: [v.get("added_over_forward_only"), v.get("metrics_over_forward_device")]
                          for k, v in doc["routes"].items() if isinstance(v, dict)},
                      "per_context_added_over_forward_only_alpha1_alpha2": {
                          r["tokens"]: [round(r["added_over_forward_only"], 4),
                                        round(r["prompt_entropy_alpha2"]["added_over_forward_only"], 4)]
                          for r in scale.get("contexts", []) if "skipped" not in r},
                      "per_context_metrics_over_forward_device_alpha1_alpha2": {
                          r["tokens"]: [r.get("metrics_over_forward_device"),
                                        r["prompt_entropy_alpha2"].get("metrics_over_forward_device")]
                          for r in scale.get("contexts", []) if "skipped" not in r}}))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
