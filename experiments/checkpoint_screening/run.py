"""Checkpoint screening with the dispersion gap (paper A Fig. 9): does G of a checkpoint's output embeddings,
computed with no forward pass, rank the checkpoints of one training run the way held-out quality does?

    .venv/bin/python experiments/checkpoint_screening/run.py            # full size, ~25 min on 2 cores
    .venv/bin/python experiments/checkpoint_screening/run.py --smoke    # ~3 min, results under the work folder

Steps, each a command as a user types it (logged under WORKDIR/logs):

1. data: English prose read at run time, the paragraphs of the Python documentation (``pydoc_data.topics``) and
   the Debian ``fortunes`` cookies, split by a hash of each document (``stable_key``): 5 % held out for
   perplexity, 5 % held out as the source of the cloze items, the rest for training;
2. ``repgeom train --config config.yaml``: a small GPT-2 from scratch that saves a checkpoint every
   ``save_steps`` (``trainer/checkpoint-N``, each a model folder with its tokenizer);
3. the screen, ``repgeom gap --models CKPT ...`` (T = ``python_keywords``, T̄ = ``general``): reads one tensor per
   checkpoint, no forward pass, timed;
4. the evaluation, one ``lm_eval --model hf`` per checkpoint with two local tasks written here: held-out rolling
   perplexity (``loglikelihood_rolling``) and a 4-way cloze (``multiple_choice``: the last word of a held-out
   sentence against three training-text words of about the same frequency, scored by log-likelihood), timed;
5. ``repgeom gap ... --scores`` with the cloze accuracies and with the perplexities: Spearman ρ per pair.

Why T = python_keywords: the byte-level BPE is trained on this text, and a good part of it is the Python
documentation, which uses the keywords in running prose (``for``, ``in``, ``if``, ``class``, ``return`` ...); most
keywords are whole entries of the trained vocabulary (those that are not are reported as missing, never dropped
silently), and they are frequent, so their output rows train from the first steps; they are the domain words of
this text in the sense of paper A's T. ``digits`` (paper A's math set) is computed too, as a second token set, and
reported next to it, not chosen after the fact.
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from repgeom_eval.analyses.plots import label_points  # noqa: E402
import gallery  # noqa: E402
from gallery import Experiment, fortunes, pydoc_paragraphs, stable_key, write_jsonl  # noqa: E402

HERE = Path(__file__).resolve().parent
DOMAIN, REFERENCE, SECOND_DOMAIN = "python_keywords", "general", "digits"
PPL_FRACTION, CLOZE_FRACTION = 0.05, 0.10  # stable_key < 0.05: perplexity; [0.05, 0.10): cloze; the rest: training
SIZES = {
    False: {"train_chars": None, "ppl_chars": 100_000, "cloze_items": 500, "gap_size": 1000, "sets": []},
    True: {"train_chars": 300_000, "ppl_chars": 12_000, "cloze_items": 60, "gap_size": 300,
           "sets": ["from_scratch.n_layer=2", "from_scratch.n_embd=64", "from_scratch.n_head=2",
                    "from_scratch.vocab_size=1024", "data.block_size=64", "training.per_device_train_batch_size=8",
                    "training.max_steps=30", "training.save_steps=10", "training.warmup_steps=3"]},
}
WORD = re.compile(r"\b[a-z]{3,}\b")  # whole lower-case words only (not "hese" of "These")


# -- data -------------------------------------------------------------------------------------------------------------

def documents() -> list[str]:
    docs = pydoc_paragraphs() + [c for cookies in fortunes().values() for c in cookies]
    return sorted(set(docs), key=stable_key)


def split(docs: list[str], size: dict[str, Any]) -> tuple[list[str], list[str], list[str]]:
    train, ppl, cloze, n_train, n_ppl = [], [], [], 0, 0
    for doc in docs:  # in hash order, so a character cap keeps a fixed subset
        key = stable_key(doc)
        if key < PPL_FRACTION:
            if n_ppl < size["ppl_chars"]:
                ppl.append(doc)
                n_ppl += len(doc)
        elif key < CLOZE_FRACTION:
            cloze.append(doc)
        elif size["train_chars"] is None or n_train < size["train_chars"]:
            train.append(doc)
            n_train += len(doc)
    return train, ppl, cloze


def cloze_items(docs: list[str], train: list[str], n_items: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One item per held-out document at most: the last word of its first sentence of 8+ words whose last word is
    a lower-case word of 3+ letters seen 3+ times in the training text; the context is the document up to that
    word (its last 60 words); the distractors are three other training words of about the same training
    frequency (within a factor 2, widened to 4 when too few), so word frequency alone does not pick the answer."""
    freq = Counter(w for doc in train for w in WORD.findall(doc))
    vocab = sorted(w for w, c in freq.items() if c >= 3)
    by_count = sorted(vocab, key=lambda w: (freq[w], w))
    counts = [freq[w] for w in by_count]
    import bisect

    items = []
    for doc in docs:
        sentences = re.split(r"(?<=[.!?])\s+", " ".join(doc.split()))
        before: list[str] = []
        for sentence in sentences:
            words = sentence.split()
            target = words[-1].rstrip(".!?\"')") if words else ""
            if len(words) >= 8 and WORD.fullmatch(target) and freq[target] >= 3:
                rng = random.Random(int(stable_key(doc) * 1e12))
                for factor in (2, 4, 8):
                    lo = bisect.bisect_left(counts, freq[target] / factor)
                    hi = bisect.bisect_right(counts, freq[target] * factor)
                    pool = [w for w in by_count[lo:hi] if w != target]
                    if len(pool) >= 3:
                        break
                if len(pool) < 3:
                    continue
                choices = [target] + rng.sample(pool, 3)
                rng.shuffle(choices)
                context = " ".join((before + words[:-1])[-60:])
                items.append({"context": context, "choices": choices, "label": choices.index(target),
                              "target": target, "target_train_count": freq[target]})
                break
            before += words
        if len(items) >= n_items:
            break
    return items, {"vocabulary_words": len(vocab), "items": len(items), "source_documents": len(docs)}


