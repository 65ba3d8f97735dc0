"""Every model type transformers can build, at tiny size, through repgeom's own loading path: the coverage table.

Runs :func:`repgeom_eval.testing.coverage.check_type` (built tiny → saved with a tokenizer → ``load_model`` → every hidden
state measured through ``Forward`` against the model's own ``output_hidden_states`` → sub-layer identities checked
again) for each causal-LM and text-encoder type of the installed transformers. A failure of the comparisons is
counted as **measured wrong** (the goal is 0).

Each type runs in a worker process with a memory limit and a time limit, so one runaway config cannot take the
sweep down. ``python benchmarks/any_model.py`` prints the table; ``--write`` also writes
benchmarks/results/any_model.json and the coverage section of docs/how-to/own-model.md (between its any-model
markers), both
from this run; ``--types opt falcon`` runs a few.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import resource
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

from repgeom_eval.testing.coverage import check_type, markdown, summarize

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "any_model.json"
COVERAGE_PAGE = ROOT / "docs" / "how-to" / "own-model.md"  # its coverage section, between the markers
START, END = "<!-- any-model:start -->", "<!-- any-model:end -->"


# -- workers ------------------------------------------------------------------------------------------------------------

def _worker(tasks, results, workdir: str, memory_gb: float) -> None:
    limit = int(memory_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.simplefilter("ignore")
    while True:
        task = tasks.get()
        if task is None:
            return
        model_type, kind = task
        results.put(("start", model_type, kind, os.getpid()))
        try:
            row = check_type(model_type, kind, workdir)
        except MemoryError:
            row = {"type": model_type, "kind": kind, "status": "not built", "reason": "out of memory at tiny size"}
        except Exception as exc:  # noqa: BLE001 - a bug of repgeom or transformers: recorded, the sweep goes on
            tb = traceback.format_exc().strip().splitlines()
            row = {"type": model_type, "kind": kind, "status": "error",
                   "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300],
                   "where": tb[-3:]}
        results.put(("done", model_type, kind, row))


def sweep(todo: list[tuple[str, str]], workers: int, timeout: float, memory_gb: float) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rows: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory(prefix="repgeom-any-model-") as workdir:
        tasks = ctx.Queue()
        for t in todo:
            tasks.put(t)
        procs: dict[int, object] = {}
        running: dict[int, tuple[str, str, float]] = {}

        def spawn():
            p = ctx.Process(target=_worker, args=(tasks, results, workdir, memory_gb), daemon=True)
            p.start()
            procs[p.pid] = p

        for _ in range(workers):
            spawn()
        while len(rows) < len(todo):
            try:
                msg = results.get(timeout=2)
            except queue.Empty:
                msg = None
            if msg and msg[0] == "start":
                running[msg[3]] = (msg[1], msg[2], time.time())
            elif msg and msg[0] == "done":
                rows[(msg[1], msg[2])] = msg[3]
                running = {pid: r for pid, r in running.items() if r[:2] != (msg[1], msg[2])}
                _progress(msg[3], len(rows), len(todo))
            for pid, p in list(procs.items()):
                started = running.get(pid)
                late = started is not None and time.time() - started[2] > timeout
                if p.is_alive() and not late:
                    continue
                if late:
                    p.kill()
                p.join()
                del procs[pid]
                if started is not None and started[:2] not in rows:
                    why = f"over {timeout:.0f} s" if late else f"worker died (exit {p.exitcode}; memory?)"
                    rows[started[:2]] = {"type": started[0], "kind": started[1], "status": "not built",
                                         "reason": why}
                    _progress(rows[started[:2]], len(rows), len(todo))
                running.pop(pid, None)
                if len(rows) + len(running) < len(todo):
                    spawn()
        for _ in procs:
            tasks.put(None)
        for p in procs.values():
            p.join(timeout=10)
    return [rows[t] for t in todo]


def _progress(row: dict, done: int, total: int) -> None:
    detail = row.get("reason") or ", ".join(row.get("block_kinds", []))
    print(f"[{done:3d}/{total}] {row['kind']:7s} {row['type']:28s} {row['status']:15s} {detail[:110]}",
          file=sys.stderr, flush=True)


def write_coverage_page(text: str) -> None:
    readme = COVERAGE_PAGE.read_text(encoding="utf-8")
    if START not in readme or END not in readme:
        raise SystemExit(f"{COVERAGE_PAGE.relative_to(ROOT)} has no {START} ... {END} section")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    COVERAGE_PAGE.write_text(f"{head}{START}\n{text}\n{END}{tail}", encoding="utf-8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", nargs="+", default=None, help="only these model types")
    ap.add_argument("--kind", choices=["causal", "encoder", "both"], default="both")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per type")
    ap.add_argument("--memory-gb", type=float, default=10.0, help="address-space limit of each worker")
    ap.add_argument("--write", action="store_true", help="write the JSON results and the coverage section of docs/how-to/own-model.md")
    args = ap.parse_args()
    import transformers

    from repgeom_eval.testing.tiny_models import causal_lm_types, encoder_types

    todo = []
    if args.kind in ("causal", "both"):
        todo += [(t, "causal") for t in causal_lm_types() if not args.types or t in args.types]
    if args.kind in ("encoder", "both"):
        todo += [(t, "encoder") for t in encoder_types() if not args.types or t in args.types]
    t0 = time.perf_counter()
    rows = sweep(todo, args.workers, args.timeout, args.memory_gb)
    doc = {"transformers": transformers.__version__, "seconds": time.perf_counter() - t0,
           "summary": summarize(rows), "rows": rows}
    text = markdown(doc)
    print(text)
    if args.write:
        if args.types:
            raise SystemExit("--write needs the whole sweep (drop --types)")
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        tmp = RESULTS.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, RESULTS)
        write_coverage_page(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
