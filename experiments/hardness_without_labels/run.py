"""Hardness without labels: does the dispersion c_i of a question's hidden state rank questions by how hard they
are for the model, and are slices of lower dispersion less accurate? (paper A, Tables 3–4 and Fig. 8)

    .venv/bin/python experiments/hardness_without_labels/run.py --smoke   # 40 questions, about 3 minutes
    .venv/bin/python experiments/hardness_without_labels/run.py           # 600 questions, about 15 minutes

1. A cloze-style multiple-choice quiz is generated from WordNet (Debian package ``wordnet``), seeded and
   deterministic: "Definition: <gloss>\\nWord:" with the synset's head word and 3 distractors from the same
   lexicographer file (so all four are, say, animals or artifacts), gold and distractors drawn from the same
   words (single lower-case words of 3-14 letters); a gloss that contains one of its own words is skipped. Written to WORKDIR/data; never committed.
2. The quiz runs through the literal ``lm_eval`` command, as docs/lmeval.md ("Your own prompt") shows a user:
   a task YAML naming ``repgeom_eval.lmeval.task.HardnessTask``, loaded with ``--include_path``, on
   SmolLM2-135M-Instruct (its GGUF file: ``--model_args pretrained=FOLDER,gguf_file=NAME``), ``--log_samples``.
   ``--metadata`` also asks for the registered ``dispersion`` metric at every block output, so c_i at every layer
   comes from the same forward pass.
3. ``repgeom slices --calibrate`` on the samples: the controlled-slice curve (slice dispersion against the fraction
   correct, 10 seeds) and the prediction of slice accuracy from slice dispersion.
4. From the samples: accuracy, AUROC of c_i for correctness (with a bootstrap interval), the same per layer, and
   the label-free baseline of the prompt's own perplexity.
"""

from __future__ import annotations

import json
import math
import random
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gallery  # noqa: E402
from repgeom_eval.analyses.plots import outside_legend  # noqa: E402
from gallery import Experiment, stable_key, wordnet_synsets, write_jsonl  # noqa: E402

TASK = "repgeom_wordnet_quiz"
N_FULL, N_SMOKE = 600, 40
LAYERS = "resid_post:[0,4,8,12,16,20,24,29]"  # c_i at these block outputs too, from the same forward pass
SEED = 17
BOOTSTRAP = 2000


def configure(parser) -> None:
    parser.add_argument("--questions", type=int, default=None,
                        help=f"quiz size (default {N_FULL}; {N_SMOKE} with --smoke)")
    parser.add_argument("--batch-size", type=int, default=16, help="lm_eval --batch_size (default 16)")


# -- the quiz -------------------------------------------------------------------------------------------------------

def tagged_senses() -> dict[tuple[str, int], int]:
    """(lemma, lexicographer file) → how often a noun sense of it is tagged in WordNet's semantic concordance."""
    counts: dict[tuple[str, int], int] = defaultdict(int)
    path = gallery.WORDNET_DIR / "cntlist.rev"
    gallery.require_debian("wordnet", path.is_file(), "this experiment's WordNet sense counts")
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        key, _, count = line.split()
        lemma, _, rest = key.partition("%")
        ss_type, lexfile = rest.split(":")[:2]
        if ss_type == "1":  # nouns
            counts[(lemma, int(lexfile))] = max(counts[(lemma, int(lexfile))], int(count))
    return counts


def plain_word(word: str) -> bool:
    return word.isalpha() and word.islower() and 3 <= len(word) <= 14


