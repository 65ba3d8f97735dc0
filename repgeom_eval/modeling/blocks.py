"""One block's sub-layers from the residual identities on the probe (docs/metrics.md#how-an-address-is-found):
pre-norm ``resid_mid = resid_pre + attn_out`` and ``resid_post = resid_mid + mlp_out``; post-norm the same sums
through the block's two norms; parallel ``resid_post = resid_pre + attn_out + mlp_out``; single-sub-layer
``resid_post = resid_pre + out``. Each tensor is the one a hook would read; names decide only which sub-layer is
attention and which the feed-forward."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from repgeom_eval.modeling.architectures import SITES
from repgeom_eval.modeling.hooks import HookPoint
from repgeom_eval.modeling.layout import Site
from repgeom_eval.modeling.probe import Call, Recorded, Recorder, close, magnitude, point_of, scale_of, tolerance

ATTENTION = re.compile(r"attn|attention", re.I)
FEED_FORWARD = re.compile(r"mlp|feed_?forward|ffn|^ff|ff$|moe|expert|intermediate|^fc\d$|dense_h_to_4h|"
                          r"Dense(Relu|Act|Gated)", re.I)
NORM = re.compile(r"norm|^ln", re.I)  # module names (leaves) of norms
NORM_CLASS = re.compile(r"Norm(alization)?\d*d?$")  # class names: LayerNorm, LlamaRMSNorm, ... not *LayerNormAttention


class _Block:
    """The same-shaped tensors read inside one block, with linear fingerprints so that sums are matched in O(k)."""

    def __init__(self, rec: Recorder, block: Call):
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

    def maybe(self, fa: torch.Tensor, fb: torch.Tensor, scale: "float | torch.Tensor", dtype_of: torch.Tensor) -> bool:
        """Fingerprints compatible with equality (a cheap necessary condition for :func:`close`; a per-dimension
        scale counts with its largest entry, which only loosens it)."""
        top = float(scale.max()) if isinstance(scale, torch.Tensor) else scale
        return float((fa - fb).abs().max()) <= tolerance(dtype_of) * top * self.bound


def analyze_block(rec: Recorder, block: Call, i: int, model_type: str, previous: Recorded | None,
                   has_embed: bool) -> tuple[str, dict[str, Site]]:
    """Sites of block ``i`` from what its modules computed on the probe; refused sites carry their reason."""
    b = _Block(rec, block)
    x, y = b.x, b.y
    prefix = block.name + "."
    sites: dict[str, Site] = {"resid_post": Site(point_of(block, "output"), f"output of block {i}")}
    if i > 0 or has_embed:
        sites["resid_pre"] = Site(point_of(block, "input"), f"input of block {i}"
                                  + (f" = output of block {i - 1}" if i else " = embed"))
    where = f"model type {model_type!r}, block {i}"

    def refuse(reason: str, names: Iterable[str] = ("resid_pre", "attn_out", "resid_mid", "mlp_in", "mlp_out"),
               absent: bool = True) -> None:
        for s in names:
            sites.setdefault(s, Site(None, f"{where}: {reason}", absent=absent))

    def outermost(c: Call) -> Call:
        """The outermost call inside the block whose output is c's output (self_attn rather than its o_proj)."""
        for o in b.outs:
            if o.start <= c.start and c.end <= o.end and close(o.out, c.out):
                return o
        return c

    def named(calls: Iterable[Call], pattern: re.Pattern) -> Call | None:
        for c in sorted(calls, key=lambda c: c.start):
            leaf = c.name[len(prefix):].rsplit(".", 1)[-1]
            cls = type(c.module).__name__
            if NORM.search(leaf) or NORM_CLASS.search(cls):
                continue
            if pattern.search(leaf) or pattern.search(cls):
                return c
        return None

    def ancestors(c: Call) -> list[Call]:
        return [o for o in b.span if c.inside(o)]

    mag_xy = scale_of(x, y)

    def nonzero(t: Recorded) -> bool:
        """Above rounding noise somewhere (in half precision: in some hidden dimension, at the tolerance of sums)."""
        if isinstance(mag_xy, torch.Tensor):
            return bool((t.t.detach().double().abs() > tolerance(t.t) * mag_xy).any())
        return magnitude(t.t) > tolerance(t.t) * mag_xy * 10

    contributions = [c for c in b.outs if nonzero(c.out)]

    # 1. sequential: stream S = x + a (pre-norm: read where a module takes it; post-norm: the output of the norm that
    #    takes it), then y = S + m (pre-norm) or y = norm(S + m) (post-norm)
    for ca in sorted(contributions, key=lambda c: c.end):
        a = ca.out
        scale = scale_of(x, a.t)
        ft = b.fx + a.fp
        # (mode, stream, where it is read, contributions start after, the second sub-layer starts at, the
        # feed-forward reads from): post-norm, the stream is made by the norm and read once its module has returned
        streams: list[tuple[str, Recorded, HookPoint, int, int, int]] = []
        for c in b.ins:
            if c.start > ca.end and b.maybe(c.inp.fp, ft, scale, x) and close(c.inp, x + a.t, scale):
                streams.append(("pre", c.inp, point_of(c, "input"), c.start, c.start, c.start))
                if c.out is not None and c.out.fp is not None and _is_norm(c, prefix):
                    oc = outermost(c)
                    streams.append(("post", c.out, point_of(oc, "output"), c.end, c.start, oc.end))
        for mode, s, s_point, after, s_start, reads_from in streams:
            for cm in contributions:
                if cm.start < after:
                    continue
                pscale = scale_of(s.t, cm.out.t)
                fp = s.fp + cm.out.fp
                if mode == "pre":
                    ok = b.maybe(b.fy, fp, pscale, x) and close(y, s.t + cm.out.t, pscale)
                else:
                    ok = any(cn.start > cm.end and b.maybe(cn.inp.fp, fp, pscale, x)
                             and close(cn.inp, s.t + cm.out.t, pscale) and close(cn.out, y) for cn in b.ins)
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
                    sites["attn_out"] = Site(point_of(oa, "output"), f"output of {oa.name}: resid_mid = resid_pre + "
                                             f"it; attention module {attn.name[len(prefix):]}")
                else:
                    refuse(f"its first sub-layer has no attention module (it is {type(oa.module).__name__} at "
                           f"{oa.name})", ["attn_out"])
                if ffn is not None:
                    sites["mlp_out"] = Site(point_of(om, "output"), f"output of {om.name}: resid_post = resid_mid + "
                                            f"it; feed-forward module {ffn.name[len(prefix):]}")
                    sites["mlp_in"] = feed_forward_input(
                        b, s.t, [c for c in b.span if c.start >= reads_from and (c.start <= cm.start or cm.inside(c))],
                        prefix, where, "resid_mid")
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
            scale = scale_of(x, ca.out.t, cm.out.t)
            if not (b.maybe(target, ca.out.fp + cm.out.fp, scale, x)
                    and close(y, x + ca.out.t + cm.out.t, scale)):
                continue
            attn = named(ancestors(ca) + [ca], ATTENTION)
            ffn = named(ancestors(cm) + [cm], FEED_FORWARD)
            if attn is None or ffn is None:
                continue
            oa, om = outermost(ca), outermost(cm)
            sites["attn_out"] = Site(point_of(oa, "output"),
                                     f"output of {oa.name}: resid_post = resid_pre + attn_out + mlp_out")
            sites["mlp_out"] = Site(point_of(om, "output"),
                                    f"output of {om.name}: resid_post = resid_pre + attn_out + mlp_out")
            sites["mlp_in"] = _parallel_feed_forward(b, x, ffn, prefix, where)
            refuse("it is a parallel residual block (attention and feed-forward both read the block input), so "
                   "there is no residual stream between them", ["resid_mid"])
            refuse("no embedding output precedes block 0", ["resid_pre"])
            return "parallel", _ordered(sites)

    # 3. one sub-layer: y = x + o (blocks of hybrid models that hold only attention, only a feed-forward, or a mixer)
    for c in contributions:
        scale = scale_of(x, c.out.t)
        if not (b.maybe(target, c.out.fp, scale, x) and close(y, x + c.out.t, scale)):
            continue
        oc = outermost(c)
        what = f"{type(oc.module).__name__} at {oc.name}"
        attn, ffn = named(ancestors(oc) + [oc], ATTENTION), named(ancestors(oc) + [oc], FEED_FORWARD)
        if attn is not None:
            sites["attn_out"] = Site(point_of(oc, "output"), f"output of {oc.name}: resid_post = resid_pre + it "
                                     "(a block with attention only)")
        if ffn is not None and attn is None:
            sites["mlp_out"] = Site(point_of(oc, "output"), f"output of {oc.name}: resid_post = resid_pre + it "
                                    "(a block with a feed-forward only)")
            sites["mlp_in"] = _parallel_feed_forward(b, x, ffn, prefix, where)
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


