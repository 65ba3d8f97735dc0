"""Datasets of the repgeom tasks: the upstream Hub dataset by default, or a local file in the same schema.

Each task YAML names ``custom_dataset: !function repgeom_eval.lmeval.documents.load_dataset`` with
``dataset_kwargs: {repgeom_schema: NAME}``. lm-eval calls it with the task's metadata (``--metadata`` and the
model arguments) as keyword arguments, so ``--metadata '{"repgeom_data": "PATH"}'`` selects a local source:

* a file (``.jsonl``, ``.json`` holding a list of records, or ``.parquet``): the evaluated split; the other
  splits the task names (few-shot sources) are empty;
* a folder holding one such file per split, named like the upstream splits (``test.jsonl``, ``dev.jsonl``, …).

Every record is checked against the schema below; the first bad record is reported with its line and field.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from repgeom_eval.spec.errors import RepgeomError

EXTENSIONS = (".jsonl", ".json", ".parquet")


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_str_list(v: Any) -> bool:
    return isinstance(v, list) and len(v) >= 2 and all(isinstance(x, str) for x in v)


def _is_digit_label(v: Any) -> bool:
    return _is_int(v) or (isinstance(v, str) and v.strip().isdigit())


def _is_arc_choices(v: Any) -> bool:
    return (isinstance(v, dict) and _is_str_list(v.get("text")) and isinstance(v.get("label"), list)
            and len(v["label"]) == len(v["text"]) and all(isinstance(x, str) for x in v["label"]))


@dataclass(frozen=True)
class Field:
    name: str
    check: Callable[[Any], bool]
    meaning: str


@dataclass(frozen=True)
class Schema:
    hub: tuple[str, str | None]  # (path, config) for datasets.load_dataset
    eval_split: str
    splits: tuple[str, ...]  # every split the task YAML names
    fields: tuple[Field, ...]
    check: Callable[[dict], str | None] | None = None  # cross-field check; returns a problem or None

    def describe(self) -> str:
        return ", ".join(f"{f.name} ({f.meaning})" for f in self.fields)


def _mmlu_check(r: dict) -> str | None:
    if len(r["choices"]) != 4:
        return f"'choices' must hold 4 answers, got {len(r['choices'])}"
    if not 0 <= r["answer"] < 4:
        return f"'answer' must be 0-3, got {r['answer']}"
    return None


def _arc_check(r: dict) -> str | None:
    if r["answerKey"] not in r["choices"]["label"]:
        return f"'answerKey' {r['answerKey']!r} is not one of choices.label {r['choices']['label']}"
    return None


def _index_check(field: str, n: Callable[[dict], int]) -> Callable[[dict], str | None]:
    def check(r: dict) -> str | None:
        value = int(r[field])
        return None if 0 <= value < n(r) else f"'{field}' must be 0-{n(r) - 1}, got {r[field]!r}"

    return check


_ARC_FIELDS = (
    Field("question", _is_str, "text"),
    Field("choices", _is_arc_choices, '{"text": [answers], "label": ["A", "B", ...]}'),
    Field("answerKey", _is_str, "label of the right answer"),
)

SCHEMAS: dict[str, Schema] = {
    "mmlu": Schema(("cais/mmlu", "all"), "test", ("test", "dev"), (
        Field("question", _is_str, "text"),
        Field("subject", _is_str, "e.g. abstract_algebra"),
        Field("choices", _is_str_list, "list of 4 answers"),
        Field("answer", _is_int, "index 0-3 of the right answer"),
    ), _mmlu_check),
    "arc_challenge": Schema(("allenai/ai2_arc", "ARC-Challenge"), "test", ("train", "validation", "test"),
                            _ARC_FIELDS, _arc_check),
    "arc_easy": Schema(("allenai/ai2_arc", "ARC-Easy"), "test", ("train", "validation", "test"), _ARC_FIELDS,
                       _arc_check),
    "hellaswag": Schema(("Rowan/hellaswag", None), "validation", ("train", "validation"), (
        Field("activity_label", _is_str, "text"),
        Field("ctx_a", _is_str, "text"),
        Field("ctx_b", _is_str, "text"),
        Field("endings", _is_str_list, "list of candidate endings"),
        Field("label", _is_digit_label, "index of the right ending, integer or digit string"),
    ), _index_check("label", lambda r: len(r["endings"]))),
    "piqa": Schema(("baber/piqa", None), "validation", ("train", "validation"), (
        Field("goal", _is_str, "text"),
        Field("sol1", _is_str, "first solution"),
        Field("sol2", _is_str, "second solution"),
        Field("label", _is_int, "0 or 1"),
    ), _index_check("label", lambda r: 2)),
    "wikitext": Schema(("EleutherAI/wikitext_document_level", "wikitext-2-raw-v1"), "test",
                       ("train", "validation", "test"), (Field("page", _is_str, "the document text"),)),
}


def _read_records(path: Path) -> list[dict]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import datasets

        return datasets.Dataset.from_parquet(str(path)).to_list()
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RepgeomError(f"{path}: not valid UTF-8 (byte {exc.start})") from None
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise RepgeomError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(data, list):
            raise RepgeomError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
        return data
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise RepgeomError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
    return records


def _validate(records: list[dict], schema_name: str, path: Path) -> None:
    schema = SCHEMAS[schema_name]
    for number, record in enumerate(records, 1):
        where = f"{path}: record {number}"
        if not isinstance(record, dict):
            raise RepgeomError(f"{where} is not a JSON object")
        for f in schema.fields:
            if f.name not in record:
                raise RepgeomError(f"{where} has no field {f.name!r}; the {schema_name} schema is: {schema.describe()}")
            if not f.check(record[f.name]):
                raise RepgeomError(f"{where}: field {f.name!r} must be {f.meaning}, got {record[f.name]!r}")
        problem = schema.check(record) if schema.check else None
        if problem:
            raise RepgeomError(f"{where}: {problem}")


def _files_in(folder: Path, splits: tuple[str, ...]) -> dict[str, Path]:
    found = {}
    for split in splits:
        matches = [folder / f"{split}{ext}" for ext in EXTENSIONS if (folder / f"{split}{ext}").is_file()]
        if len(matches) > 1:
            raise RepgeomError(f"{folder} holds several files for split {split!r}: {[m.name for m in matches]}")
        if matches:
            found[split] = matches[0]
    return found


def load_local(path: str | Path, schema_name: str):
    """A ``datasets.DatasetDict`` with every split the task names, from a local file or folder."""
    import datasets

    schema = SCHEMAS[schema_name]
    p = Path(path).expanduser()
    if p.is_dir():
        files = _files_in(p, schema.splits)
        if schema.eval_split not in files:
            raise RepgeomError(f"repgeom_data folder {str(p)!r} has no {schema.eval_split}.jsonl (or .json/.parquet); "
                               f"it may hold one file per split of: {', '.join(schema.splits)}")
    elif p.is_file():
        if p.suffix.lower() not in EXTENSIONS:
            raise RepgeomError(f"repgeom_data {str(p)!r}: expected a {', '.join(EXTENSIONS)} file or a folder")
        files = {schema.eval_split: p}
    else:
        raise RepgeomError(f"repgeom_data {str(p)!r} does not exist")
    splits = {}
    for split in schema.splits:
        if split in files:
            records = _read_records(files[split])
            _validate(records, schema_name, files[split])
            if split == schema.eval_split and not records:
                raise RepgeomError(f"{files[split]} holds no records")
            splits[split] = datasets.Dataset.from_list(records)
        else:
            splits[split] = datasets.Dataset.from_list([])
    return datasets.DatasetDict(splits)


def load_dataset(repgeom_schema: str, repgeom_data: str | None = None, **_metadata: Any):
    """``custom_dataset`` of the repgeom task YAMLs: ``repgeom_data`` if given, else the upstream Hub dataset."""
    if repgeom_schema not in SCHEMAS:
        raise RepgeomError(f"unknown repgeom_schema {repgeom_schema!r} (valid: {', '.join(SCHEMAS)})")
    if repgeom_data:
        return load_local(repgeom_data, repgeom_schema)
    import datasets

    path, name = SCHEMAS[repgeom_schema].hub
    try:
        return datasets.load_dataset(path, name)
    except Exception as exc:  # noqa: BLE001 - network, offline mode, missing cache: all end the same way
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RepgeomError(
            f"could not load the {path}{'/' + name if name else ''} dataset from the Hugging Face Hub ({first}). "
            f"Offline, pass a local copy in the same schema: --metadata '{{\"repgeom_data\": \"PATH\"}}' "
            f"(fields: {SCHEMAS[repgeom_schema].describe()})") from None
