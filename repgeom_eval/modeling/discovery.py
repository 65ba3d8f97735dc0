"""Finding every layer-address site of a model by reading its modules, and checking each one when it loads.

No table is needed: one *probe* forward pass of random token ids runs with every module hooked and
``output_hidden_states=True``, and what the model itself computes decides (docs/metrics.md#how-an-address-is-found):

* **blocks**: the ``ModuleList`` whose i-th module's output equals ``hidden_states[i+1]``;
* **embed**: the input of block 0, checked equal to ``hidden_states[0]``;
* **final**: the module whose output equals ``last_hidden_state`` (the final norm; the last block itself on models
  without one, such as BERT). Whether ``hidden_states[L]`` is before or after the final norm is read off, not assumed;
* **sub-layers**, block by block, from the residual identities, with every tensor a hook would read:
  pre-norm ``resid_mid = resid_pre + attn_out`` and ``resid_post = resid_mid + mlp_out``; post-norm (BERT) the same
  sums through the block's two norms; parallel (GPT-NeoX, Falcon, GPT-J) ``resid_post = resid_pre + attn_out +
  mlp_out``, which has no ``resid_mid``. ``attn_out`` needs an attention module in the first sub-layer and
  ``mlp_out``/``mlp_in`` a feed-forward (MLP, MoE) module in the second, found by module and class names;
* **inputs**: position ids built from the attention mask must reproduce the model's own positions, and a padded
  batch must give each text the hidden states it has alone (right and left padding are checked separately).

A site that cannot be verified is refused with a one-line reason naming the model type and the block; nothing is
guessed. Registered architecture tables (``repgeom_register_architectures``) override or complete a discovery.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch
from torch import nn

from repgeom_eval.spec.errors import RepgeomError, first_line
from repgeom_eval.modeling import layout_cache
from repgeom_eval.modeling.architectures import SITES, ArchitectureSpec
from repgeom_eval.modeling.blocks import analyze_block
from repgeom_eval.modeling.hooks import HookPoint
from repgeom_eval.modeling.inputs_check import check_inputs, pad_id_of
from repgeom_eval.modeling.layout import Layout, Site, describe, text_config
from repgeom_eval.modeling.precision import probe_precision
from repgeom_eval.modeling.probe import (Call, Recorder, accepted_inputs, build_inputs, call_of, close,
                                         few_logits, hidden_states_of, input_device, point_of, probe_ids, tensor_at)

__all__ = ["DiscoveryError", "Layout", "Site", "accepted_inputs", "build_inputs", "describe", "discover",
           "hidden_states_of", "runner_of"]


_CACHE: "weakref.WeakKeyDictionary[nn.Module, Layout]" = weakref.WeakKeyDictionary()


class DiscoveryError(RepgeomError):
    """The model's layers cannot be found or checked: measuring it would be a guess."""


