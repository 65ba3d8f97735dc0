"""Reading texts: ``.jsonl`` (a text field per line) or ``.txt`` (one text per line), with clear errors.

Two ways in: :func:`load_texts` reads a whole file into a :class:`TextSet`; :func:`open_source` gives a
:class:`TextSource` that streams records (a file, an in-memory list, or a Hugging Face ``datasets`` stream), so a
run over 100k texts holds one shard at a time. A file source validates the whole file once up front (bad JSON on
line 90,000 is reported before any forward pass), counting and hashing it as it goes, in constant memory.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from repgeom_eval.spec.errors import RepgeomError


@dataclass
class TextSet:
    """Non-empty texts plus what was skipped on the way in."""

    texts: list[str]
    source: str = "<memory>"
    ids: list[Any] = field(default_factory=list)  # the record's "id" field if present, else the line number
    n_records: int = 0
    skipped_empty: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.ids:
            self.ids = list(range(len(self.texts)))

    def summary(self) -> dict[str, Any]:
        return {"path": self.source, "n_records": self.n_records, "n_texts": len(self.texts),
                "n_skipped_empty": len(self.skipped_empty)}


def from_texts(texts: Sequence[str], source: str = "<memory>", min_texts: int = 2) -> TextSet:
    """Validate in-memory texts: skip (and count) empty ones; error if fewer than ``min_texts`` remain."""
    kept, ids, skipped = [], [], []
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise RepgeomError(f"text #{i} of {source} is a {type(t).__name__}, not a string")
        if t.strip():
            kept.append(t)
            ids.append(i)
        else:
            skipped.append(i)
    ts = TextSet(kept, source, ids, len(texts), skipped)
    _check_count(ts, min_texts)
    return ts


def _check_count(ts: TextSet, min_texts: int) -> None:
    if len(ts.texts) < min_texts:
        extra = f" ({len(ts.skipped_empty)} empty or whitespace-only skipped)" if ts.skipped_empty else ""
        raise RepgeomError(
            f"{ts.source}: {len(ts.texts)} non-empty text(s){extra}, but at least {min_texts} are needed "
            "(dispersion is a mean over pairs)"
        )


def decode_line(raw: bytes, path: Path, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RepgeomError(
            f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
            f"re-encode the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 {path.name} > fixed.{path.suffix.lstrip('.')}`"
        ) from None


def read_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of every line of a UTF-8 file, read line by line in constant memory: the one reader under
    every text and JSONL schema (a leading byte-order mark is dropped; bad UTF-8 names the line and the fix)."""
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            raw = raw.rstrip(b"\r\n")
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # UTF-8 byte-order mark
            yield lineno, decode_line(raw, path, lineno)


