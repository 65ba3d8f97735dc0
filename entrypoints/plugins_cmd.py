"""``repgeom plugins``: everything registered, where it came from (plugin, distribution, version), which plugins
failed and which are switched off."""

from __future__ import annotations

import argparse
import json

from repgeom_eval.spec.options.commands import PluginsCommand


configure = PluginsCommand.add_arguments


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from repgeom_eval.plugin_system.host import get_host

    cfg = PluginsCommand.from_args(args)
    host = get_host()
    rows = [r for r in host.listing() if cfg.kind in (None, r["kind"])]
    if cfg.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title="repgeom-eval plugins")
    for col in ("name", "kind", "plugin", "distribution", "version"):
        table.add_column(col, no_wrap=True)
    table.add_column("description", ratio=1)
    for r in rows:
        style = "red" if "error" in r else "dim" if r.get("disabled") else None
        desc = r.get("error") or r["description"]
        cells = [r["name"], r["kind"], r["plugin"], r["distribution"] or "—", r["version"] or "—", desc]
        table.add_row(*[escape(str(c)) for c in cells], style=style)
    Console(width=max(Console().width, 120)).print(table)
    if host.failures:
        Console(stderr=True).print(f"[red]{len(host.failures)} plugin(s) failed to load[/red] "
                                   "(set REPGEOM_STRICT_PLUGINS=1 to make this fatal)")
    return 0
