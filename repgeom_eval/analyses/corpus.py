"""A corpus as token chunks: documents (with an optional ``source``) → token ids → fixed-length chunks.

Paper A's unit of analysis is a chunk of ``chunk_len`` = 512 consecutive tokens (docs/metrics.md#corpus-chunks).
Two ways to cut:

* ``concat`` (default; paper A's Wikitext protocol): the documents of one source are tokenized one by one and
  joined into a single token stream, separated by the tokens of a blank line; the stream is cut into consecutive
  ``chunk_len`` slices and the incomplete tail is dropped. Every chunk has exactly ``chunk_len`` tokens, so
  batches need no padding and per-chunk statistics are comparable. Chunks never mix sources.
* ``document`` (paper A's list-type corpora): each document is cut on its own; a document's last chunk is kept if
  it has at least ``min_len`` tokens.

No special tokens are added: chunks after the first had no BOS in paper A's code either
(docs/metrics.md#corpus-chunks).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from repgeom_eval.measurement.texts import data_format, read_jsonl, read_lines
from ..spec.errors import RepgeomError

from repgeom_eval.spec.options.groups import PACKINGS  # noqa: E402 - declared with --packing
NO_SOURCE = "all"  # the source name of records without a source field


@dataclass(frozen=True)
class Document:
    text: str
    source: str
    id: Any


#: What an analysis takes as its texts (load_documents): a file path, or a list of strings, (text, source) pairs or
#: documents.
Texts = str | Path | Sequence[str] | Sequence[tuple[str, str]] | Sequence[Document]


@dataclass(frozen=True)
class Chunk:
    """``ids`` are the token ids; ``doc`` is the id of the document it starts in; ``start`` its token offset there
    (``concat``: in the source's stream)."""

    ids: tuple[int, ...]
    source: str
    doc: Any
    start: int

    def __len__(self) -> int:
        return len(self.ids)


def read_documents(path: str | Path, text_field: str = "text", source_field: str = "source") -> list[Document]:
    """Documents of a ``.jsonl`` file (``text_field``, optional ``source_field`` and ``id``) or a text file (one
    document per line). If any record has ``source_field``, every record must have it (a string)."""
    p = Path(path)
    if not p.exists():
        raise RepgeomError(f"data file {str(path)!r} does not exist")
    if p.is_dir():
        raise RepgeomError(f"data path {str(path)!r} is a directory; pass a .jsonl or .txt file")
    if data_format(p) != "jsonl":
        docs = [Document(line, NO_SOURCE, lineno) for lineno, line in read_lines(p) if line.strip()]
        if not docs:
            raise RepgeomError(f"data file {str(p)!r} has no non-empty text")
        return docs
    docs: list[Document] = []
    with_source: bool | None = None
    for lineno, record in read_jsonl(p):
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            got = type(record).__name__ if not isinstance(record, dict) else (
                f"fields {', '.join(map(repr, list(record)[:10]))}" if text_field not in record
                else f"{text_field!r} is a {type(record[text_field]).__name__}")
            raise RepgeomError(f"{p}:{lineno}: expected a JSON object with a string field {text_field!r} ({got}); "
                               "pass --text-field NAME to read another field")
        has = source_field in record
        if with_source is None:
            with_source = has
        elif has != with_source:
            raise RepgeomError(f"{p}:{lineno}: {'has' if has else 'lacks'} the {source_field!r} field but earlier "
                               f"records {'lack' if has else 'have'} it; give every record a source, or none")
        source = record.get(source_field, NO_SOURCE)
        if not isinstance(source, str) or not source:
            raise RepgeomError(f"{p}:{lineno}: field {source_field!r} must be a non-empty string, got {source!r}")
        if record[text_field].strip():
            docs.append(Document(record[text_field], source, record.get("id", lineno)))
    if not docs:
        raise RepgeomError(f"data file {str(p)!r} has no non-empty text")
    return docs


def as_documents(texts: Sequence[str] | Sequence[tuple[str, str]]) -> list[Document]:
    """In-memory texts, or (text, source) pairs, as documents."""
    out = []
    for i, item in enumerate(texts):
        text, source = (item, NO_SOURCE) if isinstance(item, str) else item
        if text.strip():
            out.append(Document(text, source, i))
    return out


def load_documents(data: Texts, text_field: str = "text", source_field: str = "source") -> tuple[list[Document], str]:
    """(documents, where they came from) for a file path, a list of documents, strings or (text, source) pairs."""
    if isinstance(data, (str, Path)):
        return read_documents(data, text_field, source_field), str(data)
    items = list(data)
    if items and all(isinstance(d, Document) for d in items):
        return items, "<memory>"
    docs = as_documents(items)
    if not docs:
        raise RepgeomError("no non-empty text given")
    return docs, "<memory>"


def tokenize_documents(tokenizer: Any, docs: Sequence[Document], batch: int = 256) -> list[list[int]]:
    """Token ids of every document, without special tokens."""
    out: list[list[int]] = []
    for lo in range(0, len(docs), batch):
        enc = tokenizer([d.text for d in docs[lo:lo + batch]], add_special_tokens=False, verbose=False)
        out.extend(list(x) for x in enc["input_ids"])
    return out


def chunk_documents(
    docs: Sequence[Document],
    token_ids: Sequence[Sequence[int]],
    chunk_len: int,
    packing: str = "concat",
    separator: Sequence[int] = (),
    min_len: int | None = None,
) -> list[Chunk]:
    """Cut tokenized documents into chunks (see the module docstring). Order: sources in first-seen order, then
    position."""
    if chunk_len < 2:
        raise RepgeomError(f"chunk length must be at least 2 tokens, got {chunk_len}")
    if packing not in PACKINGS:
        raise RepgeomError(f"unknown packing {packing!r} (valid: {', '.join(PACKINGS)})")
    min_len = chunk_len if packing == "concat" else max(2, chunk_len // 2 if min_len is None else min_len)
    chunks: list[Chunk] = []
    if packing == "document":
        for doc, ids in zip(docs, token_ids):
            for start in range(0, len(ids), chunk_len):
                piece = tuple(ids[start:start + chunk_len])
                if len(piece) >= min_len:
                    chunks.append(Chunk(piece, doc.source, doc.id, start))
        return chunks
    streams: dict[str, tuple[list[int], list[tuple[int, Any]]]] = {}
    for doc, ids in zip(docs, token_ids):
        stream, starts = streams.setdefault(doc.source, ([], []))
        if stream and separator:
            stream.extend(separator)
        starts.append((len(stream), doc.id))
        stream.extend(ids)
    for source, (stream, starts) in streams.items():
        k = 0
        for start in range(0, len(stream) - chunk_len + 1, chunk_len):
            while k + 1 < len(starts) and starts[k + 1][0] <= start:
                k += 1
            chunks.append(Chunk(tuple(stream[start:start + chunk_len]), source, starts[k][1], start))
    return chunks


def corpus_chunks(
    tokenizer: Any,
    docs: Sequence[Document],
    chunk_len: int,
    packing: str = "concat",
    min_len: int | None = None,
) -> list[Chunk]:
    """``tokenize_documents`` + ``chunk_documents`` with a blank line between the documents of a stream."""
    sep = list(tokenizer("\n\n", add_special_tokens=False)["input_ids"]) if packing == "concat" else []
    return chunk_documents(docs, tokenize_documents(tokenizer, docs), chunk_len, packing, sep, min_len)


def check_context(chunk_len: int, max_positions: int | None) -> None:
    if max_positions and chunk_len > max_positions:
        raise RepgeomError(f"chunk length {chunk_len} exceeds the model context of {max_positions} tokens; "
                           f"pass --chunk-len {max_positions} or less")


def sample_chunks(chunks: Sequence[Chunk], n: int | None, seed: int) -> list[int]:
    """Indices of ``n`` chunks drawn without replacement, ``random.Random(seed).sample`` as paper A (seed 42);
    all chunks, in order, when ``n`` is None or at least the number of chunks."""
    if n is None or n >= len(chunks):
        return list(range(len(chunks)))
    if n < 1:
        raise RepgeomError(f"number of chunks must be positive, got {n}")
    return random.Random(seed).sample(range(len(chunks)), n)


def sample_per_source(chunks: Sequence[Chunk], n: int, seed: int, sources: Sequence[str] = (),
                      what: str = "--per-source") -> list[int]:
    """Indices of ``n`` chunks of every source, drawn without replacement, in chunk order (sources in first-seen
    order). Each source has its own generator, ``random.Random(f"{seed}:{source}")``, so a source's sample does not
    depend on the other sources. ``sources`` names sources that must be there even if they gave no chunk (the
    documents' sources). Raises :class:`RepgeomError` naming every source with fewer than ``n`` chunks."""
    if n < 1:
        raise RepgeomError(f"number of chunks per source must be positive, got {n}")
    by_source: dict[str, list[int]] = {s: [] for s in sources}
    for i, c in enumerate(chunks):
        by_source.setdefault(c.source, []).append(i)
    short = {s: len(rows) for s, rows in by_source.items() if len(rows) < n}
    if short:
        have = ", ".join(f"{s!r} has {k}" for s, k in sorted(short.items(), key=lambda kv: kv[1]))
        fewest = min(short.values())
        fix = (f"ask for at most {fewest} per source" if fewest else
               "leave out the sources without a single chunk, or lower --chunk-len")
        raise RepgeomError(f"{what} {n}: too few chunks in {len(short)} of {len(by_source)} source(s) ({have}); "
                           f"give those sources more text, or {fix}")
    out: list[int] = []
    for source, rows in by_source.items():
        out.extend(sorted(random.Random(f"{seed}:{source}").sample(rows, n)))
    return out


def describe(chunks: Sequence[Chunk], docs: Sequence[Document]) -> dict[str, Any]:
    """Counts for the output's ``data`` block."""
    per_source: dict[str, int] = {}
    for c in chunks:
        per_source[c.source] = per_source.get(c.source, 0) + 1
    return {"n_documents": len(docs), "n_chunks_available": len(chunks), "chunks_per_source": per_source}