def feed_forward_input(b: _Block, stream: torch.Tensor, region: list[Call], prefix: str, where: str,
                       stream_name: str, norms_from: list[Call] | None = None) -> Site:
    """``mlp_in``, checked: the tensor the feed-forward computation reads. That is the stream it adds to after the
    norm applied to it (pre-norm), or the stream itself where no norm is applied (post-norm), read at the first
    module of ``region`` (the feed-forward's calls) whose input equals it and that does not start by normalising
    that input itself (T5's ``T5LayerFF`` and RoBERTa-PreLayerNorm's ``intermediate`` hold their norm inside: their
    input is the un-normed stream, not what the feed-forward reads). The norms are looked for among ``norms_from``
    (default: ``region``)."""
    def with_input(calls: list[Call]) -> list[Call]:
        return sorted((c for c in calls if c.inp is not None and c.inp.fp is not None), key=lambda c: c.start)

    shaped = with_input(region)
    reads: list[tuple[torch.Tensor, Call | None]] = [(stream, None)]
    for c in with_input(region if norms_from is None else norms_from):
        if _is_norm(c, prefix) and c.out is not None and c.out.fp is not None and close(c.inp, stream):
            reads.append((c.out.t, c))

    def normalises_own_input(c: Call) -> bool:
        return any(_is_norm(d, prefix) and d is not c and d.inside(c) and d.inp is not None and close(d.inp, c.inp)
                   for d in shaped)

    for c in shaped:
        if _is_norm(c, prefix) or normalises_own_input(c):
            continue
        for tensor, norm in reads[::-1]:  # normed first: a norm's output is what follows it
            if close(c.inp, tensor):
                what = f"the output of {norm.name} ({stream_name} normed)" if norm is not None else \
                    f"{stream_name} itself (no norm between)"
                return Site(point_of(c, "input"), f"input of {c.name}: what the feed-forward reads = {what}")
    norms = [norm for _, norm in reads if norm is not None]
    if norms:
        return Site(point_of(norms[-1], "output"), f"output of {norms[-1].name}: {stream_name} normed, what the "
                                                   "feed-forward reads")
    return Site(None, f"{where}: no module of its feed-forward reads {stream_name} or a norm of it, so what the "
                      "feed-forward reads cannot be verified", absent=False)


def _parallel_feed_forward(b: _Block, x: torch.Tensor, ffn: Call, prefix: str, where: str) -> Site:
    """``mlp_in`` of a block whose feed-forward reads the block input (parallel or single sub-layer): read inside the
    named feed-forward module, from the block input or a norm of it that ran before (or inside) that module."""
    inside = [c for c in b.span if c is ffn or c.inside(ffn)]
    before = [c for c in b.span if c.end <= ffn.start] + inside
    return feed_forward_input(b, x, inside, prefix, where, "resid_pre", norms_from=before)


def _is_norm(c: Call, prefix: str) -> bool:
    leaf = c.name[len(prefix):].rsplit(".", 1)[-1]
    return bool(NORM.search(leaf) or NORM_CLASS.search(type(c.module).__name__))


def _ordered(sites: dict[str, Site]) -> dict[str, Site]:
    return {s: sites[s] for s in SITES}
