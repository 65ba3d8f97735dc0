"""``repgeom addresses``: what the load check found on a model (blocks, each address's hook and how it was checked,
refused sites with their reasons), or what a layer specification resolves to."""

from __future__ import annotations

import argparse
import json

from repgeom_eval.spec.options.model import ModelOptions
from repgeom_eval.spec.options.commands import AddressesCommand


configure = AddressesCommand.add_arguments


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from repgeom_eval.modeling.addresses import resolve_request
    from repgeom_eval.modeling.architectures import SITE_MEANING, SITES
    from repgeom_eval.modeling.discovery import describe
    from repgeom_eval.modeling.loading import load_model
    from repgeom_eval.plugin_system.host import get_host

    cfg = AddressesCommand.from_args(args)
    loaded = load_model(cfg.model, options=ModelOptions.of(cfg))
    layout = loaded.layout
    rows: list[tuple[str, object, str]] = []  # (address, site, meaning)
    if cfg.layers:
        plan = resolve_request(list(cfg.layers), loaded, get_host())
        for addr in plan.addresses:
            rows.append((str(addr), _site(layout, addr), SITE_MEANING.get(addr.site, "")))
    else:
        rows.append(("embed", layout.embed, SITE_MEANING["embed"]))
        for layer, block in enumerate(layout.sites):
            rows += [(f"{s}:{layer}", block[s], SITE_MEANING[s]) for s in SITES]
        rows.append(("final", layout.final, SITE_MEANING["final"]))
    if cfg.json:
        doc = dict(describe(layout))
        doc["addresses"] = [{"address": a, "hook": str(site.point) if site.point else None, "ok": site.ok,
                             "verified": site.ok and site.verified,
                             "check" if site.ok else "refused": site.note} for a, site, _ in rows]
        print(json.dumps(doc, indent=2))
        return 0
    import sys

    console = Console(width=None if sys.stdout.isatty() else 200)  # logs and pipes get whole lines
    facts = describe(layout)
    console.print(f"[bold]{cfg.model}[/bold]: {loaded.info.architecture} ({layout.model_type}), "
                  f"{layout.n_layers} blocks at [cyan]{layout.blocks or '(none: hidden_states only)'}[/cyan]"
                  + (f", table {layout.table!r} applied" if layout.table else ", found by reading the model"))
    console.print(f"blocks: {', '.join(facts['block_kinds'])}; causal: {layout.causal}; position ids from the mask: "
                  f"{layout.position_ids}; padding that leaves hidden states unchanged: "
                  f"{', '.join(layout.padding_sides) or 'none (texts run one at a time)'}")
    console.print("hidden_states[k]: " + ", ".join(f"[{k}] {a or '?'}" for k, a in enumerate(layout.hidden_states)))
    for note in layout.notes:
        console.print(f"note: {note}")
    table = Table(title="addresses (✓ passed the load check, ? served from a plugin's table, not verified, "
                        "✗ refused)")
    for col in ("address", "hook", "check / reason refused"):
        table.add_column(col, overflow="fold")
    for name, site, _ in rows:
        mark = "✗ " if not site.ok else "✓ " if site.verified else "? "
        table.add_row(mark + name, str(site.point) if site.point else "—", site.note)
    console.print(table)
    shown = dict.fromkeys(name.partition(":")[0] for name, _, _ in rows)
    console.print("\n".join(f"  {site:<10} {SITE_MEANING[site]}" for site in shown if site in SITE_MEANING))
    return 0


def _site(layout, addr):
    if addr.site == "embed":
        return layout.embed
    if addr.site == "final":
        return layout.final
    return layout.sites[addr.layer][addr.site]
