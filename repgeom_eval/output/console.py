"""Human-readable views of a result: a rich table in the terminal."""

from __future__ import annotations

import math
import numbers
from typing import Any

from rich.markup import escape
from rich.table import Table


def fmt_number(value: Any, digits: int = 4, *, sign: bool = False, se: Any = None, missing: str = "nan",
               nan: str = "nan") -> str:
    """The one number formatter of every printed table: a real number with ``digits`` decimals (``sign``: always
    signed), ``± se`` when a finite standard error is given; ``missing`` for ``None``, ``nan`` for NaN; integers
    (counts) and anything else as they are."""
    if value is None:
        return missing
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or isinstance(value, numbers.Integral):
        return str(value)
    value = float(value)
    if math.isnan(value):
        return nan
    text = f"{value:{'+' if sign else ''}.{digits}f}"
    if isinstance(se, numbers.Real) and not isinstance(se, bool) and math.isfinite(se):  # else no ± part
        text += f" ± {se:.{digits}f}"
    return text


def _cell(value: Any) -> str:
    """A metric's value in the results table (a metric with several values shows its main one)."""
    if isinstance(value, dict):
        value = value.get("value", next(iter(value.values()), None)) if value else None
    return fmt_number(value, missing="—")


def results_table(results: dict[str, dict[str, Any]], title: str | None = None) -> Table:
    """One row per address, one column per metric."""
    metrics: list[str] = []
    for per_metric in results.values():
        for name in per_metric:
            if name not in metrics:
                metrics.append(name)
    table = Table(title=escape(title) if title else None)
    table.add_column("address", style="bold")
    for m in metrics:
        table.add_column(m, justify="right")
    for addr, per_metric in results.items():
        table.add_row(escape(addr), *[_cell(per_metric.get(m)) for m in metrics])
    return table
