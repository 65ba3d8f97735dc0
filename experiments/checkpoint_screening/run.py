"""Checkpoint screening with the dispersion gap (paper A Fig. 9): does G of a checkpoint's output embeddings,
computed with no forward pass, rank checkpoints and variants of one model family the way held-out quality does?

    .venv/bin/python experiments/checkpoint_screening/run.py            # full size, 112 min measured (2 cores shared with 2 other jobs)
    .venv/bin/python experiments/checkpoint_screening/run.py --smoke    # a few minutes, results under the work folder
    .venv/bin/python experiments/checkpoint_screening/run.py --from-raw # summary, intervals, figures from result.json

Paper A screens models within a family after training has settled (its trajectory study drops the first 120k of
700k steps as burn-in) and compares adapted with under-adapted variants (CodeLlama against Llama 2). Scaled to a
2-core CPU, two families, each analysed on its own (Spearman within a family, never pooled):

* ``finetune``: SmolLM2-135M-Instruct (GGUF, de-quantized to float32) continued-trained on Python source code with
  ``repgeom train --config config_finetune.yaml``, a checkpoint every ``save_steps``; the base model is the step-0
  variant (under-adapted, paper A's Llama 2 against CodeLlama);
* ``scratch``: a small GPT-2 trained from scratch on the same Python code with ``repgeom train --config
  config.yaml`` at a learning rate that does not decay, screened only after its burn-in (the first third of the
  steps dropped, as paper A drops 120k of 700k).

Steps, each a command as a user types it (logged under WORKDIR/logs):

1. data: the ``.py`` files of the Python standard library (``gallery.stdlib_sources``), split by a hash of each
   file (``stable_key``): 5 % held out for perplexity, 10 % held out as the source of the completion items, the rest
   for training; T̄, the frequent whole words of general English that is not code (Debian ``fortunes`` and
   ``bible-kjv``), written to a file, one word a line;
2. ``repgeom train`` for each family;
3. the screen, ``repgeom gap --models CKPT ... --distance cosine`` (T = ``python_keywords``, T̄ = the word file):
   reads one tensor per checkpoint, no forward pass, timed;
4. the evaluation, one ``lm_eval --model hf`` per checkpoint with two local tasks written here: held-out rolling
   perplexity (``loglikelihood_rolling``) and a 4-way code completion (``multiple_choice``: the identifier or keyword
   that ends a held-out line of code, after the previous two lines, against three identifiers of about the same
   training frequency), timed;
5. ``repgeom gap ... --scores`` with the perplexities and with the completion accuracies, for ``--distance cosine``
   and ``--distance euclidean``: G, its components and Spearman ρ per family.

Everything the summary says is computed by ``summarize`` from the raw values in result.json (``--from-raw``).
"""

from __future__ import annotations

import bisect
import io
import keyword
import json
import math
import random
import re
import shutil
import sys
import tokenize
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from repgeom_eval.analyses.plots import label_points  # noqa: E402
import gallery  # noqa: E402
from gallery import Experiment, stable_key, write_jsonl  # noqa: E402

HERE = Path(__file__).resolve().parent
DOMAIN = "python_keywords"
DISTANCES = ("cosine", "euclidean")
PPL_FRACTION, CLOZE_FRACTION = 0.05, 0.15  # stable_key < 0.05: perplexity; [0.05, 0.15): completion; rest: training
BURN_IN = 1 / 3  # scratch family: checkpoints before ceil(BURN_IN * max_steps) are not screened (paper A: 120k/700k)
ITEMS_PER_FILE = 3  # completion items taken from one held-out file at most
CONTEXT_LINES = 2  # lines of code before the completed line
FAMILIES = ("finetune", "scratch")  # trajectories: checkpoints of one run, ranked for free by the step
VARIANTS = "variants"  # between variants at equal step: fine-tunes of SmolLM2 on data mixtures × learning rates
MIXTURES = {"code": "Python code only", "code+prose": "Python code and Python-documentation prose, half each"}
SIZES = {
    False: {"train_finetune_chars": 600_000, "train_scratch_chars": 4_000_000, "ppl_files": 4, "ppl_chunk_chars": 1000,
            "cloze_items": 120, "tbar_size": 1000, "sets": {"finetune": [], "scratch": [], VARIANTS: []},
            "variant_steps": 32, "variant_lrs": (2e-5, 6e-5, 2e-4, 6e-4)},
    True: {"train_finetune_chars": 60_000, "train_scratch_chars": 300_000, "ppl_files": 2, "ppl_chunk_chars": 400,
           "cloze_items": 16, "tbar_size": 300, "variant_steps": 2, "variant_lrs": (1e-4, 1e-3),
           "sets": {VARIANTS: ["data.block_size=32", "training.per_device_train_batch_size=2"],
                    "finetune": ["data.block_size=32", "training.per_device_train_batch_size=2",
                                 "training.max_steps=2", "training.save_steps=1"],
                    "scratch": ["from_scratch.n_layer=2", "from_scratch.n_embd=64", "from_scratch.n_head=2",
                                "from_scratch.vocab_size=1024", "data.block_size=64",
                                "training.per_device_train_batch_size=8", "training.max_steps=60",
                                "training.save_steps=10", "training.warmup_steps=5"]}},
}
ENGLISH_WORD = re.compile(r"(?<![\w'])[a-z]{2,}(?![\w'])")  # a whole lower-case word (not "ll" of "it'll")
IDENTIFIER = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")
LABELS = {"finetune": "SmolLM2-135M fine-tuned on Python code", "scratch": "GPT-2 from scratch on Python code",
          VARIANTS: "SmolLM2-135M fine-tunes at equal step (data mixture × learning rate)"}


# -- data -------------------------------------------------------------------------------------------------------------

def split(docs: list[str], size: dict[str, Any]) -> dict[str, list[str]]:
    """Training files (the fine-tune's and the from-scratch run's, each a character-capped prefix in hash order),
    perplexity files and completion files, by each file's hash."""
    out: dict[str, list[str]] = {"train_finetune": [], "train_scratch": [], "ppl": [], "cloze": []}
    n = {"train_finetune": 0, "train_scratch": 0}
    for doc in sorted(docs, key=stable_key):
        key = stable_key(doc)
        if key < PPL_FRACTION:
            out["ppl"].append(doc)
        elif key < CLOZE_FRACTION:
            out["cloze"].append(doc)
        else:
            for name in n:
                if n[name] < size[f"{name}_chars"]:
                    out[name].append(doc)
                    n[name] += len(doc)
    return out


def capped(texts: list[str], chars: int) -> list[str]:
    """The first texts whose lengths add up to at most ``chars`` (at least one)."""
    out, n = [], 0
    for t in texts:
        if out and n + len(t) > chars:
            break
        out.append(t)
        n += len(t)
    return out


def ppl_chunks(docs: list[str], n_files: int, chunk_chars: int) -> list[str]:
    """From each of the first ``n_files`` held-out files, whole lines from its middle, up to ``chunk_chars``."""
    out = []
    for doc in docs[:n_files]:
        lines = doc.splitlines()
        i, text = len(lines) // 2, ""
        while i < len(lines) and len(text) + len(lines[i]) + 1 <= chunk_chars:
            text += lines[i] + "\n"
            i += 1
        if text.strip():
            out.append(text)
    return out


def tbar_words(n: int, exclude: set[str]) -> tuple[list[str], dict[str, Any]]:
    """The ``n`` most frequent whole lower-case words of general English that is not code (Debian fortunes and the
    King James Bible), T's words excluded; ties by the word."""
    fort = [c for cookies in gallery.fortunes().values() for c in cookies]
    bible = list(gallery.bible_books().values())
    freq = Counter(w for text in fort + bible for w in ENGLISH_WORD.findall(text))
    ranked = sorted((w for w in freq if w not in exclude), key=lambda w: (-freq[w], w))
    words = ranked[:n]
    return words, {"sources": ["Debian fortunes (gallery.fortunes)", "Debian bible-kjv (gallery.bible_books)"],
                   "rule": "most frequent whole lower-case words of 2+ letters, T's words excluded",
                   "n_words": len(words), "distinct_words_in_sources": len(freq),
                   "least_frequent_kept": words[-1] if words else None,
                   "its_count": freq[words[-1]] if words else 0}


