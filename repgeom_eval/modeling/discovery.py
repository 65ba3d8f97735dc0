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

import inspect
import re
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from repgeom_eval.errors import RepgeomError
from repgeom_eval.modeling.architectures import SITES, ArchitectureSpec
from repgeom_eval.modeling.hooks import HookPoint, input_tensor, output_tensor


@dataclass(frozen=True)
class Site:
    """One site at one block: where it is read (``None`` when refused) and how it was checked, or why not.

    A refused site is either ``absent`` (the block has no such tensor: no ``resid_mid`` in a parallel block, no
    ``attn_out`` in a Mamba block) or unverified (the load check could not confirm it, so it is not guessed)."""

    point: HookPoint | None
    note: str
    absent: bool = False

    @property
    def ok(self) -> bool:
        return self.point is not None


@dataclass
class Layout:
    """What discovery found on one model: every site's hook point, each checked on the probe input."""

    model_type: str
    runner: str  # qualified name of the module called for a measurement ("" = the model; the encoder of a seq2seq)
    blocks: str  # qualified name of the ModuleList of blocks
    n_layers: int
    embed: Site
    final: Site
    hidden_states: tuple[str | None, ...]  # canonical address of hidden_states[k] (None: matches no address)
    sites: list[dict[str, Site]]  # per block: every site of SITES → Site
    block_kinds: list[str]
    causal: bool
    logits: bool
    accepted_inputs: frozenset[str]
    position_ids: bool  # pass position_ids = cumsum(mask) - 1
    padding_sides: tuple[str, ...]  # padding sides that leave every real token's hidden states unchanged
    depends_on: frozenset[str] = frozenset()  # modules that run before `final` is read (what the hidden states use)
    after_final: frozenset[str] = frozenset()  # modules that run only after it (a pooler, the LM head)
    notes: list[str] = field(default_factory=list)
    table: str | None = None  # the registered architecture table applied on top, if any

    def site(self, name: str, layer: int) -> Site:
        return self.sites[layer][name]

    def missing_sites(self) -> dict[str, str]:
        """Sites refused at every block, with the first block's reason (what ``repgeom addresses`` lists)."""
        out = {}
        for s in SITES:
            if not any(block[s].ok for block in self.sites):
                out[s] = self.sites[0][s].note if self.sites else "the model has no blocks"
        return out


# -- the probe: one forward pass with every module hooked -------------------------------------------------------------

class _Tensor:
    """A tensor a hook would read, copied when the hook fired, with a linear fingerprint for fast matching and
    whether the model changed the original in place afterwards."""

    __slots__ = ("t", "fp", "live", "version", "flat")

    def __init__(self, tensor: torch.Tensor):
        self.t = tensor.detach().clone()
        self.fp: torch.Tensor | None = None
        self.live, self.version = tensor, tensor._version
        self.flat = False

    @property
    def changed(self) -> bool:
        return self.live._version != self.version


@dataclass
class _Call:
    name: str
    module: nn.Module
    start: int
    ordinal: int = 0  # earlier calls of the same module in this forward pass
    end: int = -1
    inp: _Tensor | None = None
    out: _Tensor | None = None
    last_hidden_state: torch.Tensor | None = None

    def inside(self, other: "_Call") -> bool:
        return other.start <= self.start and self.end <= other.end


class _Recorder:
    """Hooks on every module: the order of calls and the tensor a Capture hook would read at each input/output."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.calls: list[_Call] = []
        self._open: dict[int, list[_Call]] = {}
        self._count: dict[int, int] = {}
        self._tick = 0
        self._handles: list[Any] = []

    def __enter__(self) -> "_Recorder":
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(name), always_call=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self._tick += 1
            call = _Call(name, module, self._tick, self._count.get(id(module), 0))
            self._count[id(module)] = call.ordinal + 1
            try:
                call.inp = _Tensor(input_tensor(args, kwargs))
            except (TypeError, StopIteration):
                pass
            self.calls.append(call)
            self._open.setdefault(id(module), []).append(call)

        return hook

    def _post(self, name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self._tick += 1
            stack = self._open.get(id(module))
            if not stack:
                return
            call = stack.pop()
            call.end = self._tick
            try:
                call.out = _Tensor(output_tensor(output))
            except (TypeError, IndexError):
                pass
            lhs = getattr(output, "last_hidden_state", None)
            if isinstance(lhs, torch.Tensor):
                call.last_hidden_state = lhs

        return hook

    def of(self, module: nn.Module) -> list[_Call]:
        return [c for c in self.calls if c.module is module and c.end >= 0]


def _tolerance(t: torch.Tensor) -> float:
    return 2e-2 if t.dtype in (torch.float16, torch.bfloat16) else 1e-5


def _close(a: "torch.Tensor | _Tensor | None", b: "torch.Tensor | _Tensor | None", scale: float | None = None) -> bool:
    """Equal up to the rounding of a few additions in the tensors' dtype (relative to the largest magnitude)."""
    a = a.t if isinstance(a, _Tensor) else a
    b = b.t if isinstance(b, _Tensor) else b
    if a is None or b is None or a.shape != b.shape:
        return False
    if a is b or a.numel() == 0:
        return True
    a64, b64 = a.detach().double(), b.detach().double()
    if not (torch.isfinite(a64).all() and torch.isfinite(b64).all()):
        return False
    ref = scale if scale is not None else max(float(a64.abs().max()), float(b64.abs().max()), 1e-30)
    return float((a64 - b64).abs().max()) <= _tolerance(a) * max(ref, 1e-30)