TASK_CLOZE = """task: screening_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
TASK_PPL = """task: screening_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


# -- reading the outputs ----------------------------------------------------------------------------------------------

def lm_eval_numbers(folder: Path, tokenizer: Any) -> dict[str, float]:
    """acc, acc_norm, bits per byte and token perplexity of one checkpoint's lm_eval output folder. Token perplexity
    is exp(−Σ log-likelihood / Σ tokens) over the held-out documents (the rolling log-likelihoods in the samples;
    every token of a document is predicted, the first from the end-of-text token)."""
    results = json.loads(max(folder.rglob("results_*.json")).read_text(encoding="utf-8"))
    r = results["results"]
    ll, n_tokens = 0.0, 0
    for line in max(folder.rglob("samples_screening_ppl_*.jsonl")).read_text(encoding="utf-8").splitlines():
        sample = json.loads(line)
        value = sample["filtered_resps"][0]
        ll += float(value[0] if isinstance(value, list) else value)
        n_tokens += len(tokenizer(sample["doc"]["text"], add_special_tokens=False)["input_ids"])
    return {"acc": r["screening_cloze"]["acc,none"], "acc_stderr": r["screening_cloze"]["acc_stderr,none"],
            "acc_norm": r["screening_cloze"]["acc_norm,none"], "bits_per_byte": r["screening_ppl"]["bits_per_byte,none"],
            "word_perplexity": r["screening_ppl"]["word_perplexity,none"], "ppl": math.exp(-ll / n_tokens),
            "ppl_tokens": n_tokens, "eval_s": float(results.get("total_evaluation_time_seconds", "nan"))}


def comparison(r_ppl: float, r_acc: float, context: dict[str, float]) -> str:
    """The third summary line: which of the two correlations has the sign of paper A's finding (higher G, better
    checkpoint: negative with perplexity, positive with accuracy), and the free baseline of one run's step."""
    if math.isnan(r_ppl) or math.isnan(r_acc):
        return ("A Spearman ρ is undefined (a constant series over the checkpoints), so this run says nothing about "
                "paper A Fig. 9's ranking.")
    ok_ppl, ok_acc = r_ppl < 0, r_acc > 0
    if ok_ppl and ok_acc:
        head = ("As in paper A Fig. 9, higher G goes with the better checkpoints (lower perplexity, higher cloze "
                "accuracy) at a fraction of the cost of evaluating them")
    elif not ok_ppl and not ok_acc:
        head = ("Unlike paper A Fig. 9, where higher G marks the better checkpoint, here higher G goes with higher "
                "perplexity and lower cloze accuracy, so the screen would pick the worse checkpoints")
    else:
        good, bad = ("perplexity", "cloze accuracy") if ok_ppl else ("cloze accuracy", "perplexity")
        head = (f"Only partly like paper A Fig. 9: higher G goes with better {good} but not with better {bad}, so "
                "the two held-out measures and the screen disagree")
    return (f"{head}; within one run the training step is a free ranking too (ρ(step, perplexity) = "
            f"{context['step_ppl']:+.2f}, ρ(G, step) = {context['G_step']:+.2f}), so this small run tests whether G "
            "tracks training, not whether it beats that baseline.")