def line_end_names(source: str) -> tuple[list[tuple[int, int, str]], set[str]]:
    """(line index, column, name) of every name (identifier or keyword) that ends a logical line of code, after a
    space and something else on its line (so never inside a string, a docstring or a comment); and every name the
    file's code uses (its NAME tokens)."""
    out: list[tuple[int, int, str]] = []
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return out, set()
    for prev, tok, nxt in zip(toks, toks[1:], toks[2:]):
        if tok.type == tokenize.NAME and nxt.type == tokenize.NEWLINE and prev.end[0] == tok.start[0]:
            row, col = tok.start
            line = tok.line.split("\n")[0] if "\n" in tok.line else tok.line
            if line[col:].rstrip() == tok.string and col > 0 and line[col - 1] == " " and line[:col].strip():
                out.append((row - 1, col, tok.string))
    return out, {t.string for t in toks if t.type == tokenize.NAME}


def cloze_items(docs: list[str], train: list[str], n_items: int, one_token: Any) -> tuple[list[dict], dict]:
    """Code completion items: a name (identifier or keyword) that ends a held-out line of code, after the previous
    CONTEXT_LINES lines and the line up to it. The three distractors are names of about the same training frequency
    (within a factor 2), so frequency alone does not pick the answer: the three of the same file's code closest in
    training frequency (names the file uses, so plausible there), or, when the file has fewer than three such names, three
    drawn from all training names within a factor 2 (widened to 4 or 8 when too few). Answer and distractors are each one token of the fine-tuned model's vocabulary (with the space
    before them), so lm_eval scores the four choices with one forward pass. At most ITEMS_PER_FILE a file."""
    freq = Counter(w for doc in train for w in IDENTIFIER.findall(doc))
    vocab = sorted(w for w, c in freq.items() if c >= 3 and one_token(w))
    by_count = sorted(vocab, key=lambda w: (freq[w], w))
    counts = [freq[w] for w in by_count]
    ok = set(vocab)
    items = []
    for doc in docs:
        lines = doc.splitlines()
        ends, names = line_end_names(doc)
        found = [(i, c, w) for i, c, w in ends if w in ok and i >= CONTEXT_LINES]
        rng = random.Random(int(stable_key(doc) * 1e12))
        in_file = sorted(names & ok)
        for i, col, target in sorted(rng.sample(found, min(ITEMS_PER_FILE, len(found)))):
            near = sorted((w for w in in_file if w != target and freq[target] / 2 <= freq[w] <= freq[target] * 2),
                          key=lambda w: (abs(math.log(freq[w] / freq[target])), w))
            if len(near) >= 3:
                distractors, source = near[:3], "file"
            else:
                for factor in (2, 4, 8):
                    lo = bisect.bisect_left(counts, freq[target] / factor)
                    hi = bisect.bisect_right(counts, freq[target] * factor)
                    pool = [w for w in by_count[lo:hi] if w != target]
                    if len(pool) >= 3:
                        break
                if len(pool) < 3:
                    continue
                distractors, source = rng.sample(pool, 3), "training"
            choices = [target] + distractors
            rng.shuffle(choices)
            context = "\n".join(lines[i - CONTEXT_LINES:i] + [lines[i][:col].rstrip(" ")])
            items.append({"context": context, "choices": choices, "label": choices.index(target), "target": target,
                          "target_train_count": freq[target], "distractors_from": source,
                          "file_key": round(stable_key(doc), 6)})
            if len(items) >= n_items:
                break
        if len(items) >= n_items:
            break
    return items, {"candidate_names": len(vocab), "items": len(items), "source_files": len(docs),
                   "distractors_from_file": sum(it["distractors_from"] == "file" for it in items),
                   "context_lines": CONTEXT_LINES, "items_per_file": ITEMS_PER_FILE}


TASK_CLOZE = """task: screening_completion
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: " "
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
    is exp(−Σ log-likelihood / Σ tokens) over the held-out chunks (the rolling log-likelihoods in the samples)."""
    results = json.loads(max(folder.rglob("results_*.json")).read_text(encoding="utf-8"))
    r = results["results"]
    chunks = sorted((json.loads(line) for line in
                     max(folder.rglob("samples_screening_ppl_*.jsonl")).read_text(encoding="utf-8").splitlines()),
                    key=lambda x: x["doc_id"])
    chunk_ll, chunk_tokens = [], []
    for sample in chunks:
        value = sample["filtered_resps"][0]
        chunk_ll.append(float(value[0] if isinstance(value, list) else value))
        chunk_tokens.append(len(tokenizer(sample["doc"]["text"], add_special_tokens=False)["input_ids"]))
    items = sorted((json.loads(line) for line in
                    max(folder.rglob("samples_screening_completion_*.jsonl")).read_text(encoding="utf-8").splitlines()),
                   key=lambda x: x["doc_id"])
    c = r["screening_completion"]
    n_tokens = sum(chunk_tokens)
    return {"acc": c["acc,none"], "acc_stderr": c["acc_stderr,none"], "acc_norm": c["acc_norm,none"],
            "bits_per_byte": r["screening_ppl"]["bits_per_byte,none"], "ppl": math.exp(-sum(chunk_ll) / n_tokens),
            "ppl_tokens": n_tokens, "chunk_loglik": chunk_ll, "chunk_tokens": chunk_tokens,
            "item_acc": [float(x["acc"]) for x in items],
            "eval_s": float(results.get("total_evaluation_time_seconds", "nan"))}


def checkpoints(run: Path) -> list[tuple[int, Path]]:
    return sorted(((int(p.name.split("-")[1]), p) for p in (run / "trainer").glob("checkpoint-*")), key=lambda t: t[0])


def base_model_folder(gguf: str) -> Path:
    """The float32 de-quantized SmolLM2 that `repgeom train` started from (its GGUF cache: a plain model folder)."""
    import torch

    from repgeom_eval.modeling.gguf_cache import gguf_cache_dir

    cache = gguf_cache_dir(Path(gguf))
    if cache is None or not (cache / "model.safetensors").is_file():
        raise SystemExit(f"the de-quantized base model is not cached ({cache}); run with REPGEOM_GGUF_CACHE on")
    return cache


