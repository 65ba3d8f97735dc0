"""The load check: sites found by reading the model's modules, each verified on a probe, refused when it cannot be.

Every test here is about a way a table-free discovery could measure the wrong tensor: an in-place addition after the
hook (Falcon), tokens flattened inside the block (OPT), a parallel block, hidden states that start after block 0
(Mamba), no block modules at all (XLNet), a pooler or an LM head missing from the checkpoint, a wrong plugin table.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import repgeom_eval as rg
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.measurement.forward import Forward, model_inputs
from repgeom_eval.modeling.addresses import available_addresses, resolve, resolve_request
from repgeom_eval.modeling.loading import load_model
from repgeom_eval.testing.tiny_models import save_tiny

TEXTS = ["The quick brown fox jumps over the lazy dog near the river.", "Short text.", "Another one, a bit longer."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``tiny("opt")`` → directory of a saved tiny model of that transformers type (built once per module)."""
    made: dict[tuple[str, str], Path] = {}

    def get(model_type: str, kind: str = "causal") -> str:
        if (model_type, kind) not in made:
            made[(model_type, kind)] = save_tiny(model_type, tmp_path_factory.mktemp(f"{kind}-{model_type}"), kind)
        return str(made[(model_type, kind)])

    return get


def captured(loaded, texts=TEXTS):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Forward(loaded, resolve(available_addresses(loaded), loaded)) as fwd:
            batch = fwd.texts(texts, max_length=32)
    return {str(a): t for a, t in batch.hidden.items()}, batch.mask


def close(a, b, mask, tol=1e-5):
    a, b = a[mask], b[mask]
    return float((a - b).abs().max()) <= tol * max(float(b.abs().max()), 1e-30)


def test_built_in_tables_agree_with_discovery(tiny_model_dir):
    """The twelve tabled types: every table entry is the very site discovery verifies."""
    for kind in ("gpt2", "llama", "gpt_neox", "gpt_neox_sequential", "bert", "roberta"):
        loaded = load_model(tiny_model_dir(kind))
        assert loaded.layout.table is not None
        notes = [site.note for block in loaded.layout.sites for site in block.values() if site.ok]
        assert notes and all("agrees" in n for n in notes), (kind, [n for n in notes if "agrees" not in n])


def test_discovery_alone_finds_what_the_tables_say(tiny_model_dir):
    """With the architectures plugin switched off, the same hook points come out of discovery."""
    from repgeom_eval.plugin_system.host import PluginHost

    bare = PluginHost(disable=["architectures"])
    assert len(bare.architectures) == 0
    for kind in ("gpt2", "llama", "bert"):
        with_table = load_model(tiny_model_dir(kind))
        without = load_model(tiny_model_dir(kind), host=bare)
        assert without.layout.table is None
        addrs = available_addresses(with_table)
        assert available_addresses(without) == addrs
        assert resolve(addrs, without) == resolve(addrs, with_table)


def test_opt_feed_forward_on_flattened_tokens(tiny):
    """OPT's fc1/fc2 see [B*T, D]: the hook restores [B, T, D] and resid_post = resid_mid + mlp_out holds."""
    loaded = load_model(tiny("opt"))
    site = loaded.layout.sites[0]["mlp_out"]
    assert site.ok and site.point.flat and site.point.module_name.endswith("fc2")
    got, mask = captured(loaded)
    for i in range(loaded.layout.n_layers):
        assert got[f"mlp_out:{i}"].shape == got[f"resid_post:{i}"].shape
        assert close(got[f"resid_post:{i}"], got[f"resid_mid:{i}"] + got[f"mlp_out:{i}"], mask)


