"""Writing outputs atomically: a reader never sees a half-written file, a failed run leaves nothing behind.

Three guarantees, used by every command's ``run``:

* :func:`check_outputs` refuses, before any compute, an output that would replace an input (the same file, through a
  link or not), an output inside a model folder being read, and two outputs of one run on the same path;
* :func:`atomic_open` writes next to the target and renames into place only when the write succeeded; a full disk or
  a file-size limit is one :class:`RepgeomError` line, and the half-written file is removed;
* :func:`commit_together` holds back the renames of a run's outputs until the run has succeeded, so a run that
  fails after writing its first output leaves none of them.
"""

from __future__ import annotations

import errno
import json
import math
import os
import tempfile
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator, Union

from repgeom_eval.spec.errors import RepgeomError


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


# -- outputs never replace inputs ----------------------------------------------------------------------------------

PathArg = Union[str, os.PathLike, None]
PathsArg = Union[PathArg, Iterable[PathArg]]


def _paths(value: PathsArg) -> list[str]:
    """One path or several (a list of models), as strings; None and "" are left out."""
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        return [os.fspath(value)] if os.fspath(value) else []
    return [os.fspath(v) for v in value if v is not None and os.fspath(v)]


def _resolved(path: str) -> Path:
    return Path(os.path.abspath(os.path.expanduser(path))).resolve()


def _same_file(a: str, b: str) -> bool:
    """The same path once links are followed, or the same inode (a hard link, a bind mount, a case-insensitive
    file system)."""
    if _resolved(a) == _resolved(b):
        return True
    try:
        return os.path.samefile(os.path.expanduser(a), os.path.expanduser(b))
    except OSError:  # one of them does not exist (yet): then only the resolved paths can tell
        return False


def _inside(path: str, folder: str) -> bool:
    """Whether ``path`` lies strictly inside ``folder`` (links followed; an ancestor that is ``folder``'s inode
    counts, so a hard-linked or bind-mounted view of the folder is caught as well)."""
    child, top = _resolved(path), _resolved(folder)
    if top in child.parents:
        return True
    if not os.path.isdir(top):
        return False
    try:
        top_stat = os.stat(top)
    except OSError:
        return False
    for parent in child.parents:
        try:
            st = os.stat(parent)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (top_stat.st_dev, top_stat.st_ino):
            return True
    return False


def check_outputs(outputs: Mapping[str, PathsArg], inputs: Mapping[str, PathsArg] | None = None,
                  folders: Mapping[str, PathsArg] | None = None) -> None:
    """Refuse, before any compute, an output that would destroy an input (docs/reference/outputs.md#no-output-replaces-an-input).

    ``outputs``: label (the option, e.g. ``"--per-text"``) → the path(s) the run writes: files, or folders the run
    creates or replaces whole (``train``'s ``output_dir/model``). For a folder the run only adds files to (a kNN
    store, a run directory, a plot folder), pass the files it writes there. ``inputs``: label → the files (or
    folders) the run reads. ``folders``: label → folders being read, such as a model directory, inside which
    nothing may be written. A value may be one path or a list of paths; None is skipped.

    Refused, with one line naming both sides: an output that is the same file as an input (compared after following
    symbolic links, and by inode, so hard links count), an input inside an output folder, an output equal to or
    inside a read folder (or a read folder inside an output folder), and two outputs on the same path.
    """
    outs = [(label, p) for label, value in outputs.items() for p in _paths(value)]
    ins = [(label, p) for label, value in (inputs or {}).items() for p in _paths(value)]
    dirs = [(label, p) for label, value in (folders or {}).items() for p in _paths(value)]
    for i, (label, out) in enumerate(outs):
        for other_label, other in outs[:i]:
            if _same_file(out, other) and not is_stream(out):  # two outputs to /dev/null replace nothing
                same = f"the same path {out!r}" if out == other else f"the same file ({other!r} and {out!r})"
                raise RepgeomError(f"{other_label} and {label} are {same}; give each output its own path")
        for in_label, src in ins:
            if _same_file(out, src):
                how = "" if out == src else f" ({out!r} is {src!r})"
                raise RepgeomError(f"refusing to write {label} {out!r}: it is the {in_label} input{how}, which would "
                                   f"be destroyed; choose another path for {label}")
            if _inside(src, out):
                raise RepgeomError(f"refusing to write {label} {out!r}: it holds the {in_label} input {src!r}, "
                                   f"which would be destroyed; choose another path for {label}")
        for dir_label, folder in dirs:
            if _same_file(out, folder) or _inside(out, folder):
                raise RepgeomError(f"refusing to write {label} {out!r} inside the {dir_label} folder {folder!r} "
                                   f"that is being read; choose a path outside it")
            if _inside(folder, out):
                raise RepgeomError(f"refusing to write {label} {out!r}: it holds the {dir_label} folder "
                                   f"{folder!r} that is being read; choose another path for {label}")


