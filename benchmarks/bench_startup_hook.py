"""What the lm-eval start-up hook (repgeom_lm_eval.pth) adds to every Python start-up in the environment.

Runs ``python -c pass`` alternately with the hook active and with ``REPGEOM_LM_EVAL_AUTOLOAD=0`` (the .pth line
then skips the import), many times, and prints the medians and their difference. Target: ≤ 1 ms added.
Bytecode matters: with ``PYTHONDONTWRITEBYTECODE=1`` an editable install compiles the hook at every start-up;
a wheel install has it compiled by pip. Both are printed.

    python benchmarks/bench_startup_hook.py [--runs 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def median_ms(env: dict[str, str], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def hook_import_ms(env: dict[str, str], runs: int) -> float:
    """Median cumulative import time of the hook module itself (``-X importtime``), ms; 0 when not imported."""
    values = []
    for _ in range(runs):
        err = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], env=env, capture_output=True,
                             text=True, check=True).stderr
        found = [line for line in err.splitlines() if line.rstrip().endswith(" _repgeom_lm_eval_hook")]
        values.append(int(found[0].split("|")[1]) / 1000 if found else 0.0)
    return statistics.median(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=60)
    args = ap.parse_args()
    for bytecode in (True, False):
        base = dict(os.environ)
        base.pop("PYTHONDONTWRITEBYTECODE", None)
        if not bytecode:
            base["PYTHONDONTWRITEBYTECODE"] = "1"
        on, off = [], []
        for _ in range(3):  # interleaved rounds: load on a shared machine hits both sides alike
            on.append(median_ms(base | {"REPGEOM_LM_EVAL_AUTOLOAD": "1"}, args.runs // 3))
            off.append(median_ms(base | {"REPGEOM_LM_EVAL_AUTOLOAD": "0"}, args.runs // 3))
        a, b = statistics.median(on), statistics.median(off)
        label = "bytecode cached" if bytecode else "no bytecode (PYTHONDONTWRITEBYTECODE=1)"
        own = hook_import_ms(base | {"REPGEOM_LM_EVAL_AUTOLOAD": "1"}, 15)
        off_own = hook_import_ms(base | {"REPGEOM_LM_EVAL_AUTOLOAD": "0"}, 15)
        print(f"{label}: python -c pass with the hook {a:.2f} ms, with REPGEOM_LM_EVAL_AUTOLOAD=0 {b:.2f} ms "
              f"(difference {a - b:+.2f} ms); importing the hook module: {own:.2f} ms on, {off_own:.2f} ms off")


if __name__ == "__main__":
    main()