def _mag(*ts: torch.Tensor) -> float:
    return max(float(t.detach().double().abs().max()) for t in ts)


def _probe_ids(model: nn.Module, config: Any, rows: int = 2, length: int = 7, seed: int = 0) -> torch.Tensor:
    """Random token ids (no special tokens), the same every time."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None) or getattr(config, "vocab_size", None) or 256
    special: set[int] = set()
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id", "sep_token_id", "cls_token_id",
                "decoder_start_token_id"):
        value = getattr(config, key, None)
        special.update(v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, int))
    pool = [i for i in range(min(int(vocab), 4096)) if i not in special][8:] or list(range(int(vocab)))
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(pool), (rows, length), generator=g)
    return torch.tensor(pool)[picks]


# -- what the runner accepts -------------------------------------------------------------------------------------------

def accepted_inputs(module: nn.Module) -> frozenset[str]:
    """The keyword arguments a module's forward names, plus ``"**"`` when it also takes ``**kwargs``."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return frozenset()
    names = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        names.add("**")
    return frozenset(names)


def build_inputs(device: torch.device, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 accepted: frozenset[str] = frozenset(), position_ids: bool = False,
                 **extra: torch.Tensor) -> dict[str, Any]:
    """The keyword arguments of one forward pass — the only place they are built: ``position_ids = cumsum(mask) - 1``
    where the load check showed they reproduce the model's own positions (so left padding does not shift them),
    ``use_cache=False`` where the forward takes it (no key/value cache is built), and of the ``extra`` inputs (such as
    ``token_type_ids``) only those the forward names (``accepted``; empty: all)."""

    def takes(name: str) -> bool:
        return not accepted or name in accepted

    inputs: dict[str, Any] = {"input_ids": input_ids.to(device)}
    inputs.update({k: v.to(device) for k, v in extra.items() if takes(k)})
    if attention_mask is not None:
        inputs["attention_mask"] = attention_mask.to(device)
        if position_ids:
            inputs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0).to(device)
    if "use_cache" in accepted or "**" in accepted:  # Granite-MoE-hybrid takes it through **kwargs
        inputs["use_cache"] = False
    return inputs


# -- discovery -----------------------------------------------------------------------------------------------------------

ATTENTION = re.compile(r"attn|attention", re.I)
FEED_FORWARD = re.compile(r"mlp|feed_?forward|ffn|^ff|ff$|moe|expert|intermediate|^fc\d$|dense_h_to_4h|"
                          r"Dense(Relu|Act|Gated)", re.I)
