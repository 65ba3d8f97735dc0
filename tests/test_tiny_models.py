"""repgeom_eval.testing.tiny_models: tiny random models of many architectures, shrunk from transformers' own configs."""

import importlib.util

import pytest
import torch

from repgeom_eval.testing.tiny_models import (CAUSAL, ENCODER, TinyBuildError, build_tiny, build_tiny_with_tokenizer,
                                      causal_lm_types, encoder_types, forward_hidden_states, save_tiny, tiny_config)

# diverse blocks: learned positions (opt), parallel attention + MQA (falcon), MoE (mixtral), alternating
# sliding/global attention (gemma2), a linear-attention/attention hybrid with MoE (qwen3_next), an encoder-decoder
# (t5) and a BERT encoder
ROUND_TRIP = [("opt", CAUSAL), ("falcon", CAUSAL), ("mixtral", CAUSAL), ("gemma2", CAUSAL), ("qwen3_next", CAUSAL),
              ("t5", ENCODER), ("bert", ENCODER)]
TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.mark.parametrize("model_type,kind", ROUND_TRIP)
def test_save_and_reload_gives_the_same_model(tmp_path, model_type, kind):
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = build_tiny_with_tokenizer(model_type, kind, seed=3)
    path = save_tiny(model_type, tmp_path / model_type, kind, seed=3)

    reloaded_tok = AutoTokenizer.from_pretrained(path)
    ids = reloaded_tok(TEXT, return_tensors="pt").input_ids
    assert ids.tolist() == tokenizer(TEXT, return_tensors="pt").input_ids.tolist()
    text_config = model.config.get_text_config()
    vocab = text_config.vocab_size
    assert len(reloaded_tok) <= vocab and int(ids.max()) < vocab
    specials = {"<unk>", "<pad>", "<s>", "</s>", "[CLS]", "[SEP]", "[MASK]"}  # make_tokenizer's
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        value = getattr(text_config, name, None)
        assert value is None or tokenizer.convert_ids_to_tokens(value) in specials, (name, value)

    reloaded = (AutoModelForCausalLM if kind == CAUSAL else AutoModel).from_pretrained(path).eval()
    assert type(reloaded) is type(model)
    assert set(reloaded.state_dict()) == set(model.state_dict())
    before, after = forward_hidden_states(model, ids), forward_hidden_states(reloaded, ids)
    assert len(before) == len(after) >= 3  # embeddings + at least two blocks
    for a, b in zip(before, after):
        assert a.shape[:2] == ids.shape and a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_build_is_tiny_float32_eval_and_seeded():
    a, b, c = build_tiny("gptj", seed=1), build_tiny("gptj", seed=1), build_tiny("gptj", seed=2)
    assert not a.training and next(a.parameters()).dtype == torch.float32
    assert sum(p.numel() for p in a.parameters()) < 3_000_000
    assert a.config.rotary_dim <= a.config.n_embd // a.config.n_head  # rotary part fits in the shrunk head
    for (name, x), y, z in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(x, y), name
    assert any(not torch.equal(x, z) for x, z in zip(a.parameters(), c.parameters()))
    hidden = forward_hidden_states(a)
    assert len(hidden) == 3 and hidden[-1].shape == (2, 7, 32)


def test_sizes_are_honoured_and_token_ids_moved_into_the_vocabulary():
    cfg = tiny_config("gpt2", n_layers=3, width=48, vocab_size=300, max_positions=64)
    assert (cfg.n_layer, cfg.n_embd, cfg.vocab_size, cfg.n_positions) == (3, 48, 300, 64)
    assert 0 <= cfg.bos_token_id < 300 and 0 <= cfg.eos_token_id < 300  # 50256 by default
    mla = tiny_config("deepseek_v3")  # multi-head latent attention: the rotary part is the model's head_dim
    assert mla.qk_head_dim == mla.qk_nope_head_dim + mla.qk_rope_head_dim and mla.head_dim == mla.qk_rope_head_dim
    assert mla.num_hidden_layers == 2 and mla.first_k_dense_replace == 1  # one dense layer, one MoE layer


def test_hybrids_keep_every_kind_of_layer():
    assert set(tiny_config("qwen3_next").layer_types) == {"linear_attention", "full_attention"}
    assert set(tiny_config("jamba").layers_block_type) == {"attention", "mamba"}
    assert set(tiny_config("gemma2").layer_types) == {"sliding_attention", "full_attention"}
    gemma3n = tiny_config("gemma3n_text")  # four kinds: (sliding, full) x (sparse, dense activations)
    assert gemma3n.num_hidden_layers == 4 and len(set(zip(gemma3n.layer_types,
                                                           gemma3n.activation_sparsity_pattern))) == 4


def test_type_lists():
    causal = causal_lm_types()
    assert causal == sorted(causal) and {"llama", "mixtral", "jamba", "gpt2"} <= set(causal)
    encoders = encoder_types()  # imports the candidates' modeling modules: a few seconds
    assert encoders == sorted(encoders) and {"bert", "roberta", "deberta-v2", "t5", "bart", "electra"} <= set(encoders)
    assert not {"llama", "whisper", "qwen2_audio", "modernvbert", "perceiver"} & set(encoders)  # not text-only


def _one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert text and "\n" not in text
    return text


def test_errors_are_one_line():
    with pytest.raises(TinyBuildError) as exc:
        build_tiny("no_such_model")
    assert "no_such_model" in _one_line(exc)
    with pytest.raises(TinyBuildError) as exc:
        build_tiny("llama", kind="seq2seq")
    _one_line(exc)
    with pytest.raises(TinyBuildError) as exc:
        build_tiny("llama", width=1024, n_layers=4)  # counted on the meta device, never allocated
    assert "parameters" in _one_line(exc)
    if importlib.util.find_spec("timm") is None:
        with pytest.raises(TinyBuildError) as exc:
            build_tiny("gemma3n")
        assert _one_line(exc) == "needs the timm package"
    model = build_tiny("gemma4_assistant")  # a drafter: it runs on its backbone's states, not on token ids alone
    with pytest.raises(TinyBuildError) as exc:
        forward_hidden_states(model)
    assert _one_line(exc).startswith("forward fails")
