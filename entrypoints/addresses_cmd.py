"""``repgeom addresses``: the layer addresses a model supports (or what a layer spec expands to)."""

from __future__ import annotations

import argparse

from .measure_cmd import add_model_args


def configure(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--layers", nargs="+", default=None, help="show what this layer specification resolves to")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from repgeom_eval.modeling.addresses import available_addresses, resolve, resolve_request
    from repgeom_eval.modeling.architectures import SITE_MEANING
    from repgeom_eval.modeling.loading import load_model
    from repgeom_eval.plugin_system.host import get_host

    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    if args.layers:
        points = resolve_request(args.layers, loaded, get_host()).points
    else:
        points = resolve(available_addresses(loaded), loaded)
    table = Table(title=f"{args.model} ({loaded.info.model_type}, {loaded.info.n_layers} blocks)")
    for col in ("address", "hook", "meaning"):
        table.add_column(col)
    for addr, point in points.items():
        table.add_row(str(addr), f"{point.direction} of {point.module_name or '<model>'}",
                      SITE_MEANING.get(addr.site, ""))
    Console().print(table)
    return 0
