"""Per-query vectors with correctness labels, read from lm-eval's samples output or from a JSONL + vector file.

* lm-eval ``--log_samples`` output of a repgeom hardness task: a ``samples_<task>_<date>.jsonl`` file, or the
  ``--output_path`` folder holding it. Each record's ``repgeom_slice_spearman`` field carries the query's vector
  (base64 float32), its correctness, the gold answer's perplexity (``ppl``: the per-token perplexity of the correct
  choice given the prompt) and the prompt's own perplexity (``prompt_ppl``; absent from samples written before it
  existed).
* Any JSONL with one record per query (a ``correct`` field: true/false or 0/1; optionally ``ppl`` and
  ``prompt_ppl``) together with a vector file holding one row per record, in the same order: ``.npy`` ([N, d]) or
  ``.safetensors`` (one tensor).
"""

from __future__ import annotations

import base64
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.measurement.texts import read_jsonl

SAMPLES_FIELD = "repgeom_slice_spearman"


def encode_vector(vector: np.ndarray) -> str:
    """float32 little-endian bytes, base64: exact, about 5.3 bytes per dimension in a samples file."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def decode_vector(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<f4")


@dataclass
class Queries:
    vectors: np.ndarray  # [N, d]
    correct: np.ndarray  # [N] float 0/1
    ppl: np.ndarray | None  # [N] or None: the gold answer's perplexity given the prompt
    source: str
    prompt_ppl: np.ndarray | None = None  # [N] or None: the prompt's own perplexity


def _json_lines(path: Path) -> list[tuple[int, dict]]:
    """The records of a samples or queries file with their line numbers; its schema: one JSON object per line."""
    records = []
    for lineno, record in read_jsonl(path):
        if not isinstance(record, dict):
            raise RepgeomError(f"{path}:{lineno}: expected a JSON object per line")
        records.append((lineno, record))
    if not records:
        raise RepgeomError(f"{path} holds no records")
    return records


def _check_vector(vector: np.ndarray, where: str) -> np.ndarray:
    """A query vector the slices can use: finite, and not all zeros (a zero vector has no direction, so its cosine
    distance to anything is undefined)."""
    if not np.isfinite(vector).all():
        raise RepgeomError(f"{where}: the vector has {int((~np.isfinite(vector)).sum())} NaN or infinite value(s)")
    if not np.any(vector):
        raise RepgeomError(f"{where}: the vector is all zeros (no direction, so no cosine distance)")
    return vector


def find_samples_file(folder: Path, task: str | None) -> Path:
    """The newest ``samples_<task>_*.jsonl`` under an lm-eval output folder."""
    found = sorted(folder.rglob("samples_*.jsonl"))
    if task:
        found = [p for p in found if p.name.startswith(f"samples_{task}_")]
    if not found:
        raise RepgeomError(f"no lm-eval samples file{f' of task {task!r}' if task else ''} under {str(folder)!r}; "
                           "run lm_eval with --log_samples --output_path DIR")
    tasks = sorted({p.name[len("samples_"):].rsplit("_", 1)[0] for p in found})
    if len(tasks) > 1:
        raise RepgeomError(f"{str(folder)!r} holds samples of several tasks ({', '.join(tasks)}); choose one with "
                           "--task")
    return max(found, key=lambda p: (p.name, str(p)))  # lm-eval's file names end with a sortable date


def from_samples(path: str | Path, task: str | None = None) -> Queries:
    """Queries from lm-eval samples output (a file, or an ``--output_path`` folder)."""
    p = Path(path)
    if p.is_dir():
        p = find_samples_file(p, task)
    elif not p.is_file():
        raise RepgeomError(f"{str(path)!r} does not exist")
    records = _json_lines(p)
    vectors, correct, ppl, prompt_ppl = [], [], [], []
    for lineno, record in records:
        where = f"{p}:{lineno}"
        item = record.get(SAMPLES_FIELD)
        if not isinstance(item, dict) or "vector" not in item:
            raise RepgeomError(f"{where}: no {SAMPLES_FIELD} vector; the file must come from a repgeom_hardness_* "
                               "task run with --log_samples (and that metric kept)")
        try:
            vector = decode_vector(item["vector"])
        except (TypeError, ValueError) as exc:
            raise RepgeomError(f"{where}: {SAMPLES_FIELD}.vector is not a base64 float32 vector ({exc})") from None
        vectors.append(_check_vector(vector.astype(np.float64), f"{where}: {SAMPLES_FIELD}.vector"))
        correct.append(_truth(item.get("correct"), f"{where}: {SAMPLES_FIELD}.correct"))
        ppl.append(_perplexity(item.get("ppl"), f"{where}: {SAMPLES_FIELD}.ppl"))
        prompt_ppl.append(_perplexity(item.get("prompt_ppl"), f"{where}: {SAMPLES_FIELD}.prompt_ppl"))
    if len({len(v) for v in vectors}) != 1:
        raise RepgeomError(f"{p}: the vectors do not all have the same length")
    lines = [n for n, _ in records]
    return Queries(np.stack(vectors), np.asarray(correct), _column(ppl, lines, p, "ppl"), str(p),
                   _column(prompt_ppl, lines, p, "prompt_ppl"))


def _perplexity(value: object, where: str) -> float:
    """A perplexity: a positive finite number, or None (not known: NaN here)."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise RepgeomError(f"{where}: a perplexity must be a positive finite number, got {value!r}")
    return float(value)