def read_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, value) of every non-blank line of a JSONL file (:func:`read_lines`, :func:`parse_json`): the
    one JSONL reader; each schema (texts, documents, queries, MTEB task files) checks its records on top of it."""
    path = Path(path)
    for lineno, line in read_lines(path):
        if not line.strip():
            continue
        try:
            yield lineno, parse_json(line, f"{path}:{lineno}")
        except RepgeomError as exc:
            if "not valid JSON" not in str(exc):
                raise
            raise RepgeomError(f"{exc}; each line of a .jsonl file must be one JSON object") from None


# -- file formats ----------------------------------------------------------------------------------------------------

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")  # one JSON object per line
TEXT_SUFFIXES = (".txt",)  # one text per line
_COMPRESSED = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd", ".zip": "zip", ".tgz": "gzip",
               ".tar": "tar", ".7z": "7z", ".lz4": "lz4"}


def data_format(path: str | Path) -> str:
    """``"jsonl"`` or ``"text"`` by the file's extension (README, "Measure"); any other extension is refused rather
    than read as lines of text (a CSV's header would become a text, a .gz file would be bytes)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in TEXT_SUFFIXES:
        return "text"
    known = "; repgeom reads .jsonl (also .json, .ndjson: one JSON object per line) and .txt (one text per line)"
    if suffix in _COMPRESSED:
        raise RepgeomError(f"data file {str(path)!r} is {_COMPRESSED[suffix]}-compressed{known}: decompress it first")
    what = f"has the extension {suffix!r}" if suffix else "has no extension"
    hint = ("convert it to .jsonl" if suffix in (".csv", ".tsv", ".parquet", ".arrow", ".xlsx") else
            "rename it to .txt if it holds one plain text per line")
    raise RepgeomError(f"data file {str(path)!r} {what}{known}; {hint}")


def source_files(data: Any) -> list[str]:
    """The local files a data argument reads (a path, or the ``data_files`` of an ``hf:`` spec), for
    :func:`repgeom_eval.output.files.check_outputs`."""
    if isinstance(data, Path):
        return [str(data)]
    if not isinstance(data, str) or not data:
        return []
    if data.startswith("hf:"):
        files = dict(parse_qsl(data.partition("?")[2], keep_blank_values=True)).get("data_files")
        return [f for f in (files or "").split(",") if f and Path(f).exists()]
    return [data]


def parse_json(text: str, where: str) -> Any:
    """``json.loads`` with user-facing errors: invalid JSON, nesting too deep for the parser, and lone UTF-16
    surrogates (``"\\ud800"`` escapes that are no Unicode character) are a one-line :class:`RepgeomError` naming
    ``where`` (e.g. ``file.jsonl:12``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RepgeomError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise RepgeomError(f"{where}: JSON nested too deeply to read (thousands of levels of [ or {{)") from None
    _check_surrogates(value, where)
    return value


def _check_surrogates(value: Any, where: str) -> None:
    """Refuse strings that hold a lone surrogate: tokenizers and UTF-8 writers fail on them later, far from here."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise RepgeomError(f"{where}: the string {item[max(0, exc.start - 10):exc.start + 10]!r} holds a lone "
                                   f"UTF-16 surrogate (U+{ord(item[exc.start]):04X}), which is not a character; "
                                   "fix the \\u escape in the file") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def load_texts(path: str | Path, text_field: str = "text", min_texts: int = 2) -> TextSet:
    """Read ``path`` whole: ``.jsonl``/``.json``/``.ndjson`` lines with a ``text_field``, ``.txt`` one text per line;
    other extensions are refused (:func:`data_format`)."""
    src = FileSource(path, text_field, min_texts)  # validates the whole file
    texts, ids, skipped = [], [], []
    for rid, text in src.records():
        if text is not None and text.strip():
            texts.append(text)
            ids.append(rid)
        else:
            skipped.append(rid)
    return TextSet(texts, src.source, ids, len(texts) + len(skipped), skipped)


# -- streaming sources ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Record:
    """One non-empty text: ``index`` is its position among the non-empty texts of the source, ``id`` the record's
    ``id`` field (else its line number, or list position)."""

    index: int
    id: Any
    text: str


