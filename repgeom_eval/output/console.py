"""Human-readable views of a result: a rich table in the terminal."""

from __future__ import annotations

import math
from typing import Any

from rich.markup import escape
from rich.table import Table


def _fmt(value: Any) -> str:
    if isinstance(value, dict):
        value = value.get("value", next(iter(value.values()), None)) if value else None
    if value is None:
        return "—"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4f}"
    return str(value)


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
        table.add_row(escape(addr), *[_fmt(per_metric.get(m)) for m in metrics])
    return table
