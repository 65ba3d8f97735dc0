"""Hardness without labels: does the dispersion c_i of a question's hidden state rank questions by how hard they
are for the model, and are slices of lower dispersion less accurate? (paper A, Tables 3–4 and Fig. 8) — asked
under three prompts and two scorings, because the answer can hang on both.

    .venv/bin/python experiments/hardness_without_labels/run.py --smoke   # 40 questions, about 5 minutes on a loaded machine
    .venv/bin/python experiments/hardness_without_labels/run.py           # 600 questions × 3 prompts, 10 min measured on 2 quiet cores (49 min shared)

1. A multiple-choice quiz is generated from WordNet (Debian package ``wordnet``), seeded and deterministic: a
   noun's gloss, its head word and 3 distractors from the same lexicographer file (so all four are, say, animals
   or artifacts), gold and distractors drawn from the same words (single lower-case words of 3-14 letters); a
   gloss that contains one of its own words is skipped. Written to WORKDIR/data; never committed.
2. The same questions are asked with three prompts (``PROMPTS``): the quiz's ("Definition: <gloss>\\nWord:"), a
   cloze sentence ('The word for "<gloss>" is') and an MMLU-style letter prompt (the four words listed as A-D,
   answered with a letter). One task YAML per prompt naming ``repgeom_eval.lmeval.task.HardnessTask`` (the form
   docs/lmeval.md, "Your own prompt", documents), all three in one literal ``lm_eval`` command on
   SmolLM2-135M-Instruct (its GGUF file: ``--model_args pretrained=FOLDER,gguf_file=NAME``) with
   ``--log_samples``. ``--metadata`` also asks for the registered ``dispersion`` metric at every block output,
   so c_i at those layers comes from the same forward pass.
3. Each prompt is scored both ways lm-eval scores multiple choice: ``acc`` (sum of the choice's token
   log-likelihoods) and ``acc_norm`` (per byte). ``repgeom slices`` runs on each (prompt, scoring): on the samples
   for ``acc`` (the task's own correctness; with ``--calibrate`` for the quiz prompt), and on the same question
   vectors written out with ``--vectors --correct-field acc_norm`` for ``acc_norm``.
4. From the samples: accuracy, AUROC of c_i for correctness per (prompt, scoring) with bootstrap intervals over
   the questions, the same per layer, and the label-free baseline of the prompt's own perplexity. Paper A's slice
   curve is the main verdict, with the questions as the unit: each question's final-layer vector is kept, and the
   statistic D(correct) − D(wrong) (the curve's two ends) gets a bootstrap over questions and a permutation p of
   the correctness labels; the seeds' ρ is shown as exploratory.
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

N_FULL, N_SMOKE = 600, 40
LAYERS = "resid_post:[0,4,8,12,16,20,24,29]"  # c_i at these block outputs too, from the same forward pass
SEED = 17
BOOTSTRAP = 2000
SCORINGS = ("acc", "acc_norm")
# Under the letter prompt every choice is one letter of one byte, so acc_norm (per byte) is acc by construction: the
# cell is asked and counted once.
SCORED = {"quiz": SCORINGS, "cloze": SCORINGS, "letter": ("acc",)}
CHANCE = 0.25  # four choices
MAIN = ("quiz", "acc")  # the gallery's first protocol: the row the calibration side observation is made on
# name → (how result.md describes it, lm-eval doc_to_text, doc_to_choice); each choice is scored as lm-eval's
# multiple_choice scores a continuation (target delimiter " ")
PROMPTS = {
    "quiz": ('"Definition: <gloss>\\nWord:" → " <word>"', "Definition: {{definition}}\\nWord:", "choices"),
    "cloze": ('\'The word for "<gloss>" is\' → " <word>"', 'The word for \\"{{definition}}\\" is', "choices"),
    "letter": ('MMLU-style: "Which word means \\"<gloss>\\"?\\nA. …\\nD. …\\nAnswer:" → " A" … " D"',
               'Which word means \\"{{definition}}\\"?\\nA. {{choices[0]}}\\nB. {{choices[1]}}\\nC. '
               '{{choices[2]}}\\nD. {{choices[3]}}\\nAnswer:', '["A", "B", "C", "D"]'),
}


def task_name(prompt: str) -> str:
    return f"repgeom_wordnet_{prompt}"


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
doc_to_text: "{text}"
doc_to_choice: {choice}
doc_to_target: answer
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
  - {{metric: acc_norm, aggregation: mean, higher_is_better: true}}
  - {{metric: repgeom_dispersion, aggregation: repgeom_mean, higher_is_better: null}}
  - {{metric: repgeom_auroc, aggregation: repgeom_auroc, higher_is_better: null}}
  - {{metric: repgeom_slice_spearman, aggregation: repgeom_slice_spearman, higher_is_better: null}}
metadata:
  version: 1.0
"""


# -- statistics (everything from here on reads result.json only) -----------------------------------------------------