def build_quiz(n: int, seed: int = SEED, common: bool = False) -> list[dict]:
    """``n`` questions: a noun's gloss, its head word and 3 distractors from the same lexicographer file; with
    ``common``, only words whose sense is tagged in WordNet's sense counts (an easier quiz)."""
    tagged = tagged_senses() if common else {}
    by_lexname: dict[int, set[str]] = defaultdict(set)
    candidates = []
    for synset in wordnet_synsets(("noun",)):
        head = synset.words[0]
        if not plain_word(head) or (common and tagged.get((head, synset.lexname), 0) < 1):
            continue
        by_lexname[synset.lexname].add(head)
        definition = synset.definition
        words = {w.lower() for w in synset.words}
        tokens = set(re.findall(r"[a-z]+", definition.lower()))
        if 15 <= len(definition) <= 150 and not (words & tokens) and not any(w + "s" in tokens for w in words):
            candidates.append((synset, words))
    pools = {lex: sorted(words) for lex, words in by_lexname.items()}
    candidates.sort(key=lambda c: stable_key(f"{seed}:{c[0].offset}"))
    quiz, used = [], set()
    for synset, words in candidates:
        head = synset.words[0]
        pool = [w for w in pools[synset.lexname] if w not in words]
        if head in used or len(pool) < 3:
            continue
        rng = random.Random(f"{seed}:{synset.offset}")
        choices = [head, *rng.sample(pool, 3)]
        rng.shuffle(choices)
        quiz.append({"id": synset.offset, "definition": synset.definition, "choices": choices,
                     "answer": choices.index(head), "lexname": synset.lexname})
        used.add(head)
        if len(quiz) == n:
            break
    if len(quiz) < n:
        raise SystemExit(f"WordNet gave only {len(quiz)} usable questions, {n} asked for")
    return quiz


TASK_YAML = """\
# written by experiments/hardness_without_labels/run.py: the form docs/lmeval.md ("Your own prompt") documents
task: {task}
class: !function repgeom_eval.lmeval.task.HardnessTask
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Definition: {{{{definition}}}}\\nWord:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
  - {{metric: repgeom_dispersion, aggregation: repgeom_mean, higher_is_better: null}}
  - {{metric: repgeom_dispersion_correct, aggregation: repgeom_mean, higher_is_better: null}}
  - {{metric: repgeom_dispersion_incorrect, aggregation: repgeom_mean, higher_is_better: null}}
  - {{metric: repgeom_auroc, aggregation: repgeom_auroc, higher_is_better: null}}
  - {{metric: repgeom_acc_low_c, aggregation: repgeom_acc_low_c, higher_is_better: null}}
  - {{metric: repgeom_acc_high_c, aggregation: repgeom_acc_high_c, higher_is_better: null}}
  - {{metric: repgeom_slice_spearman, aggregation: repgeom_slice_spearman, higher_is_better: null}}
metadata:
  version: 1.0
"""


# -- statistics -----------------------------------------------------------------------------------------------------

def auroc_ci(scores, labels, seed: int = 0, n: int = BOOTSTRAP) -> tuple[float, float]:
    """95 % percentile bootstrap interval of the AUROC, resampling questions (repgeom_eval.functional.bootstrap;
    resamples with one class only are undefined and dropped)."""
    from repgeom_eval.functional.bootstrap import bootstrap_ci
    from repgeom_eval.functional.stats import auroc

    ci = bootstrap_ci(lambda s, y: auroc(s, y), scores, labels, n_resamples=n, seed=seed)
    return ci.low, ci.high


def layer_key(name: str) -> tuple[int, str]:
    m = re.search(r"@resid_post:(\d+)$", name)
    return (int(m.group(1)), name) if m else (10**6, name)


# -- figures --------------------------------------------------------------------------------------------------------

