"""Example local tasks of all four types, generated from text already on the machine (no Hub, nothing committed).

Sources are documents grouped by a topic label:

* ``pydoc``: Python's own documentation (``pydoc_data.topics``, shipped with CPython); label = help topic
  (``string-methods``, ``debugger``, ...), document = paragraph.
* ``fortunes``: the Debian ``fortunes`` package (``/usr/share/games/fortunes``); label = category (``science``,
  ``politics``, ...), document = one fortune.

From them: a topic **Classification** and **Clustering** of sentences, a graded **STS** (4 = neighbouring sentences
of one document, 2 = same topic, 0 = different topics) and a **Retrieval** task (query = a sentence taken out of a
document, relevant = the rest of that document). Everything is seeded, so the same call writes the same files.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import yaml

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.output.files import atomic_open

SOURCES = ("pydoc", "fortunes")
FORTUNES_DIR = Path("/usr/share/games/fortunes")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"“‘(])")
#: name → (labels, sentences per label for train/test/clustering, STS pairs per grade, retrieval queries,
#: clustering bootstrap rounds)
SIZES = {"small": (4, 8, 6, 6, 8, 10, 1), "medium": (6, 24, 16, 16, 40, 40, 5),
         "large": (8, 48, 32, 32, 100, 100, 10),
         # 300 evaluated items a task (test texts, clustered texts, STS pairs), 10 topics of 90 sentences each
         "xlarge": (10, 30, 30, 30, 100, 100, 10)}


def sentences(text: str, min_words: int = 5, max_words: int = 40) -> list[str]:
    out = []
    for s in _SENTENCE_END.split(" ".join(text.split())):
        words = s.split()
        if not s.endswith((".", "!", "?")):
            continue
        letters = sum(c.isalpha() for c in s)
        if min_words <= len(words) <= max_words and letters >= 0.6 * len(s):
            out.append(" ".join(words))
    return out


def pydoc_documents() -> dict[str, list[list[str]]]:
    """help topic → its prose paragraphs (code examples and tables dropped), each as a list of sentences."""
    from pydoc_data.topics import topics

    groups: dict[str, list[list[str]]] = {}
    for key in sorted(topics):
        docs = []
        for para in re.split(r"\n\s*\n", topics[key]):
            lines = [ln for ln in para.splitlines() if ln.strip() and not ln.startswith("   ") and ">>>" not in ln]
            sents = sentences(" ".join(lines))
            if sents:
                docs.append(sents)
        if docs:
            groups[key] = docs
    return groups


def fortune_documents(folder: str | Path = FORTUNES_DIR) -> dict[str, list[list[str]]]:
    """fortune category → its fortunes, each as a list of sentences (attribution lines dropped)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise RepgeomError(f"fortune files not found in {str(folder)!r}; install the Debian package `fortunes` or "
                           "use --source pydoc")
    groups: dict[str, list[list[str]]] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix or not path.is_file() or path.name in ("fortunes",):
            continue
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        docs = []
        for entry in text.split("\n%\n"):
            body = "\n".join(ln for ln in entry.splitlines() if not ln.strip().startswith(("--", "-- ")))
            sents = sentences(body, min_words=4)
            if sents:
                docs.append(sents)
        if docs:
            groups[path.name] = docs
    return groups


