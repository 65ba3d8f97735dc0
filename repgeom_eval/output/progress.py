"""Progress of long runs, visible on a terminal and in logs alike: every progress bar of repgeom-eval is made here.

``--progress`` (the shared run options, repgeom_eval/spec/options/groups.py) takes

* ``auto`` (default): a bar on a terminal; otherwise (a log file, a pipe, a batch job) plain lines on stderr, one
  every 30 seconds or every 10 % of the work, whichever comes first, and one when the work is done;
* ``always``: a bar, even into a file;
* ``never``: nothing.

From Python, ``progress=True`` is ``auto`` (or the mode of an enclosing :func:`progress_mode`), ``progress=False``
is ``never``. :func:`progress_bar` returns a tqdm bar or a :class:`LineProgress` with the part of tqdm's interface
the commands use (``update``, ``set_description``, ``set_postfix``, ``set_postfix_str``, ``write``, ``close``, ``n``,
``total``, a context manager, iteration), so a caller does not care which.
"""

from __future__ import annotations

import contextvars
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from repgeom_eval.spec.errors import RepgeomError

PROGRESS_MODES = ("auto", "always", "never")
LINE_EVERY_S = 30.0  # auto, not a terminal: a line at least this often ...
LINE_EVERY_FRACTION = 0.1  # ... and at every 10 % of the total
_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("repgeom_progress_mode", default="auto")


def mode_of(progress: Any = None) -> str:
    """``auto``, ``always`` or ``never`` from a mode or a boolean (``None``/``True``: the current default mode)."""
    if progress is None or progress is True:
        return _MODE.get()
    if progress is False:
        return "never"
    if isinstance(progress, str) and progress in PROGRESS_MODES:
        return progress
    raise RepgeomError(f"--progress: unknown value {progress!r} (valid: {', '.join(PROGRESS_MODES)})")


@contextmanager
def progress_mode(progress: Any) -> Iterator[str]:
    """Within the block, bars made with ``progress=True`` (or without ``progress``) follow ``progress``'s mode:
    how a command's ``--progress`` reaches code that takes a plain on/off switch."""
    token = _MODE.set(mode_of(progress))
    try:
        yield _MODE.get()
    finally:
        _MODE.reset(token)


def duration(seconds: float) -> str:
    """A duration as people read it: ``0.42s``, ``7.5s``, ``42s``, ``3m05s``, ``2h03m00s``."""
    if seconds < 1:
        return f"{max(seconds, 0):.2f}s"
    if seconds < 10:
        return f"{seconds:.1f}s"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class LineProgress:
    """Progress as plain lines (``repgeom: desc: 40/100 seq (40%), 12s elapsed, about 18s left``): for logs."""

    def __init__(self, iterable: Iterable[Any] | None = None, total: float | None = None, desc: str | None = None,
                 unit: str = "it", stream: Any = None, every_s: float = LINE_EVERY_S,
                 every_fraction: float = LINE_EVERY_FRACTION, clock: Any = time.monotonic):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc or "progress", unit
        self.stream, self.every_s, self.every_fraction, self.clock = stream, every_s, every_fraction, clock
        self.n = 0
        self.postfix = ""
        self.start = self._last = clock()
        self._next_step = every_fraction
        self.closed = False

    # what the callers of a tqdm bar use
    def update(self, n: float = 1) -> None:
        self.n += n
        now = self.clock()
        fraction = self.n / self.total if self.total else None
        if fraction is not None and fraction >= 1:
            return  # the last line is close()'s: "done in ..."
        if fraction is not None and fraction >= self._next_step:
            while self._next_step <= fraction:
                self._next_step += self.every_fraction
            self._emit(now)
        elif now - self._last >= self.every_s:
            self._emit(now)

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or self.desc

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
        items = {**dict(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = str(s)

    def write(self, s: str) -> None:
        print(s, file=self._stream, flush=True)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.n:
                self._emit(self.clock(), done=True)

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __iter__(self) -> Iterator[Any]:
        for item in self.iterable or ():
            yield item
            self.update(1)
        self.close()

    # the line
    @property
    def _stream(self) -> Any:
        return self.stream or sys.stderr

    def line(self, now: float, done: bool = False) -> str:
        elapsed = now - self.start
        count = f"{self.n:g}" + (f"/{self.total:g}" if self.total else "") + f" {self.unit}"
        if self.total:
            count += f" ({100 * self.n / self.total:.0f}%)"
        timing = f"{duration(elapsed)} elapsed"
        if done:
            timing = f"done in {duration(elapsed)}"
        elif self.total and 0 < self.n < self.total:
            timing += f", about {duration(elapsed * (self.total - self.n) / self.n)} left"
        return f"repgeom: {self.desc}: {count}, {timing}" + (f" [{self.postfix}]" if self.postfix else "")

    def _emit(self, now: float, done: bool = False) -> None:
        self._last = now
        print(self.line(now, done), file=self._stream, flush=True)


def progress_bar(iterable: Iterable[Any] | None = None, *, progress: Any = None, total: float | None = None,
                 desc: str | None = None, unit: str = "it", leave: bool = False, disable: bool = False,
                 **tqdm_kwargs: Any) -> Any:
    """A progress bar in the mode of ``progress`` (module docstring); ``disable=True`` is silent whatever the mode
    (e.g. on a rank > 0 of a distributed run). Takes tqdm's keywords (``total``, ``desc``, ``unit``, ``leave`` ...)."""
    from tqdm.auto import tqdm

    mode = mode_of(progress)
    if disable or mode == "never":
        return tqdm(iterable, total=total, disable=True)
    if mode == "always" or sys.stderr.isatty():
        return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, **tqdm_kwargs)
    return LineProgress(iterable, total=total, desc=desc, unit=unit)