def main(argv: list[str] | None = None) -> None:
    exp = Experiment("checkpoint_screening", "Checkpoint screening with the dispersion gap",
                     "paper A Fig. 9 (G of checkpoints against their downstream quality)", doc=__doc__, argv=argv)
    size = SIZES[exp.smoke]
    work = exp.workdir
    data = work / "data"

    with exp.step("data"):
        train, ppl_docs, cloze_docs = split(documents(), size)
        items, cloze_info = cloze_items(cloze_docs, train, size["cloze_items"])
        write_jsonl(data / "train.jsonl", [{"text": t} for t in train])
        write_jsonl(data / "heldout_ppl.jsonl", [{"text": t} for t in ppl_docs])
        write_jsonl(data / "cloze.jsonl", items)
        tasks = work / "tasks"
        tasks.mkdir(exist_ok=True)
        (tasks / "screening_cloze.yaml").write_text(TASK_CLOZE.format(path=data / "cloze.jsonl"), encoding="utf-8")
        (tasks / "screening_ppl.yaml").write_text(TASK_PPL.format(path=data / "heldout_ppl.jsonl"), encoding="utf-8")
        shutil.copy(HERE / "config.yaml", work / "config.yaml")
    data_info = {"train_docs": len(train), "train_chars": sum(map(len, train)), "ppl_docs": len(ppl_docs),
                 "ppl_chars": sum(map(len, ppl_docs)), "cloze": cloze_info,
                 "sources": ["pydoc_data.topics paragraphs", "Debian fortunes (gallery.fortunes)"]}

    with exp.step("train (repgeom train)"):
        sets = [a for s in size["sets"] for a in ("--set", s)]
        train_s = exp.run("repgeom", "train", "--config", "config.yaml", *sets, "--overwrite", "--no-progress",
                          log="train")
    trained = json.loads((work / "run" / "results.json").read_text(encoding="utf-8"))
    ckpts = sorted((work / "run" / "trainer").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    steps = [int(p.name.split("-")[1]) for p in ckpts]
    models = [str(p) for p in ckpts]
    print(f"[{exp.name}] {len(ckpts)} checkpoints: steps {steps}", flush=True)

    gap_args = ["--reference", REFERENCE, "--size", size["gap_size"]]
    with exp.step("screen (repgeom gap, every checkpoint)"):
        gap_s = exp.run("repgeom", "gap", "--models", *models, "--domain", DOMAIN, *gap_args,
                        "--output", work / "gap.json", log="gap_screen")
    gap_doc = json.loads((work / "gap.json").read_text(encoding="utf-8"))
    gap = {r["model"]: r for r in gap_doc["results"]}
    n_words = gap_doc["config"]["token_sets"]["domain"].get("n_words", "?")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models[-1])
    evals: dict[str, dict[str, float]] = {}
    eval_walls: dict[str, float] = {}
    with exp.step("evaluate (lm_eval per checkpoint: perplexity + cloze)"):
        for step, model in zip(steps, models):
            out = work / "lm_eval" / f"step{step}"
            shutil.rmtree(out, ignore_errors=True)
            eval_walls[model] = exp.run(
                "lm_eval", "--model", "hf", "--model_args", f"pretrained={model},dtype=float32", "--device", "cpu",
                "--batch_size", 32, "--include_path", tasks, "--tasks", "screening_ppl,screening_cloze",
                "--log_samples", "--output_path", out, log=f"lm_eval_step{step}")
            evals[model] = lm_eval_numbers(out, tokenizer)
            print(f"[{exp.name}] step {step}: G {gap[model]['G']:.4f}, ppl {evals[model]['ppl']:.2f}, "
                  f"cloze acc {evals[model]['acc']:.3f}", flush=True)

    scores = {"cloze_acc": {m: evals[m]["acc"] for m in models}, "ppl": {m: evals[m]["ppl"] for m in models}}
    rho: dict[str, Any] = {}
    with exp.step("Spearman (repgeom gap --scores)"):
        for name, values in scores.items():
            path = work / f"scores_{name}.json"
            path.write_text(json.dumps(values, indent=1), encoding="utf-8")
            exp.run("repgeom", "gap", "--models", *models, "--domain", DOMAIN, *gap_args, "--scores", path,
                    "--output", work / f"gap_vs_{name}.json", log=f"gap_scores_{name}")
            rho[name] = json.loads((work / f"gap_vs_{name}.json").read_text(encoding="utf-8"))["spearman"]
            if rho[name]["rho"] is None:  # undefined: a constant series (e.g. equal accuracies at smoke size)
                rho[name]["rho"] = math.nan
        exp.run("repgeom", "gap", "--models", *models, "--domain", SECOND_DOMAIN, *gap_args,
                "--output", work / "gap_digits.json", log="gap_digits")
    gap2 = {r["model"]: r for r in json.loads((work / "gap_digits.json").read_text(encoding="utf-8"))["results"]}

    from repgeom_eval.functional.stats import spearman

    G = [gap[m]["G"] for m in models]
    ppl = [evals[m]["ppl"] for m in models]
    acc = [evals[m]["acc"] for m in models]
    G2 = [gap2[m]["G"] for m in models]
    context_rho = {"step_ppl": spearman(steps, ppl), "step_acc": spearman(steps, acc), "G_step": spearman(G, steps),
                   "ppl_acc": spearman(ppl, acc), "digits_G_ppl": spearman(G2, ppl),
                   "digits_G_acc": spearman(G2, acc), "within_T_ppl": spearman([gap[m]["within_T"] for m in models], ppl),
                   "between_ppl": spearman([gap[m]["between"] for m in models], ppl)}
    eval_wall = sum(eval_walls.values())
    eval_core = sum(evals[m]["eval_s"] for m in models)
    gap_core = sum(gap[m]["timings"]["total_s"] for m in models)

    # -- tables ------------------------------------------------------------------------------------------------------
    rows = [[s, gap[m]["G"], gap[m]["within_T"], gap[m]["between"], gap[m]["within_Tbar"], gap2[m]["G"], evals[m]["ppl"],
             evals[m]["bits_per_byte"], evals[m]["acc"], evals[m]["acc_norm"], round(eval_walls[m], 1)]
            for s, m in zip(steps, models)]
    exp.table("Per checkpoint (G: T = python_keywords, T̄ = general; ppl: held-out token perplexity; cloze: 4-way)",
              ["step", "G", "within(T)", "between(T,T̄)", "within(T̄)", "G (T = digits)", "ppl", "bits/byte", "cloze acc",
               "cloze acc_norm", "lm_eval wall s"], rows)
    exp.table("Spearman correlations over the checkpoints", ["pair", "ρ", "n"], [
        ["G, held-out perplexity (repgeom gap --scores)", rho["ppl"]["rho"], rho["ppl"]["n"]],
        ["G, cloze accuracy (repgeom gap --scores)", rho["cloze_acc"]["rho"], rho["cloze_acc"]["n"]],
        ["G with T = digits, perplexity", context_rho["digits_G_ppl"], len(models)],
        ["G with T = digits, cloze accuracy", context_rho["digits_G_acc"], len(models)],
        ["within(T) alone, perplexity", context_rho["within_T_ppl"], len(models)],
        ["between(T, T̄) alone, perplexity", context_rho["between_ppl"], len(models)],
        ["G, training step", context_rho["G_step"], len(models)],
        ["training step, perplexity (the no-cost baseline)", context_rho["step_ppl"], len(models)],
        ["training step, cloze accuracy", context_rho["step_acc"], len(models)],
        ["perplexity, cloze accuracy", context_rho["ppl_acc"], len(models)],
    ])
    exp.table("Wall time: the screen against evaluating every checkpoint", ["what", "seconds"], [
        [f"repgeom gap over {len(models)} checkpoints (one process, wall)", round(gap_s, 1)],
        ["  of which reading W rows + computing G (sum of per-checkpoint timings)", round(gap_core, 2)],
        [f"lm_eval perplexity + cloze, {len(models)} processes (wall)", round(eval_wall, 1)],
        ["  of which lm_eval's own evaluation time (sum)", round(eval_core, 1)],
        ["evaluation wall / screen wall", round(eval_wall / gap_s, 1)],
        ["training (repgeom train, for scale)", round(train_s, 1)],
    ])

    # -- summary -----------------------------------------------------------------------------------------------------
    m = trained["model"]
    r_ppl, r_acc = rho["ppl"]["rho"], rho["cloze_acc"]["rho"]
    summary = [
        f"A {m['n_layers']}-layer width-{m['hidden_size']} GPT-2 trained from scratch with `repgeom train` on "
        f"{data_info['train_chars'] / 1e6:.1f} M characters of English prose (Python docs, fortunes), "
        f"{len(models)} checkpoints (steps {steps[0]}–{steps[-1]}), screened with `repgeom gap` (T = python_keywords, "
        f"T̄ = general) and evaluated with `lm_eval` (held-out perplexity, {cloze_info['items']}-item 4-way cloze).",
        f"Spearman ρ(G, perplexity) = {r_ppl:+.2f}, ρ(G, cloze accuracy) = {r_acc:+.2f} (n = {len(models)}); "
        f"perplexity {ppl[0]:.1f} → {ppl[-1]:.1f}, cloze {acc[0]:.2f} → {acc[-1]:.2f}; the screen took "
        f"{gap_s:.0f} s for all checkpoints against {eval_wall:.0f} s of evaluation ({eval_wall / gap_s:.0f}×).",
        comparison(r_ppl, r_acc, context_rho),
    ]
    notes = [
        "Perplexity is token-level, exp(−Σ log p / Σ tokens) over the held-out documents, from lm_eval's rolling "
        "log-likelihoods (--log_samples; disjoint windows of the model's context). lm_eval's word perplexity and "
        "bits per byte are in result.json; all checkpoints share one tokenizer, so all three rank them identically.",
        "Cloze: the last word of the first 8+-word sentence of a held-out document whose last word is a lower-case "
        "word seen 3+ times in training, against three training words of about the same training frequency; "
        "lm_eval multiple_choice (acc: sum of the continuation's token log-likelihoods; acc_norm: per byte).",
        f"Why T = python_keywords: the BPE is trained on this text and the Python documentation uses the keywords "
        f"in its prose, so they are frequent entries whose output rows train from the start (T holds "
        f"{gap[models[0]]['n_T']} ids: {n_words - len(gap[models[0]]['missing_T'])} of the {n_words} keywords, with and without "
        f"a leading space; not whole entries of this {trained['model'].get('vocab_size', 'trained')}-entry "
        f"vocabulary: {', '.join(gap[models[0]]['missing_T']) or 'none'}). T̄ = general: "
        f"{gap[models[0]]['n_Tbar']} alphabetic entries of 3+ letters outside T. T = digits (paper A's math set) "
        f"is reported beside it, chosen before the run, not after it.",
        "Timing: the screen is one `repgeom gap` process over all checkpoints; the evaluation is one `lm_eval` "
        "process per checkpoint (process start and lm_eval's task indexing included; its own evaluation time is "
        "given separately). Both ran niced on a shared 2-core machine.",
        f"repgeom train's own check at the last step (packed blocks of the same held-out file): perplexity "
        f"{trained['evaluations'][-1]['perplexity']['prose']:.2f}." if trained.get("evaluations") else
        "repgeom train made no evaluation.",
    ]
    exp.finish(summary, data={
        "steps": steps, "models": [Path(x).name for x in models], "G": G, "G_digits": G2, "ppl": ppl, "cloze_acc": acc,
        "gap": {Path(k).name: {x: v[x] for x in ("G", "within_T", "within_Tbar", "between", "n_T", "n_Tbar")}
                for k, v in gap.items()},
        "evaluations": {Path(k).name: v for k, v in evals.items()},
        "spearman": {"G_ppl": rho["ppl"], "G_cloze_acc": rho["cloze_acc"], **context_rho},
        "wall_s": {"gap_screen": gap_s, "gap_core_sum": gap_core, "evaluation": eval_wall,
                   "evaluation_core_sum": eval_core, "per_checkpoint_eval": {Path(k).name: v for k, v in eval_walls.items()},
                   "train": train_s},
        "token_sets": {"domain": DOMAIN, "reference": REFERENCE, "size": size["gap_size"], "second_domain": SECOND_DOMAIN,
                       "n_T": gap[models[0]]["n_T"], "n_Tbar": gap[models[0]]["n_Tbar"],
                       "missing_T": gap[models[0]]["missing_T"]},
        "model": trained["model"], "training": trained["config"]["training"],
        "from_scratch": trained["config"]["from_scratch"], "data": data_info,
    }, notes=notes)
    gallery.from_raw(exp.name, summarize, draw, [gallery.FROM_RAW, "--out", str(exp.out)])