def build_tasks(groups: dict[str, list[list[str]]], prefix: str, size: str = "medium",
                seed: int = 0) -> dict[str, dict]:
    """Task specs (with inline records) for :func:`repgeom_eval.mteb_layers.make_task`."""
    if size not in SIZES:
        raise RepgeomError(f"unknown size {size!r} (valid: {', '.join(SIZES)})")
    n_labels, n_train, n_test, n_cluster, n_pairs, n_queries, n_rounds = SIZES[size]
    rng = random.Random(seed)
    need = n_train + n_test + n_cluster
    ranked = sorted(groups, key=lambda k: (-sum(len(d) for d in groups[k]), k))
    labels = [k for k in ranked if sum(len(d) for d in groups[k]) >= need][:n_labels]
    if len(labels) < 2:
        raise RepgeomError(f"the {prefix} text has fewer than 2 topics with {need} sentences; try a smaller size")
    pools = {}
    for label in labels:
        sents = [s for d in groups[label] for s in d]
        rng.shuffle(sents)
        pools[label] = sents
    classification_train = [{"text": s, "label": lab} for lab in labels for s in pools[lab][:n_train]]
    classification_test = [{"text": s, "label": lab} for lab in labels
                           for s in pools[lab][n_train:n_train + n_test]]
    clustering = [{"text": s, "label": lab} for lab in labels for s in pools[lab][n_train + n_test:need]]

    # STS: three grades of relatedness, n_pairs each.
    multi = [(lab, d) for lab in labels for d in groups[lab] if len(d) >= 2]
    sts = []
    for _ in range(n_pairs):
        lab, doc = rng.choice(multi)
        i = rng.randrange(len(doc) - 1)
        sts.append({"sentence1": doc[i], "sentence2": doc[i + 1], "score": 4})
        a, b = rng.sample(pools[rng.choice(labels)], 2)
        sts.append({"sentence1": a, "sentence2": b, "score": 2})
        la, lb = rng.sample(labels, 2)
        sts.append({"sentence1": rng.choice(pools[la]), "sentence2": rng.choice(pools[lb]), "score": 0})
    rng.shuffle(sts)

    # Retrieval: each document of >= 3 sentences is a candidate; a query is one of its sentences, removed from it.
    docs = [(lab, d) for lab in labels for d in groups[lab] if len(d) >= 2]
    rng.shuffle(docs)
    corpus, queries, qrels = [], [], []
    for j, (lab, d) in enumerate(docs[: max(n_queries * 3, 30)]):
        sents = list(d)
        if len(queries) < n_queries and len(sents) >= 3:
            q = sents.pop(rng.randrange(len(sents)))
            queries.append({"id": f"q{j}", "text": q})
            qrels.append({"query_id": f"q{j}", "doc_id": f"d{j}", "score": 1})
        corpus.append({"id": f"d{j}", "title": "", "text": " ".join(sents)})

    name = prefix.capitalize()
    return {
        f"{name}STS": {"type": "STS", "data": sts, "min_score": 0, "max_score": 4,
                       "description": f"graded relatedness of sentence pairs from {prefix} text"},
        f"{name}TopicClassification": {"type": "Classification", "train": classification_train,
                                       "test": classification_test,
                                       # the whole training set every time: one experiment says it all
                                       "samples_per_label": n_train, "n_experiments": 1,
                                       "description": f"topic of a {prefix} sentence ({', '.join(labels)})"},
        f"{name}TopicClustering": {"type": "Clustering", "data": clustering, "n_clusters": n_rounds,
                                   "description": f"{prefix} sentences clustered by topic"},
        f"{name}Retrieval": {"type": "Retrieval", "corpus": corpus, "queries": queries, "qrels": qrels,
                             "description": f"find the {prefix} document a sentence was taken from"},
    }


def write_example_tasks(folder: str | Path, source: str = "pydoc", size: str = "medium", seed: int = 0,
                        overwrite: bool = False) -> Path:
    """Write the example tasks' JSONL files and ``tasks.yaml`` into ``folder``; returns the tasks file. A file there
    with other content (a tasks file the user edited, tasks of another size or seed) is replaced only with
    ``overwrite``; the same files written again are left as they are."""
    if source not in SOURCES:
        raise RepgeomError(f"unknown source {source!r} (valid: {', '.join(SOURCES)})")
    groups = pydoc_documents() if source == "pydoc" else fortune_documents()
    specs = build_tasks(groups, source, size=size, seed=seed)
    return write_tasks(folder, specs, f"Example tasks generated by repgeom from {source} text (size {size}, seed "
                                      f"{seed}).", overwrite)


def write_tasks(folder: str | Path, specs: dict[str, dict], header: str, overwrite: bool = False) -> Path:
    """Write task specs (:func:`build_tasks`' form: inline records) as one JSONL file per record list and a
    ``tasks.yaml`` naming them, for ``--tasks-file``; returns the tasks file. A file there with other content is
    replaced only with ``overwrite``; the same files written again are left as they are."""
    folder = Path(folder).expanduser()
    texts: dict[str, str] = {}  # file name → content, all decided before anything is written
    entries = []
    for name, spec in specs.items():
        entry = {"name": name}
        for key, value in spec.items():
            if isinstance(value, list):
                file_name = f"{name}.{key}.jsonl"
                texts[file_name] = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in value)
                entry[key] = file_name
            else:
                entry[key] = value
        entries.append(entry)
    texts["tasks.yaml"] = (f"# {header}\n" + yaml.safe_dump({"tasks": entries}, sort_keys=False, allow_unicode=True))
    changed = [n for n, text in texts.items() if (folder / n).exists() and _read(folder / n) != text]
    if changed and not overwrite:
        raise RepgeomError(f"{str(folder)!r} already holds {', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''}"
                           f" with other content (edited, or tasks of another --size/--seed); choose another folder, "
                           "or add --overwrite to replace them")
    folder.mkdir(parents=True, exist_ok=True)
    for file_name, text in texts.items():
        with atomic_open(folder / file_name) as fh:
            fh.write(text)
    return folder / "tasks.yaml"


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
