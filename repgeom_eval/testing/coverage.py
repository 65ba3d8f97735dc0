"""Does repgeom measure a model type right? One type at tiny size, through repgeom's own loading path.

:func:`check_type` builds a tiny random model of a transformers type (``repgeom_eval.testing.tiny_models``), saves it with a
tokenizer, loads it with ``load_model`` (Auto class, weights check, the load check of modeling/discovery.py), and
compares:

* **every hidden state**: a padded batch of two real texts through ``Forward`` (the path every command uses) at every
  bare hidden-state index, against the model's own ``output_hidden_states`` for each text alone, at every real token;
* **sub-layers**: which sites the load check verified, and the residual identities again on the tensors ``Forward``
  captured from the real texts (pre-norm: resid_mid = resid_pre + attn_out and resid_post = resid_mid + mlp_out;
  parallel: resid_post = resid_pre + attn_out + mlp_out; every block: resid_pre = the previous resid_post).

A failure of either is **measured wrong**. :func:`summarize` and :func:`markdown` make the coverage table that
``make any-model`` (benchmarks/any_model.py) writes into docs/how-to/own-model.md (its coverage section); the test suite runs the same check.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from pathlib import Path

TEXTS = ["The quick brown fox jumps over the lazy dog near the river bank today.", "Short text."]


def check_type(model_type: str, kind: str, workdir: str) -> dict:
    """One row of the coverage table: ``status`` is ``not built``, ``refused`` (with a one-line ``reason``),
    ``equal`` or ``measured wrong`` (with what differed, in ``wrong``). Warnings of the run are not shown."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _check_type(model_type, kind, workdir)


def _check_type(model_type: str, kind: str, workdir: str) -> dict:
    from repgeom_eval.spec.errors import RepgeomError
    from repgeom_eval.modeling.loading import load_model
    from repgeom_eval.testing.tiny_models import TinyBuildError, save_tiny

    row: dict = {"type": model_type, "kind": kind}
    t0 = time.perf_counter()
    path = Path(workdir) / f"{kind}-{model_type}"
    try:
        save_tiny(model_type, path, kind)
    except TinyBuildError as exc:
        return row | {"status": "not built", "reason": str(exc)}
    try:
        loaded = load_model(str(path))
    except RepgeomError as exc:
        return row | {"status": "refused", "reason": str(exc).replace(str(path), "<tiny model>"),
                      "seconds": time.perf_counter() - t0}
    layout = loaded.layout
    row["blocks"] = layout.blocks
    row["block_kinds"] = sorted(set(layout.block_kinds))
    row["padding_sides"] = list(layout.padding_sides)
    row["notes"] = layout.notes

    try:
        return _compare(row, loaded, t0)
    except RepgeomError as exc:  # the model's own forward fails on real texts (Funnel ...): refused in one line
        return row | {"status": "refused", "reason": str(exc), "seconds": time.perf_counter() - t0}


