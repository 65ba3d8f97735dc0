"""The BPE tokenizer of every tiny test model, trained in ~0.1 s on text that ships with Python (no network)."""

from __future__ import annotations

_SPECIAL = ["<unk>", "<pad>", "<s>", "</s>", "[CLS]", "[SEP]", "[MASK]"]


def training_text() -> list[str]:
    try:
        from pydoc_data.topics import topics

        return [t for _, t in sorted(topics.items())][:80]
    except ImportError:  # pragma: no cover - every CPython ships pydoc_data
        words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()
        return [" ".join(words[(i * 7 + j) % len(words)] for j in range(40)) for i in range(200)]


def make_tokenizer(encoder: bool = False, vocab_size: int = 384):
    """A byte-level BPE tokenizer trained in ~0.1 s; ``encoder=True`` adds [CLS] … [SEP] like BERT."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(training_text(), trainer=trainer)
    if encoder:
        cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
        return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                       cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]", model_max_length=128)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   model_max_length=128)
