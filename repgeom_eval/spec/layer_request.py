"""The layer-request grammar as strings (docs/metrics.md#layer-addresses): the one split of a request into its
items, for every surface (``repgeom measure --layers``, ``repgeom mteb run --layer``, lm-eval's
``repgeom_layer``/``repgeom_layers``, the Python keywords). Standard library only: a command checks a request's
syntax before torch or a model loads; repgeom_eval/modeling/addresses.py resolves the items against a model.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass

from repgeom_eval.spec.errors import RepgeomError

AUTO = "auto"
#: the one name under which every output records a layer request as given (its items, as :func:`layer_request`
#: split them); ``layers`` are canonical addresses, ``layer`` is one (docs/metrics.md#layer-addresses)
REQUEST_KEY = "layer_request"
AUTO_ELSEWHERE = ("layer 'auto' is the layer pick of `repgeom mteb run --layer auto` (docs/picks.md); name the "
                  "layers here (final, all, resid_post:[0,-1], ...)")


@dataclass(frozen=True)
class LayerRequest:
    """A layer request split into its items by :func:`layer_request`: what every surface hands on."""

    items: tuple[str, ...]

    @property
    def auto(self) -> bool:
        """Whether this is the layer pick (``auto``, which :func:`layer_request` allows only alone)."""
        return self.items == (AUTO,)

    def record(self) -> list[str]:
        """The request as an output records it, under :data:`REQUEST_KEY`."""
        return list(self.items)

    def __str__(self) -> str:
        return ",".join(self.items)


def layer_request(request: "str | int | LayerRequest | Sequence[str | int]") -> LayerRequest:
    """THE split of a layer request (docs/metrics.md#layer-addresses), for every surface: a string, an integer or a
    list of them; each string splits at the commas outside ``[...]``, so ``"resid_post:[0,1],final"`` and
    ``["resid_post:[0,1]", "final"]`` are the same two items. ``auto`` (the layer pick) is one item, alone.
    Errors: an empty request, a value of another type, an item whose brackets do not close, ``auto`` with others."""
    if isinstance(request, LayerRequest):
        return request
    parts = [request] if isinstance(request, (str, int)) else request
    if not isinstance(parts, (list, tuple)) or not all(
            isinstance(x, (str, int)) and not isinstance(x, bool) for x in parts):
        raise RepgeomError(f"a layer request is an address, a comma-separated string or a list of them "
                           f"(e.g. final or [\"resid_post:[0,1]\", \"final\"]), got {request!r}")
    return _split_once(tuple(str(x) for x in parts))


@functools.lru_cache(maxsize=1024)
def _split_once(parts: tuple[str, ...]) -> LayerRequest:
    """The split and its checks, once per process for one request (a request travels through several checks and
    config copies: each gets the same frozen :class:`LayerRequest`); an error is raised again on every call."""
    items = _split_items(parts)
    for item in items:
        outside = re.sub(r"\[[^\[\]]*\]", "", item)  # what is left once every [...] is taken out
        if "[" in outside or "]" in outside:
            raise RepgeomError(f"bad layer address {item!r}: its brackets are unbalanced or nested; a list of "
                               "blocks is written site:[0,1,-1], in one item")
    if not items:
        raise RepgeomError("no layer address given; try --layers final, --layers all or --layers resid_post:*")
    if AUTO in items and len(items) > 1:
        raise RepgeomError(f"layer 'auto' picks one layer and evaluates it with final; it cannot be combined with "
                           f"other layers ({', '.join(items)})")
    return LayerRequest(tuple(items))


def _split_items(parts: Sequence[str]) -> list[str]:
    """Split each string on the commas that are not inside brackets (only :func:`_split_once` calls this)."""
    items: list[str] = []
    for part in parts:
        depth, cur = 0, ""
        for ch in part:
            depth += ch == "["
            depth -= ch == "]"
            if ch == "," and depth == 0:
                items.append(cur)
                cur = ""
            else:
                cur += ch
        items.append(cur)
    return [i.strip() for i in items if i.strip()]