def _compare(row: dict, loaded, t0: float) -> dict:
    import torch

    from repgeom_eval.spec.errors import RepgeomError
    from repgeom_eval.measurement.forward import Forward, model_inputs
    from repgeom_eval.modeling.addresses import available_addresses, resolve, resolve_request
    from repgeom_eval.modeling.probe import hidden_states_of

    layout = loaded.layout
    # 3. every hidden state, padded batch through Forward vs each text alone through the model itself
    n_hidden = len(layout.hidden_states)
    bare = [str(k) for k in range(n_hidden) if layout.hidden_states[k] is not None]
    if not bare:
        raise RepgeomError("no hidden state is one vector per token ([batch, tokens, width]); measurable: "
                           + ", ".join(str(a) for a in available_addresses(loaded)))
    plan = resolve_request(bare, loaded)
    worst, wrong = 0.0, []
    with Forward(loaded, plan.points) as fwd:
        batch = fwd.texts(TEXTS, max_length=32)
    mask = batch.mask.cpu()
    for row_i in range(len(TEXTS)):
        real = mask[row_i]
        ids = batch.ids[row_i:row_i + 1, real]
        try:
            with torch.no_grad():
                ref = hidden_states_of(loaded.runner(**model_inputs(loaded, ids, torch.ones_like(ids)),
                                                     output_hidden_states=True, return_dict=True))
        except Exception as exc:  # noqa: BLE001 - the model itself fails on this text alone: nothing to compare
            raise RepgeomError(f"the model's own forward pass fails on a real text of {ids.shape[1]} tokens: "
                               f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from None
        for item, addr in zip(bare, [plan.reported_as.get(b, b) for b in bare]):
            k = int(item)
            got = batch.hidden[_address(plan, addr)][row_i, real.to(batch.hidden[_address(plan, addr)].device)]
            want = ref[k][0].to(got.dtype)
            scale = float(want.abs().max()) or 1.0
            err = float((got - want).abs().max()) / scale
            worst = max(worst, err)
            if err > 1e-4:
                wrong.append(f"hidden_states[{k}] ({addr}): relative error {err:.2e}")
    row["hidden_states"] = n_hidden
    row["max_rel_error"] = worst
    # 4. sub-layers the load check verified, checked again on the captured real texts
    verified = {s for block in layout.sites for s, site in block.items() if site.ok and site.verified}
    refused: dict[str, dict] = {}
    for block in layout.sites:
        for s, site in block.items():
            if (not site.ok or not site.verified) and (s not in refused or not site.absent and refused[s]["absent"]):
                # an unverified one (refused, or served from a table unchecked) shows over an absent one
                refused[s] = {"reason": site.note, "absent": site.absent and not site.ok}
    row["verified_sites"] = sorted(verified)
    row["refused"] = {s: refused[s] for s in sorted(refused)}
    with Forward(loaded, resolve(available_addresses(loaded), loaded)) as fwd:
        got = {str(a): t for a, t in fwd.texts(TEXTS, max_length=32).hidden.items()}
    m = mask.to(next(iter(got.values())).device) if got else mask
    wrong += _identities(layout, got, m)
    row["wrong"] = wrong
    row["status"] = "measured wrong" if wrong else "equal"
    row["seconds"] = time.perf_counter() - t0
    return row


def _address(plan, name):
    return next(a for a in plan.addresses if str(a) == name)


def _identities(layout, got: dict, mask) -> list[str]:
    out = []

    def close(a, b, what):
        a, b = a[mask], b[mask]
        scale = max(float(a.abs().max()), float(b.abs().max()), 1e-30)
        if float((a - b).abs().max()) > 1e-4 * scale:
            out.append(what)

    for i, kind in enumerate(layout.block_kinds):
        g = {s: got.get(f"{s}:{i}") for s in ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")}
        if i and g["resid_pre"] is not None and got.get(f"resid_post:{i - 1}") is not None:
            close(g["resid_pre"], got[f"resid_post:{i - 1}"], f"block {i}: resid_pre != resid_post:{i - 1}")
        if kind == "sequential, pre-norm" and all(g[s] is not None for s in ("resid_pre", "attn_out", "resid_mid")):
            close(g["resid_mid"], g["resid_pre"] + g["attn_out"], f"block {i}: resid_mid != resid_pre + attn_out")
        if kind == "sequential, pre-norm" and all(g[s] is not None for s in ("resid_mid", "mlp_out", "resid_post")):
            close(g["resid_post"], g["resid_mid"] + g["mlp_out"], f"block {i}: resid_post != resid_mid + mlp_out")
        if kind == "parallel" and all(g[s] is not None for s in ("resid_pre", "attn_out", "mlp_out", "resid_post")):
            close(g["resid_post"], g["resid_pre"] + g["attn_out"] + g["mlp_out"],
                  f"block {i}: resid_post != resid_pre + attn_out + mlp_out")
    return out


# -- the table ----------------------------------------------------------------------------------------------------------

SUBLAYER_CLASSES = ("all six sites at every block",
                    "every site the blocks have (parallel blocks: no resid_mid)",
                    "every site the blocks have (hybrid or single-sub-layer blocks)",
                    "some sites unverified (refused)", "hidden states only (no block modules)")


def sublayer_class(row: dict) -> str:
    """Verified = every site a block structurally has passed the load check (the first three classes)."""
    refused = row.get("refused", {})
    if not row.get("blocks"):
        return SUBLAYER_CLASSES[4]
    if not refused:
        return SUBLAYER_CLASSES[0]
    if any(not r["absent"] for r in refused.values()):
        return SUBLAYER_CLASSES[3]
    if set(refused) == {"resid_mid"} and all("parallel" in r["reason"] for r in refused.values()):
        return SUBLAYER_CLASSES[1]
    return SUBLAYER_CLASSES[2]


def summarize(rows: list[dict]) -> dict:
    out = {}
    for kind in ("causal", "encoder"):
        mine = [r for r in rows if r["kind"] == kind]
        built = [r for r in mine if r["status"] not in ("not built",)]
        equal = [r for r in built if r["status"] == "equal"]
        verified = [r for r in equal if sublayer_class(r) in SUBLAYER_CLASSES[:3]]
        out[kind] = {
            "types": len(mine), "built": len(built), "equal_at_every_hidden_state": len(equal),
            "sublayers_verified": len(verified),
            "refused": len([r for r in built if r["status"] == "refused"]),
            "errors": len([r for r in built if r["status"] == "error"]),
            "measured_wrong": len([r for r in built if r["status"] == "measured wrong"]),
            "sublayers": dict(Counter(sublayer_class(r) for r in equal)),
        }
    return out


def markdown(doc: dict) -> str:
    s = doc["summary"]
    lines = [f"Swept on transformers {doc['transformers']} by `make any-model` ({doc['seconds']:.0f} s; "
             "benchmarks/any_model.py, results in benchmarks/results/any_model.json):", "",
             "| model types | in transformers | built tiny | equal at every hidden state | sub-layers verified | "
             "refused | measured wrong |", "|---|---|---|---|---|---|---|"]
    for kind, label in (("causal", "causal LM"), ("encoder", "text encoder / encoder-decoder")):
        k = s[kind]
        pct = lambda a, b: f"{a} ({100 * a / b:.0f} %)" if b else "0"  # noqa: E731
        lines.append(f"| {label} | {k['types']} | {k['built']} | {pct(k['equal_at_every_hidden_state'], k['built'])} "
                     f"| {pct(k['sublayers_verified'], k['built'])} | {k['refused'] + k['errors']} "
                     f"| {k['measured_wrong']} |")
    lines += ["", "Sub-layer sites of the types measured equal:", ""]
    for kind, label in (("causal", "causal LM"), ("encoder", "encoder")):
        parts = [f"{n} {c}" for c, n in sorted(s[kind]["sublayers"].items(), key=lambda x: -x[1])]
        lines.append(f"- {label}: " + "; ".join(parts))
    bad = [r for r in doc["rows"] if r["status"] in ("refused", "error", "measured wrong")]
    if bad:
        lines += ["", "Refused or failed (one line each):", ""]
        lines += [f"- `{r['type']}` ({r['kind']}): {r['status']}: {r.get('reason') or '; '.join(r.get('wrong', []))}"
                  for r in bad]
    unbuilt = Counter(r["reason"].split(":")[0] for r in doc["rows"] if r["status"] == "not built")
    if unbuilt:
        lines += ["", "Not buildable at tiny size: " + ", ".join(
            f"`{r['type']}`" for r in doc["rows"] if r["status"] == "not built") + "."]
    return "\n".join(lines)
