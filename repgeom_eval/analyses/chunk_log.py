"""Resumable per-chunk runs: every chunk's values appended to a run directory as they are computed.

``repgeom ppl-bins --run-dir DIR`` writes ``DIR/run.json`` (the run's key: the model's identity, a hash of the sampled
chunks' token ids, the addresses, the chunk length, the batch size and the dtype) and appends one line per finished
chunk to ``DIR/chunks.jsonl``, flushed to disk after every batch. ``--resume`` reads the lines back and computes only
the missing chunks, in the same batches as an uninterrupted run, so the numbers are the same (floats are written
with ``repr``, which round-trips float64 exactly). A torn last line (a kill mid-write) is dropped and recomputed; a
key that does not match is reported, never silently reused.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.output.files import write_json

KEY_FILE, ROWS_FILE = "run.json", "chunks.jsonl"


def run_files(folder: str | Path) -> list[str]:
    """The files a run writes into its ``--run-dir`` (for the outputs guard: none may replace an input)."""
    return [str(Path(folder) / KEY_FILE), str(Path(folder) / ROWS_FILE)]


def chunks_digest(chunks: Sequence[Any]) -> str:
    """sha256 of the sampled chunks' token ids in order: the data, the tokenizer, the sampling seed and the chunk
    length all change it."""
    digest = hashlib.sha256()
    for c in chunks:
        digest.update(",".join(map(str, c.ids)).encode())
        digest.update(b";")
    return "sha256:" + digest.hexdigest()


class ChunkLog:
    """The rows already computed (``done``: chunk index → (perplexity, dispersion per address)) and an append-only
    file for the rest."""

    def __init__(self, folder: Path, done: dict[int, tuple[float, list[float]]]) -> None:
        self.folder = folder
        self.done = done
        self._fh = (folder / ROWS_FILE).open("a", encoding="utf-8")

    @classmethod
    def open(cls, folder: str | Path, key: dict[str, Any], resume: bool) -> "ChunkLog":
        folder = Path(folder)
        key_file = folder / KEY_FILE
        if not resume:
            if key_file.exists():
                raise RepgeomError(f"--run-dir {folder} already holds a run ({key_file}); add --resume to continue "
                                   "it, or give an empty folder")
            folder.mkdir(parents=True, exist_ok=True)
            write_json(key_file, key)
            (folder / ROWS_FILE).write_text("", encoding="utf-8")
            return cls(folder, {})
        if not key_file.is_file():
            raise RepgeomError(f"--resume: {folder} holds no run to continue (no {KEY_FILE}); run once with "
                               f"--run-dir {folder} and without --resume")
        try:
            saved = json.loads(key_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise RepgeomError(f"--resume: cannot read {key_file} ({exc}); start again with an empty --run-dir") \
                from exc
        differ = sorted(k for k in set(saved) | set(key) if saved.get(k) != key.get(k))
        if differ:
            shown = "; ".join(f"{k}: run {saved.get(k)!r}, now {key.get(k)!r}" for k in differ)
            raise RepgeomError(f"--resume: {folder} holds another run ({shown}); give the same model, data and "
                               "options, or an empty --run-dir")
        done = read_rows(folder / ROWS_FILE, len(key["addresses"]))
        # rewrite without a torn last line, so that the next append starts on a line of its own
        tmp = folder / (ROWS_FILE + ".tmp")
        tmp.write_text("".join(row_line(i, p, d) for i, (p, d) in sorted(done.items())), encoding="utf-8")
        os.replace(tmp, folder / ROWS_FILE)
        return cls(folder, done)

    def append(self, rows: Sequence[int], ppl: Sequence[float], disp: Sequence[Sequence[float]]) -> None:
        """Record finished chunks; on disk before the next batch starts."""
        for i, p, d in zip(rows, ppl, disp):
            self._fh.write(row_line(i, p, d))
            self.done[int(i)] = (float(p), [float(x) for x in d])
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()


def row_line(i: int, ppl: float, disp: Sequence[float]) -> str:
    return json.dumps({"chunk": int(i), "ppl": float(ppl), "dispersion": [float(x) for x in disp]}) + "\n"


def read_rows(path: Path, width: int) -> dict[int, tuple[float, list[float]]]:
    """The complete lines of ``path``; a torn or malformed line is skipped (its chunk is computed again)."""
    done: dict[int, tuple[float, list[float]]] = {}
    if not path.is_file():
        return done
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
            ppl, disp = float(row["ppl"]), [float(x) for x in row["dispersion"]]
        except (ValueError, KeyError, TypeError):
            continue
        if len(disp) == width:
            done[int(row["chunk"])] = (ppl, disp)
    return done