# -- writing --------------------------------------------------------------------------------------------------------

# What a failed write means to the user: a full disk and a file-size limit are not bugs, so they get one line.
_WRITE_ERRORS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EFBIG: "the file would exceed the file-size limit (ulimit -f) or the file system's maximum",
    errno.EROFS: "the file system is read-only",
    errno.EIO: "input/output error on the device",
}


def write_error(path: str | Path, exc: OSError) -> RepgeomError | None:
    """The one-line error for a failed write of ``path``, or None if ``exc`` is not a write failure."""
    why = _WRITE_ERRORS.get(exc.errno or -1)
    if why is None:
        return None
    return RepgeomError(f"cannot write {str(path)!r}: {why}; nothing was written")


class _Group:
    """Outputs whose renames wait for the end of a run (see :func:`commit_together`)."""

    def __init__(self, paths: Iterable[PathArg]):
        self.paths = {_key(p) for p in _paths(list(paths))}
        self.pending: dict[str, tuple[str, Path]] = {}

    def defer(self, tmp: str, final: Path) -> None:
        old = self.pending.pop(_key(final), None)
        if old is not None:  # written twice in one run: the last version wins
            _unlink(old[0])
        self.pending[_key(final)] = (tmp, final)

    def discard(self) -> None:
        for tmp, _ in self.pending.values():
            _unlink(tmp)
        self.pending.clear()


_GROUPS: list[_Group] = []


def _key(path: PathArg) -> str:
    """A path as the file it names (links followed): a run's outputs are matched by where they land."""
    return os.path.realpath(os.path.expanduser(os.fspath(path)))  # type: ignore[arg-type]


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@contextmanager
def commit_together(paths: Iterable[PathArg]) -> Iterator[None]:
    """Within the block, :func:`atomic_open` writes to any of ``paths`` stay in their temporary files; they are
    renamed into place together when the block ends without an error, and deleted otherwise. A run that fails
    after writing its first output (a full disk while writing the second, an error in a plot) leaves no output.

    Only the listed paths wait: checkpoints and caches written meanwhile land at once, as they must.
    """
    group = _Group(paths)
    _GROUPS.append(group)
    try:
        yield
    except BaseException:
        group.discard()
        raise
    finally:
        _GROUPS.remove(group)
    items = list(group.pending.values())
    for i, (tmp, final) in enumerate(items):
        try:
            os.replace(tmp, final)
        except OSError as exc:
            for later, _ in items[i:]:
                _unlink(later)
            raise (write_error(final, exc) or RepgeomError(
                f"cannot write {str(final)!r}: {exc.strerror or exc}")) from None
    group.pending.clear()


def is_stream(path: str | Path) -> bool:
    """An existing target that is not a regular file, links followed: a device (``/dev/null``), a FIFO, a socket,
    ``/dev/stdout``. Such a target is written in place, never replaced (a rename over it would put a regular file
    where the device node was)."""
    import stat

    try:
        mode = os.stat(os.path.expanduser(os.fspath(path))).st_mode  # links followed (/dev/stdout → a pipe)
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


@contextmanager
def _write_in_place(path: str | Path, mode: str) -> Iterator[IO[Any]]:
    try:
        with open(os.path.expanduser(os.fspath(path)), mode, encoding=None if "b" in mode else "utf-8") as fh:
            yield fh
    except OSError as exc:
        clean = write_error(path, exc)
        raise (clean or RepgeomError(f"cannot write {str(path)!r}: {exc.strerror or exc}")) from None


@contextmanager
def atomic_open(path: str | Path, mode: str = "w") -> Iterator[IO[Any]]:
    """Write to a temporary file next to ``path`` and rename it into place only on success (inside
    :func:`commit_together`, when the whole run has succeeded). A full disk or a file-size limit is a one-line
    :class:`RepgeomError`; the temporary file is removed either way.

    A symbolic link is followed (the file it points to is replaced, the link stays); a target that is no regular
    file (:func:`is_stream`: ``/dev/null``, ``/dev/stdout``, a FIFO) is written in place, as ``open`` would."""
    if is_stream(path):
        with _write_in_place(path, mode) as fh:
            yield fh
        return
    p = check_writable(Path(os.path.realpath(os.path.expanduser(os.fspath(path)))))
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent or ".")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp creates 0600; give the file the permissions open() would
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        group = next((g for g in reversed(_GROUPS) if _key(p) in g.paths), None)
        if group is not None:
            group.defer(tmp, p)
        else:
            os.replace(tmp, p)
    except OSError as exc:
        _unlink(tmp)
        clean = write_error(p, exc)
        if clean is None:
            raise
        raise clean from None
    except BaseException:
        _unlink(tmp)
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
