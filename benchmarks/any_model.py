"""Every model type transformers can build, at tiny size, through repgeom's own loading path: the coverage table.

For each causal-LM and text-encoder type of the installed transformers (``repgeom_eval.tiny_models``):

1. **built**: a tiny random model from transformers' own config class, saved with a tokenizer;
2. **loaded** through ``load_model`` (Auto class, weights check, the load check of modeling/discovery.py);
3. **equal at every hidden state**: a padded batch of two real texts run through ``Forward`` (the path every command
   uses) at every bare hidden-state index, compared at every real token with the model's own
   ``output_hidden_states`` for each text alone;
4. **sub-layers**: which sites the load check verified; the residual identities are checked again on the tensors
   ``Forward`` captured from the real texts (pre-norm: resid_mid = resid_pre + attn_out and resid_post = resid_mid +
   mlp_out; parallel: resid_post = resid_pre + attn_out + mlp_out; every block: resid_pre = the previous
   resid_post). A failure of 3 or 4 is counted as **measured wrong** (the goal is 0).

Each type runs in a worker process with a memory limit and a time limit, so one runaway config cannot take the
sweep down. ``python benchmarks/any_model.py`` prints the table; ``--write`` also writes
benchmarks/results/any_model.json and the coverage section of README.md (between its any-model markers), both
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
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "any_model.json"
README = ROOT / "README.md"
START, END = "<!-- any-model:start -->", "<!-- any-model:end -->"
TEXTS = ["The quick brown fox jumps over the lazy dog near the river bank today.", "Short text."]


def check_type(model_type: str, kind: str, workdir: str) -> dict:
    """One row of the table (runs inside a worker)."""
    from repgeom_eval.errors import RepgeomError
    from repgeom_eval.modeling.loading import load_model
    from repgeom_eval.tiny_models import TinyBuildError, save_tiny

    row: dict = {"type": model_type, "kind": kind}
    t0 = time.perf_counter()
    path = Path(workdir) / f"{kind}-{model_type}"
    try:
        save_tiny(model_type, path, kind)
    except TinyBuildError as exc:
        return row | {"status": "not built", "reason": str(exc)}
    try:
        loaded = load_model(str(path))
    except RepgeomError as exc:
        return row | {"status": "refused", "reason": str(exc), "seconds": time.perf_counter() - t0}
    layout = loaded.layout
    row["blocks"] = layout.blocks
    row["block_kinds"] = sorted(set(layout.block_kinds))
    row["padding_sides"] = list(layout.padding_sides)
    row["notes"] = layout.notes

    try:
        return _compare(row, loaded, t0)
    except RepgeomError as exc:  # the model's own forward fails on real texts (Funnel ...): refused in one line
        return row | {"status": "refused", "reason": str(exc), "seconds": time.perf_counter() - t0}


def _compare(row: dict, loaded, t0: float) -> dict:
    import torch

    from repgeom_eval.errors import RepgeomError

    from repgeom_eval.measurement.forward import Forward, model_inputs
    from repgeom_eval.modeling.addresses import available_addresses, resolve, resolve_request

    layout = loaded.layout
    # 3. every hidden state, padded batch through Forward vs each text alone through the model itself
    n_hidden = len(layout.hidden_states)
    bare = [str(k) for k in range(n_hidden) if layout.hidden_states[k] is not None]
    if not bare:
        raise RepgeomError("no hidden state is one vector per token ([batch, tokens, width]); measurable: "
                           + ", ".join(str(a) for a in available_addresses(loaded)))
    plan = resolve_request(bare, loaded)
    worst, wrong = 0.0, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Forward(loaded, plan.points) as fwd:
            batch = fwd.texts(TEXTS, max_length=32)
        mask = batch.mask.cpu()
        for row_i in range(len(TEXTS)):
            real = mask[row_i]
            ids = batch.ids[row_i:row_i + 1, real]
            try:
                with torch.no_grad():
                    ref = loaded.runner(**model_inputs(loaded, ids, torch.ones_like(ids)), output_hidden_states=True,
                                        return_dict=True).hidden_states
            except Exception as exc:  # noqa: BLE001 - the model itself fails on this text alone: nothing to compare
                raise RepgeomError(f"the model's own forward pass fails on a real text of {ids.shape[1]} tokens: "
                                   f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from None
            ref = [h[0] if isinstance(h, (tuple, list)) else h for h in ref]  # PEGASUS-X: (tokens, global tokens)
            for item, addr in zip(bare, [plan.reported_as.get(b, b) for b in bare]):
                k = int(item)
                got = batch.hidden[_address(plan, addr)][row_i, real.to(batch.hidden[_address(plan, addr)].device)]
                want = ref[k][0].to(got.dtype)
                scale = float(want.abs().max()) or 1.0
                err = float((got - want).abs().max()) / scale
                worst = max(worst, err)
                if err > 1e-4:
                    wrong.append(f"hidden_states[{k}] ({addr}): relative error {err:.2e}")
    row["hidden_states"] = n_hidden
    row["max_rel_error"] = worst
    # 4. sub-layers the load check verified, checked again on the captured real texts
    verified = {s for block in layout.sites for s, site in block.items() if site.ok}
    refused: dict[str, dict] = {}
    for block in layout.sites:
        for s, site in block.items():
            if not site.ok and (s not in refused or not site.absent and refused[s]["absent"]):
                refused[s] = {"reason": site.note, "absent": site.absent}  # an unverified one shows over an absent one
    row["verified_sites"] = sorted(verified)
    row["refused"] = {s: refused[s] for s in sorted(refused)}
    addrs = available_addresses(loaded)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Forward(loaded, resolve(addrs, loaded)) as fwd:
            got = {str(a): t for a, t in fwd.texts(TEXTS, max_length=32).hidden.items()}
    m = mask.to(next(iter(got.values())).device) if got else mask
    wrong += _identities(layout, got, m)
    row["wrong"] = wrong
    row["status"] = "measured wrong" if wrong else "equal"
    row["seconds"] = time.perf_counter() - t0
    return row


def _address(plan, name):
    return next(a for a in plan.addresses if str(a) == name)


def _identities(layout, got: dict, mask) -> list[str]:
    out = []

    def close(a, b, what):
        a, b = a[mask], b[mask]
        scale = max(float(a.abs().max()), float(b.abs().max()), 1e-30)
        if float((a - b).abs().max()) > 1e-4 * scale:
            out.append(what)

    for i, kind in enumerate(layout.block_kinds):
        g = {s: got.get(f"{s}:{i}") for s in ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")}
        if i and g["resid_pre"] is not None and got.get(f"resid_post:{i - 1}") is not None:
            close(g["resid_pre"], got[f"resid_post:{i - 1}"], f"block {i}: resid_pre != resid_post:{i - 1}")
        if kind == "sequential, pre-norm" and all(g[s] is not None for s in ("resid_pre", "attn_out", "resid_mid")):
            close(g["resid_mid"], g["resid_pre"] + g["attn_out"], f"block {i}: resid_mid != resid_pre + attn_out")
        if kind == "sequential, pre-norm" and all(g[s] is not None for s in ("resid_mid", "mlp_out", "resid_post")):
            close(g["resid_post"], g["resid_mid"] + g["mlp_out"], f"block {i}: resid_post != resid_mid + mlp_out")
        if kind == "parallel" and all(g[s] is not None for s in ("resid_pre", "attn_out", "mlp_out", "resid_post")):
            close(g["resid_post"], g["resid_pre"] + g["attn_out"] + g["mlp_out"],
                  f"block {i}: resid_post != resid_pre + attn_out + mlp_out")
    return out


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


# -- the table ----------------------------------------------------------------------------------------------------------

SUBLAYER_CLASSES = ("all six sites at every block",
                    "every site the blocks have (parallel blocks: no resid_mid)",
                    "every site the blocks have (hybrid or single-sub-layer blocks)",
                    "some sites unverified (refused)", "hidden states only (no block modules)")


def sublayer_class(row: dict) -> str:
    """Verified = every site a block structurally has passed the load check (the first three classes)."""
    refused = row.get("refused", {})
    if not row.get("blocks"):
        return SUBLAYER_CLASSES[4]
    if not refused:
        return SUBLAYER_CLASSES[0]
    if any(not r["absent"] for r in refused.values()):
        return SUBLAYER_CLASSES[3]
    if set(refused) == {"resid_mid"} and all("parallel" in r["reason"] for r in refused.values()):
        return SUBLAYER_CLASSES[1]
    return SUBLAYER_CLASSES[2]


def summarize(rows: list[dict]) -> dict:
    out = {}
    for kind in ("causal", "encoder"):
        mine = [r for r in rows if r["kind"] == kind]
        built = [r for r in mine if r["status"] not in ("not built",)]
        equal = [r for r in built if r["status"] == "equal"]
        verified = [r for r in equal if sublayer_class(r) in SUBLAYER_CLASSES[:3]]
        out[kind] = {
            "types": len(mine), "built": len(built), "equal_at_every_hidden_state": len(equal),
            "sublayers_verified": len(verified),
            "refused": len([r for r in built if r["status"] == "refused"]),
            "errors": len([r for r in built if r["status"] == "error"]),
            "measured_wrong": len([r for r in built if r["status"] == "measured wrong"]),
            "sublayers": dict(Counter(sublayer_class(r) for r in equal)),
        }
    return out


def markdown(doc: dict) -> str:
    s = doc["summary"]
    lines = [f"Swept on transformers {doc['transformers']} by `make any-model` ({doc['seconds']:.0f} s; "
             "benchmarks/any_model.py, results in benchmarks/results/any_model.json):", "",
             "| model types | in transformers | built tiny | equal at every hidden state | sub-layers verified | "
             "refused | measured wrong |", "|---|---|---|---|---|---|---|"]
    for kind, label in (("causal", "causal LM"), ("encoder", "text encoder / encoder-decoder")):
        k = s[kind]
        pct = lambda a, b: f"{a} ({100 * a / b:.0f} %)" if b else "0"  # noqa: E731
        lines.append(f"| {label} | {k['types']} | {k['built']} | {pct(k['equal_at_every_hidden_state'], k['built'])} "
                     f"| {pct(k['sublayers_verified'], k['built'])} | {k['refused'] + k['errors']} "
                     f"| {k['measured_wrong']} |")
    lines += ["", "Sub-layer sites of the types measured equal:", ""]
    for kind, label in (("causal", "causal LM"), ("encoder", "encoder")):
        parts = [f"{n} {c}" for c, n in sorted(s[kind]["sublayers"].items(), key=lambda x: -x[1])]
        lines.append(f"- {label}: " + "; ".join(parts))
    bad = [r for r in doc["rows"] if r["status"] in ("refused", "error", "measured wrong")]
    if bad:
        lines += ["", "Refused or failed (one line each):", ""]
        lines += [f"- `{r['type']}` ({r['kind']}): {r['status']}: {r.get('reason') or '; '.join(r.get('wrong', []))}"
                  for r in bad]
    unbuilt = Counter(r["reason"].split(":")[0] for r in doc["rows"] if r["status"] == "not built")
    if unbuilt:
        lines += ["", "Not buildable at tiny size: " + ", ".join(
            f"`{r['type']}`" for r in doc["rows"] if r["status"] == "not built") + "."]
    return "\n".join(lines)


def write_readme(text: str) -> None:
    readme = README.read_text(encoding="utf-8")
    if START not in readme or END not in readme:
        raise SystemExit(f"README.md has no {START} ... {END} section")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    README.write_text(f"{head}{START}\n{text}\n{END}{tail}", encoding="utf-8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", nargs="+", default=None, help="only these model types")
    ap.add_argument("--kind", choices=["causal", "encoder", "both"], default="both")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per type")
    ap.add_argument("--memory-gb", type=float, default=10.0, help="address-space limit of each worker")
    ap.add_argument("--write", action="store_true", help="write the JSON results and the README section")
    args = ap.parse_args()
    import transformers

    from repgeom_eval.tiny_models import causal_lm_types, encoder_types

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
        write_readme(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