def main(argv: list[str] | None = None) -> None:
    exp = Experiment("checkpoint_screening", "Checkpoint screening with the dispersion gap",
                     "paper A Fig. 9 (G of checkpoints against their downstream quality)", doc=__doc__, argv=argv)
    size = SIZES[exp.smoke]
    work = exp.workdir
    data = work / "data"
    gguf = gallery.smollm2()

    with exp.step("data"):
        from repgeom_eval.modeling.checkpoint_tensors import load_tokenizer

        parts = split(gallery.stdlib_sources(), size)
        chunks = ppl_chunks(parts["ppl"], size["ppl_files"], size["ppl_chunk_chars"])
        smol_tok = load_tokenizer(gguf)
        one_token = lambda w: len(smol_tok(" " + w, add_special_tokens=False)["input_ids"]) == 1  # noqa: E731
        items, cloze_info = cloze_items(parts["cloze"], parts["train_scratch"], size["cloze_items"], one_token)
        t_words = {w.lower() for w in keyword.kwlist}  # T's words (the python_keywords set), kept out of T̄
        words, tbar_info = tbar_words(size["tbar_size"], t_words)
        (data).mkdir(parents=True, exist_ok=True)
        tbar_file = data / "tbar_words.txt"
        tbar_file.write_text("\n".join(words) + "\n", encoding="utf-8")
        for name in ("train_finetune", "train_scratch"):
            write_jsonl(data / f"{name}.jsonl", [{"text": t} for t in parts[name]])
        prose = capped(gallery.pydoc_paragraphs(), size["train_finetune_chars"])
        write_jsonl(data / "train_prose.jsonl", [{"text": t} for t in prose])
        write_jsonl(data / "heldout_ppl.jsonl", [{"text": t} for t in chunks])
        write_jsonl(data / "completion.jsonl", items)
        tasks = work / "tasks"
        tasks.mkdir(exist_ok=True)
        (tasks / "screening_completion.yaml").write_text(TASK_CLOZE.format(path=data / "completion.jsonl"),
                                                         encoding="utf-8")
        (tasks / "screening_ppl.yaml").write_text(TASK_PPL.format(path=data / "heldout_ppl.jsonl"), encoding="utf-8")
        shutil.copy(HERE / "config.yaml", work / "config.yaml")
        shutil.copy(HERE / "config_finetune.yaml", work / "config_finetune.yaml")
    data_info = {"source": "Python standard library .py files (gallery.stdlib_sources)",
                 "train_finetune_files": len(parts["train_finetune"]),
                 "train_finetune_chars": sum(map(len, parts["train_finetune"])),
                 "train_scratch_files": len(parts["train_scratch"]),
                 "train_scratch_chars": sum(map(len, parts["train_scratch"])),
                 "train_prose_paragraphs": len(prose), "train_prose_chars": sum(map(len, prose)),
                 "ppl_chunks": len(chunks), "ppl_chars": sum(map(len, chunks)), "completion": cloze_info,
                 "tbar": tbar_info}

    families: dict[str, dict[str, Any]] = {}
    for fam in FAMILIES:
        config = "config_finetune.yaml" if fam == "finetune" else "config.yaml"
        model_set = ["--set", f"model={gguf}"] if fam == "finetune" else []
        sets = [a for s in size["sets"][fam] for a in ("--set", s)]
        with exp.step(f"{fam}: train (repgeom train)"):
            train_s = exp.run("repgeom", "train", "--config", config, *model_set, *sets, "--overwrite",
                              "--no-progress", log=f"train_{fam}")
        run = work / ("run_finetune" if fam == "finetune" else "run_scratch")
        trained = json.loads((run / "results.json").read_text(encoding="utf-8"))
        saved = checkpoints(run)
        max_steps = trained["config"]["training"]["max_steps"]
        if fam == "finetune":
            first = 0
            pairs = [(0, base_model_folder(gguf))] + saved
        else:
            from repgeom_eval.training.geometry import pick_checkpoint

            first = pick_checkpoint([], max_steps, BURN_IN)["first_eligible_step"]
            pairs = [(s, p) for s, p in saved if s >= first]
        steps = [s for s, _ in pairs]
        models = [str(p) for _, p in pairs]
        print(f"[{exp.name}] {fam}: {len(models)} variants screened, steps {steps} (saved: "
              f"{[s for s, _ in saved]})", flush=True)
        families[fam] = evaluate_family(exp, fam, steps, models, tbar_file, tasks, trained, train_s, first,
                                        [s for s, _ in saved])
        if not exp.smoke and fam == "finetune":  # 540 MB a checkpoint: free the disk once measured
            for _, p in saved:
                shutil.rmtree(p, ignore_errors=True)

    families[VARIANTS] = train_variants(exp, size, gguf, tbar_file, tasks)

    exp.finish(["(written by summarize)"] * 3, data={
        "families": families, "data": data_info, "burn_in": BURN_IN,
        "token_sets": {"domain": DOMAIN, "reference": "data/tbar_words.txt (frequent whole English words)",
                       "reference_words": len(words), "distances": list(DISTANCES)},
    })
    gallery.from_raw(exp.name, summarize, draw, [gallery.FROM_RAW, "--out", str(exp.out)])


def variant_name(mixture: str, lr: float) -> str:
    return f"{mixture}_lr{lr:g}"


def train_variants(exp: Experiment, size: dict[str, Any], gguf: str, tbar_file: Path, tasks: Path) -> dict[str, Any]:
    """The between-variant family: SmolLM2 fine-tuned for the same number of steps on each data mixture at each
    learning rate (one `repgeom train` each, config_finetune.yaml with the mixture's domains), the final checkpoints
    screened and evaluated like a trajectory's. The step ranks nothing here."""
    import yaml

    work = exp.workdir
    steps = size["variant_steps"]
    base = yaml.safe_load((HERE / "config_finetune.yaml").read_text(encoding="utf-8"))
    names, models, runs, train_s = [], [], [], []
    sets = [a for x in size["sets"][VARIANTS] for a in ("--set", x)]
    for mixture in MIXTURES:
        for lr in size["variant_lrs"]:
            name = variant_name(mixture, lr)
            config = dict(base, output_dir=f"run_{name}")
            config["data"] = dict(base["data"], domains=dict(base["data"]["domains"]))
            if mixture == "code+prose":
                config["data"]["domains"]["prose"] = {"train": "data/train_prose.jsonl"}
            config["training"] = dict(base["training"], max_steps=steps, save_steps=steps, learning_rate=lr)
            path = work / f"config_{name}.yaml"
            path.write_text(f"# {name}: written by run.py from config_finetune.yaml ({MIXTURES[mixture]}, "
                            f"learning rate {lr:g}, {steps} steps)\n" + yaml.safe_dump(config, sort_keys=False),
                            encoding="utf-8")
            with exp.step(f"{VARIANTS}: train {name} (repgeom train)"):
                train_s.append(exp.run("repgeom", "train", "--config", path.name, "--set", f"model={gguf}", *sets,
                                       "--overwrite", "--no-progress", log=f"train_{name}"))
            run = work / f"run_{name}"
            runs.append(json.loads((run / "results.json").read_text(encoding="utf-8")))
            saved = checkpoints(run)
            names.append(name)
            models.append(str(saved[-1][1]))
    f = evaluate_family(exp, VARIANTS, [steps] * len(models), models, tbar_file, tasks, runs[0], sum(train_s), steps,
                        [steps], names=names)
    f["variants"] = [{"name": n, "mixture": n.rsplit("_lr", 1)[0], "learning_rate": float(n.rsplit("_lr", 1)[1]),
                      "train_s": t, "last_logged_train_ce": (r.get("train_log") or [{}])[-1].get("ce")}
                     for n, t, r in zip(names, train_s, runs)]
    f["training"]["learning_rate"] = None  # one per variant (see variants)
    if not exp.smoke:  # 540 MB a checkpoint: free the disk once measured
        for m in models:
            shutil.rmtree(m, ignore_errors=True)
    return f


def evaluate_family(exp: Experiment, fam: str, steps: list[int], models: list[str], tbar_file: Path, tasks: Path,
                    trained: dict[str, Any], train_s: float, first: int, saved_steps: list[int],
                    names: list[str] | None = None) -> dict[str, Any]:
    """The screen (timed), lm_eval on every variant (timed), and G with both distances against both scores."""
    work = exp.workdir
    gap_args = ["--domain", DOMAIN, "--reference", tbar_file]
    with exp.step(f"{fam}: screen (repgeom gap, every variant)"):
        screen_s = exp.run("repgeom", "gap", "--models", *models, *gap_args, "--distance", "cosine",
                           "--output", work / f"gap_{fam}_screen.json", log=f"gap_{fam}_screen")
    screen_doc = json.loads((work / f"gap_{fam}_screen.json").read_text(encoding="utf-8"))

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models[-1])
    evals, walls = [], []
    with exp.step(f"{fam}: evaluate (lm_eval per variant: perplexity + completion)"):
        for step, model, tag in zip(steps, models, names or [f"step{x}" for x in steps]):
            out = work / "lm_eval" / f"{fam}_{tag}"
            shutil.rmtree(out, ignore_errors=True)
            walls.append(exp.run(
                "lm_eval", "--model", "hf", "--model_args", f"pretrained={model},dtype=float32", "--device", "cpu",
                "--batch_size", 16, "--include_path", tasks, "--tasks", "screening_ppl,screening_completion",
                "--log_samples", "--output_path", out, log=f"lm_eval_{fam}_{tag}"))
            evals.append(lm_eval_numbers(out, tokenizer))
            print(f"[{exp.name}] {fam} {tag}: ppl {evals[-1]['ppl']:.3f}, completion acc "
                  f"{evals[-1]['acc']:.3f} ({walls[-1]:.0f} s)", flush=True)

    scores = {"ppl": [e["ppl"] for e in evals], "completion_acc": [e["acc"] for e in evals]}
    G: dict[str, dict[str, list[float]]] = {}
    rho: dict[str, dict[str, Any]] = {}
    gap_rows: dict[str, Any] = {}
    with exp.step(f"{fam}: G cosine and Euclidean against the scores (repgeom gap --scores)"):
        for distance in DISTANCES:
            rho[distance] = {}
            for name, values in scores.items():
                path = work / f"scores_{fam}_{name}.json"
                path.write_text(json.dumps(dict(zip(models, values)), indent=1), encoding="utf-8")
                outp = work / f"gap_{fam}_{distance}_vs_{name}.json"
                exp.run("repgeom", "gap", "--models", *models, *gap_args, "--distance", distance, "--scores", path,
                        "--output", outp, log=f"gap_{fam}_{distance}_{name}")
                doc = json.loads(outp.read_text(encoding="utf-8"))
                sp = doc["spearman"]
                rho[distance][name] = {"rho": sp.get("rho"), "n": sp.get("n")}
                gap_rows[distance] = {r["model"]: r for r in doc["results"]}
            by = gap_rows[distance]
            G[distance] = {k: [float(by[m][k]) for m in models] for k in ("G", "within_T", "between", "within_Tbar")}
    first_row = gap_rows["cosine"][models[0]]
    screen = {r["model"]: r for r in screen_doc["results"]}
    return {
        "label": LABELS[fam], "steps": steps,
        "models": names or [Path(m).name if fam == "scratch" or i else "base (step 0)" for i, m in enumerate(models)],
        "saved_steps": saved_steps, "first_screened_step": first,
        "G_cosine": G["cosine"]["G"], "G_euclidean": G["euclidean"]["G"],
        "components": {d: {k: v for k, v in G[d].items() if k != "G"} for d in DISTANCES},
        "G_cosine_screen": [float(screen[m]["G"]) for m in models],
        "ppl": scores["ppl"], "completion_acc": scores["completion_acc"],
        "acc_stderr": [e["acc_stderr"] for e in evals], "acc_norm": [e["acc_norm"] for e in evals],
        "bits_per_byte": [e["bits_per_byte"] for e in evals], "ppl_tokens": evals[0]["ppl_tokens"],
        # per item, so that item noise enters the intervals: each completion item's 0/1 result, each held-out
        # chunk's summed log-likelihood (its token count is the same for every variant of a family)
        "item_acc": [e["item_acc"] for e in evals], "chunk_loglik": [e["chunk_loglik"] for e in evals],
        "chunk_tokens": evals[0]["chunk_tokens"],
        "repgeom_spearman": rho,
        "wall_s": {"screen": screen_s, "screen_core_sum": sum(r["timings"]["total_s"] for r in screen.values()),
                   "evaluation": sum(walls), "evaluation_core_sum": sum(e["eval_s"] for e in evals),
                   "per_variant_evaluation": walls, "train": train_s},
        "token_sets": {"n_T": first_row["n_T"], "n_Tbar": first_row["n_Tbar"], "missing_T": first_row["missing_T"],
                       "n_missing_Tbar": len(first_row["missing_Tbar"]),
                       "missing_Tbar_examples": first_row["missing_Tbar"][:20]},
        "model": trained["model"], "training": {k: trained["config"]["training"].get(k) for k in (
            "max_steps", "per_device_train_batch_size", "learning_rate", "lr_scheduler_type", "warmup_steps",
            "save_steps")},
        "block_size": trained["config"]["data"]["block_size"],
        "from_scratch": trained["config"].get("from_scratch"),
        "train_check": trained.get("evaluations", [])[-1:] ,
    }


