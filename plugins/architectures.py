"""Address tables for the architectures repgeom-eval knows out of the box."""

from __future__ import annotations

from typing import Any

from repgeom_eval import hookimpl, post_ln_encoder, pre_ln_decoder


def _neox_unavailable(config: Any) -> dict[str, str]:
    if getattr(config, "use_parallel_residual", False):
        return {"resid_mid": "this GPT-NeoX configuration uses parallel residual blocks (attention and MLP read "
                             "the same input), so there is no stream between attention and MLP"}
    return {}


GPT2 = pre_ln_decoder("gpt2", blocks="h", attn="attn", ln2="ln_2", mlp="mlp", final_norm="ln_f",
                      description="GPT-2 (transformer.h[l])")
LLAMA = pre_ln_decoder("llama", blocks="layers", attn="self_attn", ln2="post_attention_layernorm", mlp="mlp",
                       final_norm="norm", description="Llama-style decoder (model.layers[l]): Llama, SmolLM2, "
                                                     "Mistral, Qwen2, Qwen3, Gemma, Phi-3, OLMo")
GPT_NEOX = pre_ln_decoder("gpt_neox", blocks="layers", attn="attention", ln2="post_attention_layernorm",
                          mlp="mlp", final_norm="final_layer_norm", unavailable=_neox_unavailable,
                          description="GPT-NeoX / Pythia (gpt_neox.layers[l])")
BERT = post_ln_encoder("bert", description="BERT / MiniLM post-LN encoder (encoder.layer[l])")
ROBERTA = post_ln_encoder("roberta", position_ids_from_mask=False,
                          description="RoBERTa / XLM-R post-LN encoder; positions come from the padding index")

TABLE = {
    "gpt2": GPT2,
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": LLAMA,
    "gemma": LLAMA,
    "phi3": LLAMA,
    "olmo": LLAMA,
    "gpt_neox": GPT_NEOX,
    "bert": BERT,
    "roberta": ROBERTA,
    "xlm-roberta": ROBERTA,
}


@hookimpl
def repgeom_register_architectures(registry):
    for model_type, spec in TABLE.items():
        registry.add(spec, name=model_type, description=spec.description)
