"""Start-up time of the cheap ``repgeom`` commands against ``lm_eval --help`` (issue 16, item 3).

Times, each in a fresh process, ``repgeom --help``, ``repgeom plugins``, ``repgeom addresses --help`` and
``lm_eval --help`` (the installed console scripts next to this Python), interleaved in a shuffled (seeded) order
every repeat so that load from other processes falls on all of them alike. Printed per command: the median wall time,
the median CPU time of the child process (user + system, less sensitive to a busy machine), their ratios to
``lm_eval --help``, and whether the process imported torch / transformers (one ``-X importtime`` run each).

``--baseline REV`` times the same ``repgeom`` commands from an older revision too, in the same run: the revision's
``repgeom_eval/``, ``plugins/``, ``entrypoints/`` and ``task_configs/`` are exported with ``git archive`` into a
temporary folder laid out as the installed package and put first on ``PYTHONPATH`` (the installed metadata, hence
the plugin entry points, stay this environment's). The after/before ratios are then printed as well.

    .venv/bin/python benchmarks/bench_startup.py                        # 7 repeats, ~20 s
    .venv/bin/python benchmarks/bench_startup.py --baseline 7a7a48d     # before/after in one run, ~1 min
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
COMMANDS = {
    "repgeom --help": ["--help"],
    "repgeom plugins": ["plugins"],
    "repgeom addresses --help": ["addresses", "--help"],
}
REFERENCE = "lm_eval --help"


def _script(name: str) -> list[str]:
    path = BIN / name
    if path.exists():
        return [str(path)]
    if name == "repgeom":
        return [sys.executable, "-m", "repgeom_eval"]
    raise SystemExit(f"{path} not found: install lm-eval (pip install 'repgeom-eval[lmeval]') to compare against it")


def export_revision(rev: str, dest: Path) -> Path:
    """``rev``'s sources laid out as the installed package under ``dest``; returns the folder for PYTHONPATH."""
    archive = dest / "src.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, "repgeom_eval", "plugins",
                        "entrypoints", "task_configs"], stdout=f, check=True)
    src, site = dest / "src", dest / "site"
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(src, filter="data")
        else:  # pragma: no cover - Pythons before the extraction filters
            tar.extractall(src)
    site.mkdir()
    shutil.move(str(src / "repgeom_eval"), site / "repgeom_eval")
    for folder in ("plugins", "entrypoints", "task_configs"):  # as [tool.setuptools.package-dir] installs them
        shutil.move(str(src / folder), site / "repgeom_eval" / folder)
    return site


def run_once(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and child CPU seconds of one run of ``argv`` (output discarded), run outside the repository so that its
    folders do not shadow a baseline on ``PYTHONPATH``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def heavy_imports(argv: list[str], env: dict[str, str]) -> str:
    """Which of torch / transformers the command imports (from ``-X importtime``)."""
    err = subprocess.run(argv, env={**env, "PYTHONPROFILEIMPORTTIME": "1"}, cwd=tempfile.gettempdir(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True).stderr
    found = {line.rsplit("|", 1)[-1].strip() for line in err.splitlines() if line.startswith("import time:")}
    return ", ".join(m for m in ("torch", "transformers") if m in found) or "neither"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7, help="runs of each command (default 7)")
    ap.add_argument("--baseline", metavar="REV", help="also time the repgeom commands of this git revision")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    env.pop("PYTHONPROFILEIMPORTTIME", None)
    repgeom, lm_eval = _script("repgeom"), _script("lm_eval")
    cases: dict[str, tuple[list[str], dict[str, str]]] = {name: ([*repgeom, *a], env) for name, a in COMMANDS.items()}
    cases[REFERENCE] = ([*lm_eval, "--help"], env)

    tmp = None
    if args.baseline:
        tmp = tempfile.TemporaryDirectory(prefix="bench-startup-")
        site = export_revision(args.baseline, Path(tmp.name))
        base_env = dict(env, PYTHONPATH=os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])]))
        where = subprocess.run([sys.executable, "-c", "import repgeom_eval.plugins.commands as m; print(m.__file__)"],
                               env=base_env, cwd=tmp.name, capture_output=True, text=True, check=True).stdout.strip()
        assert where.startswith(str(site)), f"the baseline is not the one imported: {where}"
        for name, a in COMMANDS.items():
            cases[f"{name} [{args.baseline}]"] = ([*repgeom, *a], base_env)

    try:
        for argv, case_env in cases.values():  # warm the file cache and the bytecode of every case
            run_once(argv, case_env)
        walls: dict[str, list[float]] = {name: [] for name in cases}
        cpus: dict[str, list[float]] = {name: [] for name in cases}
        rng = random.Random(args.seed)
        for _ in range(args.repeats):
            order = list(cases)
            rng.shuffle(order)
            for name in order:
                wall, cpu = run_once(*cases[name])
                walls[name].append(wall)
                cpus[name].append(cpu)
        imports = {name: heavy_imports(*cases[name]) for name in cases if name != REFERENCE}
    finally:
        if tmp is not None:
            tmp.cleanup()

    wall = {n: statistics.median(v) for n, v in walls.items()}
    cpu = {n: statistics.median(v) for n, v in cpus.items()}
    print(f"{args.repeats} runs each, interleaved; medians; ratios to {REFERENCE}; load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    width = max(map(len, cases))
    print(f"{'command':<{width}}  {'wall s':>7} {'ratio':>6}  {'CPU s':>6} {'ratio':>6}  imports")
    for name in cases:
        print(f"{name:<{width}}  {wall[name]:7.3f} {wall[name] / wall[REFERENCE]:6.2f}  {cpu[name]:6.3f} "
              f"{cpu[name] / cpu[REFERENCE]:6.2f}  {imports.get(name, '(reference)')}")
    if args.baseline:
        print(f"\nafter / before ({args.baseline}), medians of the same run:")
        for name in COMMANDS:
            old = f"{name} [{args.baseline}]"
            print(f"  {name:<{width}}  wall {wall[name] / wall[old]:.3f}   CPU {cpu[name] / cpu[old]:.3f}")


if __name__ == "__main__":
    main()