# -- intervals, verdicts, tables and figures (issue 25): everything below reads result.json only ----------------------

PAIRS = {  # name: (x, y, what paper A predicts for the sign: below/above 0, or None for context)
    "Gcos_ppl": ("G_cosine", "ppl", "below"), "Gcos_acc": ("G_cosine", "completion_acc", "above"),
    "Geuc_ppl": ("G_euclidean", "ppl", "below"), "Geuc_acc": ("G_euclidean", "completion_acc", "above"),
    "step_ppl": ("steps", "ppl", None), "step_acc": ("steps", "completion_acc", None),
    "Gcos_step": ("G_cosine", "steps", None), "Geuc_step": ("G_euclidean", "steps", None),
    "ppl_acc": ("ppl", "completion_acc", None),
}
COMPONENTS = ("within_T", "between", "within_Tbar")
SAID = {gallery.FOLLOWS: "follows paper A", gallery.OPPOSITE: "the opposite of paper A",
        gallery.CANNOT_TELL: "cannot tell at this size"}
PAPER = ("Paper A Fig. 9: within a family, higher G marks the better checkpoint (ρ(G, perplexity) below 0, "
         "ρ(G, accuracy) above 0).")


def span(values: list[float]) -> float:
    """(max − min) / |mean| in percent: how much G moves over a family."""
    mean = sum(values) / len(values)
    return 100 * (max(values) - min(values)) / abs(mean) if mean else math.nan


def series(f: dict[str, Any], key: str) -> list[float]:
    if key in f:
        return f[key]
    distance, comp = key.split(":")  # "cosine:within_T"
    return f["components"][distance][comp]


def outcome_draws(f: dict[str, Any], key: str, n: int = 2000, seed: int = 1) -> Any:
    """[n, variants]: ``key`` (completion_acc or ppl) of every variant recomputed on a bootstrap resample of the
    evaluation's own units (the completion items; the held-out chunks, perplexity = exp(−Σ ll / Σ tokens)), the same
    resample for every variant (they answered the same items). None where result.json keeps no per-item values."""
    import numpy as np

    from repgeom_eval.functional.bootstrap import bootstrap_indices

    units = {"completion_acc": "item_acc", "ppl": "chunk_loglik"}.get(key)
    if units is None or units not in f:
        return None
    values = np.asarray(f[units], float)  # [variants, units]
    idx = bootstrap_indices(values.shape[1], n, seed)
    counts = np.zeros((n, values.shape[1]))
    np.add.at(counts, (np.arange(n)[:, None], idx), 1.0)
    if key == "completion_acc":
        return counts @ values.T / values.shape[1]
    tokens = counts @ np.asarray(f["chunk_tokens"], float)
    return np.exp(-(counts @ values.T) / tokens[:, None])


def item_noise(f: dict[str, Any], x: str, y: str) -> dict[str, Any]:
    """The draws for a pair: ``joint`` (variants and items resampled together, the interval a family with more than
    SMALL variants uses) and ``items`` (the variants fixed, only the items resampled: how much item noise alone
    moves ρ). Empty where neither series has per-item values."""
    import numpy as np

    from repgeom_eval.functional.bootstrap import bootstrap_indices

    dx, dy = outcome_draws(f, x), outcome_draws(f, y)
    if dx is None and dy is None:
        return {}
    base = lambda key, d: np.broadcast_to(np.asarray(series(f, key), float), (2000, len(f["steps"]))) if d is None \
        else d  # noqa: E731
    xs, ys = base(x, dx), base(y, dy)
    idx = bootstrap_indices(len(f["steps"]), 2000, 0)
    rows = np.arange(2000)[:, None]
    return {"joint": gallery._corr(xs[rows, idx], ys[rows, idx], "spearman"),
            "items": gallery._corr(xs, ys, "spearman")}


def trajectory(f: dict[str, Any]) -> bool:
    """A family of one run's checkpoints (the step ranks them for free), not variants at equal step."""
    return len(set(f["steps"])) > 1