# -- intervals, verdicts and figures (issue 25): everything below reads result.json only ------------------------------

PAIRS = {  # name: (x, y, what paper A predicts for the sign: below/above 0, or None for context)
    "G_ppl": ("G", "ppl", "below"), "G_cloze_acc": ("G", "cloze_acc", "above"),
    "digits_G_ppl": ("G_digits", "ppl", "below"), "digits_G_acc": ("G_digits", "cloze_acc", "above"),
    "G_step": ("G", "steps", None), "step_ppl": ("steps", "ppl", None), "step_acc": ("steps", "cloze_acc", None),
}


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """result.json with the summary, intervals and verdicts recomputed from its per-checkpoint values."""
    from repgeom_eval.functional.bootstrap import rowwise_spearman
    from repgeom_eval.functional.stats import spearman

    d = doc["data"]
    n = len(d["steps"])
    intervals = {}
    for name, (x, y, _) in PAIRS.items():
        iv = gallery.interval(rowwise_spearman, d[x], d[y])
        iv["estimate"] = spearman(d[x], d[y])  # the library's ρ (equal to the row-wise one; NaN policy its own)
        intervals[name] = iv
    verdict = {name: gallery.decide(intervals[name]["low"], intervals[name]["high"], 0.0, expect)
               for name, (_, _, expect) in PAIRS.items() if expect}
    said = {gallery.FOLLOWS: "as paper A", gallery.OPPOSITE: "the opposite of paper A",
            gallery.CANNOT_TELL: "cannot tell at this size"}
    show = lambda k: f"{intervals[k]['estimate']:+.2f} ({intervals[k]['low']:+.2f} to {intervals[k]['high']:+.2f})"  # noqa: E731
    m, info = d["model"], d["data"]
    ppl, acc, steps = d["ppl"], d["cloze_acc"], d["steps"]
    last_drop = 100 * (1 - ppl[-1] / ppl[-2]) if n >= 2 else math.nan
    wall = d["wall_s"]
    summary = [
        f"A {m['n_layers']}-layer width-{m['hidden_size']} GPT-2 trained from scratch with `repgeom train` on "
        f"{info['train_chars'] / 1e6:.1f} M characters of English prose (Python docs, fortunes), {n} checkpoints "
        f"(steps {steps[0]}–{steps[-1]}), screened with `repgeom gap` (cosine G; T = python_keywords, T̄ = general) "
        f"and evaluated with `lm_eval` (held-out perplexity, {info['cloze']['items']}-item 4-way cloze). Protocol "
        f"limits: the whole run is early training, burn-in only ({d['training']['max_steps']} steps from scratch, "
        f"{d['training']['lr_scheduler_type']} schedule; perplexity falls {ppl[0] / ppl[-1]:.1f}-fold over it, and the "
        f"last {steps[-1] - steps[-2]} steps change it by {last_drop:.1f} % as the learning rate decays), it is trained on prose but screened with Python keywords, "
        "and only the cosine G is shown (result.json holds no Euclidean G); not covered: paper A's setting of many "
        "fine-tuned checkpoints of one pretrained model (e.g. 30 SmolLM2 fine-tunes).",
        f"Spearman ρ over the {n} checkpoints with 95 % intervals (percentile bootstrap over checkpoints, 2000 "
        f"resamples, seed 0): ρ(G, perplexity) = {show('G_ppl')}, ρ(G, cloze accuracy) = {show('G_cloze_acc')}; "
        f"T = digits: {show('digits_G_ppl')} and {show('digits_G_acc')}; perplexity {ppl[0]:.1f} → {ppl[-1]:.1f}, "
        f"cloze {acc[0]:.2f} → {acc[-1]:.2f}; the screen took {wall['gap_screen']:.0f} s for all checkpoints against "
        f"{wall['evaluation']:.0f} s of evaluation ({wall['evaluation'] / wall['gap_screen']:.0f}×).",
        "Paper A Fig. 9: higher G marks the better checkpoint (ρ with perplexity below 0, with accuracy above 0). "
        f"Decided by the intervals: with perplexity, {said[verdict['G_ppl']]}; with cloze accuracy, "
        f"{said[verdict['G_cloze_acc']]}. Within one run the training step ranks the checkpoints for free "
        f"(ρ(step, perplexity) = {show('step_ppl')}, ρ(G, step) = {show('G_step')}), so this run tests whether G "
        "tracks early training, not whether it beats that baseline or screens fine-tunes.",
    ]
    pick = checkpoint_pick(d)
    summary[2] += " " + pick_sentence(pick)
    rows = [[f"ρ({x}, {y})", intervals[k]["estimate"], f"{intervals[k]['low']:+.3f} to {intervals[k]['high']:+.3f}",
             n, verdict.get(k, "context (no paper prediction)")] for k, (x, y, _) in PAIRS.items()]
    tables = [{"title": "Spearman ρ over the checkpoints with 95 % intervals (percentile bootstrap over checkpoints)",
               "header": ["pair", "ρ", "95 % CI", "n", "verdict"], "rows": rows}, pick_table(pick)]
    notes = [
        "Intervals resample the checkpoints (the only unit result.json keeps per value): they are successive "
        "states of one training run, not independent draws, and n = 10 is small, so the intervals describe how "
        "stable the ranking is across these checkpoints, not a population of runs. Per-item cloze results and "
        "the G of resampled token sets are not kept, so neither can be resampled here.",
        "Protocol limits, stated with the verdict: every checkpoint is early training (burn-in), when G and "
        "perplexity both move with the step; the model is trained on English prose while T is the Python keywords "
        "(frequent in the Python documentation's prose); G is the cosine dispersion gap only, a Euclidean G was "
        "not computed by this run; paper A screens fine-tuned checkpoints of a pretrained model, which this run "
        "does not (it needs new long runs).",
    ]
    figures = [{"file": "gap_ppl_vs_step.png", "caption": "G of each checkpoint's output embeddings (top), its "
                "held-out perplexity (middle) and 4-way cloze accuracy (bottom, 95 % binomial interval from lm_eval's "
                "s.e.; dotted: chance) against the training step"},
               {"file": "gap_vs_ppl.png", "caption": "G against held-out perplexity and cloze accuracy, one point per "
                "checkpoint (labels: training step); titles: Spearman ρ with its 95 % bootstrap interval"}]
    notes.append(PICK_NOTE.format(burn_in=pick["burn_in"], first=pick["first_eligible_step"],
                                  max_steps=pick["max_steps"], n=n, reference=d["token_sets"]["reference"],
                                  size=d["token_sets"]["size"], **pick["callback_defaults"]))
    out = gallery.regenerated(doc, summary, tables, notes, intervals, figures)
    out["data"]["checkpoint_pick"] = pick
    return out