NORM = re.compile(r"norm|^ln", re.I)  # module names (leaves) of norms
NORM_CLASS = re.compile(r"Norm(alization)?\d*d?$")  # class names: LayerNorm, LlamaRMSNorm, ... not *LayerNormAttention

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
             cache: bool = True) -> Layout:
    """Find and check every layer-address site of ``model`` (a transformers ``PreTrainedModel``)."""
    if cache and model in _CACHE and _CACHE[model].table == table_name:
        return _CACHE[model]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            layout = _discover(model, table, table_name)
    finally:
        model.train(was_training)
    if cache:
        _CACHE[model] = layout
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
    device = param.device if param is not None else torch.device("cpu")
    ids = _probe_ids(model, config)
    base = build_inputs(device, ids, torch.ones_like(ids), accepted=accepted) | _few_logits(accepted)
    with _Recorder(model) as rec:
        try:
            out = runner(**base, output_hidden_states=True, return_dict=True)
        except Exception as exc:  # noqa: BLE001 - any failure of a foreign forward pass is reported in one line
            raise DiscoveryError(f"model type {model_type!r}: the load check's probe forward pass (random token ids, "
                                 f"text only) failed: {type(exc).__name__}: {_line(exc)}") from None
    hidden = hidden_states_of(out)
    if not hidden:
        raise DiscoveryError(f"model type {model_type!r} returns no hidden_states from its forward pass "
                             "(output_hidden_states=True), so no layer can be checked; it cannot be measured")
    lhs = getattr(out, "last_hidden_state", None)
    if not isinstance(lhs, torch.Tensor):
        lhs = _outer_last_hidden_state(rec)
    if lhs is None:
        lhs = hidden[-1]
        notes.append("the model returns no last_hidden_state: `final` is its last hidden state")
    logits = isinstance(getattr(out, "logits", None), torch.Tensor)

    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text_config is not config or getattr(config, "vision_config", None) is not None:
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
    _check_inputs(runner, layout, ids, device, _pad_id(model, config, ids))
    return layout


def hidden_states_of(output: Any) -> tuple[torch.Tensor, ...]:
    """The ``hidden_states`` a forward pass returned, one tensor each (PEGASUS-X pairs each entry with its global
    tokens: the tokens come first); empty when there are none."""
    hidden = getattr(output, "hidden_states", None)
    if not isinstance(hidden, (tuple, list)):
        return ()
    hidden = [h[0] if isinstance(h, (tuple, list)) and h and isinstance(h[0], torch.Tensor) else h for h in hidden]
    return tuple(h.detach() for h in hidden) if all(isinstance(h, torch.Tensor) for h in hidden) else ()


