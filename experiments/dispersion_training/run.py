"""Paper A's push-away experiment, offline: GPT-2 (scaled down) trained from scratch on English prose and Python
code, baseline vs push-away (cross-domain) vs squeeze at equal steps; per-domain test perplexity at two step counts
(the shape of paper A Table 2 / Table 13). Not part of CI.

    .venv/bin/python experiments/dispersion_training/run.py --smoke          # ~1 minute: checks the pipeline
    .venv/bin/python experiments/dispersion_training/run.py --parallel 3     # the real run: 400 steps, ~35 min
    .venv/bin/python experiments/dispersion_training/run.py --parallel 3 --set training.max_steps=1200 \
        --set 'evaluate_at=[600,1200]' --set training.warmup_steps=60       # 3x longer

Steps: prepare_data.py writes the two domains into WORKDIR/data (nothing downloaded or committed); config.yaml is
copied to WORKDIR and each variant runs as ``repgeom train --config WORKDIR/config.yaml --set ...`` in its own
process; the table goes to experiments/results/dispersion_training[_smoke].{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results"
sys.path.insert(0, str(HERE))

import prepare_data  # noqa: E402

VARIANTS = {
    "baseline": [],
    "push_away": [{"name": "push_away", "weight": 0.01, "cross_domain": True, "layers": "final"}],
    "squeeze": [{"name": "squeeze", "weight": 0.01, "cross_domain": True, "layers": "final"}],
}
SMOKE = ["training.max_steps=20", "evaluate_at=[10,20]", "training.per_device_train_batch_size=8",
         "from_scratch.n_layer=2", "from_scratch.vocab_size=1024"]


def run_variant(workdir: Path, name: str, extra: list[str], log: Path) -> subprocess.Popen:
    sets = [f"aux_losses={json.dumps(VARIANTS[name])}", f"output_dir=runs/{name}", *extra]
    cmd = [sys.executable, "-m", "repgeom_eval", "train", "--config", str(workdir / "config.yaml")]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def mean_last(log: list[dict], key: str, fraction: float = 0.1) -> float | None:
    values = [row[key] for row in log if key in row]
    if not values:
        return None
    tail = values[-max(1, int(len(values) * fraction)):]
    return sum(tail) / len(tail)


def table(results: dict[str, dict]) -> tuple[list[dict], str]:
    rows, steps = [], sorted({e["step"] for r in results.values() for e in r["evaluations"]})
    domains = list(next(iter(results.values()))["data"])
    for name, r in results.items():
        row = {"variant": name, "objective": r["config"]["objective"]}
        for e in r["evaluations"]:
            for d in domains:
                row[f"{d}@{e['step']}"] = e["perplexity"][d]
        row["dispersion"] = mean_last(r["train_log"], "dispersion")
        row["dispersion_cross"] = mean_last(r["train_log"], "dispersion_cross")
        row["s_per_step"] = r["timings"]["s_per_step"]
        rows.append(row)
    head = ["variant"] + [f"{d} ppl @ {s}" for s in steps for d in domains] + \
        ["train d (final, last 10%)", "train d× (cross-domain)", "s/step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["variant"]] + [_fmt(row.get(f"{d}@{s}"), 2) for s in steps for d in domains]
        cells += [_fmt(row["dispersion"], 4), _fmt(row["dispersion_cross"], 4), _fmt(row["s_per_step"], 2)]
        lines.append("| " + " | ".join(cells) + " |")
    return rows, "\n".join(lines)


def _fmt(value, digits: int) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/tmp/repgeom-dispersion-training",
                    help="data, configs, logs and runs (outside git)")
    ap.add_argument("--smoke", action="store_true", help="20 steps of a 2-layer model: checks that it all runs")
    ap.add_argument("--parallel", type=int, default=1, help="variants run at the same time (default 1)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override for every variant (as repgeom train --set)")
    args = ap.parse_args(argv)
    workdir = Path(args.workdir) / ("smoke" if args.smoke else "full")
    workdir.mkdir(parents=True, exist_ok=True)
    data_summary = prepare_data.main(["--out", str(workdir / "data")] +
                                     (["--max-chars", "200000", "--max-test-chars", "20000"] if args.smoke else []))
    shutil.copy(HERE / "config.yaml", workdir / "config.yaml")
    extra = (SMOKE if args.smoke else []) + args.overrides
    t0 = time.time()
    pending, running, failed = list(args.variants), [], []
    while pending or running:
        while pending and len(running) < max(args.parallel, 1):
            name = pending.pop(0)
            log = workdir / f"{name}.log"
            print(f"[{time.strftime('%H:%M:%S')}] start {name} (log: {log})", flush=True)
            running.append((name, run_variant(workdir, name, extra, log)))
        time.sleep(2)
        for name, proc in list(running):
            if proc.poll() is not None:
                running.remove((name, proc))
                print(f"[{time.strftime('%H:%M:%S')}] {name} finished with exit code {proc.returncode}", flush=True)
                if proc.returncode:
                    failed.append(name)
    if failed:
        raise SystemExit(f"variants failed: {failed}; see the logs in {workdir}")
    results = {n: json.loads((workdir / "runs" / n / "results.json").read_text()) for n in args.variants}
    rows, markdown = table(results)
    first = next(iter(results.values()))
    out = {"experiment": "paper A push-away, cross-domain (Table 2 / Table 13 shape)", "smoke": args.smoke,
           "overrides": extra, "wall_s": time.time() - t0, "data": data_summary,
           "model": first["model"], "training": first["config"]["training"],
           "from_scratch": first["config"]["from_scratch"], "rows": rows,
           "aux_losses": {n: r["config"]["aux_losses"] for n, r in results.items()}}
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / ("dispersion_training_smoke" if args.smoke else "dispersion_training")
    stem.with_suffix(".json").write_text(json.dumps(out, indent=2) + "\n")
    stem.with_suffix(".md").write_text(
        f"# Push-away experiment{' (smoke)' if args.smoke else ''}\n\n"
        f"Model: GPT-2 from scratch, {first['model']['n_layers']} layers, width {first['model']['hidden_size']}, "
        f"{first['model']['n_parameters']:,} parameters; {first['config']['training'].get('max_steps')} steps of "
        f"{first['config']['training'].get('per_device_train_batch_size')} x {first['config']['data']['block_size']}"
        f" tokens. Test perplexity per domain (lower is better); d = mean pairwise cosine distance of the final "
        f"hidden states of the training batches (mean over the last 10% of steps).\n\n{markdown}\n\n"
        f"Wall time {out['wall_s'] / 60:.1f} min. Command: `{' '.join(['python', *sys.argv])}`\n")
    print(markdown)


if __name__ == "__main__":
    main()