class TextSource:
    """An iterable of :class:`Record` that can be read more than once (each iteration starts over).

    ``n_texts`` is known up front where the source allows it (files, lists) and ``None`` for a stream; after one
    full iteration ``counts()`` is exact either way. ``fingerprint`` identifies the content (for resumable runs).
    """

    source: str = "<memory>"
    fingerprint: str = ""
    n_texts: int | None = None
    min_texts: int = 2

    def records(self) -> Iterator[tuple[Any, str | None]]:  # pragma: no cover - abstract
        """(id, text) of every record; text ``None`` or blank for an empty record."""
        raise NotImplementedError

    def __iter__(self) -> Iterator[Record]:
        self._n_records, self._skipped, self._first_skipped = 0, 0, []
        index = 0
        for rid, text in self.records():
            self._n_records += 1
            if text is None or not text.strip():
                self._skipped += 1
                if len(self._first_skipped) < 5:
                    self._first_skipped.append(rid)
                continue
            yield Record(index, rid, text)
            index += 1
        self._n_texts_seen = index
        if self._n_records == 0:
            raise RepgeomError(f"data {self.source!r} is empty")
        if index < self.min_texts:
            extra = f" ({self._skipped} empty or whitespace-only skipped)" if self._skipped else ""
            raise RepgeomError(f"{self.source}: {index} non-empty text(s){extra}, but at least {self.min_texts} "
                               "are needed (dispersion is a mean over pairs)")

    def counts(self) -> dict[str, Any]:
        """What the last full iteration saw (the results file's ``data`` block)."""
        return {"path": self.source, "n_records": getattr(self, "_n_records", None),
                "n_texts": getattr(self, "_n_texts_seen", self.n_texts),
                "n_skipped_empty": getattr(self, "_skipped", None)}

    def shards(self, size: int) -> Iterator[list[Record]]:
        """Consecutive lists of ``size`` records (the last one shorter)."""
        if size < 1:
            raise RepgeomError(f"shard size must be positive, got {size}")
        it = iter(self)
        while chunk := list(itertools.islice(it, size)):
            yield chunk


class ListSource(TextSource):
    """Texts already in memory (a list of strings, or a :class:`TextSet`)."""

    def __init__(self, texts: Sequence[str] | TextSet, source: str = "<memory>", min_texts: int = 2):
        if isinstance(texts, TextSet):
            self._pairs = list(zip(texts.ids, texts.texts))
            self.source = texts.source
            self._n_records = texts.n_records
        else:
            for i, t in enumerate(texts):
                if not isinstance(t, str):
                    raise RepgeomError(f"text #{i} of {source} is a {type(t).__name__}, not a string")
                _check_surrogates(t, f"text #{i} of {source}")
            self._pairs = list(enumerate(texts))
            self.source = source
        self.min_texts = min_texts
        self.n_texts = sum(1 for _, t in self._pairs if t.strip())
        digest = hashlib.sha256()
        for _, t in self._pairs:
            digest.update(t.encode("utf-8", "surrogatepass") + b"\x00")
        self.fingerprint = "sha256:" + digest.hexdigest()
        list(iter(self))  # validate now: too few texts fail before the model is loaded

    def records(self) -> Iterator[tuple[Any, str | None]]:
        yield from self._pairs


class FileSource(TextSource):
    """A ``.jsonl``/``.txt`` file read line by line; validated, counted and hashed in one pass up front."""

    def __init__(self, path: str | Path, text_field: str = "text", min_texts: int = 2):
        p = Path(path)
        if not p.exists():
            raise RepgeomError(f"data file {str(path)!r} does not exist")
        if p.is_dir():
            raise RepgeomError(f"data path {str(path)!r} is a directory; pass a .jsonl or .txt file")
        self.path, self.text_field, self.min_texts = p, text_field, min_texts
        self.source = str(p)
        self.is_jsonl = data_format(p) == "jsonl"
        self.fingerprint = "sha256:" + _file_hash(p)
        self.n_texts = sum(1 for _ in self)  # full validation pass, constant memory

    def records(self) -> Iterator[tuple[Any, str | None]]:
        if not self.is_jsonl:
            yield from read_lines(self.path)
            return
        for lineno, record in read_jsonl(self.path):
            yield _text_record(record, self.path, lineno, self.text_field)