# -- the training callback's label-free pick against the held-out choice (issue 26) ----------------------------------

PICK_SETS = {"G": "domain", "G_digits": "second_domain"}  # G's column → its token set's key in data.token_sets
PICK_NOTE = (
    "Checkpoint pick: `repgeom_eval.training.geometry.pick_checkpoint`, the rule GeometryCallback applies "
    "(largest cosine G at or after burn_in × max_steps, ties to the later step; default burn_in {burn_in} of max_steps {max_steps}, "
    "so steps ≥ {first}), run on the G that `repgeom gap` measured on the saved checkpoints (T̄ = {reference}, "
    "{size} sampled entries; the callback's defaults: T = {cb_domain}, T̄ = {cb_reference}, {cb_size}) for both "
    "token sets T this run computed; the callback itself was "
    "not run here, it computes G with the same token sets and distance code but was not checked against these "
    "values. The held-out choice is the lowest held-out perplexity over all {n} checkpoints (it reads labels; "
    "the pick does not). This is one training run, so there is no interval over runs; a bootstrap over the "
    "checkpoints is not given, because the checkpoints are the whole candidate set of the pick, not a sample of "
    "it, and resampling them would only measure which duplicates a resample happens to hold.")


def checkpoint_pick(d: dict[str, Any]) -> dict[str, Any]:
    """The callback's label-free pick (pick_checkpoint, its default burn-in) over the run's checkpoints for each
    token set, against the checkpoint of lowest held-out perplexity."""
    import dataclasses

    from repgeom_eval.training.config import GeometryProbe
    from repgeom_eval.training.geometry import pick_checkpoint

    defaults = {f.name: f.default for f in dataclasses.fields(GeometryProbe)}
    burn_in = defaults["burn_in"]
    steps, ppl, acc = d["steps"], d["ppl"], d["cloze_acc"]
    max_steps = d["training"]["max_steps"]
    best = min(range(len(steps)), key=lambda i: (ppl[i], steps[i]))
    order = sorted(range(len(steps)), key=lambda i: ppl[i])
    out: dict[str, Any] = {"burn_in": burn_in, "max_steps": max_steps, "n_checkpoints": len(steps),
                           "held_out_step": steps[best],
                           "held_out_ppl": ppl[best], "held_out_cloze_acc": acc[best], "by_token_set": {},
                           "callback_defaults": {"cb_domain": defaults["domain"], "cb_reference": defaults["reference"],
                                                 "cb_size": defaults["size"]}}
    for key, which in PICK_SETS.items():
        name = d["token_sets"][which]
        label = name + (" (this run's T)" if which == "domain" else "") + (
            " (GeometryCallback's default T)" if name == defaults["domain"] else "")
        records = [{"step": s, "G": {"cosine": g}, "checkpoint": m} for s, g, m in zip(steps, d[key], d["models"])]
        picked = pick_checkpoint(records, max_steps, burn_in)
        i = steps.index(picked["step"])
        eligible = [j for j in order if steps[j] >= picked["first_eligible_step"]]
        out["first_eligible_step"] = picked["first_eligible_step"]
        out["by_token_set"][key] = {
            "token_set": label, "step": picked["step"], "G_cosine": picked["G_cosine"],
            "n_eligible": picked["n_eligible"], "ppl": ppl[i], "cloze_acc": acc[i],
            "ppl_minus_best": ppl[i] - ppl[best], "ppl_ratio": ppl[i] / ppl[best],
            "rank_by_ppl": order.index(i) + 1, "rank_by_ppl_among_eligible": eligible.index(i) + 1,
            "is_held_out_choice": i == best, "rule": picked["rule"]}
    return out