def layer_key(name: str) -> tuple[int, str]:
    m = re.search(r"@resid_post:(\d+)$", name)
    return (int(m.group(1)), name) if m else (10**6, name)


def auroc_draws(scores, labels, seed: int = 0, n: int = BOOTSTRAP):
    """The AUROC of ``scores`` for the 0/1 ``labels`` on ``n`` resamples of the questions (the library's seeded
    indices; the Mann-Whitney form with average ranks for ties, as repgeom_eval.functional.stats.auroc; NaN where
    a resample holds one class only)."""
    import numpy as np
    from scipy.stats import rankdata

    from repgeom_eval.functional.bootstrap import bootstrap_indices

    s, y = np.asarray(scores, float), np.asarray(labels, float)
    idx = bootstrap_indices(s.size, n, seed)
    ranks, pos = rankdata(s[idx], axis=1), y[idx] == 1
    n_pos = pos.sum(axis=1)
    n_neg = s.size - n_pos
    with np.errstate(invalid="ignore", divide="ignore"):
        return ((ranks * pos).sum(axis=1) - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def auroc_test(name: str, scores, labels, flip: bool = False):
    """AUROC of ``scores`` (negated with ``flip``) for correctness against 0.5 (gallery.auroc_test: percentile
    bootstrap over the questions where it holds its estimate; Mann-Whitney p)."""
    import numpy as np

    s = -np.asarray(scores, float) if flip else np.asarray(scores, float)
    return gallery.auroc_test(name, s, labels, "above", auroc_draws(s, labels))


def per_seed_spearman(curve: dict) -> list[float]:
    """Each slice seed's Spearman ρ(fraction correct, slice dispersion) over the fractions (each seed draws one slice
    per fraction)."""
    import numpy as np

    from repgeom_eval.functional.bootstrap import rowwise_spearman

    per_seed = np.asarray(curve["dispersion"], float).T  # [seeds, fractions]
    xs = np.broadcast_to(np.asarray(curve["fractions"], float), per_seed.shape)
    return [float(r) for r in rowwise_spearman(xs, per_seed)]


def seed_test(name: str, curve: dict):
    """The slice curve as `repgeom slices` draws it, over its seeds (exploratory: every seed draws from the same
    questions, so this covers the slice draws, not the choice of questions)."""
    return gallery.mean_test(name, per_seed_spearman(curve), 0.0, "above")


def unit_vectors(per_question: dict):
    """The questions' vectors (final layer, last prompt token) as float64 unit rows [N, d]."""
    import numpy as np

    from repgeom_eval.analyses.queries import decode_vector

    u = np.stack([decode_vector(v) for v in per_question["vector"]]).astype(np.float64)
    return u / np.linalg.norm(u, axis=1, keepdims=True)


def on_grid(u, total: float):
    """``u`` rounded to the multiples of 2^-k for which every partial sum of ``total`` weighted rows is exact in
    float64: the matrix product then has one value, whatever order a BLAS picks by CPU (the order moved the 12th
    digit of the committed intervals between machines). The rounding moves each coordinate by < 2^-k ≈ 1e-13."""
    import math

    import numpy as np

    k = 52 - math.ceil(math.log2(max(float(total), 2.0)))
    return np.ldexp(np.rint(np.ldexp(u, k)), -k)


def pair_sums(weights, u):
    """Per row of ``weights`` ([B, N] question counts, a resample each): the sum of unit vectors S, the count n and
    Σ w² — with them the mean cosine over pairs of distinct questions is (‖S‖² − Σw²) / (n² − Σw²) (a question
    drawn twice is not paired with itself). O(B·N·d), no N×N matrix (docs/metrics.md, the dispersion identity)."""
    n = weights.sum(axis=1)
    return weights @ on_grid(u, n.max()), n, (weights * weights).sum(axis=1)


def class_dispersion(weights, u):
    """Dispersion (mean pairwise cosine distance) of the questions ``weights`` selects, per row."""
    s, n, q = pair_sums(weights, u)
    return 1.0 - ((s * s).sum(axis=1) - q) / (n * n - q)


def slice_gap(u, correct, weights):
    """Paper A's slice curve end to end: the dispersion of the correctly answered questions minus that of the wrongly
    answered ones, per row of ``weights``. A random slice's dispersion is unbiased for its class's, so this is the
    curve's all-correct slice minus its all-wrong slice without the draw of the slices."""
    y = correct[None, :]
    return class_dispersion(weights * y, u) - class_dispersion(weights * (1.0 - y), u)


def expected_curve(u, correct, fractions, size, weights):
    """E[slice dispersion] at each fraction for slices of ``size`` drawn as `repgeom slices` draws them
    (round(size·f) correct, the rest wrong, without replacement), per row of ``weights``: [B, fractions]."""
    import numpy as np

    y = correct[None, :]
    sc, nc, qc = pair_sums(weights * y, u)
    sw, nw, qw = pair_sums(weights * (1.0 - y), u)
    cc = ((sc * sc).sum(axis=1) - qc) / (nc * nc - qc)
    ww = ((sw * sw).sum(axis=1) - qw) / (nw * nw - qw)
    cw = (sc * sw).sum(axis=1) / (nc * nw)
    out = []
    for f in fractions:
        k = round(size * f)
        m = size - k
        out.append(1.0 - (k * (k - 1) * cc + m * (m - 1) * ww + 2 * k * m * cw) / (size * (size - 1)))
    return np.stack(out, axis=1)


def question_weights(n: int, draws: int = BOOTSTRAP, seed: int = 0):
    """[draws, n] counts of each question in the library's seeded bootstrap resamples of the questions."""
    import numpy as np

    from repgeom_eval.functional.bootstrap import bootstrap_indices

    idx = bootstrap_indices(n, draws, seed)
    w = np.zeros((draws, n))
    np.add.at(w, (np.arange(draws)[:, None], idx), 1.0)
    return w


def label_permutations(correct, draws: int = BOOTSTRAP, seed: int = 0):
    """[draws, n] 0/1 rows: the correctness labels shuffled over the questions (class sizes kept)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(correct) for _ in range(draws)])


def gap_test(name: str, u, correct):
    """The slice statistic (all-correct minus all-wrong dispersion) against 0 with the questions as the unit: the
    percentile interval of the bootstrap over questions (gallery.statistic_test rules) and the permutation p of the
    correctness labels (two-sided, 2000 shuffles, seed 0, (1 + #|gap*| ≥ |gap|) / (1 + 2000))."""
    import numpy as np

    ones = np.ones((1, correct.size))
    estimate = float(slice_gap(u, correct, ones)[0])
    draws = slice_gap(u, correct, question_weights(correct.size))
    perms = label_permutations(correct)
    null = class_dispersion(perms, u) - class_dispersion(1.0 - perms, u)
    p = float((1 + np.sum(np.abs(null) >= abs(estimate) - 1e-15)) / (1 + null.size))
    return gallery.statistic_test(name, "D(correct) − D(wrong)", estimate, draws, int(correct.size), 0.0, "above",
                                  p=p, test=f"permutation of the correctness labels ({null.size} shuffles)")


SAID = {gallery.FOLLOWS: "follows", gallery.OPPOSITE: "the opposite", gallery.CANNOT_TELL: "cannot tell at this size"}


def ci(interval: dict, digits: int = 2) -> str:
    return (f"95 % CI {interval['low']:.{digits}f} to {interval['high']:.{digits}f}" if math.isfinite(interval["low"])
            else "no interval")


def flips(verdicts: dict[tuple[str, str], str]) -> str:
    """What changes a verdict: the scoring within a prompt, the prompt within a scoring."""
    prompts = list(dict.fromkeys(p for p, _ in verdicts))
    scorings = list(dict.fromkeys(s for _, s in verdicts))
    of = lambda p: [s for s in scorings if (p, s) in verdicts]  # noqa: E731
    at = lambda s: [p for p in prompts if (p, s) in verdicts]  # noqa: E731
    by_scoring = [f"under the {p} prompt ({', '.join(f'{s}: {SAID[verdicts[p, s]]}' for s in of(p))})"
                  for p in prompts if len({verdicts[p, s] for s in of(p)}) > 1]
    by_prompt = [f"with {s} ({', '.join(f'{p}: {SAID[verdicts[p, s]]}' for p in at(s))})"
                 for s in scorings if len({verdicts[p, s] for p in at(s)}) > 1]
    if not by_scoring and not by_prompt:
        return "Neither the prompt nor the scoring changes this verdict."
    parts = []
    if by_scoring:
        parts.append("the scoring changes it " + "; ".join(by_scoring))
    if by_prompt:
        parts.append("the prompt changes it " + "; ".join(by_prompt))
    return "What flips it: " + ", and ".join(parts) + "."


def cells(prompts: dict) -> list[tuple[str, str]]:
    """The (prompt, scoring) pairs counted: each prompt's distinct scorings (SCORED), in order."""
    return [(p, s) for p in prompts for s in SCORED.get(p, SCORINGS)]


def curve_band(u, y, curve: dict) -> dict:
    """The expected slice curve and its 95 % percentile band over the question bootstrap."""
    import numpy as np

    ones = np.ones((1, y.size))
    est = expected_curve(u, y, curve["fractions"], curve["size"], ones)[0]
    draws = expected_curve(u, y, curve["fractions"], curve["size"], question_weights(y.size))
    low, high = np.nanpercentile(draws, [2.5, 97.5], axis=0)
    return {"estimate": [float(x) for x in est], "low": [float(x) for x in low], "high": [float(x) for x in high]}


def summarize(doc: dict) -> dict:
    """result.json with the summary, verdicts and interval tables recomputed from its data."""
    import numpy as np

    d = doc["data"]
    prompts = d["prompts"]
    main_prompt, main_scoring = d["main"]
    main = (main_prompt, main_scoring)
    keys = cells(prompts)
    intervals: dict = {p: {} for p in prompts}
    rows, layer_rows, at_chance = [], [], []
    gap_tests, seed_tests, auc_tests = {}, {}, {}
    for prompt, pd in prompts.items():
        q = pd["per_question"]
        u = unit_vectors(q)
        for scoring in SCORED.get(prompt, SCORINGS):
            y = np.asarray(q[scoring], float)
            curve = pd["slices"][scoring]
            gap_tests[prompt, scoring] = gap_test(f"slice gap {prompt}/{scoring}", u, y)
            auc_tests[prompt, scoring] = auroc_test(f"AUROC {prompt}/{scoring}", q["c"], y)
            seed_tests[prompt, scoring] = gallery.explore(seed_test(f"slice ρ over seeds {prompt}/{scoring}", curve))
            known = [i for i, v in enumerate(q["prompt_ppl"]) if v is not None]
            pp = gallery.explore(auroc_test(f"AUROC −(prompt ppl) {prompt}/{scoring}",
                                            [q["prompt_ppl"][i] for i in known], y[known], flip=True))
            acc = gallery.explore(gallery.mean_test(f"accuracy {prompt}/{scoring}", list(y), CHANCE, "above"))
            intervals[prompt][scoring] = {"accuracy": acc.as_dict(), "auroc_prompt_perplexity": pp.as_dict(),
                                          "slice_spearman_seeds": seed_tests[prompt, scoring].as_dict(),
                                          "expected_curve": curve_band(u, y, curve)}
            if acc.verdict != gallery.FOLLOWS:
                at_chance.append(f"{prompt}/{scoring}")
        y = np.asarray(q["acc"], float)
        intervals[prompt]["acc_by_layer"] = {
            k: gallery.explore(auroc_test(f"AUROC {prompt} resid_post:{k}", v, y)).as_dict()
            for k, v in q["c_by_layer"].items()}
        for k, v in intervals[prompt]["acc_by_layer"].items():
            layer_rows.append([prompt, f"resid_post:{k}", v["estimate"], ci(v, 3), v["p"], gallery.exploratory_cell(v)])
    gap_finding = gallery.decide(list(gap_tests.values()), gap_tests[main].name,
                                 "slices of lower dispersion are less accurate")
    auc_finding = gallery.decide(list(auc_tests.values()), auc_tests[main].name,
                                 "lower-dispersion questions are harder")
    for key in keys:
        prompt, scoring = key
        intervals[prompt][scoring]["slice_gap"] = gap_finding["tests"][gap_tests[key].name]
        intervals[prompt][scoring]["auroc"] = auc_finding["tests"][auc_tests[key].name]
    verdict_gap = {k: gap_finding["tests"][gap_tests[k].name]["verdict"] for k in keys}
    verdict_auc = {k: auc_finding["tests"][auc_tests[k].name]["verdict"] for k in keys}
    for prompt, scoring in keys:
        q = prompts[prompt]["per_question"]
        curve, iv_ = prompts[prompt]["slices"][scoring], intervals[prompt][scoring]
        a, g, r, acc, pp = (iv_["auroc"], iv_["slice_gap"], iv_["slice_spearman_seeds"], iv_["accuracy"],
                            iv_["auroc_prompt_perplexity"])
        rows.append([prompt, scoring, float(np.mean(q[scoring])), ci(acc, 3), g["estimate"], ci(g, 4), g["p_holm"],
                     SAID[verdict_gap[prompt, scoring]], a["estimate"], ci(a, 3), a["p_holm"],
                     SAID[verdict_auc[prompt, scoring]], curve["spearman"], r["estimate"], ci(r), r["p"],
                     f"{curve['dispersion_mean'][0]:.4f} → {curve['dispersion_mean'][-1]:.4f}", curve["size"],
                     pp["estimate"]])
    count = lambda verdicts, v: sum(verdicts[k] == v for k in keys)  # noqa: E731
    tally = lambda verdicts: ", ".join(f"{SAID[v]} in {count(verdicts, v)}" for v in  # noqa: E731
                                       (gallery.FOLLOWS, gallery.OPPOSITE, gallery.CANNOT_TELL) if count(verdicts, v))
    iv = intervals
    row_text = lambda p, s, what, digits=2: (  # noqa: E731
        f"{p}/{s} {gallery.show_test(iv[p][s][what], digits, what != 'auroc')}")
    cal = d.get("calibration") or {}
    side = (f" Side observation, not counted against paper A (which does not offer dispersion as a calibrated accuracy "
            f"predictor): on the {main_prompt} prompt with {main_scoring}, `repgeom slices --calibrate` predicts slice "
            f"accuracy with test MAE {cal['mae_mean']:.3f} ± {cal['mae_se']:.3f} (s.e. over {cal['seeds']} seeds) "
            f"against {d['calibration_mae_constant']:.3f} for always predicting 0.5." if cal.get("mae_mean") is not None
            and d.get("calibration_mae_constant") is not None else "")
    n_seeds = seed_tests[main].n
    seeds_follow = [f"{p}/{s}" for p, s in keys if seed_tests[p, s].verdict == gallery.FOLLOWS]
    seeds_opposite = [f"{p}/{s}" for p, s in keys if seed_tests[p, s].verdict == gallery.OPPOSITE]
    summary = [
        f"SmolLM2-135M-Instruct (GGUF) answered the same {d['questions']} WordNet questions (definition → word, 3 "
        f"distractors from the same lexicographer file) under {len(prompts)} prompts ({', '.join(prompts)}) in one "
        "`lm_eval --include_path` command with repgeom hardness YAMLs, scored with acc and acc_norm (the letter "
        "prompt once: its choices are single letters, where the two are the same), then `repgeom slices` on each of "
        f"the {len(keys)} (prompt, scoring) pairs; each question's final-layer vector is kept. Not covered: other "
        "quizzes, larger models.",
        "Paper A's slice curve (main finding): slices of lower dispersion are less accurate. Primary test: "
        f"{main_prompt}/{main_scoring}, the dispersion of the correctly answered questions minus that of the wrongly "
        "answered ones (the curve's all-correct slice minus its all-wrong slice, without the draw of slices), above "
        f"0, with the {d['questions']} questions as the unit (percentile bootstrap over questions; permutation p of "
        f"the correctness labels); family: the {len(keys)} (prompt, scoring) pairs, Holm: "
        + "; ".join(f"{row_text(p, s, 'slice_gap', 4)} {SAID[verdict_gap[p, s]]}" for p, s in keys)
        + f" — {tally(verdict_gap)} of {len(keys)}; primary: {SAID[gap_finding['verdict']]}. " + flips(verdict_gap)
        + (f" Under {', '.join(at_chance)} the accuracy is not above chance, so there the curve sorts questions by "
           "which choice the model favours rather than by what it knows." if at_chance else "")
        + f" Exploratory, unadjusted: over the {n_seeds} slice seeds of `repgeom slices` (the slice draws only; "
        f"every seed draws from the same questions) the mean per-seed ρ is above 0 in {len(seeds_follow)} of "
        f"{len(keys)} ({', '.join(seeds_follow) or 'none'}) and below in {len(seeds_opposite)} "
        f"({', '.join(seeds_opposite) or 'none'}).",
        "Question ranking (AUROC of c_i for correctness above 0.5: lower-dispersion questions are harder). Primary "
        f"test: {main_prompt}/{main_scoring} (percentile bootstrap over the {d['questions']} questions, Mann-Whitney "
        f"p); family: the {len(keys)} pairs, Holm: "
        + "; ".join(f"{row_text(p, s, 'auroc')} {SAID[verdict_auc[p, s]]}" for p, s in keys)
        + f" — {tally(verdict_auc)} of {len(keys)}; primary: {SAID[auc_finding['verdict']]}. Accuracies: "
        + ", ".join(f"{p}/{s} {np.mean(prompts[p]['per_question'][s]):.3f}" for p, s in keys)
        + (f" ({', '.join(at_chance)}: not above chance, {CHANCE:.2f}, exploratory t test, so correctness there "
           "is mostly which choice the model favours, not what it knows)" if at_chance else "")
        + ". Exploratory: the label-free prompt perplexity ranks them with AUROC "
        + ", ".join(f"{p}/{s} {iv[p][s]['auroc_prompt_perplexity']['estimate']:.2f}" for p, s in keys) + "." + side,
    ]
    tables = [
        gallery.finding_table(gap_finding, "slices of lower dispersion are less accurate (paper A's slice curve; "
                                           "D(correct) − D(wrong) above 0, questions as the unit)"),
        gallery.finding_table(auc_finding, "lower-dispersion questions are harder (AUROC of c_i above 0.5)"),
        {"title": "One row per (prompt, scoring): accuracy, the slice statistic D(correct) − D(wrong), AUROC of c_i "
                  "for correctness and the slice curve over seeds (exploratory), with 95 % intervals, Holm-adjusted p "
                  f"and verdicts (each family: the {len(keys)} pairs)",
         "header": ["prompt", "scoring", "accuracy", "95 % interval", "D(correct) − D(wrong)", "95 % interval",
                    "p (Holm)", "verdict", "AUROC c_i", "95 % interval", "p (Holm)", "verdict",
                    "slice ρ (seed-mean curve)", "mean per-seed ρ", "95 % interval", "p (exploratory)",
                    "slice D at 0 % → 100 % correct", "slice size", "AUROC −(prompt ppl)"], "rows": rows},
        {"title": "AUROC of c_i for correctness (acc) at every block output read, per prompt (same forward pass; "
                  "exploratory, unadjusted Mann-Whitney p)",
         "header": ["prompt", "layer", "AUROC", "95 % interval", "p", "verdict"], "rows": layer_rows},
        {"title": "Prompts", "header": ["name", "prompt → continuation", "scorings counted"],
         "rows": [[p, pd["prompt"], ", ".join(SCORED.get(p, SCORINGS))] for p, pd in prompts.items()]},
        protocol_table(d),
    ]
    notes = [gallery.RULE_NOTE,
             "Units: the questions are the unit of replication. The slice statistic D(correct) − D(wrong) is "
             "computed from every question's kept vector (mean cosine distance over pairs of distinct questions, "
             "by the O(N·d) sum identity); its interval is the percentile bootstrap over the questions (2000 "
             "resamples, seed 0; a question drawn twice is not paired with itself) and its p the two-sided "
             "permutation test of the correctness labels (2000 shuffles, seed 0). A random slice's dispersion is "
             "unbiased for its class's, so the statistic is the slice curve's two ends without the noise of the "
             "slice draws; the figure's band is the expected curve under the same bootstrap. The slice seeds of "
             "`repgeom slices` all draw from the same questions, so a test over them shrinks toward a point however "
             "few the questions: it is shown, exploratory only. AUROCs: percentile bootstrap over the questions, "
             "Mann-Whitney U p.",
             "The calibration MAE is a side observation and does not enter a verdict: paper A does not present "
             "dispersion as a calibrated accuracy predictor. The calibration figure is the run's own (its test "
             "slices are not kept in result.json) and is not redrawn."]
    figures = [{"file": "slices.png", "caption": "Controlled slices, one panel per prompt (columns) and scoring (rows): "
                "slice dispersion against the fraction of correctly answered questions, SmolLM2-135M-Instruct on the "
                "WordNet quiz; points: `repgeom slices` (mean ± s.e. over its seeds), line and band: the expected "
                "slice dispersion from every question's vector with its 95 % band over a bootstrap of the questions; "
                "titles give D(correct) − D(wrong) with its interval"},
               {"file": "auroc_by_layer.png", "caption": "AUROC of c_i for correctness (acc) at each block output, "
                "per prompt, with 95 % intervals (bootstrap over questions); dashed: chance"}]
    figures += [f for f in doc["figures"] if f["file"] == "calibration.png"]
    out = gallery.regenerated(doc, summary, tables, notes, intervals, figures)
    out["data"]["findings"] = gallery.stable({"slice_curve": gap_finding, "question_ranking": auc_finding})
    return out


def protocol_table(d: dict) -> dict:
    """Where this run departs from paper A's hardness protocol (Tables 3–4, Fig. 8)."""
    return {"title": "Protocol: paper A against this run",
            "header": ["", "paper A", "this run", "why"],
            "rows": [
                ["model", "the paper's LLMs", "SmolLM2-135M-Instruct (GGUF, Q4_1 dequantized to float32)",
                 "the only offline decoder here"],
                ["queries", "a labelled benchmark pool", f"{d['questions']} WordNet questions generated at run time",
                 "no benchmark data offline"],
                ["vector", "last token, final layer, of the context scored", "the same", ""],
                ["slices", "100 queries at each mixing ratio (grid not stated), 10 seeds, mean ± std",
                 "100 queries at 0 %, 10 %, …, 100 % correct, 10 seeds, mean ± s.e.", "the grid is our choice"],
                ["statistic", "correlation of slice dispersion with slice accuracy",
                 "D(correct) − D(wrong) over every question (the curve's ends, no draw noise); the seeds' ρ "
                 "exploratory", "the questions, not the seeds, are the unit of replication"],
                ["scoring", "the benchmark's", "acc and acc_norm (the letter prompt once)",
                 "the verdict can hang on it"],
                ["tests", "none stated", "bootstrap and label permutation over questions; Holm over the prompt × "
                 "scoring family", "one primary test per finding"],
            ]}


# -- figures --------------------------------------------------------------------------------------------------------

def slices_figure(prompts: dict, intervals: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(SCORINGS), len(prompts), figsize=(3.4 * len(prompts), 2.9 * len(SCORINGS)),
                             sharex=True, squeeze=False)
    for col, (prompt, pd) in enumerate(prompts.items()):
        for row, scoring in enumerate(SCORINGS):
            ax = axes[row][col]
            if scoring not in SCORED.get(prompt, SCORINGS):
                ax.axis("off")
                ax.text(0.5, 0.5, f"{prompt}, {scoring}:\nthe same as acc\n(one-letter choices)", ha="center",
                        va="center", fontsize=8, transform=ax.transAxes)
                continue
            curve, g = pd["slices"][scoring], intervals[prompt][scoring]["slice_gap"]
            band = intervals[prompt][scoring]["expected_curve"]
            xs = [100 * f for f in curve["fractions"]]
            ax.fill_between(xs, band["low"], band["high"], color=f"C{col}", alpha=0.2, lw=0)
            ax.plot(xs, band["estimate"], color=f"C{col}", lw=1)
            ax.errorbar(xs, curve["dispersion_mean"], yerr=curve["dispersion_se"], ls="none", marker="o", ms=3,
                        capsize=2, color=f"C{col}")
            ax.set_title(f"{prompt}, {scoring}: D(correct) − D(wrong)\n= {g['estimate']:+.4f} ({ci(g, 4)})",
                         fontsize=8)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7)
            if row == len(SCORINGS) - 1 or SCORINGS[row + 1] not in SCORED.get(prompt, SCORINGS):
                ax.set_xlabel("correct questions in the slice (%)", fontsize=8)
            if col == 0:
                ax.set_ylabel("slice dispersion D", fontsize=8)
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


def layer_figure(intervals: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.3))
    for k, (prompt, iv) in enumerate(intervals.items()):
        layers = sorted(iv["acc_by_layer"], key=int)
        est = [iv["acc_by_layer"][x]["estimate"] for x in layers]
        lo = [max(0.0, e - iv["acc_by_layer"][x]["low"]) for e, x in zip(est, layers)]
        hi = [max(0.0, iv["acc_by_layer"][x]["high"] - e) for e, x in zip(est, layers)]
        xs = [int(x) + 0.25 * (k - 1) for x in layers]
        ax.errorbar(xs, est, yerr=[lo, hi], marker="o", ms=3, capsize=2, color=f"C{k}", label=prompt)
    ax.axhline(0.5, color="grey", lw=1, ls="--")
    ax.set_xlabel("block output (resid_post index)")
    ax.set_ylabel("AUROC of c_i for correctness (acc)")
    outside_legend(ax, fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def draw(doc: dict, out: Path) -> None:
    d = doc["data"]
    gallery.save_figure(slices_figure(d["prompts"], d["intervals"]), out / "slices.png")
    gallery.save_figure(layer_figure(d["intervals"]), out / "auroc_by_layer.png")


# -- the run --------------------------------------------------------------------------------------------------------

def read_samples(out: Path, task: str) -> list[dict]:
    path = max(out.rglob(f"samples_{task}_*.jsonl"), key=lambda p: p.name)
    return sorted((json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()),
                  key=lambda s: s["doc_id"])


def main(argv=None) -> None:
    import shutil

    import numpy as np

    from repgeom_eval.analyses.queries import SAMPLES_FIELD, decode_vector, encode_vector

    exp = Experiment("hardness_without_labels", "Hardness without labels: question dispersion on a WordNet quiz",
                     "paper A, Tables 3–4 (hardness slices) and Fig. 8", doc=__doc__, argv=argv, configure=configure)
    n = exp.args.questions or (N_SMOKE if exp.smoke else N_FULL)
    tasks = exp.workdir / "tasks"
    with exp.step(f"generate the WordNet quiz ({n} questions) and one task per prompt"):
        quiz = build_quiz(n)
        data = write_jsonl(exp.workdir / "data" / "wordnet_quiz.jsonl", quiz)
        shutil.rmtree(tasks, ignore_errors=True)
        tasks.mkdir()
        for prompt, (_, text, choice) in PROMPTS.items():
            (tasks / f"{task_name(prompt)}.yaml").write_text(
                TASK_YAML.format(task=task_name(prompt), data=data, text=text, choice=choice), encoding="utf-8")
    gguf = Path(gallery.smollm2())
    out = exp.workdir / "lm_eval_out"
    shutil.rmtree(out, ignore_errors=True)
    metadata = {"repgeom_metrics": ["dispersion"], "repgeom_layers": [LAYERS]}
    with exp.step(f"lm_eval on SmolLM2-135M-Instruct ({len(PROMPTS)} prompts, one command)"):
        lm_seconds = exp.run("lm_eval", "--model", "hf", "--model_args",
                             f"pretrained={gguf.parent},gguf_file={gguf.name}", "--include_path", tasks,
                             "--tasks", ",".join(task_name(p) for p in PROMPTS), "--batch_size", exp.args.batch_size,
                             "--log_samples", "--output_path", out, "--metadata", json.dumps(metadata), log="lm_eval")
    results = json.loads(max(out.rglob("results_*.json"), key=lambda p: p.name).read_text(encoding="utf-8"))

    per_prompt: dict = {}
    calibration, notes_seen = None, []
    for prompt in PROMPTS:
        task = task_name(prompt)
        samples = read_samples(out, task)
        table = results["results"][task]
        layer_names = sorted((k for k in samples[0] if k.startswith("repgeom:dispersion@resid_post:")),
                             key=layer_key)
        items = [s[SAMPLES_FIELD] for s in samples]
        vectors = np.stack([decode_vector(it["vector"]) for it in items])
        vector_file = exp.workdir / f"vectors_{prompt}.npy"
        np.save(vector_file, vectors)
        records = write_jsonl(exp.workdir / f"queries_{prompt}.jsonl", [
            {"doc_id": s["doc_id"], "acc": float(s["acc"]), "acc_norm": float(s["acc_norm"]), "ppl": it["ppl"],
             "prompt_ppl": it["prompt_ppl"]} for s, it in zip(samples, items)])
        curves = {}
        for scoring in SCORED[prompt]:
            sl_path = exp.workdir / f"slices_{prompt}_{scoring}.json"
            source = [out, "--task", task] if scoring == "acc" else [records, "--vectors", vector_file,
                                                                     "--correct-field", scoring]
            args = ["slices", *source, "--output", sl_path]
            with exp.step(f"repgeom slices: {prompt} prompt, {scoring}"):
                if (prompt, scoring) == MAIN:
                    try:
                        exp.run("repgeom", *args, "--calibrate", "--plot", exp.workdir / "slices_repgeom.png",
                                log=f"slices_{prompt}_{scoring}")
                    except SystemExit as exc:
                        if not exp.smoke:
                            raise
                        # a 40-question quiz rarely has both kinds of answer in every calibration part
                        exp.warn(f"--calibrate failed at smoke size, slices without it: {str(exc).splitlines()[-1]}")
                        exp.run("repgeom", *args, log=f"slices_{prompt}_{scoring}")
                else:
                    exp.run("repgeom", *args, log=f"slices_{prompt}_{scoring}")
            sl = json.loads(sl_path.read_text(encoding="utf-8"))
            curves[scoring] = {k: v for k, v in sl["slices"].items() if k not in ("perplexity", "prompt_perplexity")}
            notes_seen += [f"repgeom slices ({prompt}, {scoring}): {x}" for x in sl.get("notes", [])]
            if (prompt, scoring) == MAIN:
                calibration = sl.get("calibration")
        per_prompt[prompt] = {
            "prompt": PROMPTS[prompt][0], "task": task,
            "lm_eval": {k.split(",")[0]: v for k, v in table.items() if "," in k and not isinstance(v, str)},
            "slices": curves,
            "per_question": {
                "acc": [float(s["acc"]) for s in samples], "acc_norm": [float(s["acc_norm"]) for s in samples],
                "c": [float(s["repgeom_dispersion"]) for s in samples],
                # the question's vector (final layer, last prompt token), float32 base64: the question-level
                # bootstrap of the slice statistic resamples these
                "vector": [encode_vector(v) for v in vectors],
                "prompt_ppl": [it["prompt_ppl"] for it in items], "answer_ppl": [it["ppl"] for it in items],
                "c_by_layer": {name.split("@")[1].split(":")[1]: [float(s[name]) for s in samples]
                               for name in layer_names}},
        }
    for note in dict.fromkeys(notes_seen):
        exp.warn(note)

    cal = calibration or {}
    if cal.get("test_slices"):
        exp.figure(calibration_figure(cal), "calibration",
                   "Calibration (quiz prompt, acc): slice accuracy against slice dispersion on the test slices with "
                   "the fitted regressor (left), and predicted against true slice accuracy (right)")
    mae_constant = (float(np.mean([abs(a - 0.5) for t in cal["test_slices"] for a in t["accuracy"]]))
                    if cal.get("test_slices") else None)  # predicting 0.5 (the calibration slices' mean) everywhere
    lex_acc: dict[int, list[float]] = defaultdict(list)
    for q, ok in zip(quiz, per_prompt["quiz"]["per_question"]["acc"]):
        lex_acc[q["lexname"]].append(ok)
    notes = [
        "The quiz is generated at run time from the Debian wordnet package (single-word nouns of 3-14 letters; "
        f"seed {SEED}); it is not committed. The same questions, in the same order, go to every prompt.",
        "c_i is the mean cosine distance of a question's vector (final layer, last prompt token) to all other "
        "questions' vectors under the same prompt; its mean is the dispersion D. c_i does not depend on the "
        "scoring, only the correctness labels do. The per-layer AUROCs read c_i of the registered `dispersion` "
        "metric at each block output, from the same forward pass.",
        "Scorings: `acc` takes the choice with the largest summed log-likelihood, `acc_norm` the largest per byte "
        "of the choice; under the letter prompt every choice is one letter, so the two agree there.",
        "Accuracy by lexicographer file (quiz prompt, acc; largest five): " + "; ".join(
            f"{lex}: {np.mean(v):.2f} of {len(v)}" for lex, v in sorted(lex_acc.items(), key=lambda kv: -len(kv[1]))[:5]),
    ]
    exp.finish(["(summary written from the raw results by summarize())"], data={
        "questions": n, "prompts": per_prompt, "main": list(MAIN), "layers": LAYERS, "lm_eval_seconds": round(lm_seconds, 1),
        "calibration": {k: v for k, v in cal.items() if k != "test_slices"} if cal else None,
        "calibration_mae_constant": mae_constant,
    }, notes=notes)
    gallery.from_raw(exp.name, summarize, draw, [gallery.FROM_RAW, "--out", str(exp.out)])


if __name__ == "__main__":
    if gallery.FROM_RAW in sys.argv:
        gallery.from_raw("hardness_without_labels", summarize, draw)
    else:
        main()