def _column(values: list[float], lines: list[int], path: Path, field: str) -> np.ndarray | None:
    """The values, or None when none of them is known (a field the input does not have). Known on some records only
    (a one-token prompt has no perplexity of its own) is said once: slice means use the records that have it."""
    known = [math.isfinite(x) for x in values]
    if not any(known):
        return None
    if not all(known):
        missing = known.index(False)
        warnings.warn(f"{path}: {len(known) - sum(known)} of {len(known)} records have no {field} (the first at line "
                      f"{lines[missing]}); slice means of {field} use the records that have it", stacklevel=3)
    return np.asarray(values)


def _load_vectors(path: Path) -> np.ndarray:
    if not path.is_file():
        raise RepgeomError(f"vector file {str(path)!r} does not exist")
    if path.suffix == ".npy":
        try:
            array = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise RepgeomError(f"{path}: not a numeric .npy array ({str(exc).splitlines()[0][:160]}); write it with "
                               "numpy.save") from None
    elif path.suffix == ".safetensors":
        from safetensors.numpy import load_file

        try:
            tensors = load_file(str(path))
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError (and OSError, ...)
            raise RepgeomError(f"{path}: not a readable .safetensors file ({str(exc).splitlines()[0][:160]}); "
                               "write it with safetensors.numpy.save_file") from None
        if len(tensors) != 1:
            raise RepgeomError(f"{path} holds {len(tensors)} tensors ({', '.join(tensors)}); expected exactly one")
        array = next(iter(tensors.values()))
    else:
        raise RepgeomError(f"vector file {str(path)!r}: expected .npy or .safetensors")
    if array.ndim != 2:
        raise RepgeomError(f"{path}: expected an [N, d] array, got shape {tuple(array.shape)}")
    return np.asarray(array, dtype=np.float64)


def _truth(value: object, where: str) -> float:
    if isinstance(value, bool) or (isinstance(value, (int, float)) and value in (0, 1)):
        return float(value)
    raise RepgeomError(f"{where}: correct must be true/false or 0/1, got {value!r}")


def from_vector_file(queries: str | Path, vectors: str | Path, correct_field: str = "correct",
                     ppl_field: str = "ppl", prompt_ppl_field: str = "prompt_ppl") -> Queries:
    """Queries from a JSONL (correctness, optional answer and prompt perplexities) and a vector file, row i ↔
    record i."""
    qp, vp = Path(queries), Path(vectors)
    if qp.is_dir():
        raise RepgeomError(f"queries file {str(qp)!r} is a directory; with --vectors, pass the JSONL file itself")
    if not qp.is_file():
        raise RepgeomError(f"queries file {str(qp)!r} does not exist")
    records = _json_lines(qp)
    array = _load_vectors(vp)
    if len(array) != len(records):
        raise RepgeomError(f"{vp} has {len(array)} vectors but {qp} has {len(records)} records; they must match "
                           "row for row")
    correct, ppl, prompt_ppl = [], [], []
    for row, (lineno, record) in enumerate(records):
        where = f"{qp}:{lineno}"
        if correct_field not in record:
            raise RepgeomError(f"{where}: no {correct_field!r} field (use --correct-field)")
        correct.append(_truth(record[correct_field], f"{where}: {correct_field}"))
        ppl.append(_perplexity(record.get(ppl_field), f"{where}: {ppl_field}"))
        prompt_ppl.append(_perplexity(record.get(prompt_ppl_field), f"{where}: {prompt_ppl_field}"))
        _check_vector(array[row], f"{vp}: row {row} (the vector of {where})")
    lines = [n for n, _ in records]
    return Queries(array, np.asarray(correct), _column(ppl, lines, qp, ppl_field), str(qp),
                   _column(prompt_ppl, lines, qp, prompt_ppl_field))