def pick_sentence(pick: dict[str, Any]) -> str:
    parts = []
    for key, p in pick["by_token_set"].items():
        parts.append(f"T = {p['token_set'].split(' ')[0]}: step {p['step']}, perplexity {p['ppl']:.1f}, "
                     f"{p['ppl_minus_best']:+.1f} ({p['ppl_ratio'] - 1:+.1%}) over the held-out choice, rank "
                     f"{p['rank_by_ppl']} of {pick['n_checkpoints']} by perplexity "
                     f"({p['rank_by_ppl_among_eligible']} of {p['n_eligible']} eligible)")
    hits = [p["is_held_out_choice"] for p in pick["by_token_set"].values()]
    verdict = ("it picks the held-out choice with both token sets" if all(hits) else
               "it does not pick the held-out choice with either token set" if not any(hits) else
               "it picks the held-out choice with one token set only")
    return (f"The training callback's label-free pick (largest G at or after step {pick['first_eligible_step']}) "
            f"against the held-out choice (lowest perplexity, step {pick['held_out_step']}, "
            f"{pick['held_out_ppl']:.1f}): " + "; ".join(parts) + f"; {verdict} (one run, so no interval).")


def pick_table(pick: dict[str, Any]) -> dict[str, Any]:
    rows = [[p["token_set"], p["step"], p["G_cosine"], p["ppl"], pick["held_out_step"], pick["held_out_ppl"],
             p["ppl_minus_best"], f"{p['rank_by_ppl']}/{pick['n_checkpoints']}",
             f"{p['rank_by_ppl_among_eligible']}/{p['n_eligible']}", p["cloze_acc"], pick["held_out_cloze_acc"]]
            for p in pick["by_token_set"].values()]
    return {"title": "Label-free checkpoint pick (GeometryCallback's pick_checkpoint) against the held-out choice "
                     "(lowest perplexity); one run, no interval",
            "header": ["T", "picked step", "G (cosine)", "pick ppl", "held-out step", "held-out ppl", "ppl − best",
                       "rank by ppl", "rank among eligible", "pick cloze acc", "held-out cloze acc"],
            "rows": rows}


