"""Local MTEB tasks from JSONL files, so layer sweeps run without the Hugging Face Hub.

A tasks file (YAML or JSON) lists tasks; relative paths are read from the tasks file's folder::

    tasks:
      - name: MySTS
        type: STS                 # records {"sentence1", "sentence2", "score"}
        data: sts.jsonl
        min_score: 0              # optional, default: min/max of the scores
        max_score: 5
      - name: MyTopics
        type: Classification      # records {"text", "label"}; a train and an evaluation file
        train: topics_train.jsonl
        test: topics_test.jsonl
      - name: MyClusters
        type: Clustering          # records {"text", "label"}
        data: clusters.jsonl
      - name: MySearch
        type: Retrieval
        corpus: corpus.jsonl      # {"id", "text", "title" (optional)}
        queries: queries.jsonl    # {"id", "text"}
        qrels: qrels.jsonl        # {"query_id", "doc_id", "score" (optional, default 1)}

Every data entry may also be a list of records instead of a file name (the Python API: :func:`make_task`).
Optional for every task: ``description``, ``language`` (default ``eng-Latn``), ``main_score`` and ``split`` (the
evaluation split's name, default ``test``); per type: ``samples_per_label``/``n_experiments`` (classification),
``n_clusters``/``max_documents_per_cluster`` (clustering). The dataset revision recorded by mteb is a hash of the data,
so editing a file starts a new result rather than mixing with the old one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from datasets import Dataset, DatasetDict
from mteb.abstasks.classification import AbsTaskClassification
from mteb.abstasks.clustering import AbsTaskClustering
from mteb.abstasks.retrieval import AbsTaskRetrieval
from mteb.abstasks.sts import AbsTaskSTS
from mteb.abstasks.task_metadata import TaskMetadata

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.measurement.texts import read_jsonl

TASK_TYPES = ("STS", "Classification", "Clustering", "Retrieval")
MAIN_SCORES = {"STS": "cosine_spearman", "Classification": "accuracy", "Clustering": "v_measure",
               "Retrieval": "ndcg_at_10"}
#: type → {data entry: required record fields}
DATA_FIELDS = {
    "STS": {"data": ("sentence1", "sentence2", "score")},
    "Classification": {"train": ("text", "label"), "test": ("text", "label")},
    "Clustering": {"data": ("text", "label")},
    "Retrieval": {"corpus": ("id", "text"), "queries": ("id", "text"), "qrels": ("query_id", "doc_id")},
}
_COMMON = ("name", "type", "description", "language", "main_score", "split")
_OPTIONS = {"STS": ("min_score", "max_score"), "Classification": ("samples_per_label", "n_experiments"),
            "Clustering": ("n_clusters", "max_documents_per_cluster"), "Retrieval": ()}


def _read_records(value: Any, what: str, base_dir: Path | None) -> tuple[list[dict[str, Any]], bytes]:
    """(records, bytes to hash) from a JSONL path or an in-memory list of dicts."""
    if isinstance(value, (str, Path)):
        path = Path(value).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if path.is_dir():
            raise RepgeomError(f"{what}: {str(path)!r} is a directory, expected a JSONL file")
        if not path.is_file():
            raise RepgeomError(f"{what}: file {str(path)!r} not found")
        records = []
        try:
            for lineno, rec in read_jsonl(path):
                if not isinstance(rec, dict):
                    raise RepgeomError(f"{path}:{lineno} is a {type(rec).__name__}, expected a JSON object")
                records.append(rec)
        except RepgeomError as exc:
            raise RepgeomError(f"{what}: {exc}") from None
        return records, path.read_bytes()
    if isinstance(value, Sequence) and all(isinstance(r, Mapping) for r in value):
        records = [dict(r) for r in value]
        return records, json.dumps(records, sort_keys=True, default=str).encode()
    raise RepgeomError(f"{what}: expected a JSONL file name or a list of records, got {type(value).__name__}")


def _check_fields(records: list[dict[str, Any]], fields: Sequence[str], what: str) -> None:
    if not records:
        raise RepgeomError(f"{what}: no records")
    for i, rec in enumerate(records, 1):
        missing = [f for f in fields if f not in rec]
        if missing:
            raise RepgeomError(f"{what}: record {i} has no {', '.join(repr(m) for m in missing)} "
                               f"(each record needs {', '.join(fields)}; it has {', '.join(sorted(rec))})")
        for f in ("text", "sentence1", "sentence2"):
            if f in rec and not isinstance(rec[f], str):
                raise RepgeomError(f"{what}: record {i}: {f!r} must be a string, got {type(rec[f]).__name__}")


def _metadata(spec: Mapping[str, Any], kind: str, digest: str) -> TaskMetadata:
    split = str(spec.get("split", "test"))
    try:
        return TaskMetadata(
            name=str(spec["name"]), type=kind, main_score=str(spec.get("main_score", MAIN_SCORES[kind])),
            description=str(spec.get("description", f"local {kind} task {spec['name']}")),
            eval_langs=[str(spec.get("language", "eng-Latn"))], eval_splits=[split], modalities=["text"],
            dataset={"path": f"local/{spec['name']}", "revision": digest},
        )
    except ValueError as exc:  # pydantic: bad language code, main score ...
        raise RepgeomError(f"task {spec['name']!r}: {str(exc).splitlines()[0]} ({exc})") from None


def make_task(spec: Mapping[str, Any], base_dir: str | Path | None = None):
    """Build an mteb task instance from a dict (one entry of a tasks file). Data entries are JSONL file names
    (relative to ``base_dir``) or lists of records. Errors name the task, the file and the record."""
    if not isinstance(spec, Mapping) or "name" not in spec or "type" not in spec:
        raise RepgeomError(f"a task needs at least 'name' and 'type' ({', '.join(TASK_TYPES)}); got {spec!r}")
    kinds = {k.lower(): k for k in TASK_TYPES}
    kind = kinds.get(str(spec["type"]).lower())
    if kind is None:
        raise RepgeomError(f"task {spec['name']!r}: type {spec['type']!r} is not one of {', '.join(TASK_TYPES)}")
    allowed = set(_COMMON) | set(DATA_FIELDS[kind]) | set(_OPTIONS[kind])
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise RepgeomError(f"task {spec['name']!r} ({kind}): unknown key(s) {unknown} (allowed: {sorted(allowed)})")
    base = Path(base_dir) if base_dir is not None else None
    data: dict[str, list[dict[str, Any]]] = {}
    h = hashlib.sha256()
    for entry, fields in DATA_FIELDS[kind].items():
        if entry not in spec:
            raise RepgeomError(f"task {spec['name']!r} ({kind}) needs {entry!r}: records with {', '.join(fields)}")
        what = f"task {spec['name']!r}, {entry}"
        data[entry], raw = _read_records(spec[entry], what, base)
        _check_fields(data[entry], fields, what)
        h.update(entry.encode() + b"\0" + raw)
    options = {k: spec[k] for k in _OPTIONS[kind] if k in spec}
    h.update(json.dumps(options, sort_keys=True).encode())
    metadata = _metadata(spec, kind, h.hexdigest()[:16])
    return _BUILDERS[kind](metadata, data, options)


def load_tasks_file(path: str | Path) -> list:
    """All tasks of a YAML/JSON tasks file (see the module docstring)."""
    from repgeom_eval.spec.option_fields import read_yaml_file

    path = Path(path).expanduser()
    if not path.exists() and not path.is_symlink():
        raise RepgeomError(f"tasks file {str(path)!r} not found")
    doc = read_yaml_file(path, f"tasks file {str(path)!r}")
    entries = doc.get("tasks") if isinstance(doc, dict) else doc
    if not isinstance(entries, list) or not entries:
        raise RepgeomError(f"tasks file {str(path)!r} must hold a list of tasks (a 'tasks:' list or a top-level list)")
    tasks = [make_task(e, path.parent) for e in entries]
    names = [t.metadata.name for t in tasks]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise RepgeomError(f"tasks file {str(path)!r} defines {', '.join(dupes)} more than once")
    return tasks


# -- one builder per task type ----------------------------------------------------------------------------------------

def _sts(metadata: TaskMetadata, data: dict, options: dict):
    records = data["data"]
    try:
        scores = [float(r["score"]) for r in records]
    except (TypeError, ValueError):
        raise RepgeomError(f"task {metadata.name!r}: every 'score' must be a number") from None
    split = metadata.eval_splits[0]
    table = {"sentence1": [r["sentence1"] for r in records], "sentence2": [r["sentence2"] for r in records],
             "score": scores}

    def load_data(self, num_proc=None, **kwargs):
        self.dataset = DatasetDict({split: Dataset.from_dict(table)})
        self.data_loaded = True

    low, high = options.get("min_score", min(scores)), options.get("max_score", max(scores))
    if not float(low) < float(high):  # mteb divides by max_score - min_score
        raise RepgeomError(f"task {metadata.name!r}: its scores span nothing (min_score {low}, max_score {high}); an "
                           "STS task needs pairs of different similarity, or min_score < max_score")
    attrs = {"metadata": metadata, "load_data": load_data, "min_score": low, "max_score": high}
    return type(metadata.name, (AbsTaskSTS,), attrs)()


def _classification(metadata: TaskMetadata, data: dict, options: dict):
    split = metadata.eval_splits[0]
    if split == "train":
        raise RepgeomError(f"task {metadata.name!r}: the evaluation split cannot be called 'train'")
    tables = {name: {"text": [r["text"] for r in data[key]], "label": [r["label"] for r in data[key]]}
              for name, key in (("train", "train"), (split, "test"))}
    unseen = set(tables[split]["label"]) - set(tables["train"]["label"])
    if unseen:
        raise RepgeomError(f"task {metadata.name!r}: test labels {sorted(map(str, unseen))} never occur in train")

    def load_data(self, num_proc=None, **kwargs):
        self.dataset = DatasetDict({name: Dataset.from_dict(t) for name, t in tables.items()})
        self.data_loaded = True

    attrs = {"metadata": metadata, "load_data": load_data, **options}
    return type(metadata.name, (AbsTaskClassification,), attrs)()


def _clustering(metadata: TaskMetadata, data: dict, options: dict):
    split = metadata.eval_splits[0]
    records = data["data"]
    table = {"sentences": [r["text"] for r in records], "labels": [str(r["label"]) for r in records]}
    if len(set(table["labels"])) < 2:
        raise RepgeomError(f"task {metadata.name!r}: clustering needs at least 2 distinct labels")

    def load_data(self, num_proc=None, **kwargs):
        self.dataset = DatasetDict({split: Dataset.from_dict(table)})
        self.data_loaded = True

    # mteb's defaults suit 100k-document sets: embed them all, and bootstrap samples as large as the set.
    attrs = {"metadata": metadata, "load_data": load_data, "max_fraction_of_documents_to_embed": None,
             "max_documents_per_cluster": min(len(records), 16_384), **options}
    return type(metadata.name, (AbsTaskClustering,), attrs)()


def _retrieval(metadata: TaskMetadata, data: dict, options: dict):
    from mteb.abstasks.retrieval_dataset_loaders import RetrievalSplitData

    split = metadata.eval_splits[0]
    corpus = [{"id": str(r["id"]), "text": r["text"], "title": str(r.get("title") or "")} for r in data["corpus"]]
    queries = [{"id": str(r["id"]), "text": r["text"]} for r in data["queries"]]
    doc_ids, query_ids = {d["id"] for d in corpus}, {q["id"] for q in queries}
    qrels: dict[str, dict[str, int]] = {}
    for i, r in enumerate(data["qrels"], 1):
        qid, did = str(r["query_id"]), str(r["doc_id"])
        if qid not in query_ids or did not in doc_ids:
            raise RepgeomError(f"task {metadata.name!r}, qrels record {i}: "
                               + (f"query {qid!r} is not in queries" if qid not in query_ids
                                  else f"document {did!r} is not in the corpus"))
        qrels.setdefault(qid, {})[did] = int(r.get("score", 1))

    def load_data(self, num_proc=None, **kwargs):
        self.dataset = {"default": {split: RetrievalSplitData(
            corpus=Dataset.from_list(corpus), queries=Dataset.from_list(queries), relevant_docs=qrels,
            top_ranked=None)}}
        self.data_loaded = True

    return type(metadata.name, (AbsTaskRetrieval,), {"metadata": metadata, "load_data": load_data})()


_BUILDERS = {"STS": _sts, "Classification": _classification, "Clustering": _clustering, "Retrieval": _retrieval}