def slice_figure(curve: dict, size: int, rho_ci: dict | None = None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [100 * f for f in curve["fractions"]]
    fig, axes = plt.subplots(1, 2, figsize=(9.2, 3.5))
    ax = axes[0]
    ax.errorbar(xs, curve["dispersion_mean"], yerr=curve["dispersion_se"], marker="o", ms=4, capsize=3,
                color="C0")
    ax.set_xlabel("correct questions in the slice (%)")
    ax.set_ylabel("slice dispersion D (final layer)")
    ax.set_title(f"Spearman ρ = {curve['spearman']:.2f}" + (f" (95 % CI {rho_ci['low']:.2f} to {rho_ci['high']:.2f})"
                 if rho_ci else "") + f"; {size} per slice, {curve['seeds']} seeds", fontsize=9)
    ax.grid(alpha=0.3)
    ax = axes[1]
    if curve.get("perplexity_mean"):
        ax.errorbar(xs, curve["perplexity_mean"], yerr=curve["perplexity_se"], marker="o", ms=4, capsize=3,
                    color="C1", label=f"gold answer given prompt (ρ = {curve['spearman_perplexity']:.2f})")
    if curve.get("prompt_perplexity_mean"):
        ax.errorbar(xs, curve["prompt_perplexity_mean"], yerr=curve["prompt_perplexity_se"], marker="s", ms=4,
                    capsize=3, color="C2", label=f"prompt (ρ = {curve['spearman_prompt_perplexity']:.2f})")
    ax.set_yscale("log")
    ax.set_xlabel("correct questions in the slice (%)")
    ax.set_ylabel("slice mean perplexity (per token)")
    outside_legend(ax, fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def calibration_figure(calibration: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9.2, 3.6))
    ax = axes[0]
    for seed, points in enumerate(calibration["test_slices"]):
        ax.scatter(points["dispersion"], points["accuracy"], s=6, alpha=0.35, color="C0",
                   label="test slices" if seed == 0 else None)
        order = sorted(range(len(points["dispersion"])), key=lambda i: points["dispersion"][i])
        ax.plot([points["dispersion"][i] for i in order], [points["predicted"][i] for i in order], color="C3",
                alpha=0.5, lw=1, label="fitted (chosen on validation)" if seed == 0 else None)
    ax.set_xlabel("slice dispersion D")
    ax.set_ylabel("slice accuracy")
    outside_legend(ax, fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes[1]
    for points in calibration["test_slices"]:
        ax.scatter(points["accuracy"], points["predicted"], s=6, alpha=0.35, color="C0")
    ax.plot([0, 1], [0, 1], color="grey", lw=1, ls="--")
    ax.set_xlabel("true slice accuracy")
    ax.set_ylabel("predicted from slice dispersion")
    ax.set_title(f"test MAE {calibration['mae_mean']:.3f} ± {calibration['mae_se']:.3f} over "
                 f"{calibration['seeds']} seeds ({calibration['size']} per slice)", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def layer_figure(layers: list[tuple[str, float]], intervals: dict | None = None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    xs = range(len(layers))
    per_layer = (intervals or {}).get("auroc_by_layer")
    if per_layer:
        est = [per_layer[name]["estimate"] for name, _ in layers]  # the AUROC the interval is about
        lo = [max(0.0, e - per_layer[name]["low"]) for e, (name, _) in zip(est, layers)]
        hi = [max(0.0, per_layer[name]["high"] - e) for e, (name, _) in zip(est, layers)]
        ax.errorbar(xs, est, yerr=[lo, hi], marker="o", ms=3, capsize=2)
    else:
        ax.plot(xs, [a for _, a in layers], marker="o", ms=3)
    final = (intervals or {}).get("auroc")
    if final:
        ax.axhspan(final["low"], final["high"], color="C1", alpha=0.15, lw=0,
                   label=f"final layer {final['estimate']:.3f}, 95 % CI")
        ax.legend(fontsize=7, loc="lower right")
    ax.axhline(0.5, color="grey", lw=1, ls="--")
    ax.set_xticks(range(0, len(layers), 5 if len(layers) > 10 else 1))
    ax.set_xticklabels([layers[i][0] for i in range(0, len(layers), 5 if len(layers) > 10 else 1)], fontsize=8)
    ax.set_xlabel("block output (resid_post)")
    ax.set_ylabel("AUROC of c_i for correctness")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


# -- the run --------------------------------------------------------------------------------------------------------

def main(argv=None) -> None:
    import numpy as np

    exp = Experiment("hardness_without_labels", "Hardness without labels: question dispersion on a WordNet quiz",
                     "paper A, Tables 3–4 (hardness slices) and Fig. 8", doc=__doc__, argv=argv, configure=configure)
    n = exp.args.questions or (N_SMOKE if exp.smoke else N_FULL)
    with exp.step(f"generate the WordNet quiz ({n} questions)"):
        quiz = build_quiz(n)
        data = write_jsonl(exp.workdir / "data" / "wordnet_quiz.jsonl", quiz)
        tasks = exp.workdir / "tasks"
        tasks.mkdir(exist_ok=True)
        (tasks / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data), encoding="utf-8")
    gguf = Path(gallery.smollm2())
    out = exp.workdir / "lm_eval_out"
    if out.exists():
        import shutil

        shutil.rmtree(out)
    metadata = {"repgeom_metrics": ["dispersion"], "repgeom_layers": [LAYERS]}
    with exp.step("lm_eval on SmolLM2-135M-Instruct"):
        lm_seconds = exp.run("lm_eval", "--model", "hf", "--model_args",
                             f"pretrained={gguf.parent},gguf_file={gguf.name}", "--include_path", tasks,
                             "--tasks", TASK, "--batch_size", exp.args.batch_size, "--log_samples",
                             "--output_path", out, "--metadata", json.dumps(metadata), log="lm_eval")
    slices_json = exp.workdir / "slices.json"
    with exp.step("repgeom slices --calibrate"):
        args = ["slices", out, "--task", TASK, "--output", slices_json, "--plot", exp.workdir / "slices_repgeom.png"]
        try:
            exp.run("repgeom", *args, "--calibrate", log="slices")
        except SystemExit as exc:
            if not exp.smoke:
                raise
            # a 40-question quiz rarely has both kinds of answer in every calibration part: the curve only
            exp.warn(f"--calibrate failed at smoke size, slices without it: {str(exc).splitlines()[-1]}")
            exp.run("repgeom", *args, log="slices")

    # -- read what the commands wrote -------------------------------------------------------------------------------
    results_file = max(out.rglob("results_*.json"), key=lambda p: p.name)
    table = json.loads(results_file.read_text(encoding="utf-8"))["results"][TASK]
    samples_file = max(out.rglob(f"samples_{TASK}_*.jsonl"), key=lambda p: p.name)
    samples = sorted((json.loads(line) for line in samples_file.read_text(encoding="utf-8").splitlines()),
                     key=lambda s: s["doc_id"])
    sl = json.loads(slices_json.read_text(encoding="utf-8"))
    curve, cal = sl["slices"], sl["calibration"]
    from repgeom_eval.functional.stats import auroc

    correct = np.array([s["acc"] for s in samples], dtype=float)
    c = np.array([s["repgeom_dispersion"] for s in samples], dtype=float)
    prompt_ppl = np.array([s["repgeom_slice_spearman"]["prompt_ppl"] for s in samples], dtype=float)
    answer_ppl = np.array([s["repgeom_slice_spearman"]["ppl"] for s in samples], dtype=float)
    acc = float(correct.mean())
    auc = float(table["repgeom_auroc,none"])
    auc_lo, auc_hi = auroc_ci(c, correct)
    auc_prompt = float(auroc(-prompt_ppl, correct))  # lower prompt perplexity → predicted correct
    layer_names = sorted((k for k in samples[0] if k.startswith("repgeom:dispersion@resid_post:")), key=layer_key)
    layers = [(name.split("@")[1].split(":")[1],
               float(auroc(np.array([s[name] for s in samples], dtype=float), correct))) for name in layer_names]
    best_layer = max(layers, key=lambda x: x[1]) if layers else ("-", float("nan"))
    lex_acc: dict[int, list[float]] = defaultdict(list)
    for q, ok in zip(quiz, correct):
        lex_acc[q["lexname"]].append(ok)

    # -- tables and figures -----------------------------------------------------------------------------------------
    exp.table("lm_eval's table (final layer, last context token)", ["metric", "value"], [
        ["questions", len(samples)], ["acc", acc], ["acc s.e.", float(table.get("acc_stderr,none", math.nan))],
        ["repgeom_auroc (c_i → correct)", auc], ["AUROC 95 % bootstrap interval", f"{auc_lo:.3f} – {auc_hi:.3f}"],
        ["repgeom_acc_low_c (lowest c_i decile)", float(table["repgeom_acc_low_c,none"])],
        ["repgeom_acc_high_c (highest c_i decile)", float(table["repgeom_acc_high_c,none"])],
        ["repgeom_dispersion D", float(table["repgeom_dispersion,none"])],
        ["repgeom_dispersion_correct", float(table["repgeom_dispersion_correct,none"])],
        ["repgeom_dispersion_incorrect", float(table["repgeom_dispersion_incorrect,none"])],
        ["repgeom_slice_spearman", float(table["repgeom_slice_spearman,none"])],
        ["AUROC of −(prompt perplexity) → correct (label-free baseline)", auc_prompt],
    ])
    exp.table(f"Controlled slices (`repgeom slices`): {curve['size']} questions per slice, {curve['seeds']} seeds, "
              "mean ± s.e.", ["correct", "slice dispersion", "answer perplexity", "prompt perplexity"],
              [[f"{100 * f:.0f}%", f"{curve['dispersion_mean'][i]:.5f} ± {curve['dispersion_se'][i]:.5f}",
                f"{curve['perplexity_mean'][i]:.1f} ± {curve['perplexity_se'][i]:.1f}",
                f"{curve['prompt_perplexity_mean'][i]:.1f} ± {curve['prompt_perplexity_se'][i]:.1f}"]
               for i, f in enumerate(curve["fractions"])])
    exp.table("Spearman ρ against the fraction correct", ["curve", "ρ"], [
        ["slice dispersion (11 means)", curve["spearman"]],
        [f"slice dispersion (all {len(curve['fractions']) * curve['seeds']} slices)", curve["spearman_all_slices"]],
        ["slice answer perplexity", curve["spearman_perplexity"]],
        ["slice prompt perplexity", curve["spearman_prompt_perplexity"]]])
    cal = cal or {"mae_mean": math.nan, "mae_se": math.nan, "size": 0, "chosen": [], "seeds": 0, "test_slices": []}
    # what predicting 0.5 (the calibration slices' mean accuracy) for every test slice would score
    mae_constant = float(np.mean([abs(a - 0.5) for t in cal["test_slices"] for a in t["accuracy"]])) \
        if cal["test_slices"] else math.nan
    chosen = ", ".join(f"{k} ×{cal['chosen'].count(k)}" for k in dict.fromkeys(cal["chosen"]))
    exp.table("Calibration (`repgeom slices --calibrate`): slice accuracy from slice dispersion",
              ["test MAE (mean ± s.e. over seeds)", "MAE of always predicting 0.5", "slice size",
               "regressor chosen on validation"],
              [[f"{cal['mae_mean']:.3f} ± {cal['mae_se']:.3f}", mae_constant, cal["size"], chosen]])
    if layers:
        exp.table("AUROC of c_i for correctness at every block output (same forward pass, `repgeom_metrics`)",
                  ["layer", "AUROC"], [[name, a] for name, a in layers])
    exp.figure(slice_figure(curve, curve["size"]), "slices",
               "Controlled slices: slice dispersion (left) and mean perplexities (right) against the fraction of "
               "correctly answered questions, SmolLM2-135M-Instruct on the WordNet quiz (mean ± s.e. over seeds)")
    if cal["test_slices"]:
        exp.figure(calibration_figure(cal), "calibration",
                   "Calibration: slice accuracy against slice dispersion on the test slices with the fitted "
                   "regressor (left), and predicted against true slice accuracy (right)")
    if layers:
        exp.figure(layer_figure(layers), "auroc_by_layer", "AUROC of c_i for correctness at each block output")
    for note in dict.fromkeys(sl.get("notes", [])):
        exp.warn(f"repgeom slices: {note}")

    # -- summary ------------------------------------------------------------------------------------------------------
    low_c, high_c = float(table["repgeom_acc_low_c,none"]), float(table["repgeom_acc_high_c,none"])
    layer_range = (f"{min(a for _, a in layers):.2f}–{max(a for _, a in layers):.2f}" if layers else "n/a")
    follows_auc = auc_lo > 0.5
    follows_curve = curve["spearman"] > 0.5
    if follows_auc and follows_curve:
        verdict = (f"SmolLM2-135M follows it here: c_i ranks questions better than chance (AUROC {auc:.3f}, 95 % CI "
                   f"{auc_lo:.3f}–{auc_hi:.3f}) and slice dispersion rises with the fraction correct "
                   f"(ρ = {curve['spearman']:.2f}).")
    else:
        parts = []
        if not follows_auc:
            parts.append(f"c_i does not rank the questions (AUROC {auc:.3f}, 95 % CI {auc_lo:.3f}–{auc_hi:.3f}; "
                         f"{layer_range} at the {len(layers)} layers read; lowest-c_i decile {low_c:.2f} correct, "
                         f"highest {high_c:.2f})")
        else:
            parts.append(f"c_i ranks the questions better than chance (AUROC {auc:.3f}, 95 % CI "
                         f"{auc_lo:.3f}–{auc_hi:.3f})")
        parts.append(f"slice dispersion {'rises' if follows_curve else 'does not rise'} with the fraction correct "
                     f"(ρ = {curve['spearman']:.2f}, D {curve['dispersion_mean'][0]:.3f} → "
                     f"{curve['dispersion_mean'][-1]:.3f})")
        if math.isfinite(mae_constant):
            better = cal["mae_mean"] < mae_constant
            parts.append(f"calibration MAE {cal['mae_mean']:.2f} is {'below' if better else 'no better than'} "
                         f"always predicting 0.5 ({mae_constant:.2f})")
        verdict = ("SmolLM2-135M-Instruct on this quiz does not follow it: " + "; ".join(parts)
                   + f". The label-free prompt perplexity does better (AUROC {auc_prompt:.3f}).")
    summary = [
        f"SmolLM2-135M-Instruct (GGUF) answered {len(samples)} cloze-style WordNet questions (definition → word, 3 "
        f"distractors from the same lexicographer file) through `lm_eval --include_path` with a repgeom hardness "
        f"YAML, then `repgeom slices --calibrate` on its samples.",
        f"Accuracy {acc:.3f}; AUROC of c_i for correctness {auc:.3f} ({auc_lo:.3f}–{auc_hi:.3f}; best layer "
        f"resid_post:{best_layer[0]} {best_layer[1]:.3f}; prompt perplexity {auc_prompt:.3f}); slice curve "
        f"D {curve['dispersion_mean'][0]:.4f} at 0 % → {curve['dispersion_mean'][-1]:.4f} at 100 % correct, "
        f"Spearman {curve['spearman']:.2f}; calibration MAE {cal['mae_mean']:.3f} ± {cal['mae_se']:.3f}.",
        "Paper A: questions of lower dispersion are harder, and slices of lower dispersion less accurate. " + verdict,
    ]
    notes = [
        "The quiz is generated at run time from the Debian wordnet package (single-word nouns of 3-14 letters; "
        f"seed {SEED}); it is not committed. Prompt: \"Definition: <gloss>\\nWord:\", each "
        "choice scored as lm-eval scores a multiple-choice continuation; correct = lm-eval's `acc`.",
        "c_i is the mean cosine distance of a question's vector (final layer, last prompt token) to all other "
        "questions' vectors; its mean is the dispersion D. The per-layer AUROCs read c_i of the registered "
        "`dispersion` metric at each block output, from the same forward pass.",
        "Answer perplexity is the gold answer's per-token perplexity given the prompt (it uses the label); prompt "
        "perplexity is the prompt's own (label-free), both from lm-eval's forward pass.",
        "Accuracy by lexicographer file (largest five): " + "; ".join(
            f"{lex}: {np.mean(v):.2f} of {len(v)}" for lex, v in sorted(lex_acc.items(), key=lambda kv: -len(kv[1]))[:5]),
    ]
    exp.finish(summary, data={
        "questions": len(samples), "accuracy": acc, "auroc": auc, "auroc_ci95": [auc_lo, auc_hi],
        "auroc_prompt_perplexity": auc_prompt, "acc_low_c": table["repgeom_acc_low_c,none"],
        "acc_high_c": table["repgeom_acc_high_c,none"], "dispersion": table["repgeom_dispersion,none"],
        "dispersion_correct": table["repgeom_dispersion_correct,none"],
        "dispersion_incorrect": table["repgeom_dispersion_incorrect,none"],
        "auroc_by_layer": dict(layers), "slices": {k: v for k, v in curve.items() if k not in
                                                   ("dispersion", "perplexity", "prompt_perplexity")},
        "calibration": {k: v for k, v in cal.items() if k != "test_slices"}, "calibration_mae_constant": mae_constant,
        "lm_eval_seconds": round(lm_seconds, 1), "answer_perplexity_median": float(np.median(answer_ppl)),
        "prompt_perplexity_median": float(np.nanmedian(prompt_ppl)),
        "per_question": {"correct": correct.tolist(), "c": c.tolist(), "prompt_ppl": prompt_ppl.tolist(),
                         "c_by_layer": {name.split("@")[1].split(":")[1]: [float(s[name]) for s in samples]
                                        for name in layer_names}},
    }, notes=notes)
    gallery.from_raw(exp.name, summarize, draw, [gallery.FROM_RAW, "--out", str(exp.out)])


# -- intervals and verdicts (issue 25): everything below reads result.json only --------------------------------------

def slice_rho_interval(curve: dict, seed: int = 0, n: int = BOOTSTRAP) -> dict:
    """Interval of Spearman ρ(fraction correct, slice dispersion) over the slice means. result.json keeps each
    fraction's mean ± s.e. over the seeds, not the seeds' values, so each mean is redrawn from a normal with that
    s.e. (a parametric bootstrap over seeds) and ρ recomputed; the percentile interval of those ρ."""
    import numpy as np

    from repgeom_eval.functional.bootstrap import percentile_interval, rowwise_spearman

    mean, se = np.asarray(curve["dispersion_mean"], float), np.asarray(curve["dispersion_se"], float)
    draws = np.random.default_rng(seed).normal(mean, se, size=(n, mean.size))
    xs = np.broadcast_to(np.asarray(curve["fractions"], float), draws.shape)
    lo, hi, valid = percentile_interval(rowwise_spearman(xs, draws))
    return {"estimate": curve["spearman"], "low": lo, "high": hi, "n": int(mean.size), "n_resamples": n,
            "n_valid": valid, "level": 0.95, "seed": seed,
            "method": "parametric bootstrap over seeds (normal draws from each slice mean ± s.e.), percentile"}


def summarize(doc: dict) -> dict:
    """result.json with the summary, verdicts and interval table recomputed from its data."""
    import numpy as np

    from repgeom_eval.functional.stats import auroc

    d = doc["data"]
    curve, cal = d["slices"], d["calibration"]
    per_q = d.get("per_question")
    intervals: dict = {}
    if per_q:  # runs that keep every question's values: every AUROC gets its interval
        y = np.asarray(per_q["correct"], float)
        intervals["auroc"] = gallery.interval(lambda s, t: auroc(s, t), per_q["c"], y, vectorized=False)
        intervals["auroc_prompt_perplexity"] = gallery.interval(
            lambda s, t: auroc(-s, t), per_q["prompt_ppl"], y, vectorized=False)
        intervals["auroc_by_layer"] = {k: gallery.interval(lambda s, t: auroc(s, t), v, y, vectorized=False)
                                       for k, v in per_q["c_by_layer"].items()}
    else:  # the interval the run computed over the questions (the per-question values were not kept)
        lo, hi = d["auroc_ci95"]
        intervals["auroc"] = {"estimate": d["auroc"], "low": lo, "high": hi, "n": d["questions"],
                              "n_resamples": BOOTSTRAP, "level": 0.95, "seed": 0,
                              "method": "percentile bootstrap over questions, computed by the run"}
    intervals["slice_spearman"] = slice_rho_interval(curve)
    a, r = intervals["auroc"], intervals["slice_spearman"]
    auc = a["estimate"]  # with per-question values: recomputed from them; otherwise lm_eval's, as the run wrote
    v_auc = gallery.decide(a["low"], a["high"], null=0.5, expect="above")
    v_rho = gallery.decide(r["low"], r["high"], null=0.0, expect="above")
    layer_vals = d["auroc_by_layer"]
    layer_range = f"{min(layer_vals.values()):.3f}–{max(layer_vals.values()):.3f}" if layer_vals else "n/a"
    best_layer = max(layer_vals, key=layer_vals.get) if layer_vals else "-"
    pp = intervals.get("auroc_prompt_perplexity")
    pp_text = (f"{pp['estimate']:.3f} ({ci(pp)})" if pp else
               f"{d['auroc_prompt_perplexity']:.3f} (no interval: the per-question values were not kept)")
    said = {gallery.FOLLOWS: "follows it", gallery.OPPOSITE: "the opposite of the paper",
            gallery.CANNOT_TELL: "cannot tell at this size"}
    summary = [
        f"SmolLM2-135M-Instruct (GGUF) answered {d['questions']} cloze-style WordNet questions (definition → word, "
        "3 distractors from the same lexicographer file) through `lm_eval --include_path` with a repgeom hardness "
        "YAML, then `repgeom slices --calibrate` on its samples. Not covered: other prompt formats and quizzes "
        "(one prompt, one quiz), larger models.",
        f"Accuracy {d['accuracy']:.3f}; AUROC of c_i for correctness {auc:.3f} ({ci(a)}; percentile "
        f"bootstrap over the {d['questions']} questions); per block output {layer_range} (best resid_post:"
        f"{best_layer}; {'intervals in the table' if per_q else 'no intervals: per-question values not kept'}); "
        f"prompt perplexity {pp_text}; slice curve D {curve['dispersion_mean'][0]:.4f} at 0 % → "
        f"{curve['dispersion_mean'][-1]:.4f} at 100 % correct, Spearman ρ {curve['spearman']:.2f} ({ci(r)}; "
        f"{curve['seeds']} seeds).",
        "Paper A: questions of lower dispersion are harder (AUROC of c_i above 0.5), and slices of lower dispersion "
        f"less accurate (ρ above 0). Decided by the 95 % intervals: question ranking, {said[v_auc]} (AUROC "
        f"{auc:.3f}, {ci(a)}); slice curve, {said[v_rho]} (ρ {curve['spearman']:.2f}, {ci(r)}). Side "
        f"observation, not counted against paper A (which does not offer dispersion as a calibrated accuracy "
        f"predictor): calibration MAE {cal['mae_mean']:.3f} ± {cal['mae_se']:.3f} (s.e. over "
        f"{cal['seeds']} seeds) against {d['calibration_mae_constant']:.3f} for always predicting 0.5.",
    ]
    rows = [["AUROC of c_i → correct (final layer)", auc, ci(a), a["method"], v_auc],
            ["Spearman ρ(fraction correct, slice dispersion)", curve["spearman"], ci(r), r["method"], v_rho]]
    if pp:
        rows.append(["AUROC of −(prompt perplexity) → correct", pp["estimate"], ci(pp), pp["method"],
                     gallery.decide(pp["low"], pp["high"], null=0.5, expect="above")])
    for k, v in intervals.get("auroc_by_layer", {}).items():
        rows.append([f"AUROC of c_i at resid_post:{k}", v["estimate"], ci(v), v["method"],
                     gallery.decide(v["low"], v["high"], null=0.5, expect="above")])
    tables = [{"title": "95 % intervals and verdicts (follows: interval beyond the paper's null on its side; "
                        "cannot tell: interval holds the null)",
               "header": ["statistic", "value", "95 % interval", "how", "verdict"], "rows": rows}]
    notes = ["Intervals: the AUROC's is a percentile bootstrap over the questions (2000 resamples, seed 0). "
             + ("" if per_q else "This run's result.json keeps no per-question values, so the per-layer AUROCs, "
                "the prompt-perplexity AUROC and the correct/incorrect dispersion difference get no interval here; "
                "runs of the current run.py keep them (data.per_question). ")
             + "The slice curve's ρ interval redraws each slice mean from its mean ± s.e. over the seeds (the "
             "seeds' own values are not kept), a parametric stand-in for resampling the seeds; it treats the 11 "
             "means as independent, though their slices are drawn from the same questions, so it is likely too "
             "narrow.",
             "The calibration MAE is reported as a side observation and does not enter the verdict: paper A does not "
             "present dispersion as a calibrated accuracy predictor. The calibration figure is the run's own (its "
             "test slices are not kept in result.json) and is not redrawn."]
    figures = [f if f["file"] != "auroc_by_layer.png" else
               {"file": f["file"], "caption": "AUROC of c_i for correctness at each block output; band: 95 % interval "
                "of the final layer's AUROC (bootstrap over questions); dashed: chance"
                + ("; bars: 95 % intervals per layer" if per_q else "; per-layer intervals need per-question values, "
                   "not kept by this run")} for f in doc["figures"]]
    return gallery.regenerated(doc, summary, tables, notes, intervals, figures)


def ci(interval: dict) -> str:
    return (f"95 % CI {interval['low']:.3f} to {interval['high']:.3f}" if math.isfinite(interval["low"])
            else "no interval")


def draw(doc: dict, out: Path) -> None:
    d = doc["data"]
    gallery.save_figure(slice_figure(d["slices"], d["slices"]["size"], d["intervals"]["slice_spearman"]),
                        out / "slices.png")
    layers = sorted(d["auroc_by_layer"].items(), key=lambda kv: int(kv[0]))
    gallery.save_figure(layer_figure(layers, d["intervals"]), out / "auroc_by_layer.png")


if __name__ == "__main__":
    if gallery.FROM_RAW in sys.argv:
        gallery.from_raw("hardness_without_labels", summarize, draw)
    else:
        main()