def test_falcon_in_place_addition_is_copied_before(tiny):
    """Falcon adds attention into the MLP's output in place: the hook keeps the MLP's own output."""
    loaded = load_model(tiny("falcon"))
    assert loaded.layout.block_kinds[0] == "parallel"
    mlp = loaded.layout.sites[0]["mlp_out"]
    assert mlp.ok and mlp.point.copy
    assert not loaded.layout.sites[0]["resid_mid"].ok and loaded.layout.sites[0]["resid_mid"].absent
    got, mask = captured(loaded)
    for i in range(loaded.layout.n_layers):
        total = got[f"resid_pre:{i}"] + got[f"attn_out:{i}"] + got[f"mlp_out:{i}"]
        assert close(got[f"resid_post:{i}"], total, mask)
        assert not close(got[f"mlp_out:{i}"], got[f"resid_post:{i}"] - got[f"resid_pre:{i}"], mask)


def test_parallel_block_refuses_resid_mid_in_one_line(tiny):
    loaded = load_model(tiny("gpt_neox"))
    with pytest.raises(RepgeomError, match=r"resid_mid:0 is not available on this gpt_neox model.*parallel") as info:
        resolve_request("resid_mid:0", loaded)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("model_type", ["mamba", "xlnet", "jamba", "gemma2", "mixtral", "t5"])
def test_bare_indices_equal_the_models_own_hidden_states(tiny, model_type):
    """Whatever the model's hidden_states hold (Mamba's start after block 0; XLNet has no block modules), a bare
    index reads exactly hidden_states[k]: padded batch through Forward vs each text alone through the model."""
    kind = "encoder" if model_type == "t5" else "causal"
    path = tiny(model_type, kind)
    try:
        loaded = load_model(path)
    except RepgeomError as exc:  # measured right or refused in one line: refused only where the model cannot run
        from transformers import AutoModel, AutoModelForCausalLM

        own = (AutoModel if kind == "encoder" else AutoModelForCausalLM).from_pretrained(path)
        ids = torch.tensor([[11, 12, 13, 14]])
        with pytest.raises(Exception):  # noqa: B017 - whatever the model's own code raises
            own(input_ids=ids)
        assert "\n" not in str(exc)
        return
    n = len(loaded.layout.hidden_states)
    plan = resolve_request([str(k) for k in range(n)], loaded)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Forward(loaded, plan.points) as fwd:
            batch = fwd.texts(TEXTS, max_length=32)
    for row in range(len(TEXTS)):
        real = batch.mask[row].cpu()
        ids = batch.ids[row:row + 1, real]
        with torch.no_grad():
            ref = loaded.runner(**model_inputs(loaded, ids, torch.ones_like(ids)), output_hidden_states=True,
                                return_dict=True).hidden_states
        for k in range(n):
            addr = next(a for a in plan.addresses if str(a) == plan.reported_as.get(str(k), str(k)))
            got = batch.hidden[addr][row, real]
            assert torch.allclose(got, ref[k][0], atol=1e-5, rtol=1e-4), (model_type, k, str(addr))


def test_hidden_states_only_model_refuses_sub_layers_with_the_reason(tiny):
    loaded = load_model(tiny("xlnet"))
    assert loaded.layout.blocks == "" and loaded.layout.embed.point.direction == "hidden_states"
    with pytest.raises(RepgeomError, match="no list of block modules produces its hidden_states"):
        resolve_request("mlp_out:0", loaded)
    result = rg.measure(loaded, TEXTS, layers="all", metrics=["dispersion"], progress=False)
    assert set(result.results) == {"embed", "resid_post:0", "final"}


def test_mamba_blocks_have_no_attention_and_say_so(tiny):
    loaded = load_model(tiny("mamba"))
    site = loaded.layout.sites[0]["attn_out"]
    assert not site.ok and site.absent and "single sub-layer" in site.note and "'mamba'" in site.note
    assert loaded.layout.hidden_states[0] == "resid_post:0"  # Mamba's hidden_states start after block 0


def test_encoder_decoder_measures_its_encoder_and_says_so(tiny):
    with pytest.warns(UserWarning, match="t5 is an encoder-decoder model: its encoder is measured"):
        loaded = load_model(tiny("t5", "encoder"))
    assert loaded.layout.runner == "encoder" and loaded.layout.blocks == "encoder.block"
    result = rg.measure(loaded, TEXTS, layers="final", metrics=["dispersion"], progress=False)
    assert 0 < result.results["final"]["dispersion"] < 2


