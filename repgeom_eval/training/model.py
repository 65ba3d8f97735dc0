"""The model ``repgeom train`` trains: a checkpoint loaded with its model options (continued training), or a small
GPT-2 built from scratch with a byte-level BPE tokenizer trained on the training texts."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.spec.options.train import TrainConfig

EOS = "<|endoftext|>"


def train_tokenizer(texts: Sequence[str], vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2 style) trained on ``texts``, with ``<|endoftext|>`` as BOS/EOS/pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS)


def build_model(cfg: TrainConfig, train_texts: Sequence[str]) -> tuple[Any, Any, dict[str, Any]]:
    """(model in train mode, tokenizer, source description for results.json)."""
    import transformers

    if cfg.model is not None:
        from repgeom_eval.modeling.loading import load_model

        loaded = load_model(cfg.model, options=cfg.model_options)
        model = loaded.model.train().requires_grad_(True)
        return model, loaded.tokenizer, {"kind": "continued", "model": cfg.model}
    scratch = cfg.from_scratch
    assert scratch is not None  # TrainConfig holds exactly one of model and from_scratch
    if scratch.tokenizer is None:
        tokenizer = train_tokenizer(train_texts, scratch.vocab_size)
    else:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(scratch.tokenizer)
        except (OSError, ValueError) as exc:
            raise RepgeomError(f"cannot load tokenizer {scratch.tokenizer!r}: {str(exc).splitlines()[0]}") from None
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    kwargs = dict(n_layer=scratch.n_layer, n_embd=scratch.n_embd, n_head=scratch.n_head,
                  n_positions=int(cfg.data.block_size), vocab_size=len(tokenizer),
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    extra = dict(scratch.gpt2)
    try:
        config = transformers.GPT2Config(**kwargs, **extra)
    except (TypeError, ValueError) as exc:
        raise RepgeomError(f"from_scratch: bad GPT-2 config: {exc}") from None
    unknown = [k for k in extra if not hasattr(config, k)]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(config.to_dict()), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise RepgeomError(f"from_scratch: {unknown} are not GPT-2 config keys{hint} (e.g. n_layer, n_embd, n_head, "
                           "vocab_size, resid_pdrop, embd_pdrop, attn_pdrop)")
    transformers.set_seed(cfg.seed)
    model = transformers.GPT2LMHeadModel(config).train()
    return model, tokenizer, {"kind": "from_scratch", "gpt2": {**kwargs, **extra},
                              "tokenizer": scratch.tokenizer
                              or f"byte-level BPE trained on the training texts ({scratch.vocab_size})"}
