"""Push-away, squeeze and a paper C dispersion loss, trained from scratch (paper A Table 2 / Table 13; paper C).

A GPT-2 (scaled down: 4 layers of width 128, 4096-token vocabulary, 128-token blocks) is trained from scratch on
two domains, English prose and Python code, with the literal ``repgeom train`` command: cross-entropy alone
(baseline), plus paper A's cross-domain push-away loss, plus its sign-flipped ablation (squeeze), and plus paper
C's angular-spread loss; every variant with several seeds. Reported: per-domain test perplexity at two step
counts (mean ± sd over the seeds) and the dispersion of the final hidden states during training.

    .venv/bin/python experiments/dispersion_training/run.py --smoke        # ~2 minutes: checks the pipeline
    .venv/bin/python experiments/dispersion_training/run.py --parallel 2   # 4 variants x 3 seeds, 400 steps

prepare_data.py writes the two domains into the work folder (nothing downloaded or committed); config.yaml is
copied there and each (variant, seed) runs as ``repgeom train --config config.yaml --set ...`` in its own process.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import gallery  # noqa: E402
from repgeom_eval.analyses.plots import outside_legend  # noqa: E402
import prepare_data  # noqa: E402

VARIANTS = {
    "baseline": [],
    "push_away": [{"name": "push_away", "weight": 0.01, "cross_domain": True, "layers": "final"}],
    "squeeze": [{"name": "squeeze", "weight": 0.01, "cross_domain": True, "layers": "final"}],
    # paper C's "dispersion" loss with its GPT-2 script's settings (clamped ε-cosine, t = 0.1), λ = 0.1
    "angular_spread": [{"name": "angular_spread", "weight": 0.1, "variant": "reference", "clamp": 0.1}],
}
SMOKE = ["training.max_steps=12", "evaluate_at=[6,12]", "training.per_device_train_batch_size=8",
         "training.warmup_steps=2", "from_scratch.n_layer=2", "from_scratch.vocab_size=1024"]
FULL = ["training.max_steps=400", "evaluate_at=[200,400]", "training.warmup_steps=20"]


def configure(p) -> None:
    p.add_argument("--parallel", type=int, default=2, help="runs at the same time (default 2: one per core)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds per variant (default 0 1 2; smoke: 0)")
    p.add_argument("--reuse", action="store_true",
                   help="keep the runs already finished in the work folder (same settings assumed) and train only "
                        "the missing ones")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for every run (as repgeom train --set)")


def start(exp: gallery.Experiment, variant: str, seed: int, extra: list[str]):
    import subprocess

    sets = [f"aux_losses={json.dumps(VARIANTS[variant])}", f"output_dir=runs/{variant}-s{seed}", f"seed={seed}",
            *extra]
    args = ["train", "--config", "config.yaml"] + [a for s in sets for a in ("--set", s)]
    exp.commands.append("repgeom " + " ".join(map(gallery.shlex.quote, args)))
    log = (exp.logs / f"{variant}-s{seed}.log").open("w", encoding="utf-8")
    return subprocess.Popen([gallery.console_script("repgeom"), *args], stdout=log, stderr=subprocess.STDOUT,
                            cwd=exp.workdir, env=gallery._env())


def mean_last(log: list[dict], key: str, fraction: float = 0.1) -> float | None:
    values = [row[key] for row in log if key in row and row[key] is not None]
    if not values:
        return None
    tail = values[-max(1, int(len(values) * fraction)):]
    return sum(tail) / len(tail)


def mean_sd(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else float("nan"))


def pm(mean: float, sd: float, digits: int = 2) -> str:
    return f"{mean:.{digits}f}" + ("" if math.isnan(sd) else f" ± {sd:.{digits}f}")


def verdict(deltas: dict[str, dict], domains: list[str]) -> str:
    """The third summary line: each objective against what its paper predicts, read against the seed spread (a
    change counts only when every seed moves the same way and the mean exceeds the paired sd)."""
    expected = {"push_away": ("lower", "paper A"), "squeeze": ("higher", "paper A's ablation"),
                "angular_spread": ("lower", "paper C")}
    parts = []
    for v, (direction, source) in expected.items():
        rows = [deltas[f"{v}/{d}"] for d in domains if f"{v}/{d}" in deltas]
        if not rows:
            continue
        clear = [r for r in rows if r["lower_in"] in (0, r["of"]) and r["of"] > 1
                 and abs(r["mean_pct"]) > (0 if math.isnan(r["sd_pct"]) else r["sd_pct"])]
        signs = {"lower" if r["mean_pct"] < 0 else "higher" for r in clear}
        if len(clear) == len(rows) and signs == {direction}:
            word = f"follows {source} (perplexity {direction} in every domain and seed)"
        elif len(clear) == len(rows) and len(signs) == 1:
            word = f"goes against {source} (perplexity {signs.pop()} in every domain and seed)"
        else:
            word = f"does not separate from the baseline at this scale ({source} predicts {direction} perplexity)"
        parts.append(f"{v} {word}")
    return "Against the papers: " + "; ".join(parts) + "."


def main(argv: list[str] | None = None) -> None:
    exp = gallery.Experiment("dispersion_training", "Push-away, squeeze and a dispersion loss, trained from scratch",
                             "paper A Table 2 / Table 13 (push-away, squeeze ablation); paper C (angular spread)",
                             __doc__, argv, configure)
    args = exp.args
    seeds = args.seeds or ([0] if exp.smoke else [0, 1, 2])
    with exp.step("prepare data"):
        data_summary = prepare_data.main(["--out", str(exp.workdir / "data")] +
                                         (["--max-chars", "200000", "--max-test-chars", "20000"] if exp.smoke else []))
    (exp.workdir / "config.yaml").write_text((HERE / "config.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    extra = (SMOKE if exp.smoke else FULL) + args.overrides
    jobs = [(v, s) for s in seeds for v in args.variants]  # seed-major: an early stop still has whole seeds
    done = {(v, s) for v, s in jobs if args.reuse and (exp.workdir / "runs" / f"{v}-s{s}" / "results.json").is_file()}
    if done:
        print(f"[{exp.name}] reusing {len(done)} finished run(s): {sorted(done)}", flush=True)
    with exp.step(f"train {len(jobs) - len(done)} runs, {args.parallel} at a time"):
        pending, running, failed = [j for j in jobs if j not in done], [], []
        while pending or running:
            while pending and len(running) < max(args.parallel, 1):
                v, s = pending.pop(0)
                print(f"[{time.strftime('%H:%M:%S')}] start {v} seed {s}", flush=True)
                running.append((v, s, start(exp, v, s, extra)))
            time.sleep(2)
            for job in list(running):
                if job[2].poll() is not None:
                    running.remove(job)
                    print(f"[{time.strftime('%H:%M:%S')}] {job[0]} seed {job[1]}: exit {job[2].returncode}", flush=True)
                    if job[2].returncode:
                        failed.append(f"{job[0]}-s{job[1]}")
        if failed:
            raise SystemExit(f"runs failed: {failed}; logs in {exp.logs}")
    runs = {(v, s): json.loads((exp.workdir / "runs" / f"{v}-s{s}" / "results.json").read_text(encoding="utf-8"))
            for v, s in jobs}
    first = next(iter(runs.values()))
    domains = list(first["data"])
    steps = sorted({e["step"] for r in runs.values() for e in r["evaluations"]})

    per_run, agg = [], {}
    for (v, s), r in runs.items():
        ppl = {(e["step"], d): e["perplexity"][d] for e in r["evaluations"] for d in domains}
        row = {"variant": v, "seed": s, "perplexity": {f"{d}@{st}": ppl[(st, d)] for st in steps for d in domains},
               "dispersion": mean_last(r["train_log"], "dispersion"),
               "dispersion_cross": mean_last(r["train_log"], "dispersion_cross"),
               "s_per_step": r["timings"]["s_per_step"]}
        per_run.append(row)
    for v in args.variants:
        rows = [r for r in per_run if r["variant"] == v]
        agg[v] = {k: mean_sd([r["perplexity"][k] for r in rows]) for k in rows[0]["perplexity"]}
        agg[v]["dispersion"] = mean_sd([r["dispersion"] for r in rows])
        agg[v]["dispersion_cross"] = mean_sd([r["dispersion_cross"] for r in rows])
    keys = [f"{d}@{st}" for st in steps for d in domains]
    exp.table(f"Test perplexity per domain (mean ± sd over seeds {seeds}); d = mean pairwise cosine distance of "
              "the final hidden states of the training batches, last 10% of steps",
              ["variant"] + [f"{k.split('@')[0]} ppl @ {k.split('@')[1]}" for k in keys] + ["train d", "train d×"],
              [[v] + [pm(*agg[v][k]) for k in keys] + [pm(*agg[v]["dispersion"], 4), pm(*agg[v]["dispersion_cross"], 4)]
               for v in args.variants])
    exp.table("Every run", ["variant", "seed"] + keys + ["train d", "s/step"],
              [[r["variant"], r["seed"]] + [r["perplexity"][k] for k in keys] + [r["dispersion"], r["s_per_step"]]
               for r in per_run])

    # relative change against the baseline at the last step, per seed (paired: same init and data order)
    last = steps[-1]
    deltas = {}
    if "baseline" in args.variants:
        base = {r["seed"]: r for r in per_run if r["variant"] == "baseline"}
        for v in args.variants:
            if v == "baseline":
                continue
            for d in domains:
                k = f"{d}@{last}"
                rel = [100 * (r["perplexity"][k] / base[r["seed"]]["perplexity"][k] - 1)
                       for r in per_run if r["variant"] == v and r["seed"] in base]
                deltas[f"{v}/{d}"] = {"mean_pct": mean_sd(rel)[0], "sd_pct": mean_sd(rel)[1],
                                      "lower_in": sum(x < 0 for x in rel), "of": len(rel)}
        exp.table(f"Perplexity change against the baseline at step {last}, paired by seed (negative = better)",
                  ["variant", "domain", "mean %", "sd %", "seeds lower"],
                  [[k.split("/")[0], k.split("/")[1], round(x["mean_pct"], 2), round(x["sd_pct"], 2),
                    f"{x['lower_in']}/{x['of']}"] for k, x in deltas.items()])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(domains), figsize=(4.2 * len(domains), 3.4))
    for ax, d in zip(axes if len(domains) > 1 else [axes], domains):
        k = f"{d}@{last}"
        means = [agg[v][k][0] for v in args.variants]
        sds = [0 if math.isnan(agg[v][k][1]) else agg[v][k][1] for v in args.variants]
        ax.bar(range(len(means)), means, yerr=sds, capsize=4,
               color=["#888888", "#1f77b4", "#d62728", "#2ca02c"][: len(means)])
        for i, v in enumerate(args.variants):
            ax.scatter([i] * len(seeds), [r["perplexity"][k] for r in per_run if r["variant"] == v],
                       color="black", s=10, zorder=3)
        ax.set_xticks(range(len(means)), args.variants, rotation=20)
        lo = min(r["perplexity"][k] for r in per_run)
        hi = max(r["perplexity"][k] for r in per_run)
        ax.set_ylim(lo - 0.25 * (hi - lo + 1), hi + 0.25 * (hi - lo + 1))
        ax.set_title(f"{d}: test perplexity @ step {last}")
    fig.suptitle(f"mean ± sd over seeds {seeds}; dots: single runs", fontsize=9)
    exp.figure(fig, "perplexity", f"Per-domain test perplexity at step {last} by training objective "
               f"(mean ± sd over {len(seeds)} seed(s), dots: each run; lower is better).")

    fig, ax = plt.subplots(figsize=(5.2, 3.4))
    for v in args.variants:
        r = runs[(v, seeds[0])]
        pts = [(row["step"], row["dispersion"]) for row in r["train_log"] if row.get("dispersion") is not None]
        if pts:
            xs, ys = zip(*pts)
            w = max(1, len(ys) // 25)
            smooth = [statistics.fmean(ys[max(0, i - w):i + 1]) for i in range(len(ys))]
            ax.plot(xs, smooth, label=v)
    ax.set_xlabel("step")
    ax.set_ylabel("train d at final (smoothed)")
    outside_legend(ax, fontsize=8)
    ax.set_title(f"dispersion of the final hidden states, seed {seeds[0]}")
    exp.figure(fig, "dispersion", "Dispersion d of the final hidden states of each training batch, by step "
               f"(moving average, seed {seeds[0]}).")

    def delta_line(v: str) -> str:
        parts = [f"{d} {deltas[f'{v}/{d}']['mean_pct']:+.1f} % (lower in {deltas[f'{v}/{d}']['lower_in']}/"
                 f"{deltas[f'{v}/{d}']['of']} seeds)" for d in domains if f"{v}/{d}" in deltas]
        return f"{v}: " + ", ".join(parts)

    model = first["model"]
    summary = [
        f"GPT-2 from scratch ({model['n_layers']} layers, width {model['hidden_size']}, "
        f"{model['n_parameters']:,} parameters), {first['config']['training'].get('max_steps')} steps on Python-doc/"
        f"fortune prose and stdlib code, {len(args.variants)} objectives × {len(seeds)} seed(s) with `repgeom train`.",
        "Test perplexity at step " + str(last) + " against the baseline, paired by seed: "
        + "; ".join(delta_line(v) for v in args.variants if v != "baseline") + ".",
        verdict(deltas, domains),
    ]
    notes = [
        "λ: push-away and squeeze 0.01 cross-domain at `final` (paper A's cross-domain setting); angular_spread 0.1 "
        "on every block output (paper C's default layers), variant `reference` with clamp t = 0.1 (paper C's GPT-2 "
        "script).",
        "Seeds change the initialisation and the data order; within a seed every objective sees the same batches, "
        "so the per-seed differences are paired.",
        "Runs went side by side on a shared 2-core machine; s/step is wall time per step under that load.",
    ]
    exp.finish(summary, {"variants": VARIANTS, "seeds": seeds, "overrides": extra, "data": data_summary,
                         "model": model, "training": first["config"]["training"],
                         "from_scratch": first["config"]["from_scratch"], "runs": per_run,
                         "aggregate": {v: {k: list(x) for k, x in a.items()} for v, a in agg.items()},
                         "relative_to_baseline": deltas}, notes)
    gallery.from_raw(exp.name, summarize, draw, [gallery.FROM_RAW, "--out", str(exp.out)])


# -- intervals and verdicts (issue 25): everything below reads result.json only --------------------------------------

EXPECTED = {"push_away": ("below", "paper A"), "squeeze": ("above", "paper A's ablation"),
            "angular_spread": ("below", "paper C")}


def paired_changes(d: dict) -> dict:
    """Per objective and domain: the % change of test perplexity against the baseline at the last step, per seed
    (paired: same initialisation and batches), and the test of its mean over the seeds (gallery.mean_test: with at
    most 10 seeds the t-interval and the exact sign-flip p)."""

    runs = d["runs"]
    keys = list(runs[0]["perplexity"])  # the run's own order of domains
    last = max(int(k.split("@")[1]) for k in keys)
    domains = [k.split("@")[0] for k in keys if k.endswith(f"@{last}")]
    base = {r["seed"]: r for r in runs if r["variant"] == "baseline"}
    out = {}
    for v in dict.fromkeys(r["variant"] for r in runs):
        if v == "baseline":
            continue
        for dom in domains:
            k = f"{dom}@{last}"
            pairs = [(r["seed"], 100 * (r["perplexity"][k] / base[r["seed"]]["perplexity"][k] - 1))
                     for r in runs if r["variant"] == v and r["seed"] in base]
            rel = [x for _, x in pairs]
            test = gallery.mean_test(f"{v}/{dom}", rel, 0.0, EXPECTED[v][0]) if v in EXPECTED and len(rel) > 1 \
                else None
            out[f"{v}/{dom}"] = {"seeds": [s for s, _ in pairs], "pct": rel, "step": last,
                                 "ci": test.as_dict() if test else None}
    return out


def summarize(doc: dict) -> dict:
    """result.json with the summary, intervals and verdicts recomputed from its per-run perplexities."""
    d = doc["data"]
    ch = paired_changes(d)
    n_seeds = len(d["seeds"])
    variants = list(dict.fromkeys(k.split("/")[0] for k in ch))
    domains = list(dict.fromkeys(k.split("/")[1] for k in ch))
    last = next(iter(ch.values()))["step"] if ch else 0

    primary_key = next((f"{v}/{dom}" for v in EXPECTED for dom in domains if ch.get(f"{v}/{dom}", {}).get("ci")),
                       None)
    family = [gallery.StatTest(**ch[k]["ci"]) for k in ch if ch[k]["ci"]]
    finding = gallery.decide(family, primary_key, "each objective moves perplexity the way its paper predicts") \
        if primary_key else None
    for k in ch:
        if finding and ch[k]["ci"]:
            ch[k]["ci"] = finding["tests"][k]

    def decide(key: str) -> str:
        c = ch[key]["ci"]
        return c["verdict"] if c else gallery.CANNOT_TELL

    def show(key: str) -> str:
        c = ch[key]["ci"]
        mean = statistics.fmean(ch[key]["pct"])
        return f"{key.split('/')[1]} {mean:+.1f} %" + (f" ({c['low']:+.1f} to {c['high']:+.1f})" if c else "")

    m = d["model"]
    said = {gallery.FOLLOWS: "follows", gallery.OPPOSITE: "opposite", gallery.CANNOT_TELL: "cannot tell"}
    verdict_parts = []
    for v in variants:
        if v not in EXPECTED:
            continue
        words = [f"{dom}: {said[decide(f'{v}/{dom}')]} (p {ch[f'{v}/{dom}']['ci']['p']:.2g}, Holm "
                 f"{ch[f'{v}/{dom}']['ci']['p_holm']:.2g})" if ch[f"{v}/{dom}"]["ci"] else f"{dom}: cannot tell"
                 for dom in domains]
        direction = "lower" if EXPECTED[v][0] == "below" else "higher"
        verdict_parts.append(f"{v} ({EXPECTED[v][1]} predicts {direction} perplexity) — " + ", ".join(words))
    floor = 2 / 2 ** n_seeds
    summary = [
        f"GPT-2 from scratch ({m['n_layers']} layers, width {m['hidden_size']}, {m['n_parameters']:,} parameters), "
        f"{d['training'].get('max_steps')} steps on Python-doc/fortune prose and stdlib code, {len(variants) + 1} "
        f"objectives × {n_seeds} seed(s) with `repgeom train`. Not covered: longer training, larger models, more "
        "seeds, other loss weights.",
        f"Test perplexity at step {last} against the baseline, paired by seed, mean % change with 95 % t-interval "
        f"over the {n_seeds} seeds: "
        + "; ".join(f"{v}: " + ", ".join(show(f"{v}/{dom}") for dom in domains) for v in variants) + ".",
        (f"Primary test: {primary_key}, the mean paired change over the seeds (t-interval; exact sign-flip p over "
         f"the {2 ** n_seeds} sign patterns); family: the {len(family)} (objective, domain) changes, Holm. "
         if finding else "")
        + "Verdicts: " + "; ".join(verdict_parts)
        + (f"; primary: {said[finding['verdict']]}" if finding else "")
        + f". With {n_seeds} seeds the exact test's smallest two-sided p is {floor:.2g}, so no verdict can be "
        "reached at this size however consistently the seeds move; the intervals assume normal seed-to-seed changes "
        "and are wide for the same reason.",
    ]
    rows = [[k.split("/")[0], k.split("/")[1], statistics.fmean(x["pct"]),
             f"{x['ci']['low']:+.2f} to {x['ci']['high']:+.2f}" if x["ci"] else "n/a",
             ", ".join(f"{p:+.2f}" for p in x["pct"]), x["ci"]["p"] if x["ci"] else "n/a",
             x["ci"]["p_holm"] if x["ci"] else "n/a", decide(k)] for k, x in ch.items()]
    tables = [{"title": f"Perplexity change against the baseline at step {last}, paired by seed, with 95 % t-intervals "
                        "over the seeds, exact sign-flip p and Holm over the objectives and domains",
               "header": ["variant", "domain", "mean %", "95 % CI", "per seed %", "p", "p (Holm)", "verdict"],
               "rows": rows}]
    if finding:
        tables.insert(0, gallery.finding_table(finding, "each objective moves test perplexity the way its paper "
                                                        "predicts"))
    tables.append(protocol_table(n_seeds, last))
    notes = [gallery.RULE_NOTE,
             f"Units: the seeds (each seed is one paired initialisation and data order). With {n_seeds} seeds a "
             f"percentile bootstrap has only {math.comb(2 * n_seeds - 1, n_seeds)} distinct resamples and is never "
             "wider than the seeds' own range, so none is used: the t-interval and the exact sign-flip test over the "
             "seeds replace it (and the as-run rule, every seed the same way and |mean| above the sd)."]
    figures = [*[f for f in doc["figures"] if f["file"] != "perplexity_change.png"],
               {"file": "perplexity_change.png", "caption": f"Test perplexity change against the baseline at step "
                f"{last}, paired by seed: mean with 95 % t-interval over the seeds (bars) and each seed "
                "(dots); below 0 is better"}]
    out = gallery.regenerated(doc, summary, tables, notes, ch, figures)
    if finding:
        out["data"]["findings"] = gallery.stable({"perplexity_change": finding})
    return out


def protocol_table(n_seeds: int, steps: int) -> dict:
    """Where this run departs from papers A and C's training protocols."""
    return {"title": "Protocol: papers A and C against this run",
            "header": ["", "papers", "this run", "why"],
            "rows": [
                ["model", "GPT-2-size and larger models, pretrained for long runs", "a 4-layer width-128 GPT-2 from "
                 f"scratch, {steps} steps", "2 CPU cores"],
                ["data", "web-scale and domain corpora", "Python documentation prose, fortunes and standard-library "
                 "code", "offline"],
                ["loss weights", "tuned per paper", "push-away and squeeze 0.01, angular spread 0.1 (paper C's "
                 "script settings)", "not tuned here"],
                ["seeds", "not stated as a test", f"{n_seeds}, paired with the baseline", "CPU time; the exact test's "
                 f"floor is {2 / 2 ** n_seeds:.2g}"],
                ["tests", "none stated", "mean paired change, t-interval, exact sign-flip p, Holm over objectives × "
                 "domains", "one primary test per finding"],
            ]}


