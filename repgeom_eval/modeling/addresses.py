"""Layer addresses: parsing the grammar of docs/metrics.md#layer-addresses and resolving it to hook points on a model.

Grammar (items separated by commas or given as a list)::

    site:layer     site ∈ resid_pre, attn_out, resid_mid, mlp_in, mlp_out, resid_post
                   layer = 3 | -1 | * | [0,4,-1]     (0-based block index, negative counts from the end)
    embed          hidden_states[0]
    final          last_hidden_state (after the final norm where the model has one)
    k              a bare integer: exactly hidden_states[k] (k = 0 → embed, k = L or -1 → final,
                   otherwise resid_post:k-1)
    NAME           a registered layer selector, e.g. ``all`` (every hidden state) or ``blocks``
    auto           alone: the layer pick of ``repgeom mteb run --layer auto`` (docs/picks.md)

:func:`~repgeom_eval.spec.layer_request.layer_request` (on the torch-free floor, as strings) is the one split of a
request into its items, for every surface (``measure --layers``,
``mteb run --layer``, lm-eval's ``repgeom_layer``/``repgeom_layers``, the Python keywords); everything below parses
what it returns. Results store only the canonical form (``resid_post:11``, ``final``, ``embed``), and the request
as given under :data:`REQUEST_KEY`.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from repgeom_eval.modeling.architectures import SITES
from repgeom_eval.modeling.hook_point import HookPoint
from repgeom_eval.spec.errors import RepgeomError, UnknownNameError
from repgeom_eval.spec.layer_request import AUTO, AUTO_ELSEWHERE, LayerRequest, layer_request

if TYPE_CHECKING:  # pragma: no cover
    from repgeom_eval.modeling.loading import LoadedModel, ModelInfo

ALIASES = ("embed", "final")
_SITE_ORDER = {s: i for i, s in enumerate(SITES)}


@dataclass(frozen=True)
class Address:
    """A canonical layer address: ``site`` is one of SITES, ``"embed"`` or ``"final"``."""

    site: str
    layer: int | None = None

    def __str__(self) -> str:
        return self.site if self.layer is None else f"{self.site}:{self.layer}"

    def depth_key(self, n_layers: int) -> tuple[int, int]:
        """Execution order, for sorting tables and plots by depth."""
        if self.site == "embed":
            return (-1, 0)
        if self.site == "final":
            return (n_layers, 0)
        return (self.layer or 0, _SITE_ORDER[self.site])


def _parse_int(text: str, what: str) -> int:
    if not re.fullmatch(r"[+-]?\d+", text.strip()):
        raise RepgeomError(f"bad layer address {what!r}: {text.strip()!r} is not an integer, '*' or a list like [0,3,-1]")
    return int(text)


def parse_layers(
    spec: "str | LayerRequest | Sequence[str]",
    n_layers: int,
    selectors: Callable[[str], Callable[..., Iterable[str]] | None] | None = None,
    model_info: "ModelInfo | None" = None,
    _depth: int = 0,
    selector_names: Iterable[str] = (),
    hidden_map: Sequence[str | None] | None = None,
) -> list[Address]:
    """Parse a layer specification into canonical addresses (deduplicated, order preserved).

    Args:
        spec: e.g. ``"resid_post:*"``, ``"final,3"``, ``["mlp_in:[0,-1]", "embed"]``.
        n_layers: number of blocks L of the model.
        selectors: looks up a named layer selector (returns ``None`` if unknown).
        model_info: passed to selectors.
        selector_names: the registered selectors' names, offered as suggestions when a name is unknown.
        hidden_map: the canonical address of each of the model's own ``hidden_states[k]`` (found when it loaded);
            by default ``hidden_states[k]`` is the output of block k-1 and the last one is ``final``.
    """
    out: list[Address] = []
    for item in layer_request(spec).items:
        for addr in _parse_item(item, n_layers, selectors, model_info, _depth, tuple(selector_names), hidden_map):
            if addr not in out:
                out.append(addr)
    if not out and _depth == 0:
        raise RepgeomError("no layer address given; try --layers final, --layers all or --layers resid_post:*")
    return out


def _parse_item(item: str, n_layers: int, selectors: Any, model_info: Any, depth: int,
                selector_names: tuple[str, ...], hidden_map: Sequence[str | None] | None) -> list[Address]:
    if item in ALIASES:
        return [Address(item)]
    if item == AUTO:
        raise RepgeomError(AUTO_ELSEWHERE)
    if re.fullmatch(r"[+-]?\d+", item):
        return [hidden_state_address(int(item), n_layers, hidden_map)]
    site, sep, layer_spec = item.partition(":")
    site = site.strip()
    if not sep:
        selector = selectors(site) if selectors is not None else None
        if selector is not None:
            if depth > 5:
                raise RepgeomError(f"layer selector {site!r} expands recursively")
            got = selector(model_info)
            got = [got] if isinstance(got, str) else list(got)  # a selector may return one spec string
            if not got:  # a selector that names nothing on this model (the request as a whole may still)
                return []
            return parse_layers(got, n_layers, selectors, model_info, depth + 1, selector_names, hidden_map)
        if site in SITES:
            raise RepgeomError(f"layer address {site!r} needs a layer: {site}:3, {site}:-1, {site}:* or {site}:[0,-1]")
        raise UnknownNameError(
            "layer address", site, list(SITES) + list(ALIASES) + list(selector_names) + ["<integer>"],
            "addresses look like resid_post:11, mlp_in:-1, resid_mid:*, embed, final or a bare hidden-state index",
        )
    if site not in SITES:
        raise UnknownNameError("layer-address site", site, SITES, f"in {item!r}")
    layer_spec = layer_spec.strip()
    if layer_spec == "*":
        layers = list(range(n_layers))
    elif layer_spec.startswith("[") and layer_spec.endswith("]"):
        layers = [_parse_int(x, item) for x in layer_spec[1:-1].split(",") if x.strip()]
    else:
        layers = [_parse_int(layer_spec, item)]
    out = []
    for layer in layers:
        if not -n_layers <= layer < n_layers:
            raise RepgeomError(
                f"layer {layer} in {item!r} is out of range: the model has {n_layers} blocks "
                f"(valid: 0..{n_layers - 1} or -{n_layers}..-1)"
            )
        out.append(Address(site, layer % n_layers))
    return out


def hidden_state_address(k: int, n_layers: int, hidden_map: Sequence[str | None] | None = None) -> Address:
    """The canonical address of ``hidden_states[k]`` (negative k counts from the end, -1 = the last one).

    ``hidden_map`` (from the model's load check) names what each ``hidden_states[k]`` of this model is; without it,
    ``hidden_states[k]`` is the output of block k-1 and the last one is ``final``, as on nearly every model.
    """
    n_hidden = len(hidden_map) if hidden_map is not None else n_layers + 1
    if not -n_hidden <= k < n_hidden:
        raise RepgeomError(
            f"hidden-state index {k} is out of range: the model has {n_hidden} hidden states "
            f"(valid: 0..{n_hidden - 1} or -{n_hidden}..-1)"
        )
    k %= n_hidden
    if hidden_map is not None:
        name = hidden_map[k]
        if name is None:
            raise RepgeomError(f"hidden_states[{k}] of this model equals no layer address that can be hooked; see "
                               "`repgeom addresses --model MODEL` for what its hidden states are")
        return parse_address(name)
    if k == 0:
        return Address("embed")
    if k == n_layers:
        return Address("final")
    return Address("resid_post", k - 1)


def parse_address(name: str) -> Address:
    """``"resid_post:3"`` → ``Address("resid_post", 3)``; ``"final"`` → ``Address("final")`` (canonical forms only)."""
    site, _, layer = name.partition(":")
    return Address(site, int(layer)) if layer else Address(site)


def resolve(addresses: Sequence[Address], loaded: "LoadedModel") -> dict[Address, HookPoint]:
    """Map canonical addresses to the hook points found and checked when the model loaded; a site the load check
    refused is an error that gives its reason and the sites this model has."""
    layout = loaded.layout
    out: dict[Address, HookPoint] = {}
    unverified: list[str] = []
    for addr in addresses:
        if addr.site == "embed":
            site = layout.embed
        elif addr.site == "final":
            site = layout.final
        else:
            assert addr.layer is not None
            if not 0 <= addr.layer < layout.n_layers:
                raise RepgeomError(f"address {addr} is out of range: the model has {layout.n_layers} blocks")
            site = layout.sites[addr.layer][addr.site]
        if site.point is None:
            valid = [s for s in SITES if any(block[s].ok for block in layout.sites)]
            valid += [a for a in ALIASES if getattr(layout, a).ok]
            raise RepgeomError(f"address {addr} is not available on this {layout.model_type} model: {site.note} "
                               f"(available sites: {', '.join(valid)}; `repgeom addresses` lists them)")
        if not site.verified:
            unverified.append(f"{addr} ({site.point})")
        out[addr] = site.point
    if unverified:
        warnings.warn(f"{', '.join(unverified)}: read where the architecture table {layout.table!r} says, which the "
                      f"load check could not verify on this {layout.model_type} model; `repgeom addresses` shows why",
                      stacklevel=3)
    return out


def available_addresses(loaded: "LoadedModel") -> list[Address]:
    """Every canonical address this model supports, in depth order (``repgeom addresses``)."""
    layout = loaded.layout
    out = [Address("embed")] if layout.embed.ok else []
    for layer, block in enumerate(layout.sites):
        out += [Address(s, layer) for s in SITES if block[s].ok]
    if layout.final.ok:
        out.append(Address("final"))
    return out


# -- a layer request, resolved in one place ---------------------------------------------------------------------------
# Every command (measure, the analyses, the lm-eval tasks, the MTEB sweep, training) turns the user's layer request
# into addresses here: selectors looked up in the plugin host, the grammar above, depth order, and one rule for two
# names of the same tensor.


def check_request_syntax(request: "str | LayerRequest | Sequence[str]", selector_names: Sequence[str]) -> None:
    """What can be checked of a layer request without a model (site names, index syntax, selector names), so that
    a surface can refuse a bad request before the model loads; ranges are checked on the model."""
    names = set(selector_names)

    def selector(name: str):
        return (lambda info: ["final"]) if name in names else None  # expanded on the model

    syntax = [re.sub(r":\s*\*", ":0", x) for x in layer_request(request).items]  # `*` expands on the model
    parse_layers(syntax, 10 ** 6, selector, None, selector_names=sorted(names))


def parse_request(request: "str | LayerRequest | Sequence[str]", info: "ModelInfo", host: Any = None) -> list[Address]:
    """Canonical addresses of a layer request, in depth order (selectors such as ``all`` expanded).

    Needs only the model's :class:`ModelInfo` (block count), so it works before any weights are loaded.
    """
    from repgeom_eval.plugin_system.host import get_host

    host = host or get_host()

    def selector(name: str):
        return host.layer_selectors.get(name) if name in host.layer_selectors else None

    found = parse_layers(request, info.n_layers, selector, info, selector_names=host.layer_selectors.names(),
                         hidden_map=hidden_map_of(info))
    return sorted(found, key=lambda a: a.depth_key(info.n_layers))


@dataclass(frozen=True)
class LayerPlan:
    """What a run reads: canonical addresses in depth order, and the hook point of each."""

    addresses: tuple[Address, ...]
    points: dict[Address, HookPoint]
    # request items reported under another name: bare hidden-state indices ("12" → "resid_post:11", "30" → "final")
    # and aliases ("resid_pre:0" → "embed"); written into results so that nobody has to redo the arithmetic
    reported_as: dict[str, str] = field(default_factory=dict)


def resolve_request(request: "str | LayerRequest | Sequence[str]", loaded: "LoadedModel",
                    host: Any = None) -> LayerPlan:
    """Parse a layer request and map it to hook points on ``loaded.model``.

    The one rule for aliases: every tensor has one name. A requested address that reads the same tensor as
    ``embed`` or ``final`` (``resid_pre:0`` always; BERT's ``resid_post:-1``, which has no final norm after it) is
    reported under that alias, and a warning names what was renamed; two requested names of one tensor become one.
    """
    addresses = parse_request(request, loaded.info, host)
    aliases = [Address(a) for a in ALIASES if getattr(loaded.layout, a).ok]
    points = resolve(list(dict.fromkeys(addresses + aliases)), loaded)
    alias_of = {points[a]: a for a in aliases}
    kept: list[Address] = []
    renamed: dict[Address, list[str]] = {}
    for addr in addresses:
        name = alias_of.get(points[addr], addr)
        if name != addr:
            renamed.setdefault(name, []).append(str(addr))
        if name not in kept:
            kept.append(name)
    for name, others in renamed.items():
        warnings.warn(f"{', '.join(others)} and {name} are the same tensor on this {loaded.info.model_type} model; "
                      f"reporting it once, as {name}", stacklevel=3)
    reported_as = {str(addr): str(name) for name, others in renamed.items() for addr in others}
    n_layers = loaded.info.n_layers
    bare = {item: alias_of.get(points[a], a) for item, a in bare_indices(request, n_layers,
                                                                           hidden_map_of(loaded.info)).items()}
    if bare:
        reported_as |= {item: str(a) for item, a in bare.items()}
        last = [item for item, a in bare.items() if str(a) == "final"]
        warnings.warn(
            "hidden-state indices are reported under their addresses (hidden_states[k] is the output of block k-1): "
            + ", ".join(f"{item} → {a}" for item, a in bare.items())
            + (f"; {', '.join(last)} is the last hidden state, which is `final` (after the final norm where the model "
               f"has one; the last block's own output is resid_post:{n_layers - 1})" if last else ""),
            stacklevel=3)
    kept.sort(key=lambda a: a.depth_key(n_layers))
    return LayerPlan(tuple(kept), {a: points[a] for a in kept}, reported_as)


def bare_indices(request: "str | LayerRequest | Sequence[str]", n_layers: int,
                 hidden_map: Sequence[str | None] | None = None) -> dict[str, Address]:
    """The bare hidden-state indices of a request (``"12"``, ``"-1"``) and the canonical address of each."""
    return {item: hidden_state_address(int(item), n_layers, hidden_map)
            for item in layer_request(request).items if re.fullmatch(r"[+-]?\d+", item)}


def hidden_map_of(info: Any) -> Sequence[str | None] | None:
    """What each ``hidden_states[k]`` of the model is, as its load check found (None before any model is loaded)."""
    layers = getattr(info, "layers", None) or {}
    return layers.get("hidden_states")
