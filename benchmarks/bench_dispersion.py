"""Benchmark: cosine dispersion by the O(N·d) sum identity vs the brute-force N×N Gram matrix.

What is measured, for N = 2000, 10000, 50000 vectors of width d = 576 (SmolLM2-135M's hidden size):

* ``repgeom_eval.functional.dispersion``          — the identity D = 1 − (‖Σu‖² − Σ‖u‖²) / (N(N−1)), O(N·d);
* ``repgeom_eval.functional.pairwise_dispersion`` — the naive reference: builds the N×N cosine matrix, O(N²·d).

Input: float32 Gaussian rows plus one shared offset vector (mean pairwise cosine ≈ 0.5, so the vectors are
correlated as hidden states are), generated from a fixed seed, so both functions see the same matrix.

How: every (function, N) runs in a fresh ``spawn`` subprocess. The child imports torch, warms the function up on
a tiny input and builds its input in place (no temporary copy). Memory: it resets the kernel's peak-RSS mark
(``/proc/self/clear_refs`` ← 5, so VmHWM = current RSS), runs the function once and reads VmHWM − RSS_before: the
peak extra resident memory of the computation itself. Where that reset is not possible it falls back to the
``ru_maxrss`` delta, a lifetime maximum (inherited across spawn, raised by freed transients) that can only
under-count. Time: the median of 1 to 5 further (warm) runs, fewer when a run is slow. Threads: 2.

The brute force allocates at least 25·N² bytes (the float64 Gram matrix, the bool off-diagonal mask, the gathered
off-diagonal values and 1 − cos; boolean indexing adds index buffers on top, ≈ 33·N² measured). When 25·N² bytes
exceed ``--max-brute-gb`` it is not run; its memory and time are then *extrapolated* as N² from the largest N that
did run, and printed with a ``~`` and the label "est." (the Gram matrix alone, 8·N² bytes, is printed too).

    .venv/bin/python benchmarks/bench_dispersion.py            # N = 2000, 10000, 50000 (~1-3 min)
    .venv/bin/python benchmarks/bench_dispersion.py --quick    # N = 2000 only
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

D = 576
SEED = 0
BRUTE_BYTES_PER_PAIR = 25  # lower bound: float64 Gram (8) + bool mask (1) + off-diagonal (8) + 1 − cos (8)


def _make_input(n: int, d: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    offset = torch.randn(d, generator=g)
    x = torch.randn(n, d, generator=g)
    return x.add_(offset)  # in place: no transient second copy before the memory baseline


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith(field + ":")))


def _child(kind: str, n: int, d: int, seed: int, time_budget_s: float) -> dict:
    """Runs in a fresh process: (value, median seconds, peak extra bytes) of one function at one N."""
    import gc
    import resource

    import torch

    from repgeom_eval.functional.dispersion import dispersion, pairwise_dispersion

    torch.set_num_threads(2)
    fn = dispersion if kind == "identity" else pairwise_dispersion
    fn(_make_input(64, d, seed + 1))  # warm-up: loads kernels, allocates thread pools
    x = _make_input(n, d, seed)
    gc.collect()
    try:  # Linux: reset the peak-RSS mark (VmHWM) to the current RSS, so the peak is this call's alone
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        method, base_kib = "VmHWM", _status_kib("VmRSS")
    except OSError:  # fall back to the lifetime maximum, which can only under-count the increase
        method, base_kib = "ru_maxrss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    value = float(fn(x))  # the memory run (cold: first touch of fresh pages); not timed
    peak_kib = _status_kib("VmHWM") if method == "VmHWM" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times: list[float] = []
    while not times or (len(times) < 5 and sum(times) < time_budget_s):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return {"value": value, "time": statistics.median(times), "peak": (peak_kib - base_kib) * 1024,
            "method": method, "runs": len(times)}


def run_in_fresh_process(kind: str, n: int, d: int, time_budget_s: float) -> dict:
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(_child, kind, n, d, SEED, time_budget_s).result()


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(b) < 1024 or unit == "GiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return ""


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="only N = 2000")
    ap.add_argument("--sizes", type=int, nargs="+", default=None, help="override the list of N")
    ap.add_argument("--dim", type=int, default=D)
    ap.add_argument("--max-brute-gb", type=float, default=6.0,
                    help="skip (and extrapolate) the brute force when 25·N² bytes exceed this many GiB (default 6)")
    ap.add_argument("--time-budget", type=float, default=3.0, help="stop repeating a run after this many seconds")
    args = ap.parse_args()
    sizes = [2000] if args.quick else (args.sizes or [2000, 10000, 50000])

    rows = []
    largest_brute = None  # (n, time, peak) of the largest N the brute force actually ran at
    t_start = time.perf_counter()
    for n in sorted(sizes):
        ident = run_in_fresh_process("identity", n, args.dim, args.time_budget)
        need_gb = BRUTE_BYTES_PER_PAIR * n * n / 1024**3
        if need_gb <= args.max_brute_gb:
            brute = run_in_fresh_process("brute", n, args.dim, args.time_budget) | {"estimated": False}
            largest_brute = (n, brute["time"], brute["peak"])
        elif largest_brute is not None:
            n0, t0, p0 = largest_brute
            scale = (n / n0) ** 2
            brute = {"value": float("nan"), "time": t0 * scale, "peak": p0 * scale, "estimated": True}
            print(f"N={n}: brute force needs >= {need_gb:.1f} GiB (Gram matrix alone {8 * n * n / 1024**3:.1f} GiB) "
                  f"> --max-brute-gb {args.max_brute_gb}; not run, time and memory extrapolated as N² from N={n0}")
        else:
            brute = {"value": float("nan"), "time": float("nan"), "peak": BRUTE_BYTES_PER_PAIR * n * n,
                     "estimated": True}
            print(f"N={n}: brute force needs >= {need_gb:.1f} GiB > --max-brute-gb; not run, memory = 25·N² bytes")
        rows.append((n, ident, brute))
        est = " (est.)" if brute["estimated"] else ""
        print(f"N={n:>6}: identity {_fmt_s(ident['time'])} / {_fmt_bytes(ident['peak'])} (D={ident['value']:.12f}); "
              f"brute force{est} {_fmt_s(brute['time'])} / {_fmt_bytes(brute['peak'])} "
              f"(D={brute['value']:.12f})", flush=True)

    methods = sorted({c["method"] for _, i, b in rows for c in (i, b) if "method" in c})
    print(f"\nd = {args.dim}, float32 input, float64 sums, 2 threads, fresh process per cell, peak memory by "
          f"{' and '.join(methods)} (total {time.perf_counter() - t_start:.0f} s)")
    head = f"{'N':>7} | {'t identity':>10} | {'t brute':>11} | {'t ratio':>9} | {'mem identity':>12} | " \
           f"{'mem brute':>11} | {'mem ratio':>9} | {'|D_id - D_brute|':>16}"
    print(head)
    print("-" * len(head))
    for n, ident, brute in rows:
        tilde = "~" if brute["estimated"] else ""
        t_ratio = brute["time"] / ident["time"]
        m_ratio = brute["peak"] / ident["peak"] if ident["peak"] > 0 else float("inf")
        diff = abs(ident["value"] - brute["value"])
        diff_s = "n/a (est.)" if brute["estimated"] else f"{diff:.2e}"
        print(f"{n:>7} | {_fmt_s(ident['time']):>10} | {tilde + _fmt_s(brute['time']):>11} | "
              f"{tilde + f'{t_ratio:.0f}x':>9} | {_fmt_bytes(ident['peak']):>12} | "
              f"{tilde + _fmt_bytes(brute['peak']):>11} | {tilde + f'{m_ratio:.0f}x':>9} | {diff_s:>16}")
    if any(b["estimated"] for _, _, b in rows):
        print("~ = estimated (not run): extrapolated as N² from the largest N the brute force ran at")


if __name__ == "__main__":
    main()