def test_bert_saved_from_its_lm_head_class_loads_without_its_pooler(tiny_model_dir, tmp_path):
    """The pooler feeds no hidden state: missing, it is listed, not refused; logits-based commands refuse."""
    from transformers import AutoTokenizer, BertConfig, BertLMHeadModel

    src = Path(tiny_model_dir("bert"))
    model = BertLMHeadModel(BertConfig.from_pretrained(src))
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(src).save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.info.unused_random_tensors and all(k.startswith("pooler.") for k in loaded.info.unused_random_tensors)
    assert loaded.info.random_init_tensors == []
    rg.measure(loaded, TEXTS, layers="all", metrics=["dispersion"], progress=False)
    with pytest.raises(RepgeomError, match="needs next-token logits"):
        Forward(loaded, resolve_request("final", loaded).points, logits=True)


def test_a_missing_tensor_that_hidden_states_read_is_still_refused(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    src = Path(tiny("opt"))
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    weights = load_file(tmp_path / "model.safetensors")
    gone = next(k for k in weights if ".layers.1.fc1." in k)
    del weights[gone]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RepgeomError, match=r"does not match its architecture: 1 tensor\(s\) missing"):
        load_model(str(tmp_path))


def test_a_missing_lm_head_is_refused_only_where_logits_are_needed(tiny_model_dir, tmp_path):
    """GPT-NeoX keeps its own output matrix (embed_out): without it hidden states are fine, logits are not."""
    from safetensors.torch import load_file, save_file

    src = Path(tiny_model_dir("gpt_neox"))
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    weights = load_file(tmp_path / "model.safetensors")
    assert "embed_out.weight" in weights
    save_file({k: v for k, v in weights.items() if k != "embed_out.weight"}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    loaded = load_model(str(tmp_path))
    head = next(n for n, p in loaded.model.named_parameters()  # lm_head.weight since transformers 5.x renamed it
                if p is loaded.model.get_output_embeddings().weight)
    assert loaded.info.unused_random_tensors == [head]
    rg.measure(loaded, TEXTS, layers="final", metrics=["dispersion"], progress=False)
    with pytest.raises(RepgeomError, match=f"lacks the tensors {head}"):
        loaded.check_logits("ppl-bins")


def test_a_plugin_table_that_contradicts_the_hidden_states_is_an_error(tiny_model_dir):
    from types import ModuleType

    from repgeom_eval import hookimpl, pre_ln_decoder
    from repgeom_eval.plugin_system.host import PluginHost

    plugin = ModuleType("wrong_table")
    wrong = pre_ln_decoder("wrong", blocks="layers", attn="self_attn", ln2="post_attention_layernorm", mlp="mlp",
                           final_norm="embed_tokens")

    @hookimpl
    def repgeom_register_architectures(registry):
        registry.add(wrong, name="llama")

    plugin.repgeom_register_architectures = repgeom_register_architectures
    host = PluginHost(disable=["architectures"], extra_plugins=[("wrong_table", plugin)])
    with pytest.raises(RepgeomError, match="architecture table 'llama'.*embed_tokens is not last_hidden_state"):
        load_model(tiny_model_dir("llama"), host=host)


def test_rows_run_alone_where_padding_changes_hidden_states(tiny_model_dir):
    """A model whose load check found a padding side unsafe gets each text alone, with the same numbers."""
    loaded = load_model(tiny_model_dir("llama"))
    want, mask = captured(loaded)
    loaded.layout.padding_sides = ()
    try:
        with pytest.warns(UserWarning, match="texts of each batch run one at a time"):
            with Forward(loaded, resolve(available_addresses(loaded), loaded)) as fwd:
                got = {str(a): t for a, t in fwd.texts(TEXTS, max_length=32).hidden.items()}
    finally:
        loaded.layout.padding_sides = ("right", "left")
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert close(got[name], tensor, mask, tol=1e-5), name


def test_in_memory_model_measures_as_its_folder(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_dir("llama")
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    from_folder = rg.measure(path, TEXTS, layers="all", metrics=["dispersion"], progress=False)
    in_memory = rg.measure(model, TEXTS, tokenizer=tokenizer, layers="all", metrics=["dispersion"], progress=False)
    for addr, values in from_folder.results.items():
        assert in_memory.results[addr]["dispersion"] == pytest.approx(values["dispersion"], rel=1e-6)
    with pytest.raises(RepgeomError, match="needs its tokenizer"):
        rg.measure(model, TEXTS, progress=False)


def test_peft_adapter_is_applied_and_recorded(tiny_model_dir, tmp_path):
    peft = pytest.importorskip("peft")  # the dev extra installs it; a user without it gets the one-line error below
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("llama")
    base = AutoModelForCausalLM.from_pretrained(path)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                     init_lora_weights=False))
    lora.save_pretrained(tmp_path / "adapter")
    from repgeom_eval.spec.options.model import ModelOptions

    plain = rg.measure(path, TEXTS, layers="all", metrics=["dispersion"], progress=False)
    adapted = rg.measure(path, TEXTS, layers="all", metrics=["dispersion"], progress=False,
                         model_options=ModelOptions(peft=str(tmp_path / "adapter")))
    assert adapted.model["options"] == {"peft": str(tmp_path / "adapter")}
    assert adapted.results["final"]["dispersion"] != pytest.approx(plain.results["final"]["dispersion"], rel=1e-6)
    # the adapted numbers are the PEFT model's own
    lora.eval()
    direct = rg.measure(lora, TEXTS, tokenizer=load_model(path).tokenizer, layers="all", metrics=["dispersion"],
                        progress=False)
    for addr in plain.results:
        assert adapted.results[addr]["dispersion"] == pytest.approx(direct.results[addr]["dispersion"], rel=1e-5)
    with pytest.raises(RepgeomError, match="no adapter_config.json"):
        load_model(path, options=ModelOptions(peft=str(tmp_path)))