class DatasetSource(TextSource):
    """A Hugging Face ``datasets`` stream (``streaming=True``): ``hf:NAME?split=train&config=C&data_files=F``.

    Nothing is downloaded up front, so the number of texts is known only after the run; local builders work
    offline, e.g. ``hf:json?data_files=texts.jsonl`` or ``hf:text?data_files=corpus.txt``.
    """

    def __init__(self, spec: str, text_field: str = "text", min_texts: int = 2):
        name, _, query = spec.removeprefix("hf:").partition("?")
        params = dict(parse_qsl(query, keep_blank_values=True))
        unknown = set(params) - {"split", "config", "data_files", "revision"}
        if not name or unknown:
            raise RepgeomError(f"bad dataset spec {spec!r}: expected hf:NAME[?split=S&config=C&data_files=F"
                               f"&revision=R]" + (f" (unknown keys: {sorted(unknown)})" if unknown else ""))
        try:
            import datasets  # noqa: F401
        except ImportError:
            raise RepgeomError("hf: data sources need the datasets package: pip install datasets") from None
        self.name, self.params, self.text_field, self.min_texts = name, params, text_field, min_texts
        self.source = spec
        parts = [spec]
        files = params.get("data_files")
        if files and Path(files).is_file():
            parts.append(_file_hash(Path(files)))
        self.fingerprint = "spec:" + hashlib.sha256("|".join(parts).encode()).hexdigest()
        self._open()  # fail now (missing dataset, no network) rather than after loading the model

    def _open(self):
        import datasets

        kw: dict[str, Any] = {"split": self.params.get("split", "train"), "streaming": True}
        if "data_files" in self.params:
            kw["data_files"] = self.params["data_files"]
        if "revision" in self.params:
            kw["revision"] = self.params["revision"]
        try:
            return datasets.load_dataset(self.name, self.params.get("config"), **kw)
        except Exception as exc:  # noqa: BLE001 - datasets raises many types; all mean "cannot open it"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RepgeomError(f"cannot open dataset {self.source!r}: {first} (offline? a local builder works "
                               "without the Hub: hf:json?data_files=FILE)") from None

    def records(self) -> Iterator[tuple[Any, str | None]]:
        for i, row in enumerate(self._open()):
            if self.text_field not in row:
                raise RepgeomError(f"{self.source}: row {i} has no {self.text_field!r} field (fields: "
                                   f"{', '.join(map(repr, list(row)[:10]))}); pass --text-field NAME")
            text = row[self.text_field]
            if text is not None and not isinstance(text, str):
                raise RepgeomError(f"{self.source}: row {i} field {self.text_field!r} is a "
                                   f"{type(text).__name__}, not a string")
            _check_surrogates(text, f"{self.source}: row {i}")
            yield row.get("id", i), text


def open_source(data: str | Path | Sequence[str] | TextSet | TextSource, text_field: str = "text",
                min_texts: int = 2) -> TextSource:
    """A :class:`TextSource` for a path, an ``hf:`` dataset spec, a list of strings or a :class:`TextSet`."""
    if isinstance(data, TextSource):
        return data
    if isinstance(data, TextSet):
        return ListSource(data, min_texts=min_texts)
    if isinstance(data, str) and data.startswith("hf:"):
        return DatasetSource(data, text_field, min_texts)
    if isinstance(data, (str, Path)):
        return FileSource(data, text_field, min_texts)
    if isinstance(data, Iterable):
        return ListSource(list(data), min_texts=min_texts)
    raise RepgeomError(f"cannot read texts from a {type(data).__name__}; pass a file path, hf:NAME or a list")


def _text_record(record: Any, path: Path, lineno: int, text_field: str) -> tuple[Any, str]:
    """(id, text) of one record of a texts file; its schema: an object with a string ``text_field``."""
    if not isinstance(record, dict):
        raise RepgeomError(f"{path}:{lineno}: expected a JSON object like {{\"{text_field}\": \"...\"}}, "
                           f"got {type(record).__name__}")
    if text_field not in record:
        keys = ", ".join(map(repr, list(record)[:10])) or "none"
        raise RepgeomError(f"{path}:{lineno}: no {text_field!r} field (fields: {keys}); "
                           "pass --text-field NAME to read another field")
    text = record[text_field]
    if not isinstance(text, str):
        raise RepgeomError(f"{path}:{lineno}: field {text_field!r} is a {type(text).__name__}, not a string")
    return record.get("id", lineno), text


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
