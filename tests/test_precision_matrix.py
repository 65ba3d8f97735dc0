"""Labels decided in a precision that can decide them (docs/metrics.md#how-an-address-is-found and #precision).

Twelve model types at tiny size, made realistic where half precision breaks (``make_realistic``: norm gains spread
over 0.4–2.5 with biases, and one massive hidden dimension, 10²–10³ times the others, as SmolLM2 has), each loaded in
float32, bfloat16 and float16:

* every address reads the same hook point as in float32, whether the load check probes the model upcast to float32
  (the default) or, where that cannot be done, per hidden dimension in the model's own dtype (a site may then be
  refused, never renamed);
* every site is the tensor the transformers source says it is, read here by this file's own hooks (``ORACLE``): a
  site chosen by module name without verification (T5's ``mlp_in`` read before its norm) fails here;
* ``measure`` gives, in each dtype, the same addresses as float32 with values within docs/metrics.md's tolerance.

The MTEB sweep and ``repgeom-hf`` run the same matrix in tests/test_precision_surfaces.py; SmolLM2 in
tests/test_smollm2.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import repgeom_eval as rg
from repgeom_eval.measurement.forward import Forward, model_inputs
from repgeom_eval.modeling.addresses import Address, available_addresses, resolve
from repgeom_eval.modeling.discovery import discover
from repgeom_eval.modeling.loading import load_model

DTYPES = ("float32", "bfloat16", "float16")
#: |value − float32's| allowed for a cosine-distance metric (docs/metrics.md#precision)
TOLERANCE = {"float32": 0.0, "bfloat16": 0.02, "float16": 0.005}
TEXTS = ["The quick brown fox jumps over the lazy dog near the river bank today.", "Short text.",
         "Numbers such as 3 and 4 appear here, in a sentence of middling length.", "x y z",
         "Another sentence, of ordinary words, to pad the batch out a little further."]

# What the transformers source says each site is: (module relative to the block, "in" or "out"), outputs read at [0].
# None: the block has no such tensor (parallel blocks have no stream between attention and feed-forward).
PRE_NORM = {"attn_out": ("self_attn", "out"), "resid_mid": ("post_attention_layernorm", "in"),
            "mlp_in": ("mlp", "in"), "mlp_out": ("mlp", "out")}
ORACLE: dict[str, tuple[str, str, str | None, dict]] = {
    # type: (kind, blocks, final norm (None: the last block's output), sites)
    "gpt2": ("causal", "transformer.h", "transformer.ln_f",
             {"attn_out": ("attn", "out"), "resid_mid": ("ln_2", "in"), "mlp_in": ("mlp", "in"),
              "mlp_out": ("mlp", "out")}),
    "llama": ("causal", "model.layers", "model.norm", PRE_NORM),
    "qwen3": ("causal", "model.layers", "model.norm", PRE_NORM),
    "mixtral": ("causal", "model.layers", "model.norm", PRE_NORM),
    "opt": ("causal", "model.decoder.layers", "model.decoder.final_layer_norm",
            {"attn_out": ("self_attn", "out"), "resid_mid": ("final_layer_norm", "in"), "mlp_in": ("fc1", "in"),
             "mlp_out": ("fc2", "out")}),
    "gemma2": ("causal", "model.layers", "model.norm",  # sandwich norms: each contribution is normed before the add
               {"attn_out": ("post_attention_layernorm", "out"), "resid_mid": ("pre_feedforward_layernorm", "in"),
                "mlp_in": ("mlp", "in"), "mlp_out": ("post_feedforward_layernorm", "out")}),
    "gpt_neox": ("causal", "gpt_neox.layers", "gpt_neox.final_layer_norm",
                 {"attn_out": ("attention", "out"), "resid_mid": None, "mlp_in": ("mlp", "in"),
                  "mlp_out": ("mlp", "out")}),
    "phi": ("causal", "model.layers", "model.final_layernorm",
            {"attn_out": ("self_attn", "out"), "resid_mid": None, "mlp_in": ("mlp", "in"), "mlp_out": ("mlp", "out")}),
    "falcon": ("causal", "transformer.h", "transformer.ln_f",
               {"attn_out": ("self_attention", "out"), "resid_mid": None, "mlp_in": ("mlp", "in"),
                "mlp_out": ("mlp", "out")}),
    "t5": ("encoder", "encoder.block", "encoder.final_layer_norm",  # T5LayerFF normalises inside: read after it
           {"attn_out": ("layer.0.SelfAttention", "out"), "resid_mid": ("layer.1", "in"),
            "mlp_in": ("layer.1.DenseReluDense", "in"), "mlp_out": ("layer.1.DenseReluDense", "out")}),
    "bert": ("encoder", "encoder.layer", None,
             {"attn_out": ("attention.output.dense", "out"), "resid_mid": ("attention", "out"),
              "mlp_in": ("intermediate", "in"), "mlp_out": ("output.dense", "out")}),
    "roberta-prelayernorm": ("encoder", "encoder.layer", "LayerNorm",  # its intermediate holds the FFN's norm
                             {"attn_out": ("attention.output.dense", "out"), "resid_mid": ("intermediate", "in"),
                              "mlp_in": ("intermediate.dense", "in"), "mlp_out": ("output.dense", "out")}),
}
TYPES = list(ORACLE)
LM_PAIRS = [("the cat sat on", "mat"), ("dogs ran over green", "hills"), ("birds sang near old", "towns"),
            ("a quick brown fox", "jumps"), ("numbers like three and", "four"), ("rain fell on the", "roof")]


def labels(layout) -> dict[str, object]:
    """Everything a label depends on: what each hidden_states[k] is called, and where each site is read."""
    out: dict[str, object] = {f"hidden_states[{k}]": name for k, name in enumerate(layout.hidden_states)}
    out["embed"], out["final"] = str(layout.embed.point), str(layout.final.point)
    for i, block in enumerate(layout.sites):
        for site, s in block.items():
            out[f"{site}:{i}"] = (str(s.point), s.verified)
    return out


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


@pytest.mark.parametrize("model_type", TYPES)
def test_labels_in_half_precision_are_the_float32_labels(realistic, model_type):
    path = realistic(model_type)
    want = labels(quiet(load_model, path, dtype="float32").layout)
    assert not any(v == ("None", True) for k, v in want.items() if k.startswith(("attn_out", "mlp_")))
    for dtype in ("bfloat16", "float16"):
        loaded = quiet(load_model, path, dtype=dtype)
        assert next(loaded.model.parameters()).dtype == getattr(torch, dtype)  # cast back after the probe
        assert any("ran in float32" in note for note in loaded.layout.notes)
        assert labels(loaded.layout) == want, dtype
        # the other path: the probe in the model's own dtype, each equality per hidden dimension; a site may be
        # refused there (T5 keeps its output projections in float32 and mixes dtypes), never named differently
        native = labels(quiet(discover, loaded.model, cache=False, upcast=False))
        wrong = {k: (v, want[k]) for k, v in native.items()
                 if v != want[k] and v not in (None, "None", ("None", True))}
        assert not wrong, (dtype, wrong)
        same = sum(v == want[k] for k, v in native.items())
        assert same >= 0.75 * len(want), (dtype, same, len(want))


def own_hooks(model, runner, blocks: str, final: str | None, sites: dict, n_layers: int, inputs: dict):
    """This file's own reading of every site: plain forward hooks at the modules the source names."""
    got: dict[str, torch.Tensor] = {}
    handles = []
    modules = dict(model.named_modules())

    def keep(name):
        def hook(module, args, kwargs, output=None):
            value = output if output is not None else (args[0] if args else kwargs["hidden_states"])
            value = value[0] if isinstance(value, tuple) else value
            got.setdefault(name, value.detach().clone())
        return hook

    for i in range(n_layers):
        block = f"{blocks}.{i}"
        handles.append(modules[block].register_forward_pre_hook(keep(f"resid_pre:{i}"), with_kwargs=True))
        handles.append(modules[block].register_forward_hook(keep(f"resid_post:{i}"), with_kwargs=True))
        for site, where in sites.items():
            if where is None:
                continue
            module, direction = modules[f"{block}.{where[0]}"], where[1]
            if direction == "in":
                handles.append(module.register_forward_pre_hook(keep(f"{site}:{i}"), with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(keep(f"{site}:{i}"), with_kwargs=True))
    if final is not None:
        handles.append(modules[final].register_forward_hook(keep("final"), with_kwargs=True))
    try:
        with torch.no_grad():
            runner(**inputs)
    finally:
        for h in handles:
            h.remove()
    if final is None:
        got["final"] = got[f"resid_post:{n_layers - 1}"]
    return got


@pytest.mark.parametrize("model_type", TYPES)
def test_every_site_is_the_tensor_the_source_names(realistic, model_type):
    kind, blocks, final, sites = ORACLE[model_type]
    loaded = quiet(load_model, realistic(model_type))
    layout = loaded.layout
    assert layout.blocks == blocks  # names from the model's root (T5's blocks are in its encoder)
    for site, where in sites.items():
        assert all(block[site].ok == (where is not None) for block in layout.sites), site
    addresses = [a for a in available_addresses(loaded) if a.site != "embed"]
    with Forward(loaded, resolve(addresses, loaded)) as fwd:
        batch = quiet(fwd.texts, TEXTS, 32)
    mask = batch.mask.cpu()
    inputs = model_inputs(loaded, batch.ids, mask.long())
    mine = own_hooks(loaded.model, loaded.runner, blocks, final, sites, layout.n_layers, inputs)
    compared = 0
    for addr in addresses:
        want = mine[str(addr)]
        want = want.reshape(*batch.ids.shape, -1)  # OPT's feed-forward sees the tokens flattened
        got = batch.hidden[addr]
        scale = float(want[mask].abs().max())
        err = float((got[mask].double() - want[mask].double()).abs().max()) / scale
        assert err < 1e-6, (addr, err)
        compared += 1
    assert compared == len(addresses) >= 2 + 4 * layout.n_layers


@pytest.mark.parametrize("model_type", TYPES)
def test_measure_in_every_precision(realistic, model_type):
    path = realistic(model_type)
    results = {dtype: quiet(rg.measure, path, TEXTS, layers="all", metrics=["dispersion", "token_dispersion"],
                            pooling="mean", dtype=dtype, batch_size=3, progress=False) for dtype in DTYPES}
    ref = results["float32"].results
    assert len(ref) == len(quiet(load_model, path).layout.hidden_states)
    for dtype, result in results.items():
        assert result.config["dtype"] == dtype
        assert result.results.keys() == ref.keys()
        for addr, values in result.results.items():
            for metric, value in values.items():
                assert abs(value - ref[addr][metric]) <= TOLERANCE[dtype], (dtype, addr, metric, value,
                                                                          ref[addr][metric])


def test_a_site_chosen_by_name_alone_would_fail_here(realistic):
    """The check above is not blind: T5's feed-forward module takes the un-normed stream (resid_mid); with realistic
    norm gains that is a different tensor, at a different dispersion, from what its DenseReluDense reads."""
    loaded = quiet(load_model, realistic("t5"))
    points = resolve([Address("resid_mid", 1), Address("mlp_in", 1)], loaded)
    with Forward(loaded, points) as fwd:
        batch = quiet(fwd.texts, TEXTS, 32)
    a, b = (batch.hidden[Address(s, 1)][batch.mask] for s in ("resid_mid", "mlp_in"))
    assert float((a - b).abs().max()) > 0.1 * float(b.abs().max())
    from repgeom_eval.functional.dispersion import pairwise_dispersion

    assert abs(float(pairwise_dispersion(a.double())) - float(pairwise_dispersion(b.double()))) > 1e-3


def test_the_upcast_restores_every_tensor_exactly(realistic):
    from repgeom_eval.modeling.precision import probe_precision

    loaded = quiet(load_model, realistic("llama"), dtype="bfloat16")
    model = loaded.model
    before = {name: (t.dtype, t.clone()) for name, t in [*model.named_parameters(), *model.named_buffers()]}
    with probe_precision(model) as how:
        assert "float32" in how and all(p.dtype == torch.float32 for p in model.parameters())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        dtype, value = before[name]
        assert t.dtype == dtype and torch.equal(t, value), name


def test_nothing_to_upcast_in_float32(realistic):
    from repgeom_eval.modeling.precision import probe_precision

    loaded = quiet(load_model, realistic("gpt2"))
    with probe_precision(loaded.model) as how:
        assert how == ""
    assert not any("load check ran" in note for note in loaded.layout.notes)


def test_a_model_that_cannot_be_upcast_is_probed_per_dimension(realistic, monkeypatch):
    from repgeom_eval.modeling import precision

    monkeypatch.setattr(precision, "free_memory", lambda device: 0)  # no room for a float32 copy
    loaded = quiet(load_model, realistic("qwen3"), dtype="bfloat16")
    note = [n for n in loaded.layout.notes if "load check ran" in n]
    assert note and "bfloat16" in note[0] and "per hidden dimension" in note[0] and "GiB" in note[0]
    assert labels(loaded.layout) == labels(quiet(load_model, realistic("qwen3")).layout)


def test_a_plugin_table_entry_the_probe_cannot_confirm_is_marked_and_warned(realistic, capsys):
    """An architecture table that reads mlp_in where the probe cannot confirm it: served, but marked in
    `repgeom addresses` (?, not ✓) and warned about in every output that reads it."""
    from repgeom_eval.modeling.architectures import pre_ln_decoder
    from repgeom_eval.modeling.hooks import HookPoint
    from repgeom_eval.modeling.loading import wrap_model

    loaded = quiet(load_model, realistic("llama"))
    table = pre_ln_decoder("my-llama", blocks="layers", attn="self_attn", ln2="post_attention_layernorm",
                           mlp="mlp", final_norm="norm")
    table = type(table)(**{**table.__dict__, "sites": {**table.sites, "mlp_in": HookPoint("mlp.down_proj", "input")}})
    layout = quiet(discover, loaded.model, table, "my-llama", cache=False)
    site = layout.sites[0]["mlp_in"]
    assert site.ok and not site.verified and "not verified" in site.note
    assert set(layout.unverified_sites()) == {"mlp_in"}
    other = wrap_model(loaded.model, loaded.tokenizer)
    other.layout = layout
    with pytest.warns(UserWarning, match="could not verify"):
        resolve([Address("mlp_in", 0)], other)


def test_in_memory_model_in_train_mode_is_measured_in_eval_mode_and_given_back(realistic):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = realistic("opt")
    model = AutoModelForCausalLM.from_pretrained(path, dropout=0.5, attention_dropout=0.5).train()
    tokenizer = AutoTokenizer.from_pretrained(path)
    first = quiet(rg.measure, model, TEXTS, tokenizer=tokenizer, layers="all", progress=False).results
    second = quiet(rg.measure, model, TEXTS, tokenizer=tokenizer, layers="all", progress=False).results
    folder = quiet(rg.measure, path, TEXTS, layers="all", progress=False).results
    assert first == second
    for addr, values in folder.items():
        assert first[addr]["dispersion"] == pytest.approx(values["dispersion"], abs=1e-6)
    assert model.training and all(m.training for m in model.modules())