def _few_logits(accepted: frozenset[str]) -> dict[str, int]:
    """The probe needs hidden states, not a vocabulary-sized output at every token (SmolLM2's LM head is 49152 x 576)."""
    return {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def _outer_last_hidden_state(rec: _Recorder) -> torch.Tensor | None:
    """``last_hidden_state`` of the outermost module that returns one (the base model inside a causal-LM head)."""
    found = [c for c in rec.calls if c.last_hidden_state is not None and c.end >= 0]
    return min(found, key=lambda c: c.start).last_hidden_state if found else None


def _find_blocks(model: nn.Module, rec: _Recorder, hidden: tuple, lhs: torch.Tensor) -> tuple[str, list[_Call]] | None:
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
        if any(calls[i + 1].start < calls[i].end or not _close(calls[i + 1].inp, calls[i].out)
               for i in range(len(calls) - 1)):
            continue
        if not all(any(_close(c.out, h) for h in hidden) for c in calls[:-1]):
            continue
        last = calls[-1].out
        if any(_close(last, h) for h in hidden) or _close(last, lhs) or any(
                c.start > calls[-1].end and _close(c.inp, last) for c in rec.calls):
            return name, calls
    return None


def _block_layout(model: nn.Module, model_type: str, runner_name: str, rec: _Recorder, hidden: tuple,
                  lhs: torch.Tensor, blocks_name: str, calls: list[_Call], accepted: frozenset[str], logits: bool,
                  notes: list[str]) -> Layout:
    n = len(calls)
    last = calls[-1]
    # embed: the stream entering block 0 (hidden_states[0], or the embedding module's output where the model's
    # hidden_states start after block 0, as Mamba's do)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    emb_out = rec.of(emb)[0].out if isinstance(emb, nn.Module) and rec.of(emb) else None
    if _close(calls[0].inp, hidden[0]):
        embed = Site(_point(calls[0], "input"), "input of block 0 = hidden_states[0]")
    elif _close(calls[0].inp, emb_out):
        embed = Site(_point(calls[0], "input"), "input of block 0 = the output of the input embeddings")
    else:
        embed = Site(None, f"model type {model_type!r}: the input of block 0 is neither hidden_states[0] nor the "
                           "output of the input embeddings")
    # final: last_hidden_state, read where it is made
    if _close(last.out, lhs):
        final = Site(_point(last, "output"), f"output of block {n - 1} = last_hidden_state (no final norm)")
    else:
        final = _outermost_output_equal(rec, lhs, after=last.end, why="= last_hidden_state") \
            or _final_from_outputs(rec, hidden, lhs, runner_name, model_type)
    final_call = _call_of(rec, model, final.point)

    # hidden_states[k] → canonical address, by what each one equals
    names: list[str | None] = []
    for k, h in enumerate(hidden):
        if embed.ok and _close(h, calls[0].inp):
            names.append("embed")
        elif _close(h, lhs):
            names.append("final")
        else:
            names.append(next((f"resid_post:{i}" for i, c in enumerate(calls) if _close(h, c.out)), None))
    if names[-1] == f"resid_post:{n - 1}":
        notes.append(f"hidden_states[{len(hidden) - 1}] is block {n - 1}'s raw output (before the final norm), "
                     "not last_hidden_state: that index reads resid_post")
    if len(hidden) != n + 1 or names[0] != "embed":
        notes.append(f"hidden_states has {len(hidden)} entries for {n} blocks: " + ", ".join(
            f"[{k}] = {a or '?'}" for k, a in enumerate(names)))

    sites, kinds = [], []
    for i, bc in enumerate(calls):
        kind, found = _analyze_block(rec, bc, i, model_type, calls[i - 1].out if i else None, embed.ok)
        sites.append(found)
        kinds.append(kind)
    return Layout(
        model_type=model_type, runner=runner_name, blocks=blocks_name, n_layers=n, embed=embed, final=final,
        hidden_states=tuple(names), sites=sites, block_kinds=kinds, causal=False, logits=logits,
        accepted_inputs=accepted, position_ids=False, padding_sides=(), notes=notes,
        **_dependencies(rec, final_call),
    )


def _hidden_states_only(model_type: str, runner_name: str, hidden: tuple, lhs: torch.Tensor,
                        accepted: frozenset[str], logits: bool, notes: list[str], rec: _Recorder,
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

    if _close(hidden[-1], lhs):
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
    final_call = _call_of(rec, model, final.point) if final.ok and final.point.direction != "hidden_states" else None
    return Layout(
        model_type=model_type, runner=runner_name, blocks="", n_layers=n,
        embed=Site(point(0), "hidden_states[0]"), final=final, hidden_states=tuple(names), sites=sites,
        block_kinds=["hidden states only"] * n, causal=False, logits=logits, accepted_inputs=accepted,
        position_ids=False, padding_sides=(), notes=notes,
        **_dependencies(rec, final_call),
    )


def _final_from_outputs(rec: _Recorder, hidden: tuple, lhs: torch.Tensor, runner_name: str,
                        model_type: str) -> Site:
    """``final`` where no module's own output is last_hidden_state (Reformer concatenates its two streams, Moshi
    returns a projection): the model's last hidden state when that is last_hidden_state, else a refusal."""
    if _close(hidden[-1], lhs):
        return Site(HookPoint(runner_name, "hidden_states", index=len(hidden) - 1),
                    f"hidden_states[{len(hidden) - 1}] of the model's output = last_hidden_state")
    return Site(None, f"model type {model_type!r}: neither a module's output nor the last hidden state equals "
                      "last_hidden_state, so `final` cannot be read")


def _dependencies(rec: _Recorder, final_call: _Call | None) -> dict[str, frozenset[str]]:
    if final_call is None:
        return {"depends_on": frozenset(c.name for c in rec.calls), "after_final": frozenset()}
    before = frozenset(c.name for c in rec.calls if c.start <= final_call.end)
    return {"depends_on": before, "after_final": frozenset(c.name for c in rec.calls if c.name not in before)}


def _outermost_output_equal(rec: _Recorder, target: torch.Tensor, why: str, after: int | None = None) -> Site | None:
    """The earliest-starting call (the outermost module) whose output equals ``target``, after a point."""
    for c in rec.calls:
        if c.end < 0 or (after is not None and c.start < after):
            continue
        if _close(c.out, target):
            return Site(_point(c, "output"), f"output of {c.name} {why}")
    return None


def _call_of(rec: _Recorder, model: nn.Module, point: HookPoint | None) -> _Call | None:
    if point is None or point.direction == "hidden_states":
        return None
    try:
        module = model.get_submodule(point.module_name) if point.module_name else model
    except AttributeError:
        return None
    calls = rec.of(module)
    return calls[point.call] if point.call < len(calls) else None


# -- one block: the residual identities -------------------------------------------------------------------------------

class _Block:
    """The same-shaped tensors read inside one block, with linear fingerprints so that sums are matched in O(k)."""

    def __init__(self, rec: _Recorder, block: _Call):
        self.block = block
        self.x, self.y = block.inp.t, block.out.t
        self.shape = self.x.shape
        self.span = [c for c in rec.calls if c is not block and c.end >= 0 and c.inside(block)]
        g = torch.Generator().manual_seed(1)
        self.proj = torch.randn(self.x.numel(), 4, generator=g, dtype=torch.float64)
        self.bound = float(self.proj.abs().sum(0).max())
        for c in self.span:
            for t in (c.inp, c.out):
                if t is None:
                    continue
                if t.t.shape != self.shape and t.t.dim() == 2 and t.t.numel() == self.x.numel() \
                        and t.t.shape[-1] == self.shape[-1]:
                    t.t, t.flat = t.t.reshape(self.shape), True  # tokens flattened to [B*T, D] (OPT's MLP)
                if t.t.shape == self.shape:
                    t.fp = self.fingerprint(t.t)
        self.fx, self.fy = self.fingerprint(self.x), self.fingerprint(self.y)
        self.outs = [c for c in self.span if c.out is not None and c.out.fp is not None]
        self.ins = [c for c in self.span if c.inp is not None and c.inp.fp is not None]

    def fingerprint(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().double().reshape(-1) @ self.proj

    def maybe(self, fa: torch.Tensor, fb: torch.Tensor, scale: float, dtype_of: torch.Tensor) -> bool:
        """Fingerprints compatible with equality (a cheap necessary condition for :func:`_close`)."""
        return float((fa - fb).abs().max()) <= _tolerance(dtype_of) * scale * self.bound


def _analyze_block(rec: _Recorder, block: _Call, i: int, model_type: str, previous: _Tensor | None,
                   has_embed: bool) -> tuple[str, dict[str, Site]]:
    """Sites of block ``i`` from what its modules computed on the probe; refused sites carry their reason."""
    b = _Block(rec, block)
    x, y = b.x, b.y
    prefix = block.name + "."
    sites: dict[str, Site] = {"resid_post": Site(_point(block, "output"), f"output of block {i}")}
    if i > 0 or has_embed:
        sites["resid_pre"] = Site(_point(block, "input"), f"input of block {i}"
                                  + (f" = output of block {i - 1}" if i else " = embed"))
    where = f"model type {model_type!r}, block {i}"

    def refuse(reason: str, names: Iterable[str] = ("resid_pre", "attn_out", "resid_mid", "mlp_in", "mlp_out"),
               absent: bool = True) -> None:
        for s in names:
            sites.setdefault(s, Site(None, f"{where}: {reason}", absent=absent))

    def outermost(c: _Call) -> _Call:
        """The outermost call inside the block whose output is c's output (self_attn rather than its o_proj)."""
        for o in b.outs:
            if o.start <= c.start and c.end <= o.end and _close(o.out, c.out):
                return o
        return c

    def named(calls: Iterable[_Call], pattern: re.Pattern) -> _Call | None:
        for c in sorted(calls, key=lambda c: c.start):
            leaf = c.name[len(prefix):].rsplit(".", 1)[-1]
            cls = type(c.module).__name__
            if NORM.search(leaf) or NORM_CLASS.search(cls):
                continue
            if pattern.search(leaf) or pattern.search(cls):
                return c
        return None

    def ancestors(c: _Call) -> list[_Call]:
        return [o for o in b.span if c.inside(o)]

    mag_xy = _mag(x, y)

    def nonzero(t: _Tensor) -> bool:
        return _mag(t.t) > _tolerance(t.t) * mag_xy * 10

    contributions = [c for c in b.outs if nonzero(c.out)]

    # 1. sequential: stream S = x + a (pre-norm: read where a module takes it; post-norm: the output of the norm that
    #    takes it), then y = S + m (pre-norm) or y = norm(S + m) (post-norm)
    for ca in sorted(contributions, key=lambda c: c.end):
        a = ca.out
        scale = _mag(x, a.t)
        ft = b.fx + a.fp
        streams: list[tuple[str, _Tensor, HookPoint, int, int]] = []
        for c in b.ins:
            if c.start > ca.end and b.maybe(c.inp.fp, ft, scale, x) and _close(c.inp, x + a.t, scale):
                streams.append(("pre", c.inp, _point(c, "input"), c.start, c.start))
                if c.out is not None and c.out.fp is not None and _is_norm(c, prefix):
                    oc = outermost(c)
                    streams.append(("post", c.out, _point(oc, "output"), c.end, c.start))
        for mode, s, s_point, after, s_start in streams:
            for cm in contributions:
                if cm.start < after:
                    continue
                pscale = _mag(s.t, cm.out.t)
                fp = s.fp + cm.out.fp
                if mode == "pre":
                    ok = b.maybe(b.fy, fp, pscale, x) and _close(y, s.t + cm.out.t, pscale)
                else:
                    ok = any(cn.start > cm.end and b.maybe(cn.inp.fp, fp, pscale, x)
                             and _close(cn.inp, s.t + cm.out.t, pscale) and _close(cn.out, y) for cn in b.ins)
                if not ok:
                    continue
                oa, om = outermost(ca), outermost(cm)
                first = [c for c in b.span if c.end <= oa.end] + ancestors(oa)
                second = [c for c in b.span if c.start >= s_start and c.end <= om.end] + ancestors(om)
                attn, ffn = named(first, ATTENTION), named([c for c in second if c.start >= s_start], FEED_FORWARD)
                ffn = ffn or named(second, FEED_FORWARD)
                sites["resid_mid"] = Site(s_point, f"{s_point}: resid_pre + attn_out"
                                          + (", normed (post-norm block)" if mode == "post" else "")
                                          + " = the stream the feed-forward adds to")
                if attn is not None:
                    sites["attn_out"] = Site(_point(oa, "output"), f"output of {oa.name}: resid_mid = resid_pre + "
                                             f"it; attention module {attn.name[len(prefix):]}")
                else:
                    refuse(f"its first sub-layer has no attention module (it is {type(oa.module).__name__} at "
                           f"{oa.name})", ["attn_out"])
                if ffn is not None:
                    sites["mlp_out"] = Site(_point(om, "output"), f"output of {om.name}: resid_post = resid_mid + "
                                            f"it; feed-forward module {ffn.name[len(prefix):]}")
                    sites["mlp_in"] = Site(_point(ffn, "input"), f"input of the feed-forward module {ffn.name}")
                else:
                    refuse(f"its second sub-layer has no feed-forward (MLP/MoE) module (it is "
                           f"{type(om.module).__name__} at {om.name})", ["mlp_out", "mlp_in"])
                refuse("no embedding output precedes block 0", ["resid_pre"])
                return "sequential, " + ("pre-norm" if mode == "pre" else "post-norm"), _ordered(sites)

    # 2. parallel: y = x + a + m, attention and feed-forward both read the block input
    target = b.fy - b.fx
    for ca in contributions:
        for cm in contributions:
            if ca is cm or ca.inside(cm) or cm.inside(ca):
                continue
            scale = _mag(x, ca.out.t, cm.out.t)
            if not (b.maybe(target, ca.out.fp + cm.out.fp, scale, x)
                    and _close(y, x + ca.out.t + cm.out.t, scale)):
                continue
            attn = named(ancestors(ca) + [ca], ATTENTION)
            ffn = named(ancestors(cm) + [cm], FEED_FORWARD)
            if attn is None or ffn is None:
                continue
            oa, om = outermost(ca), outermost(cm)
            sites["attn_out"] = Site(_point(oa, "output"),
                                     f"output of {oa.name}: resid_post = resid_pre + attn_out + mlp_out")
            sites["mlp_out"] = Site(_point(om, "output"),
                                    f"output of {om.name}: resid_post = resid_pre + attn_out + mlp_out")
            sites["mlp_in"] = Site(_point(ffn, "input"), f"input of the feed-forward module {ffn.name}")
            refuse("it is a parallel residual block (attention and feed-forward both read the block input), so "
                   "there is no residual stream between them", ["resid_mid"])
            refuse("no embedding output precedes block 0", ["resid_pre"])
            return "parallel", _ordered(sites)

    # 3. one sub-layer: y = x + o (blocks of hybrid models that hold only attention, only a feed-forward, or a mixer)
    for c in contributions:
        scale = _mag(x, c.out.t)
        if not (b.maybe(target, c.out.fp, scale, x) and _close(y, x + c.out.t, scale)):
            continue
        oc = outermost(c)
        what = f"{type(oc.module).__name__} at {oc.name}"
        attn, ffn = named(ancestors(oc) + [oc], ATTENTION), named(ancestors(oc) + [oc], FEED_FORWARD)
        if attn is not None:
            sites["attn_out"] = Site(_point(oc, "output"), f"output of {oc.name}: resid_post = resid_pre + it "
                                     "(a block with attention only)")
        if ffn is not None and attn is None:
            sites["mlp_out"] = Site(_point(oc, "output"), f"output of {oc.name}: resid_post = resid_pre + it "
                                    "(a block with a feed-forward only)")
            sites["mlp_in"] = Site(_point(ffn, "input"), f"input of the feed-forward module {ffn.name}")
        refuse(f"it has a single sub-layer ({what}), so there is no stream between two sub-layers",
               ["resid_mid"])
        refuse(f"its single sub-layer ({what}) is not " + ("attention" if ffn is not None else "a feed-forward"),
               ["attn_out", "mlp_out", "mlp_in"])
        refuse("no embedding output precedes block 0", ["resid_pre"])
        return f"single sub-layer ({type(oc.module).__name__})", _ordered(sites)

    refuse("the residual identities (resid_post = resid_mid + mlp_out with resid_mid = resid_pre + attn_out, their "
           "post-norm and parallel forms, or one sub-layer) do not hold on the probe input, so its sub-layers "
           "cannot be told apart", ["attn_out", "resid_mid", "mlp_in", "mlp_out"], absent=False)
    refuse("no embedding output precedes block 0", ["resid_pre"])
    return "not recognised", _ordered(sites)


def _is_norm(c: _Call, prefix: str) -> bool:
    leaf = c.name[len(prefix):].rsplit(".", 1)[-1]
    return bool(NORM.search(leaf) or NORM_CLASS.search(type(c.module).__name__))


def _point(call: _Call, direction: str) -> HookPoint:
    t = call.inp if direction == "input" else call.out
    return HookPoint(call.name, direction, call=call.ordinal, copy=bool(t is not None and t.changed),
                     flat=bool(t is not None and t.flat))


def _ordered(sites: dict[str, Site]) -> dict[str, Site]:
    return {s: sites[s] for s in SITES}


def _check_shapes(model: nn.Module, layout: Layout, rec: _Recorder, hidden: tuple, batch: tuple[int, ...]) -> None:
    """Refuse every site whose tensor is not one vector per token, [batch, tokens, width] (hyper-connection models
    keep several residual streams per token; Gemma 3n stacks its AltUp predictions)."""

    def tensor(point: HookPoint) -> torch.Tensor | None:
        if point.direction == "hidden_states":
            return hidden[point.index] if point.index is not None and point.index < len(hidden) else None
        t = _tensor_at(rec, model, point)
        return None if t is None else t.t

    def shaped(t: torch.Tensor | None) -> bool:
        return t is not None and t.dim() == 3 and tuple(t.shape[:2]) == batch

    def checked(site: Site, where: str) -> Site:
        if not site.ok:
            return site
        t = tensor(site.point)
        if shaped(t):
            return site
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

def _apply_table(model: nn.Module, layout: Layout, rec: _Recorder, table: ArchitectureSpec, name: str) -> None:
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
            point = _table_point(rec, model, f"{blocks_name}.{i}" + (f".{hook.module}" if hook.module else ""),
                                 hook.direction)
            found = layout.sites[i][s]
            if found.point == point:
                layout.sites[i][s] = Site(point, f"{found.note}; table {name!r} agrees")
                continue
            mine = _tensor_at(rec, model, point)
            theirs = _tensor_at(rec, model, found.point) if found.ok else None
            if theirs is not None and _close(mine, theirs):
                layout.sites[i][s] = Site(point, f"{point} (table {name!r}; the same tensor as the discovered "
                                                 f"{found.point})")
            else:
                detail = f"discovery {'found ' + str(found.point) if found.ok else 'refused it: ' + found.note}"
                layout.sites[i][s] = Site(point, f"{point} (table {name!r}, not verified: {detail})")
                if found.ok:
                    warnings.warn(f"architecture table {name!r} reads {s}:{i} at {point}, which differs from the "
                                  f"verified {found.point}; using the table", stacklevel=4)
    if table.final_norm is not None:
        point = _table_point(rec, model, prefix + table.final_norm, "output")
        if not _close(_tensor_at(rec, model, point), _tensor_at(rec, model, layout.final.point)):
            raise DiscoveryError(f"architecture table {name!r}: the output of {point.module_name} is not "
                                 f"last_hidden_state; fix its final_norm")
        layout.final = Site(point, f"{layout.final.note}; table {name!r} agrees")
    layout.table = name


def _table_point(rec: _Recorder, model: nn.Module, name: str, direction: str) -> HookPoint:
    call = _call_of(rec, model, HookPoint(name, direction))
    return _point(call, direction) if call is not None else HookPoint(name, direction)


def _tensor_at(rec: _Recorder, model: nn.Module, point: HookPoint | None) -> _Tensor | None:
    call = _call_of(rec, model, point)
    if call is None:
        return None
    return call.inp if point.direction == "input" else call.out


# -- inputs: positions, padding, causality ---------------------------------------------------------------------------

def _pad_id(model: nn.Module, config: Any, ids: torch.Tensor) -> int:
    """The id padding uses: the config's pad token where it has one in the vocabulary (RoBERTa derives positions
    from it), else any real token (only the attention mask may matter)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None) or getattr(config, "vocab_size", None) or 0
    pad = getattr(config, "pad_token_id", None)
    return pad if isinstance(pad, int) and 0 <= pad < vocab else int(ids[0, 0])


def _check_inputs(runner: nn.Module, layout: Layout, ids: torch.Tensor, device: torch.device, pad_id: int) -> None:
    """Decide position ids, check padding sides and causal attention on the probe (a few tiny forward passes). A
    check whose forward pass fails counts as failed (Funnel cannot run some lengths alone): nothing is assumed."""

    def run(input_ids: torch.Tensor, mask: torch.Tensor, position_ids: bool) -> tuple | None:
        kw = build_inputs(device, input_ids, mask, accepted=layout.accepted_inputs, position_ids=position_ids)
        kw.update(_few_logits(layout.accepted_inputs))
        try:
            return hidden_states_of(runner(**kw, output_hidden_states=True, return_dict=True)) or None
        except Exception:  # noqa: BLE001 - the model's own code, on a legal input
            return None

    def same(a: tuple | None, b: tuple | None, pick_a=lambda t: t, pick_b=lambda t: t) -> bool:
        return a is not None and b is not None and len(a) == len(b) and all(
            _close(pick_a(x), pick_b(y)) for x, y in zip(a, b))

    row = ids[:1]
    full = torch.ones_like(row)
    alone = run(row, full, False)
    layout.position_ids = "position_ids" in layout.accepted_inputs and same(run(row, full, True), alone)
    # causal attention: changing the last token leaves the earlier positions alone
    changed = row.clone()
    changed[0, -1] = ids[1, 0] if int(ids[1, 0]) != int(row[0, -1]) else ids[1, 1]
    earlier = lambda t: t[..., :-1, :]  # noqa: E731 - [..., batch, tokens, width]
    layout.causal = same(alone, run(changed, full, layout.position_ids), earlier, earlier)
    # padding: a short text in a batch with a longer one keeps the hidden states it has alone
    short = ids[1:2, : ids.shape[1] - 3]
    short_alone = run(short, torch.ones_like(short), layout.position_ids)
    ok = []
    for side in ("right", "left"):
        pad = ids.shape[1] - short.shape[1]
        filler = torch.full((1, pad), pad_id, dtype=ids.dtype)
        batch_ids = torch.cat([row, torch.cat([short, filler], 1) if side == "right" else torch.cat([filler, short], 1)])
        real = torch.ones_like(short)
        gap = torch.zeros((1, pad), dtype=real.dtype)
        mask = torch.cat([full, torch.cat([real, gap], 1) if side == "right" else torch.cat([gap, real], 1)])
        got = run(batch_ids, mask, layout.position_ids)
        keep = slice(0, short.shape[1]) if side == "right" else slice(pad, None)
        # [..., batch, tokens, width]: Gemma 3n stacks its AltUp streams in front
        if same(got, short_alone, lambda g: g[..., 1:2, keep, :]) and same(got, alone, lambda g: g[..., :1, :, :]):
            ok.append(side)
    layout.padding_sides = tuple(ok)


def describe(layout: Layout) -> Mapping[str, Any]:
    """A JSON-able summary (results files, ``repgeom addresses --json``)."""
    return {
        "model_type": layout.model_type, "blocks": layout.blocks, "n_layers": layout.n_layers,
        "runner": layout.runner or "<model>", "table": layout.table, "causal": layout.causal,
        "position_ids_from_mask": layout.position_ids, "padding_sides": list(layout.padding_sides),
        "block_kinds": sorted(set(layout.block_kinds)), "hidden_states": list(layout.hidden_states),
        "refused": layout.missing_sites(), "notes": list(layout.notes),
        "last_block_sites": [s for s, site in layout.sites[-1].items() if site.ok] if layout.sites else [],
    }