def draw(doc: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = doc["data"]
    steps, G, G2, ppl, acc = d["steps"], d["G"], d["G_digits"], d["ppl"], d["cloze_acc"]
    se = [d["evaluations"][m]["acc_stderr"] for m in d["models"]]
    fig, axes = plt.subplots(3, 1, figsize=(6.0, 6.4), sharex=True)
    axes[0].plot(steps, G, "o-", color="tab:purple", label="T = python_keywords")
    axes[0].set_ylabel("dispersion gap G")
    ax2 = axes[0].twinx()
    ax2.plot(steps, G2, "s--", color="tab:gray", ms=4, label="T = digits")
    ax2.set_ylabel("G (T = digits)", color="tab:gray")
    axes[0].legend(loc="upper left", fontsize=8)
    ax2.legend(loc="lower right", fontsize=8)
    axes[1].plot(steps, ppl, "o-", color="tab:red")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("held-out perplexity")
    axes[2].errorbar(steps, acc, yerr=[1.96 * e for e in se], fmt="o-", color="tab:green", capsize=2)
    axes[2].axhline(0.25, color="gray", lw=0.8, ls=":")
    axes[2].set_ylabel("cloze accuracy (4-way)")
    axes[2].set_xlabel("training step")
    fig.suptitle(f"GPT-2 ({d['model']['n_layers']} layers, width {d['model']['hidden_size']}) from "
                 f"scratch: G (no forward pass) vs held-out quality", fontsize=10)
    fig.tight_layout()
    gallery.save_figure(fig, out / "gap_ppl_vs_step.png")

    iv = d["intervals"]
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.5))
    for ax, y, label, key in ((axes[0], ppl, "held-out perplexity", "G_ppl"),
                              (axes[1], acc, "cloze accuracy", "G_cloze_acc")):
        ax.scatter(G, y, c=steps, cmap="viridis")
        ax.set_xlabel("dispersion gap G (T = python_keywords)")
        ax.set_ylabel(label)
        ax.set_title(f"Spearman ρ = {iv[key]['estimate']:+.2f} (95 % CI {iv[key]['low']:+.2f} to "
                     f"{iv[key]['high']:+.2f}; n = {len(steps)})", fontsize=9)
    axes[0].set_yscale("log")
    fig.tight_layout()
    for ax, y in ((axes[0], ppl), (axes[1], acc)):
        label_points(ax, G, y, steps)
    gallery.save_figure(fig, out / "gap_vs_ppl.png")


if __name__ == "__main__":
    if gallery.FROM_RAW in sys.argv:
        gallery.from_raw("checkpoint_screening", summarize, draw)
    else:
        main()