def runner_of(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """The module a measurement calls, and notes: the encoder of an encoder-decoder model, else the model."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False) and hasattr(model, "get_encoder"):
        encoder = model.get_encoder()
        if isinstance(encoder, nn.Module) and encoder is not model:
            return encoder, [f"{config.model_type} is an encoder-decoder model: its encoder is measured"]
    return model, []


def discover(model: nn.Module, table: ArchitectureSpec | None = None, table_name: str | None = None,
             cache: bool = True, upcast: bool = True) -> Layout:
    """Find and check every layer-address site of ``model`` (a transformers ``PreTrainedModel``).

    A half-precision model is probed with its weights upcast to float32 (``upcast``; exact round trip), else per
    hidden dimension in its own dtype (:mod:`~repgeom_eval.modeling.precision`); each module's train/eval mode is
    restored afterwards."""
    if cache and model in _CACHE and _CACHE[model].table == table_name:
        return _CACHE[model]
    disk_key = layout_cache.key(model, table_name, upcast) if cache and layout_cache.enabled() else None
    found = layout_cache.load(disk_key) if disk_key else None
    if found is not None:  # this checkpoint was probed before (repgeom_eval/modeling/layout_cache.py)
        _CACHE[model] = found
        return found
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad(), probe_precision(model, upcast) as how:
            layout = _discover(model, table, table_name)
    finally:
        for m, training in modes.items():
            m.training = training
    if how:
        layout.notes.append(how)
    if cache:
        _CACHE[model] = layout
    if disk_key:
        layout_cache.save(disk_key, layout)
    return layout


def _name_of(model: nn.Module, module: nn.Module) -> str:
    for name, m in model.named_modules():
        if m is module:
            return name
    raise DiscoveryError(f"{type(module).__name__} is not a sub-module of {type(model).__name__}")


def _discover(model: nn.Module, table: ArchitectureSpec | None, table_name: str | None) -> Layout:
    config = model.config
    model_type = getattr(config, "model_type", type(model).__name__)
    runner, notes = runner_of(model)
    runner_name = _name_of(model, runner) if runner is not model else ""
    accepted = accepted_inputs(runner)
    param = next(model.parameters(), None)
    device = input_device(model)
    ids = probe_ids(model, config)
    base = build_inputs(device, ids, torch.ones_like(ids), accepted=accepted) | few_logits(accepted)
    with Recorder(model) as rec:
        try:
            out = runner(**base, output_hidden_states=True, return_dict=True)
        except Exception as exc:  # noqa: BLE001 - any failure of a foreign forward pass is reported in one line
            hint = ""
            if param is not None and param.dtype == torch.float64:
                hint = ("; some kernels take no float64 (grouped expert matmuls, fused attention): try --model-arg "
                        "experts_implementation=eager, --model-arg attn_implementation=eager, or --dtype float32")
            raise DiscoveryError(f"model type {model_type!r}: the load check's probe forward pass (random token ids, "
                                 f"text only) failed: {type(exc).__name__}: {first_line(exc)[:300]}{hint}") from None
    hidden = tuple(h.detach().cpu() for h in hidden_states_of(out))  # compared with the host copies (Recorded)
    _check_finite(model, model_type, hidden)
    if not hidden:
        raise DiscoveryError(f"model type {model_type!r} returns no hidden_states from its forward pass "
                             "(output_hidden_states=True), so no layer can be checked; it cannot be measured")
    lhs = getattr(out, "last_hidden_state", None)
    lhs = lhs.detach().cpu() if isinstance(lhs, torch.Tensor) else None
    if lhs is None:
        lhs = _outer_last_hidden_state(rec)
    if lhs is None:
        lhs = hidden[-1]
        notes.append("the model returns no last_hidden_state: `final` is its last hidden state")
    logits = isinstance(getattr(out, "logits", None), torch.Tensor)

    text = text_config(config)
    if text is not config or getattr(config, "vision_config", None) is not None:
        notes.append(f"{model_type} is a multimodal model: its text model is measured, on text alone")
    found = _find_blocks(model, rec, hidden, lhs)
    if found is None:
        layout = _hidden_states_only(model_type, runner_name, hidden, lhs, accepted, logits, notes, rec, model)
    else:
        blocks_name, block_calls = found
        layout = _block_layout(model, model_type, runner_name, rec, hidden, lhs, blocks_name, block_calls,
                               accepted, logits, notes)
    if table is not None:
        _apply_table(model, layout, rec, table, table_name or table.name)
    _check_shapes(model, layout, rec, hidden, tuple(ids.shape))
    check_inputs(runner, layout, ids, device, pad_id_of(model, config, ids))
    return layout


def _check_finite(model: nn.Module, model_type: str, hidden: tuple) -> None:
    """NaN or inf first, before any structural check (a diverged checkpoint is not a model of unknown shape)."""
    if all(bool(torch.isfinite(h).all()) for h in hidden):
        return
    bad = [name for name, t in model.named_parameters()
           if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all())]
    if bad:
        shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise DiscoveryError(f"model type {model_type!r}: its weights hold NaN or inf ({shown}), the mark of a "
                             "diverged or corrupted checkpoint; nothing it computes can be measured")
    first = next(k for k, h in enumerate(hidden) if not bool(torch.isfinite(h).all()))
    raise DiscoveryError(f"model type {model_type!r}: its weights are finite, but the load check's probe gives NaN "
                         f"or inf from hidden_states[{first}] on (an overflow of its dtype, or its own code); try "
                         "--dtype float32")


def _outer_last_hidden_state(rec: Recorder) -> torch.Tensor | None:
    """``last_hidden_state`` of the outermost module that returns one (the base model inside a causal-LM head)."""
    found = [c for c in rec.calls if c.last_hidden_state is not None and c.end >= 0]
    return min(found, key=lambda c: c.start).last_hidden_state if found else None


def _find_blocks(model: nn.Module, rec: Recorder, hidden: tuple, lhs: torch.Tensor) -> tuple[str, list[Call]] | None:
    """The ModuleList of blocks: each called once, in order, each one's input the previous one's output, and every
    block's output one of the model's own hidden states (the last one may instead feed the final norm)."""
    preferred = set(getattr(model, "_no_split_modules", None) or [])
    candidates = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    candidates.sort(key=lambda nm: (type(nm[1][0]).__name__ not in preferred, -len(nm[1])))
    for name, blocks in candidates:
        calls = [rec.of(b) for b in blocks]
        if any(len(c) != 1 for c in calls):
            continue
        calls = [c[0] for c in calls]
        if any(c.inp is None or c.out is None for c in calls):
            continue
        if any(calls[i + 1].start < calls[i].end or not close(calls[i + 1].inp, calls[i].out)
               for i in range(len(calls) - 1)):
            continue
        if not all(any(close(c.out, h) for h in hidden) for c in calls[:-1]):
            continue
        last = calls[-1].out
        if any(close(last, h) for h in hidden) or close(last, lhs) or any(
                c.start > calls[-1].end and close(c.inp, last) for c in rec.calls):
            return name, calls
    return None


def _block_layout(model: nn.Module, model_type: str, runner_name: str, rec: Recorder, hidden: tuple,
                  lhs: torch.Tensor, blocks_name: str, calls: list[Call], accepted: frozenset[str], logits: bool,
                  notes: list[str]) -> Layout:
    n = len(calls)
    last = calls[-1]
    # embed: the stream entering block 0 (hidden_states[0], or the embedding module's output where the model's
    # hidden_states start after block 0, as Mamba's do)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    emb_out = rec.of(emb)[0].out if isinstance(emb, nn.Module) and rec.of(emb) else None
    if close(calls[0].inp, hidden[0]):
        embed = Site(point_of(calls[0], "input"), "input of block 0 = hidden_states[0]")
    elif close(calls[0].inp, emb_out):
        embed = Site(point_of(calls[0], "input"), "input of block 0 = the output of the input embeddings")
    else:
        embed = Site(None, f"model type {model_type!r}: the input of block 0 is neither hidden_states[0] nor the "
                           "output of the input embeddings")
    # final: last_hidden_state, read where it is made
    if close(last.out, lhs):
        final = Site(point_of(last, "output"), f"output of block {n - 1} = last_hidden_state (no final norm)")
    else:
        final = _outermost_output_equal(rec, lhs, after=last.end, why="= last_hidden_state") \
            or _final_from_outputs(rec, hidden, lhs, runner_name, model_type)
    final_call = call_of(rec, model, final.point)

    # hidden_states[k] → canonical address, by what each one equals
    names: list[str | None] = []
    for k, h in enumerate(hidden):
        if embed.ok and close(h, calls[0].inp):
            names.append("embed")
        elif close(h, lhs):
            names.append("final")
        else:
            names.append(next((f"resid_post:{i}" for i, c in enumerate(calls) if close(h, c.out)), None))
    if names[-1] == f"resid_post:{n - 1}":
        notes.append(f"hidden_states[{len(hidden) - 1}] is block {n - 1}'s raw output (before the final norm), "
                     "not last_hidden_state: that index reads resid_post")
    if len(hidden) != n + 1 or names[0] != "embed":
        notes.append(f"hidden_states has {len(hidden)} entries for {n} blocks: " + ", ".join(
            f"[{k}] = {a or '?'}" for k, a in enumerate(names)))

    sites, kinds = [], []
    for i, bc in enumerate(calls):
        kind, found = analyze_block(rec, bc, i, model_type, calls[i - 1].out if i else None, embed.ok)
        sites.append(found)
        kinds.append(kind)
    return Layout(
        model_type=model_type, runner=runner_name, blocks=blocks_name, n_layers=n, embed=embed, final=final,
        hidden_states=tuple(names), sites=sites, block_kinds=kinds, causal=False, logits=logits,
        accepted_inputs=accepted, position_ids=False, padding_sides=(), notes=notes,
        **_dependencies(rec, final_call),
    )


def _hidden_states_only(model_type: str, runner_name: str, hidden: tuple, lhs: torch.Tensor,
                        accepted: frozenset[str], logits: bool, notes: list[str], rec: Recorder,
                        model: nn.Module) -> Layout:
    """No list of blocks reproduces the hidden states (XLNet keeps them sequence-first, CPM-Ant prepends prompt
    tokens ...): read ``hidden_states[k]`` from the model's own output; sub-layers are refused."""
    n = len(hidden) - 1
    reason = (f"model type {model_type!r}: no list of block modules produces its hidden_states, so only "
              "hidden_states[k] can be read (embed, resid_post, final)")
    notes.append("no block modules reproduce the hidden states: they are read from the model's own "
                 "hidden_states output (no early stop)")

    def point(k: int) -> HookPoint:
        return HookPoint(runner_name, "hidden_states", index=k)

    if close(hidden[-1], lhs):
        final = Site(point(n), f"hidden_states[{n}] = last_hidden_state")
        last_raw = Site(None, reason + f"; hidden_states[{n}] is after the final norm")
    else:
        final = _outermost_output_equal(rec, lhs, why="= last_hidden_state") or _final_from_outputs(
            rec, hidden, lhs, runner_name, model_type)
        last_raw = Site(point(n), f"hidden_states[{n}] (before the final norm)")
    sites = []
    for i in range(n):
        block = {s: Site(None, reason) for s in SITES}
        block["resid_post"] = Site(point(i + 1), f"hidden_states[{i + 1}]") if i < n - 1 else last_raw
        sites.append(block)
    names = ["embed"] + [f"resid_post:{i}" for i in range(n - 1)] + ["final" if final.ok and final.point == point(n)
                                                                    else f"resid_post:{n - 1}"]
    final_call = call_of(rec, model, final.point) if final.ok and final.point.direction != "hidden_states" else None
    return Layout(
        model_type=model_type, runner=runner_name, blocks="", n_layers=n,
        embed=Site(point(0), "hidden_states[0]"), final=final, hidden_states=tuple(names), sites=sites,
        block_kinds=["hidden states only"] * n, causal=False, logits=logits, accepted_inputs=accepted,
        position_ids=False, padding_sides=(), notes=notes,
        **_dependencies(rec, final_call),
    )


def _final_from_outputs(rec: Recorder, hidden: tuple, lhs: torch.Tensor, runner_name: str,
                        model_type: str) -> Site:
    """``final`` where no module's own output is last_hidden_state (Reformer concatenates its two streams, Moshi
    returns a projection): the model's last hidden state when that is last_hidden_state, else a refusal."""
    if close(hidden[-1], lhs):
        return Site(HookPoint(runner_name, "hidden_states", index=len(hidden) - 1),
                    f"hidden_states[{len(hidden) - 1}] of the model's output = last_hidden_state")
    return Site(None, f"model type {model_type!r}: neither a module's output nor the last hidden state equals "
                      "last_hidden_state, so `final` cannot be read")


def _dependencies(rec: Recorder, final_call: Call | None) -> dict[str, frozenset[str]]:
    if final_call is None:
        return {"depends_on": frozenset(c.name for c in rec.calls), "after_final": frozenset()}
    before = frozenset(c.name for c in rec.calls if c.start <= final_call.end)
    return {"depends_on": before, "after_final": frozenset(c.name for c in rec.calls if c.name not in before)}


def _outermost_output_equal(rec: Recorder, target: torch.Tensor, why: str, after: int | None = None) -> Site | None:
    """The earliest-starting call (the outermost module) whose output equals ``target``, after a point."""
    for c in rec.calls:
        if c.end < 0 or (after is not None and c.start < after):
            continue
        if close(c.out, target):
            return Site(point_of(c, "output"), f"output of {c.name} {why}")
    return None


def _check_shapes(model: nn.Module, layout: Layout, rec: Recorder, hidden: tuple, batch: tuple[int, ...]) -> None:
    """Refuse every site whose tensor is not one vector per token, [batch, tokens, width] (hyper-connection models
    keep several residual streams per token; Gemma 3n stacks its AltUp predictions)."""

    def tensor(point: HookPoint) -> torch.Tensor | None:
        if point.direction == "hidden_states":
            return hidden[point.index] if point.index is not None and point.index < len(hidden) else None
        t = tensor_at(rec, model, point)
        return None if t is None else t.t

    def shaped(t: torch.Tensor | None) -> bool:
        return t is not None and t.dim() == 3 and tuple(t.shape[:2]) == batch

    def checked(site: Site, where: str) -> Site:
        if not site.ok:
            return site
        t = tensor(site.point)
        if shaped(t):
            return replace(site, width=int(t.shape[-1]))
        shape = "nothing" if t is None else f"shape {list(t.shape)}"
        return Site(None, f"model type {layout.model_type!r}, {where}: the hook reads {shape}, not one vector per "
                          f"token (batch {batch[0]} × {batch[1]} tokens × width)")

    layout.embed = checked(layout.embed, "embed")
    layout.final = checked(layout.final, "final")
    for i, block in enumerate(layout.sites):
        for name, site in block.items():
            block[name] = checked(site, f"block {i}")
    layout.hidden_states = tuple(name if shaped(hidden[k]) else None for k, name in enumerate(layout.hidden_states))
    if not layout.final.ok and not any(site.ok for block in layout.sites for site in block.values()):
        raise DiscoveryError(f"{layout.final.note}; no address of this model can be measured")


# -- registered tables --------------------------------------------------------------------------------------------------

def _apply_table(model: nn.Module, layout: Layout, rec: Recorder, table: ArchitectureSpec, name: str) -> None:
    """Let a registered table override or complete the discovered sites; a table that contradicts the model's own
    hidden states is an error, a sub-layer entry the probe cannot confirm a note in ``repgeom addresses``."""
    import warnings

    base = model.base_model
    prefix = "" if base is model else model.base_model_prefix + "."
    blocks_name = prefix + table.blocks
    if blocks_name != layout.blocks:
        raise DiscoveryError(f"architecture table {name!r} names the blocks {blocks_name!r}, but the model's "
                             f"hidden states are the outputs of {layout.blocks!r}; fix the table")
    missing = table.missing_sites(model.config)
    for i in range(layout.n_layers):
        for s in SITES:
            if s in missing:
                if layout.sites[i][s].ok:
                    layout.sites[i][s] = Site(None, f"architecture table {name!r}: {missing[s]}")
                continue
            hook = table.sites[s]
            point = _table_point(rec, model, f"{blocks_name}.{i}" + (f".{hook.module_name}" if hook.module_name else ""),
                                 hook.direction)
            found = layout.sites[i][s]
            if found.point == point:
                layout.sites[i][s] = Site(point, f"{found.note}; table {name!r} agrees")
                continue
            mine = tensor_at(rec, model, point)
            theirs = tensor_at(rec, model, found.point) if found.ok else None
            if theirs is not None and close(mine, theirs):
                layout.sites[i][s] = Site(point, f"{point} (table {name!r}; the same tensor as the discovered "
                                                 f"{found.point})")
            else:
                detail = f"discovery {'found ' + str(found.point) if found.ok else 'refused it: ' + found.note}"
                layout.sites[i][s] = Site(point, f"{point} (table {name!r}, not verified: {detail})", verified=False)
                if found.ok:
                    warnings.warn(f"architecture table {name!r} reads {s}:{i} at {point}, which differs from the "
                                  f"verified {found.point}; using the table", stacklevel=4)
    if table.final_norm is not None:
        point = _table_point(rec, model, prefix + table.final_norm, "output")
        if not close(tensor_at(rec, model, point), tensor_at(rec, model, layout.final.point)):
            raise DiscoveryError(f"architecture table {name!r}: the output of {point.module_name} is not "
                                 f"last_hidden_state; fix its final_norm")
        layout.final = Site(point, f"{layout.final.note}; table {name!r} agrees")
    layout.table = name


def _table_point(rec: Recorder, model: nn.Module, name: str, direction: str) -> HookPoint:
    call = call_of(rec, model, HookPoint(name, direction))
    return point_of(call, direction) if call is not None else HookPoint(name, direction)