def test_addresses_command_shows_the_load_check(tiny, capsys):
    from repgeom_eval.entrypoints.cli import main

    assert main(["addresses", "-m", tiny("falcon")]) == 0
    out = capsys.readouterr().out
    assert "parallel" in out and "✗ resid_mid:0" in out and "✓ mlp_out:0" in out
    assert main(["addresses", "-m", tiny("falcon"), "--json"]) == 0
    import json

    doc = json.loads(capsys.readouterr().out)
    assert doc["block_kinds"] == ["parallel"]
    assert any(a["address"] == "resid_mid:0" and not a["ok"] for a in doc["addresses"])


def test_a_second_capture_between_passes_leaves_nothing_stale(tiny):
    """lm-eval's fused capture stays installed while an extra pass runs its own Capture over the same model: the
    next pass the first one takes is its own (call counts and tensors start afresh at every pass)."""
    from repgeom_eval.modeling.hooks import Capture

    loaded = load_model(tiny("nanochat"))  # its norm module runs twice a pass: `final` is its second call
    assert loaded.layout.final.point.call == 1
    points = resolve_request(["final", "resid_post:0"], loaded).points
    tok = loaded.tokenizer
    first, other, last = (tok([t], return_tensors="pt")["input_ids"] for t in TEXTS)
    with Capture(loaded.model, points, stop_early=False) as outer:
        with torch.no_grad():
            loaded.model(input_ids=first)
        outer.take()
        with Forward(loaded, points) as inner:  # the extra pass, hooks of both captures installed
            inner.token_ids([other[0].tolist()])
        with torch.no_grad():
            want = loaded.model(input_ids=last, output_hidden_states=True).hidden_states
        got = {str(a): t for a, t in outer.take().items()}
    assert torch.allclose(got["final"], want[-1], atol=1e-6) and torch.allclose(got["resid_post:0"], want[1], atol=1e-6)
