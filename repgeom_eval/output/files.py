"""Writing outputs atomically: a reader never sees a half-written file, a failed run leaves nothing behind."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator

from repgeom_eval.errors import RepgeomError


def check_writable(path: str | Path) -> Path:
    """Fail early (before hours of compute) if ``path`` cannot be written."""
    p = Path(path)
    if p.is_dir():
        raise RepgeomError(f"output path {str(p)!r} is a directory; pass a file name")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.exists():
        raise RepgeomError(f"output directory {str(parent)!r} does not exist (for {str(p)!r}); create it first")
    if not parent.is_dir():
        raise RepgeomError(f"cannot write {str(p)!r}: {str(parent)!r} is a file, not a directory")
    try:  # the real test (os.access says yes to root on read-only mounts, and knows nothing of quotas)
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        raise RepgeomError(f"cannot write {str(p)!r}: {exc.strerror or exc}") from None
    return p


def check_creatable_dir(path: str | Path, what: str = "output folder") -> Path:
    """Fail early if the folder ``path`` neither is nor can become a writable directory."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise RepgeomError(f"{what} {str(p)!r} is a file; pass a folder")
    base = p
    while not base.exists():  # the nearest existing ancestor is where the folder would be created
        base = base.parent
    if not base.is_dir():
        raise RepgeomError(f"cannot create {what} {str(p)!r}: {str(base)!r} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as exc:
        raise RepgeomError(f"cannot write {what} {str(p)!r}: {exc.strerror or exc}") from None
    return p


@contextmanager
def atomic_open(path: str | Path, mode: str = "w") -> Iterator[IO[Any]]:
    """Write to a temporary file next to ``path`` and rename it into place only on success."""
    p = check_writable(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent or ".")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp creates 0600; give the file the permissions open() would
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def jsonable(value: Any) -> Any:
    """Plain JSON types; NaN/inf become null (JSON has no NaN)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if hasattr(value, "tolist"):
        return jsonable(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def write_json(path: str | Path, data: Any) -> None:
    with atomic_open(path) as fh:
        json.dump(jsonable(data), fh, indent=2)
        fh.write("\n")


def write_jsonl(path: str | Path, rows: Iterable[Any]) -> None:
    with atomic_open(path) as fh:
        for row in rows:
            fh.write(json.dumps(jsonable(row)) + "\n")