def draw(doc: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ch = doc["data"]["intervals"]
    domains = list(dict.fromkeys(k.split("/")[1] for k in ch))
    variants = list(dict.fromkeys(k.split("/")[0] for k in ch))
    fig, axes = plt.subplots(1, len(domains), figsize=(4.2 * len(domains), 3.4), squeeze=False)
    for ax, dom in zip(axes[0], domains):
        for i, v in enumerate(variants):
            x = ch[f"{v}/{dom}"]
            mean = statistics.fmean(x["pct"])
            if x["ci"]:
                ax.errorbar([i], [mean], yerr=[[mean - x["ci"]["low"]], [x["ci"]["high"] - mean]], fmt="o",
                            color=f"C{i}", capsize=5)
            ax.scatter([i] * len(x["pct"]), x["pct"], color="black", s=10, zorder=3)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xticks(range(len(variants)), variants, rotation=20)
        ax.set_ylabel("perplexity change vs baseline (%)")
        ax.set_title(f"{dom}: step {next(iter(ch.values()))['step']}", fontsize=10)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    gallery.save_figure(fig, out / "perplexity_change.png")


if __name__ == "__main__":
    if gallery.FROM_RAW in sys.argv:
        gallery.from_raw("dispersion_training", summarize, draw)
    else:
        main()
