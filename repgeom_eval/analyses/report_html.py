"""The HTML pieces of ``repgeom report`` (repgeom_eval/analyses/html_report.py): escaped text with inline Markdown
(``code``, **bold**), tables whose time columns read as durations, embedded PNG figures, and the fallback section
of a result no renderer knows."""

from __future__ import annotations

import base64
import html
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from repgeom_eval.output.progress import duration

_CODE = re.compile(r"(`+)(.+?)\1")
_BOLD = re.compile(r"\*\*(.+?)\*\*")
# a column of seconds: "seconds", "wall s", "lm_eval wall s", "time (s)", "s/step", "total_s" ...
_SECONDS = re.compile(r"(^|[\s_(])(seconds|secs?|s|s/step)\)?$|^time$", re.I)


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def md(text: Any) -> str:
    """``text`` escaped, with Markdown's inline code (`` `x` ``) and bold (``**x**``) rendered, not shown raw."""
    out = esc(text)
    out = _CODE.sub(lambda m: f"<code>{m.group(2)}</code>", out)
    return _BOLD.sub(lambda m: f"<strong>{m.group(1)}</strong>", out)


def fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"{value:.{digits}g}" if abs(value) >= 1e4 or (value and abs(value) < 1e-3) else f"{value:.{digits}f}"
    return str(value)


def is_seconds(header: str) -> bool:
    """Whether a column holds seconds (its values are then shown as durations: ``2m24s``, ``9.7s``)."""
    return bool(_SECONDS.search(str(header).strip()))


def cell(value: Any, seconds: bool | str = False) -> str:
    if seconds == "ratio" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return esc(f"{value:.1f}×")
    if seconds and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return esc(duration(float(value)))
    return md(fmt(value)) if isinstance(value, str) else esc(fmt(value))


def _ratio(row: Sequence[Any]) -> bool:
    """A row of a seconds column that holds a ratio of two times (``evaluation wall / screen wall``)."""
    return bool(row) and isinstance(row[0], str) and (" / " in row[0] or "ratio" in row[0].lower())


def _kind(times: list[bool], i: int, row: Sequence[Any]) -> bool | str:
    """How cell ``i`` of ``row`` reads: a duration (a seconds column), a ratio (such a column's ratio row), as is."""
    if i >= len(times) or not times[i]:
        return False
    return "ratio" if _ratio(row) else True


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    times = [is_seconds(h) for h in header]
    head = "".join(f"<th>{md(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(c, _kind(times, i, row))}</td>" for i, c in enumerate(row))
                   + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def figure(fig: Any, alt: str) -> str:
    from . import plots

    data = base64.b64encode(plots.png_bytes(fig)).decode("ascii")
    return f'<img alt="{esc(alt)}" src="data:image/png;base64,{data}">'


def png_file(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{esc(alt)}" src="data:image/png;base64,{data}">'


def para(text: str) -> str:
    return f"<p>{md(text)}</p>"


def bullets(lines: Sequence[str]) -> str:
    return "<ul>" + "".join(f"<li>{md(line)}</li>" for line in lines) + "</ul>"


def generic(doc: dict[str, Any]) -> list[str]:
    """A result of a kind no renderer knows: its config and results as escaped JSON."""
    shown = {k: doc.get(k) for k in ("config", "results") if k in doc}
    text = json.dumps(shown, indent=1, default=str)
    if len(text) > 20000:
        text = text[:20000] + "\n... (truncated)"
    return [para("No renderer for this kind; its config and results:"), f"<pre>{esc(text)}</pre>"]
