"""Every hook site against a manual computation on tiny models of every architecture in the table."""

import pytest
import torch

from repgeom_eval.modeling.addresses import available_addresses, parse_layers, resolve
from repgeom_eval.modeling.hooks import Capture
from repgeom_eval.modeling.loading import load_model

DECODERS = ["gpt2", "llama", "qwen2", "qwen3", "mistral", "gemma", "phi3", "olmo", "gpt_neox_sequential"]


def capture_all(loaded, text="The quick brown fox jumps over the lazy dog. It was not amused."):
    enc = loaded.tokenizer([text, "Short one."], padding=True, return_tensors="pt")
    addrs = available_addresses(loaded)
    with Capture(loaded.model, resolve(addrs, loaded), stop_early=False) as cap:
        got = cap.run(**enc)
    with torch.no_grad():
        ref = loaded.model(**enc, output_hidden_states=True)
    return {str(a): t for a, t in got.items()}, ref.hidden_states, enc


def close(a, b, tol=1e-5):
    return torch.allclose(a, b, atol=tol, rtol=tol)


def blocks_of(loaded):
    return loaded.model.get_submodule(loaded.layout.blocks)


@pytest.mark.parametrize("kind", DECODERS)
def test_pre_ln_decoder_sites(kind, tiny_model_dir):
    loaded = load_model(tiny_model_dir(kind, n_layers=3))
    got, hs, _ = capture_all(loaded)
    n = loaded.info.n_layers
    blocks = blocks_of(loaded)
    assert close(got["embed"], hs[0])
    assert close(got["final"], hs[n])  # hidden_states[L] = final norm(last block)
    for layer in range(n):
        block = blocks[layer]
        pre, attn, mid = got[f"resid_pre:{layer}"], got[f"attn_out:{layer}"], got[f"resid_mid:{layer}"]
        mlp_in, mlp_out, post = got[f"mlp_in:{layer}"], got[f"mlp_out:{layer}"], got[f"resid_post:{layer}"]
        assert close(pre, hs[layer])
        assert close(mid, pre + attn)
        assert close(post, mid + mlp_out)
        ln2 = loaded.model.get_submodule(loaded.layout.sites[layer]["resid_mid"].point.module_name)
        assert close(mlp_in, ln2(mid))
        if layer < n - 1:
            assert close(post, hs[layer + 1])
    final_norm = loaded.model.get_submodule(loaded.layout.final.point.module_name)
    assert close(got["final"], final_norm(got[f"resid_post:{n - 1}"]))
    assert not close(got["final"], got[f"resid_post:{n - 1}"])  # the pitfall: they differ on decoders


def test_parallel_residual_neox(tiny_model_dir):
    loaded = load_model(tiny_model_dir("gpt_neox", n_layers=2))
    enc = loaded.tokenizer(["Parallel blocks read one input."], return_tensors="pt")
    addrs = [a for a in available_addresses(loaded)]
    with Capture(loaded.model, resolve(addrs, loaded), stop_early=False) as cap:
        got = {str(a): t for a, t in cap.run(**enc).items()}
    block = blocks_of(loaded)[0]
    assert close(got["resid_post:0"], got["resid_pre:0"] + got["attn_out:0"] + got["mlp_out:0"])
    assert close(got["mlp_in:0"], block.post_attention_layernorm(got["resid_pre:0"]))


@pytest.mark.parametrize("kind", ["bert", "roberta", "xlm-roberta"])
def test_post_ln_encoder_sites(kind, tiny_model_dir):
    loaded = load_model(tiny_model_dir(kind, n_layers=3))
    got, hs, _ = capture_all(loaded)
    n = loaded.info.n_layers
    for layer in range(n):
        layer_mod = blocks_of(loaded)[layer]
        pre, attn, mid = got[f"resid_pre:{layer}"], got[f"attn_out:{layer}"], got[f"resid_mid:{layer}"]
        assert close(pre, hs[layer])
        assert close(mid, layer_mod.attention.output.LayerNorm(attn + pre))
        assert close(got[f"mlp_in:{layer}"], mid)
        assert close(got[f"resid_post:{layer}"], layer_mod.output.LayerNorm(got[f"mlp_out:{layer}"] + mid))
        assert close(got[f"resid_post:{layer}"], hs[layer + 1])
    assert close(got["final"], hs[n]) and close(got["final"], got[f"resid_post:{n - 1}"])  # no final norm


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_bare_integers_equal_hidden_states(kind, tiny_model_dir):
    loaded = load_model(tiny_model_dir(kind, n_layers=3))
    enc = loaded.tokenizer(["Hidden states by index."], return_tensors="pt")
    n = loaded.info.n_layers
    addrs = parse_layers([str(k) for k in range(n + 1)], n)
    with Capture(loaded.model, resolve(addrs, loaded)) as cap:
        got = cap.run(**enc)
    with torch.no_grad():
        hs = loaded.model(**enc, output_hidden_states=True).hidden_states
    for k, addr in enumerate(addrs):
        assert close(got[addr], hs[k]), (k, addr)


def test_early_stop_runs_only_the_blocks_needed(tiny_model_dir):
    loaded = load_model(tiny_model_dir("llama", n_layers=4))
    calls = []
    blocks = blocks_of(loaded)
    handles = [b.register_forward_hook(lambda m, a, o, i=i: calls.append(i)) for i, b in enumerate(blocks)]
    head_calls = []
    handles.append(loaded.model.lm_head.register_forward_hook(lambda *a: head_calls.append(1)))
    enc = loaded.tokenizer(["Stop early please."], return_tensors="pt")
    try:
        with Capture(loaded.model, resolve(parse_layers("mlp_out:1", 4), loaded)) as cap:
            cap.run(**enc)
        assert calls == [0]  # block 1 started but its output hook never fired: stopped inside it
        calls.clear()
        with Capture(loaded.model, resolve(parse_layers("final", 4), loaded)) as cap:
            cap.run(**enc)
        assert calls == [0, 1, 2, 3] and head_calls == []  # the LM head is skipped
        calls.clear()
        with Capture(loaded.model, resolve(parse_layers("resid_post:1", 4), loaded), stop_early=False) as cap:
            cap.run(**enc)
        assert calls == [0, 1, 2, 3] and head_calls == [1] and cap.outputs is not None
    finally:
        for h in handles:
            h.remove()


def test_hooks_are_removed_after_use(tiny_model_dir):
    loaded = load_model(tiny_model_dir("gpt2"))
    before = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in loaded.model.modules())
    with Capture(loaded.model, resolve(available_addresses(loaded), loaded)) as cap:
        cap.run(**loaded.tokenizer(["x y z"], return_tensors="pt"))
    after = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in loaded.model.modules())
    assert before == after
