"""Reading texts: ``.jsonl`` (a text field per line) or ``.txt`` (one text per line), with clear errors."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import RepgeomError


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


def _decode(raw: bytes, path: Path, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RepgeomError(
            f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
            f"re-encode the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 {path.name} > fixed.{path.suffix.lstrip('.')}`"
        ) from None


def load_texts(path: str | Path, text_field: str = "text", min_texts: int = 2) -> TextSet:
    """Read ``path``: ``.jsonl``/``.json`` lines with a ``text_field``, anything else one text per line."""
    p = Path(path)
    if not p.exists():
        raise RepgeomError(f"data file {str(path)!r} does not exist")
    if p.is_dir():
        raise RepgeomError(f"data path {str(path)!r} is a directory; pass a .jsonl or .txt file")
    raw_lines = p.read_bytes().splitlines()
    if raw_lines and raw_lines[0].startswith(b"\xef\xbb\xbf"):
        raw_lines[0] = raw_lines[0][3:]  # UTF-8 byte-order mark
    is_jsonl = p.suffix.lower() in {".jsonl", ".json", ".ndjson"}
    texts, ids, skipped = [], [], []
    n_records = 0
    for lineno, raw in enumerate(raw_lines, start=1):
        line = _decode(raw, p, lineno)
        if is_jsonl:
            if not line.strip():
                continue
            n_records += 1
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RepgeomError(f"{p}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno}); "
                                   "each line of a .jsonl file must be one JSON object") from None
            if not isinstance(record, dict):
                raise RepgeomError(f"{p}:{lineno}: expected a JSON object like {{\"{text_field}\": \"...\"}}, "
                                   f"got {type(record).__name__}")
            if text_field not in record:
                keys = ", ".join(map(repr, list(record)[:10])) or "none"
                raise RepgeomError(f"{p}:{lineno}: no {text_field!r} field (fields: {keys}); "
                                   "pass --text-field NAME to read another field")
            text = record[text_field]
            if not isinstance(text, str):
                raise RepgeomError(f"{p}:{lineno}: field {text_field!r} is a {type(text).__name__}, not a string")
            rid = record.get("id", lineno)
        else:
            n_records += 1
            text, rid = line, lineno
        if text.strip():
            texts.append(text)
            ids.append(rid)
        else:
            skipped.append(rid)
    ts = TextSet(texts, str(p), ids, n_records, skipped)
    if n_records == 0:
        raise RepgeomError(f"data file {str(p)!r} is empty")
    _check_count(ts, min_texts)
    return ts