def family_intervals(f: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every pair's Spearman ρ over the family's variants (gallery.correlation_test: with more than SMALL variants
    the percentile bootstrap over variants and items together where it holds its estimate, else Fisher z; up to
    SMALL, Fisher z and the exact permutation p), as StatTest objects; and, beside them, the interval from item noise
    alone (exploratory). Pairs with the step only for trajectories."""
    import numpy as np

    from repgeom_eval.functional.bootstrap import percentile_interval

    out, alone = {}, {}
    pairs = {k: v for k, v in PAIRS.items() if trajectory(f) or "steps" not in v[:2]}
    for d in DISTANCES:
        for c in COMPONENTS:
            pairs[f"{d[:3]}_{c}_ppl"] = (f"{d}:{c}", "ppl", None)
    for name, (x, y, expect) in pairs.items():
        noise = item_noise(f, x, y)
        out[name] = gallery.correlation_test(name, series(f, x), series(f, y), "spearman", expect or "below",
                                             noise.get("joint"), p_from_draws=bool(noise))
        if noise:
            low, high, valid = percentile_interval(noise["items"], gallery.LEVEL)
            finite = np.asarray(noise["items"], float)
            finite = finite[np.isfinite(finite)]
            alone[name] = {"low": float(low), "high": float(high), "resamples": int(valid),
                           "sd": float(finite.std(ddof=1)) if finite.size > 1 else math.nan}
    return out, alone


def detrended(f: dict[str, Any]) -> dict[str, Any]:
    """Beside each paper-predicted raw ρ: Spearman ρ of the first differences (each checkpoint's change from the one
    before: a shared trend over the steps drops out) and the partial Spearman ρ on the step (the ranks of G and of the
    outcome with the step's rank regressed out of both; undefined where G or the outcome is a monotone function of
    the step). Both through gallery.correlation_test; the partial one's resamples recompute the ranks."""
    import numpy as np

    from repgeom_eval.functional.bootstrap import bootstrap_indices, rowwise_pearson, rowwise_ranks

    steps = np.asarray(f["steps"], float)
    out: dict[str, Any] = {}
    for name, (x, y, expect) in PAIRS.items():
        if not expect:
            continue
        gx, gy = np.asarray(series(f, x), float), np.asarray(series(f, y), float)
        diff = gallery.correlation_test(f"{name} first differences", np.diff(gx), np.diff(gy), "spearman", expect)

        def partial(a, b, z):
            ra, rb, rz = rowwise_ranks(a), rowwise_ranks(b), rowwise_ranks(z)
            r_ab, r_az, r_bz = rowwise_pearson(ra, rb), rowwise_pearson(ra, rz), rowwise_pearson(rb, rz)
            with np.errstate(invalid="ignore", divide="ignore"):
                den = np.sqrt((1 - r_az ** 2) * (1 - r_bz ** 2))
                return np.where(den > 1e-9, (r_ab - r_az * r_bz) / np.where(den > 1e-9, den, 1.0), np.nan)

        est = float(partial(gx[None], gy[None], steps[None])[0])
        idx = bootstrap_indices(len(steps), 2000, 0)
        draws = partial(gx[idx], gy[idx], steps[idx])
        rz = rowwise_ranks(steps[None])[0]
        resid = lambda v: v - np.polyval(np.polyfit(rz, v, 1), rz)  # noqa: E731
        rx, ry = rowwise_ranks(gx[None])[0], rowwise_ranks(gy[None])[0]
        if math.isfinite(est):
            part = gallery.correlation_test(f"{name} partial on step", resid(rx), resid(ry), "pearson", expect,
                                            draws, controls=1, estimate=est)
        else:
            part = gallery.StatTest(f"{name} partial on step", "partial Spearman", est, math.nan, math.nan, math.nan,
                                    len(steps), "undefined (a monotone function of the step)", "none", 0.0, expect)
        out[name] = {"first_differences": gallery.explore(diff).as_dict(),
                     "partial_on_step": gallery.explore(part).as_dict()}
    return out


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """result.json with the summary, tables, notes, intervals and verdicts recomputed from its per-variant values."""
    d = doc["data"]
    fams = d["families"]
    tests, alone = {}, {}
    for fam, f in fams.items():
        tests[fam], alone[fam] = family_intervals(f)
    # the finding: one primary test, fixed before the variants were run: cosine G against perplexity between the
    # variants at equal step (paper A's screening of variants; within a trajectory the step ranks the checkpoints
    # for free), judged with every paper-predicted pair of every family, Holm over them all
    predicted = [k for k, (_, _, expect) in PAIRS.items() if expect]
    primary = f"{VARIANTS}: Gcos_ppl" if VARIANTS in fams else "scratch: Gcos_ppl"
    family = [replace(tests[fam][k], name=f"{fam}: {k}") for fam in fams for k in predicted]
    finding = gallery.decide(family, primary, "within a family, higher G marks the better variant")
    intervals = {fam: {k: (finding["tests"][f"{fam}: {k}"] if k in predicted else gallery.explore(t).as_dict())
                       for k, t in tests[fam].items()} for fam in fams}
    for fam in fams:
        for k, a in alone[fam].items():
            intervals[fam][k]["item_noise_alone"] = a
    verdict = {fam: {k: intervals[fam][k]["verdict"] for k in predicted} for fam in fams}
    trend = {fam: detrended(f) for fam, f in fams.items() if trajectory(f)}

    def same_as_step(fam: str) -> str:
        same = [name for name, k in (("cosine", "Gcos_step"), ("Euclidean", "Geuc_step"))
                if abs(intervals[fam][k]["estimate"]) >= 0.995]
        if not same:
            return ""
        return (f" ({' and '.join(same)} G {'orders' if len(same) == 1 else 'order'} the variants by the step or its "
                "reverse, |ρ| = 1.00 to two decimals, so there the screen only repeats the step's ranking)")

    def show(fam: str, k: str) -> str:
        iv = intervals[fam][k]
        if not math.isfinite(iv["estimate"]):
            return "undefined (a constant series)"
        if not math.isfinite(iv["low"]):
            return f"{iv['estimate']:+.2f} (no interval)"
        return f"{iv['estimate']:+.2f} ({iv['low']:+.2f} to {iv['high']:+.2f})"

    ft, sc = fams["finetune"], fams["scratch"]
    va = fams.get(VARIANTS)
    info, comp = d["data"], d["data"]["completion"]
    n_total = sum(len(f["steps"]) for f in fams.values())
    arch = lambda f: f"{f['model']['n_layers']}-layer width-{f['model']['hidden_size']}"  # noqa: E731
    tr = lambda f: f["training"]  # noqa: E731
    third = ""
    if va is not None:
        lrs = sorted({v["learning_rate"] for v in va["variants"]})
        mixes = list(dict.fromkeys(v["mixture"] for v in va["variants"]))
        third = (f"; (3) between variants at equal step, no step to rank them: {len(va['steps'])} fine-tunes of "
                 f"SmolLM2-135M, each {va['steps'][0]} steps of {tr(va)['per_device_train_batch_size']}×"
                 f"{va['block_size']} tokens, on each data mixture ({', '.join(f'{m}: {MIXTURES[m]}' for m in mixes)}) "
                 f"at each constant learning rate ({', '.join(f'{x:g}' for x in lrs)})")
    line1 = (
        f"{len(fams)} families screened on their own, {n_total} variants in all: (1) {LABELS['finetune']} with "
        f"`repgeom train` ({tr(ft)['max_steps']} steps of {tr(ft)['per_device_train_batch_size']}×{ft['block_size']} "
        f"tokens, learning rate {tr(ft)['learning_rate']:g} {tr(ft)['lr_scheduler_type']}), the base model (step 0, "
        f"under-adapted) and {len(ft['steps']) - 1} checkpoints (steps {ft['steps'][1]}–{ft['steps'][-1]}); (2) a "
        f"{arch(sc)} {LABELS['scratch']} ({tr(sc)['max_steps']} steps of {tr(sc)['per_device_train_batch_size']}×"
        f"{sc['block_size']} tokens, {tr(sc)['lr_scheduler_type']} at {tr(sc)['learning_rate']:g}), the first "
        f"{sc['first_screened_step']} steps dropped as burn-in ({d['burn_in']:.0%} of the run; paper A drops 120k of "
        f"700k), {len(sc['steps'])} checkpoints (steps {sc['steps'][0]}–{sc['steps'][-1]}){third}. Each screened "
        f"with `repgeom gap` (T = python_keywords, T̄ = the {d['token_sets']['reference_words']} most frequent whole "
        "lower-case English words of fortunes and the KJV Bible, cosine and Euclidean G) and evaluated with "
        f"`lm_eval` (held-out code perplexity over {info['ppl_chunks']} chunks, {info['ppl_chars']} characters; "
        f"{comp['items']}-item 4-way completion of a held-out line's last name; every item's and chunk's result "
        "kept). Not covered: models past 135M parameters, paper A's real model families (CodeLlama, math-tuned "
        "Qwen), more than one training run per setting, held-out code unseen in SmolLM2's pretraining (the standard "
        "library is public).")
    parts = []
    for fam, f in fams.items():
        w = f["wall_s"]
        moves = (f"perplexity {f['ppl'][0]:.2f} → {f['ppl'][-1]:.2f} (min {min(f['ppl']):.2f}), completion "
                 f"{f['completion_acc'][0]:.2f} → {f['completion_acc'][-1]:.2f}" if trajectory(f) else
                 f"perplexity {min(f['ppl']):.2f} to {max(f['ppl']):.2f}, completion {min(f['completion_acc']):.2f} "
                 f"to {max(f['completion_acc']):.2f}")
        parts.append(
            f"{fam} (n = {len(f['steps'])}): ρ(G cos, ppl) = {show(fam, 'Gcos_ppl')}, ρ(G cos, completion) = "
            f"{show(fam, 'Gcos_acc')}, ρ(G euc, ppl) = {show(fam, 'Geuc_ppl')}, ρ(G euc, completion) = "
            f"{show(fam, 'Geuc_acc')}; {moves}; over the family G cos spans {span(f['G_cosine']):.2g} % of its value, "
            f"G euc {span(f['G_euclidean']):.2g} %; screen {w['screen']:.0f} s against {w['evaluation']:.0f} s of "
            f"evaluation ({w['evaluation'] / w['screen']:.0f}×)")
    line2 = ("Spearman ρ within each family with 95 % intervals (more than 10 variants: percentile bootstrap over "
             "the variants and the evaluation's items together, 2000 resamples, where it holds its own estimate, "
             "else the normal interval from its s.d., p from the same resamples; at most 10: Fisher z and the exact "
             "permutation p over the variants): " + "; ".join(parts) + ".")
    vparts = []
    holm = lambda fam, k: f"Holm {gallery.p_text(intervals[fam][k]['p_holm'])}"  # noqa: E731
    for fam in fams:
        v = verdict[fam]
        vparts.append(f"{fam}: cosine G with perplexity {SAID[v['Gcos_ppl']]} ({holm(fam, 'Gcos_ppl')}), with "
                      f"completion {SAID[v['Gcos_acc']]} ({holm(fam, 'Gcos_acc')}); Euclidean G with perplexity "
                      f"{SAID[v['Geuc_ppl']]} ({holm(fam, 'Geuc_ppl')}), with completion {SAID[v['Geuc_acc']]} "
                      f"({holm(fam, 'Geuc_acc')})"
                      + (f"; step baseline ρ(step, ppl) = {show(fam, 'step_ppl')}, and ρ(G cos, step) = "
                         f"{show(fam, 'Gcos_step')}, ρ(G euc, step) = {show(fam, 'Geuc_step')}" + same_as_step(fam)
                         if trajectory(fams[fam]) else ""))
    tparts = []
    for fam in trend:
        fd = [k for k in trend[fam] if trend[fam][k]["first_differences"]["verdict"] == gallery.FOLLOWS]
        ps = [k for k in trend[fam] if trend[fam][k]["partial_on_step"]["verdict"] == gallery.FOLLOWS]
        undefined = [k for k in trend[fam] if not math.isfinite(trend[fam][k]["partial_on_step"]["estimate"])]
        tparts.append(f"{fam}: first differences follow paper A in {len(fd)} of {len(trend[fam])} pairs "
                      f"({', '.join(fd) or 'none'}; ρ(ΔG cos, Δppl) = "
                      f"{show_t(trend[fam]['Gcos_ppl']['first_differences'])}), partial on the step in {len(ps)} "
                      f"({', '.join(ps) or 'none'}; ρ(G cos, ppl | step) = "
                      f"{show_t(trend[fam]['Gcos_ppl']['partial_on_step'])})"
                      + (f", undefined for {', '.join(undefined)}" if undefined else ""))
    picks = {fam: checkpoint_pick(f) if trajectory(f) else variant_pick(f) for fam, f in fams.items()}
    noise = [f"{fam} ρ(G cos, completion) {a['low']:+.2f} to {a['high']:+.2f}" for fam in fams
             for k, a in alone[fam].items() if k == "Gcos_acc" and math.isfinite(a["low"])]
    p_iv = intervals[primary.split(": ")[0]]["Gcos_ppl"]
    line3 = (PAPER + f" Primary test: {finding['primary']} (Spearman ρ, {gallery.short_method(p_iv['interval'])}, "
             f"{p_iv['test']}); family: the {len(family)} paper-predicted pairs of the {len(fams)} families, Holm. "
             "Verdicts — " + "; ".join(vparts) + f"; primary: {SAID[finding['verdict']]}. Within a run the training "
             "step ranks the checkpoints for free, so agreement with the step is not evidence that G beats it; "
             "exploratory, with the shared trend taken out (unadjusted p): " + "; ".join(tparts) + ". "
             + (f"Item noise alone (the variants fixed, the completion items resampled) moves "
                f"{'; '.join(noise)}. " if noise else "")
             + pick_sentence(picks))
    summary = [line1, line2, line3]

    rows = []
    for fam in fams:
        n = len(fams[fam]["steps"])
        for k, iv in intervals[fam].items():
            x, y, _ = PAIRS.get(k, (None, None, None))
            label = f"ρ({x}, {y})" if x else f"ρ({k.split('_', 1)[1].rsplit('_', 1)[0]} [{k[:3]}], ppl)"
            a = iv.get("item_noise_alone")
            rows.append([fam, label, iv["estimate"], ci_cell(iv), gallery.short_method(iv["interval"]), n, iv["p"],
                         iv["p_holm"] if iv["p_holm"] is not None else "n/a",
                         SAID[iv["verdict"]] if k in verdict[fam] else context_cell(iv),
                         ci_cell(a) if a else "n/a"])
    tables = [gallery.finding_table(finding, "within a family, higher G marks the better variant (paper A Fig. 9)"),
              {"title": "Spearman ρ within each family with 95 % intervals (more than 10 variants: percentile "
                        "bootstrap over variants and items together where it holds its estimate, else the normal "
                        "interval from its s.d., p from the same resamples; at most 10: Fisher z and the exact "
                        "permutation p); verdicts from the Holm-adjusted p over the paper-predicted pairs; last "
                        "column: the interval from item noise alone (variants fixed)",
               "header": ["family", "pair", "ρ", "95 % CI", "interval", "n", "p", "p (Holm)", "verdict",
                          "item noise alone (95 %)"],
               "rows": rows},
              {"title": "Detrended (first differences) and partial-on-step Spearman ρ beside the raw ones, for the "
                        "trajectories (exploratory, unadjusted p)",
               "header": ["family", "pair", "raw ρ", "95 % CI", "verdict (Holm)", "ρ of first differences", "95 % CI",
                          "p", "verdict", "partial ρ on step", "95 % CI", "p", "verdict"],
               "rows": [[fam, k, intervals[fam][k]["estimate"], ci_cell(intervals[fam][k]),
                         SAID[intervals[fam][k]["verdict"]],
                         *[x for part in ("first_differences", "partial_on_step")
                           for x in (number(t[part]["estimate"]), ci_cell(t[part]), number(t[part]["p"]),
                                     gallery.exploratory_cell(t[part]))]]
                        for fam in trend for k, t in trend[fam].items()]}]
    for fam, f in fams.items():
        tables.append({
            "title": f"{fam}: per variant ({f['label']}; G: T = python_keywords, T̄ = frequent English words; ppl: "
                     "held-out token perplexity; completion: 4-way)",
            "header": ["variant", "step", "G cos", "within(T) cos", "between cos", "within(T̄) cos", "G euc",
                       "within(T) euc", "between euc", "within(T̄) euc", "ppl", "bits/byte", "completion acc",
                       "acc_norm", "lm_eval wall s"],
            "rows": [[f["models"][i], f["steps"][i], f["G_cosine"][i], *[f["components"]["cosine"][c][i]
                      for c in COMPONENTS], f["G_euclidean"][i], *[f["components"]["euclidean"][c][i]
                      for c in COMPONENTS], f["ppl"][i], f["bits_per_byte"][i], f["completion_acc"][i],
                      f["acc_norm"][i], round(f["wall_s"]["per_variant_evaluation"][i], 1)]
                     for i in range(len(f["steps"]))]})
    tables.append({"title": "Wall time: the screen against evaluating every variant",
                   "header": ["family", "variants", "screen: repgeom gap wall s", "of which reading rows + G (sum)",
                              "evaluation: lm_eval wall s (sum)", "of which lm_eval's own time (sum)",
                              "evaluation / screen", "training wall s"],
                   "rows": [[fam, len(f["steps"]), round(f["wall_s"]["screen"], 1),
                             round(f["wall_s"]["screen_core_sum"], 2), round(f["wall_s"]["evaluation"], 1),
                             round(f["wall_s"]["evaluation_core_sum"], 1),
                             round(f["wall_s"]["evaluation"] / f["wall_s"]["screen"], 1),
                             round(f["wall_s"]["train"], 1)] for fam, f in fams.items()]})
    tables.append(pick_table(picks))
    tables.append(protocol_table(fams))
    tbar = info["tbar"]
    notes = [
        gallery.RULE_NOTE,
        "Detrending (exploratory): the first differences correlate each checkpoint's change in G with its change in "
        "the outcome, so a trend both share over the steps drops out; the partial ρ on the step removes the step's "
        "rank from the ranks of both (undefined where one of them is a monotone function of the step). Neither is "
        "part of the finding's family.",
        "Units: a family's variants, and inside each variant the evaluation's own items (the completion items, the "
        "held-out chunks), both kept in result.json. With more than 10 variants the interval resamples both at "
        "once (the variants, and the same items for every variant, since they answered the same ones); with at "
        "most 10 (the between-variant family) it is the Fisher-z interval with the exact permutation p over the "
        "variants, and the item-noise-alone interval beside it shows how far the items move ρ by themselves. A "
        "trajectory's checkpoints are successive states of one run, not independent draws, so its intervals "
        "describe how stable the ranking is across them, not a population of runs. Families are never pooled: "
        "their G, perplexities and tokenizers are not on one scale. The primary test is the between-variant "
        "family's (fixed before it was run): there the step ranks nothing.",
        f"T = python_keywords (keyword.kwlist, {len(__import__('keyword').kwlist)} words; entries with and without "
        f"a leading space). T̄: the {tbar['n_words']} most frequent whole lower-case words (2+ letters) of the "
        f"Debian fortunes and the KJV Bible, general English that is not code, T's words excluded (least frequent "
        f"kept: {tbar['least_frequent_kept']!r}, {tbar['its_count']} times). Not whole entries of a vocabulary: "
        + "; ".join(f"{fam}: T missing {', '.join(f['token_sets']['missing_T']) or 'none'} (T holds "
                    f"{f['token_sets']['n_T']} ids), T̄ missing {f['token_sets']['n_missing_Tbar']} of "
                    f"{tbar['n_words']} words ({f['token_sets']['n_Tbar']} ids)" for fam, f in fams.items())
        + " (as `repgeom gap` reports them; missing words are left out, not replaced).",
        "Perplexity is token-level, exp(−Σ log p / Σ tokens) over the held-out chunks (whole lines from the middle of "
        "held-out standard-library files; " + ", ".join(f"{fam}: {f['ppl_tokens']} tokens" for fam, f in fams.items())
        + "), "
        "from lm_eval's rolling log-likelihoods (--log_samples). The two families have different tokenizers, so "
        "their perplexities are not comparable with each other.",
        f"Completion: a name (identifier or keyword) that ends a held-out line of code (found with Python's "
        f"tokenize, so never in a string or comment), after the previous {comp['context_lines']} lines and the line up "
        f"to it; three distractors of about the same training frequency, so frequency alone does not pick the answer: the "
        f"names of the same file's code closest in training frequency (within a factor 2; so names plausible there) "
        f"for {comp.get('distractors_from_file', '?')} items, otherwise three names drawn from the training code "
        f"within a factor 2 (widened when too few); answer and distractors are single tokens of SmolLM2's vocabulary; at most "
        f"{comp['items_per_file']} items a file, {comp['items']} items from {comp['source_files']} held-out files. "
        f"lm_eval multiple_choice (acc: the continuation's log-likelihood). With {comp['items']} items one "
        "variant's accuracy has a binomial s.e. (lm_eval's) of "
        + ", ".join(f"{sum(f['acc_stderr']) / len(f['acc_stderr']):.3f} on average in {fam}" for fam, f in fams.items())
        + "; the completion accuracies of a family differ by less than that in many pairs, which is why the "
        "intervals resample the items too.",
        "Timing: the screen is one `repgeom gap --distance cosine` process over all variants of a family; the "
        "evaluation is one `lm_eval` process per variant (process start and model load included; its own evaluation "
        "time is given separately). Both ran on a 2-core machine shared with other jobs, so the walls are noisy.",
        "The base SmolLM2 (step 0) is the GGUF (Q4_1) de-quantized to float32, the weights the fine-tune started "
        "from; the checkpoints are float32. SmolLM2 was pretrained on public code, likely including the Python "
        "standard library, so 'held out' means held out from this fine-tune only.",
    ]
    figures = [{"file": "gap_vs_step.png", "caption": "Per family (columns): cosine G, Euclidean G, held-out code "
                "perplexity and 4-way completion accuracy (95 % binomial interval from lm_eval's s.e.; dotted: chance) "
                "against the step (fine-tune: step 0 is the base model; from scratch: after burn-in)"},
               {"file": "gap_vs_ppl.png", "caption": "Cosine and Euclidean G against held-out perplexity and "
                "completion accuracy, one point per variant (labels: step), per family; titles: Spearman ρ with its "
                "95 % bootstrap interval"}]
    out = gallery.regenerated(doc, summary, tables, notes, intervals, figures)
    out["data"]["verdicts"] = verdict
    out["data"]["checkpoint_pick"] = picks
    out["data"]["findings"] = gallery.stable({"screening": finding})
    out["data"]["detrended"] = gallery.stable(trend)
    return out


def protocol_table(fams: dict[str, Any]) -> dict[str, Any]:
    """Where this run departs from paper A's screening protocol (Fig. 9)."""
    return {"title": "Protocol: paper A against this run",
            "header": ["", "paper A", "this run", "why"],
            "rows": [
                ["models", "billion-parameter families (e.g. CodeLlama against Llama 2, math-tuned Qwen)",
                 "SmolLM2-135M fine-tunes and a 4-layer GPT-2 from scratch", "what trains on 2 CPU cores"],
                ["variants", "checkpoints of one run after burn-in, and variants of one base",
                 ", ".join(f"{fam}: {len(f['steps'])}" for fam, f in fams.items()),
                 "the between-variant family has no step to rank it"],
                ["token sets", "a domain's tokens T against general tokens T̄", "T = Python keywords, T̄ = 1000 "
                 "frequent English words of fortunes and the KJV Bible", "offline sources"],
                ["quality", "downstream benchmark accuracy", "held-out code perplexity (4 chunks) and a 120-item "
                 "4-way completion", "no benchmark data offline"],
                ["tests", "correlation shown", "Spearman ρ per family, Holm over the paper-predicted pairs of every "
                 "family; intervals over variants and items", "one primary test per finding"],
            ]}


def variant_pick(f: dict[str, Any]) -> dict[str, Any]:
    """Between variants: the largest cosine G against the variant of lowest held-out perplexity; with no step,
    the label-free baseline is a random pick (expected rank (n + 1) / 2)."""
    steps, ppl, acc, g = f["steps"], f["ppl"], f["completion_acc"], f["G_cosine"]
    i = max(range(len(g)), key=lambda j: g[j])
    order = sorted(range(len(ppl)), key=lambda j: ppl[j])
    best = order[0]
    n = len(ppl)
    return {"rule": "largest cosine G", "n_candidates": n, "variant": f["models"][i], "step": steps[i],
            "G_cosine": g[i], "ppl": ppl[i], "completion_acc": acc[i], "held_out_variant": f["models"][best],
            "held_out_step": steps[best], "held_out_ppl": ppl[best], "held_out_completion_acc": acc[best],
            "ppl_ratio": ppl[i] / ppl[best], "rank_by_ppl": order.index(i) + 1, "is_held_out_choice": i == best,
            "random_expected_rank": (n + 1) / 2, "random_at_least_as_good": (order.index(i) + 1) / n}


def ci_cell(t: dict[str, Any]) -> str:
    return f"{t['low']:+.3f} to {t['high']:+.3f}" if math.isfinite(t["low"]) else "n/a"  # n/a: a perfect ρ


def show_t(t: dict[str, Any]) -> str:
    if not math.isfinite(t["estimate"]):
        return "undefined"
    if not math.isfinite(t["low"]):
        return f"{t['estimate']:+.2f} (no interval, p {t['p']:.2g})"
    return f"{t['estimate']:+.2f} ({t['low']:+.2f} to {t['high']:+.2f}, p {t['p']:.2g})"


def number(x: float) -> Any:
    return x if math.isfinite(x) else "undefined"


def context_cell(t: dict[str, Any]) -> str:
    """A pair without a paper prediction: which side of 0 its unadjusted p puts it on, labelled exploratory."""
    side = {gallery.FOLLOWS: "below 0", gallery.OPPOSITE: "above 0", gallery.CANNOT_TELL: "holds 0"}[t["verdict"]]
    return f"context (no paper prediction): {side} (exploratory)"


# -- the training callback's label-free pick against the held-out choice (issue 26) ----------------------------------

def checkpoint_pick(f: dict[str, Any]) -> dict[str, Any]:
    """GeometryCallback's rule (pick_checkpoint: largest cosine G at or after the burn-in, ties to the later step)
    over a family's screened variants, against the variant of lowest held-out perplexity. The burn-in is this
    run's (the fine-tune: none; from scratch: the dropped third), not the callback's default."""
    from repgeom_eval.training.geometry import pick_checkpoint

    steps, ppl, acc = f["steps"], f["ppl"], f["completion_acc"]
    records = [{"step": s, "G": {"cosine": g}} for s, g in zip(steps, f["G_cosine"])]
    picked = pick_checkpoint(records, None, 0.0)  # every screened variant is past this family's burn-in
    i = steps.index(picked["step"])
    best = min(range(len(steps)), key=lambda j: (ppl[j], steps[j]))
    order = sorted(range(len(steps)), key=lambda j: (ppl[j], steps[j]))
    last = max(range(len(steps)), key=lambda j: steps[j])  # the last checkpoint, which is also the step rule's pick
    return {"rule": picked["rule"], "first_screened_step": f["first_screened_step"], "n_candidates": len(steps),
            "step": picked["step"], "G_cosine": picked["G_cosine"], "ppl": ppl[i], "completion_acc": acc[i],
            "held_out_step": steps[best], "held_out_ppl": ppl[best], "held_out_completion_acc": acc[best],
            "ppl_ratio": ppl[i] / ppl[best], "rank_by_ppl": order.index(i) + 1, "is_held_out_choice": i == best,
            "last_step": steps[last], "last_ppl": ppl[last], "last_completion_acc": acc[last],
            "last_rank_by_ppl": order.index(last) + 1, "pick_vs_last": ("better" if ppl[i] < ppl[last] else
                                                                        "same" if i == last else "worse")}


def pick_sentence(picks: dict[str, dict[str, Any]]) -> str:
    parts = []
    for fam, p in picks.items():
        if "last_step" in p:
            parts.append(f"{fam}: step {p['step']} (perplexity {p['ppl']:.2f}, {p['ppl_ratio'] - 1:+.1%} over the "
                         f"held-out choice, step {p['held_out_step']}; rank {p['rank_by_ppl']} of {p['n_candidates']}; "
                         f"the last checkpoint, step {p['last_step']}, which the step baseline also picks: rank "
                         f"{p['last_rank_by_ppl']}, so the pick is {p['pick_vs_last']} than the baselines)")
        else:
            parts.append(f"{fam}: {p['variant']} (perplexity {p['ppl']:.2f}, {p['ppl_ratio'] - 1:+.1%} over the "
                         f"held-out choice, {p['held_out_variant']}; rank {p['rank_by_ppl']} of {p['n_candidates']}, "
                         f"against {p['random_expected_rank']:g} expected of a random pick, which does at least as "
                         f"well with probability {p['random_at_least_as_good']:.2f})")
    return ("The label-free pick (largest cosine G among the screened variants; the training callback's rule) "
            "against the held-out choice (lowest perplexity) and the baselines: " + "; ".join(parts)
            + " (one run each, so no interval).").replace("same than the baselines", "the baselines' own pick")


def pick_table(picks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rows = []
    for fam, p in picks.items():
        last = "last_step" in p
        rows.append([fam, p.get("variant", p["step"]), p["G_cosine"], p["ppl"],
                     f"{p['rank_by_ppl']}/{p['n_candidates']}",
                     p["last_step"] if last else "none (equal steps); random pick",
                     p["last_ppl"] if last else "n/a",
                     f"{p['last_rank_by_ppl']}/{p['n_candidates']}" if last else
                     f"{p['random_expected_rank']:g} expected",
                     p["pick_vs_last"] if last else f"a random pick at least as good: {p['random_at_least_as_good']:.2f}",
                     p.get("held_out_variant", p["held_out_step"]), p["held_out_ppl"], p["ppl_ratio"],
                     p["completion_acc"], p.get("last_completion_acc", "n/a"), p["held_out_completion_acc"]])
    return {"title": "Label-free pick (largest cosine G; GeometryCallback's pick_checkpoint for the trajectories) "
                     "against the held-out choice (lowest perplexity) and the baselines: the last checkpoint and the "
                     "step (the same checkpoint) for a trajectory, a random pick between variants at equal step; "
                     "ranks by held-out perplexity; one run each, no interval",
            "header": ["family", "pick", "G (cosine)", "pick ppl", "pick rank by ppl", "baseline (last checkpoint "
                       "= step)", "baseline ppl", "baseline rank by ppl", "pick vs baselines", "held-out choice",
                       "held-out ppl", "ppl ratio", "pick completion acc", "baseline completion acc",
                       "held-out completion acc"],
            "rows": rows}


def short_name(variant: str) -> str:
    """code+prose_lr0.0002 → c+p 2e-04"""
    mixture, _, lr = variant.rpartition("_lr")
    return f"{'c+p' if 'prose' in mixture else 'c'} {float(lr):.0e}" if mixture else variant


def draw(doc: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = doc["data"]
    fams = d["families"]
    fig, axes = plt.subplots(4, len(fams), figsize=(4.2 * len(fams), 8.0), sharex="col", squeeze=False)
    for col, (fam, f) in enumerate(fams.items()):
        ax = axes[:, col]
        if trajectory(f):
            xs, style = f["steps"], "o-"
            ax[3].set_xlabel("training step")
        else:  # variants at equal step: one point each, by name
            xs, style = list(range(len(f["models"]))), "o"
            ax[3].set_xticks(xs, [short_name(m) for m in f["models"]], rotation=60, fontsize=7)
            ax[3].set_xlabel(f"variant (all at step {f['steps'][0]})")
        ax[0].plot(xs, f["G_cosine"], style, color="tab:purple", ms=3)
        ax[0].set_ylabel("G (cosine)")
        ax[0].set_title(f"{fam}: {f['label']}", fontsize=8)
        ax[1].plot(xs, f["G_euclidean"], style.replace("o", "s"), color="tab:blue", ms=3)
        ax[1].set_ylabel("G (Euclidean)")
        ax[2].plot(xs, f["ppl"], style, color="tab:red", ms=3)
        ax[2].set_ylabel("held-out perplexity")
        ax[3].errorbar(xs, f["completion_acc"], yerr=[1.96 * e for e in f["acc_stderr"]], fmt=style,
                       color="tab:green", capsize=2, ms=3)
        ax[3].axhline(0.25, color="gray", lw=0.8, ls=":")
        ax[3].set_ylabel("completion acc (4-way)")
    fig.suptitle("G of the output embeddings (no forward pass) and held-out code quality, per family", fontsize=10)
    fig.tight_layout()
    gallery.save_figure(fig, out / "gap_vs_step.png")

    iv = d["intervals"]
    fig, axes = plt.subplots(len(fams), 4, figsize=(15.0, 3.3 * len(fams)), squeeze=False)
    for row, (fam, f) in enumerate(fams.items()):
        for col, (gkey, ykey, k, yl) in enumerate((("G_cosine", "ppl", "Gcos_ppl", "held-out perplexity"),
                                                   ("G_euclidean", "ppl", "Geuc_ppl", "held-out perplexity"),
                                                   ("G_cosine", "completion_acc", "Gcos_acc", "completion acc"),
                                                   ("G_euclidean", "completion_acc", "Geuc_acc", "completion acc"))):
            ax = axes[row, col]
            ax.scatter(f[gkey], f[ykey], c=f["steps"] if trajectory(f) else range(len(f["steps"])), cmap="viridis",
                       s=14)
            ax.set_xlabel(f"{fam}: G ({gkey.split('_')[1]})", fontsize=8)
            ax.set_ylabel(yl, fontsize=8)
            i = iv[fam][k]
            ax.set_title(f"ρ = {i['estimate']:+.2f} (95 % CI {i['low']:+.2f} to {i['high']:+.2f}; n = "
                         f"{len(f['steps'])})", fontsize=8)
    fig.tight_layout()
    for row, (fam, f) in enumerate(fams.items()):
        for col, (gkey, ykey) in enumerate((("G_cosine", "ppl"), ("G_euclidean", "ppl"),
                                            ("G_cosine", "completion_acc"), ("G_euclidean", "completion_acc"))):
            label_points(axes[row, col], f[gkey], f[ykey],
                         f["steps"] if trajectory(f) else [short_name(m) for m in f["models"]])
    gallery.save_figure(fig, out / "gap_vs_ppl.png")


if __name__ == "__main__":
    if gallery.FROM_RAW in sys.argv:
        gallery.from_raw("checkpoint_screening", summarize, draw)
    else:
        main()
