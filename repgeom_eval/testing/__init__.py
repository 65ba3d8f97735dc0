"""Helpers for testing repgeom-eval and third-party plugins: tiny offline models and a metric conformance check.

``make_tiny_model("llama", path)`` writes a 2-block model of width 32 with a BPE tokenizer trained on text that
ships with Python, loadable through the normal ``from_pretrained`` path (< 1 s, < 1 MB, no network).

``check_metric(MyMetric)`` asserts the properties every metric must have: every parameter is reported by
``config()``, the same value whether the data arrives in one batch or many, two merged shards equal one pass, state
survives ``state_dict``/``load_state_dict`` and pickling.

The package holds the test tooling (docs/development.md, "Layout"): :mod:`.tiny_models` (the one builder of a saved
tiny model, :func:`~.tiny_models.save_built`; ``save_tiny`` shrinks transformers' own config of any type),
:mod:`.tiny_tokenizer`, :mod:`.tiny_shrink` and :mod:`.tiny_overrides`, the coverage tool :mod:`.coverage` and the
demo assets :mod:`.demo`.
"""

from __future__ import annotations

import copy
import math
import pickle
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..spec.metric import Consumes, LayerBatch, Metric
from .tiny_tokenizer import training_text, make_tokenizer

TINY_KINDS = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "olmo", "gpt_neox", "gpt_neox_sequential",
              "bert", "roberta", "xlm-roberta")
def tiny_config(kind: str, vocab_size: int, n_layers: int = 2, width: int = 32):
    import transformers as tf

    common = dict(vocab_size=vocab_size)
    decoder = dict(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=n_layers, num_attention_heads=2,
                   num_key_value_heads=1, max_position_embeddings=128, pad_token_id=1, bos_token_id=2, eos_token_id=3,
                   tie_word_embeddings=True, **common)
    if kind == "gpt2":
        return tf.GPT2Config(n_layer=n_layers, n_embd=width, n_head=2, n_positions=128, bos_token_id=2,
                             eos_token_id=3, **common)
    if kind == "llama":
        return tf.LlamaConfig(**decoder)
    if kind == "mistral":
        return tf.MistralConfig(**decoder)
    if kind == "qwen2":
        return tf.Qwen2Config(**decoder)
    if kind == "qwen3":
        return tf.Qwen3Config(head_dim=width // 2, **decoder)
    if kind == "gemma":
        return tf.GemmaConfig(head_dim=width // 2, **decoder)
    if kind == "phi3":
        return tf.Phi3Config(**decoder)
    if kind == "olmo":
        return tf.OlmoConfig(**decoder)
    if kind in ("gpt_neox", "gpt_neox_sequential"):
        return tf.GPTNeoXConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=n_layers,
                                num_attention_heads=2, max_position_embeddings=128, rotary_pct=0.5,
                                use_parallel_residual=(kind == "gpt_neox"), bos_token_id=2, eos_token_id=3, **common)
    if kind == "bert":
        return tf.BertConfig(hidden_size=width, num_hidden_layers=n_layers, num_attention_heads=2,
                             intermediate_size=2 * width, max_position_embeddings=128, pad_token_id=1, **common)
    if kind in ("roberta", "xlm-roberta"):
        cls = tf.RobertaConfig if kind == "roberta" else tf.XLMRobertaConfig
        return cls(hidden_size=width, num_hidden_layers=n_layers, num_attention_heads=2,
                                intermediate_size=2 * width, max_position_embeddings=130, pad_token_id=1, **common)
    raise ValueError(f"unknown tiny model kind {kind!r} (valid: {', '.join(TINY_KINDS)})")


def make_tiny_model(kind: str, path: str | Path, n_layers: int = 2, width: int = 32, seed: int = 0) -> Path:
    """Build, save and return the directory of a tiny randomly initialised model with its tokenizer: the config is
    :func:`tiny_config` (one of :data:`TINY_KINDS`), the building and saving are
    :func:`repgeom_eval.testing.tiny_models.save_built`, the one builder of every tiny model."""
    from .tiny_models import CAUSAL, ENCODER, save_built

    encoder = kind in ("bert", "roberta", "xlm-roberta")
    tokenizer = make_tokenizer(encoder=encoder)
    # Some AutoTokenizer classes (Qwen2) add a special token on load: leave head-room in the vocabulary.
    config = tiny_config(kind, len(tokenizer) + 16, n_layers=n_layers, width=width)
    return save_built(config, tokenizer, path, ENCODER if encoder else CAUSAL, seed=seed)


# -- metric conformance ------------------------------------------------------------------------------------------

def _random_batch(consumes: Consumes, n: int, dim: int, seed: int, views: int = 2) -> list[LayerBatch]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (n,), generator=g)
    t = int(lengths.max())
    hidden = torch.randn(n, t, dim, generator=g, dtype=torch.float64) + 0.5
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    hidden = hidden * mask.unsqueeze(-1)
    pooled = torch.randn(n, dim, generator=g, dtype=torch.float64) + 0.5
    vw = torch.randn(n, views, dim, generator=g, dtype=torch.float64) + 0.5
    return [LayerBatch("test", torch.arange(n), pooled=pooled, hidden=hidden, mask=mask, views=vw)]


def _slice(batch: LayerBatch, lo: int, hi: int) -> LayerBatch:
    def s(x):
        return None if x is None else x[lo:hi]

    return LayerBatch(batch.address, batch.index[lo:hi], s(batch.pooled), s(batch.hidden), s(batch.mask), s(batch.views))


def _close(a: Any, b: Any, rtol: float, path: str = "result") -> None:
    if isinstance(a, Mapping):
        assert isinstance(b, Mapping) and set(a) == set(b), f"{path}: keys differ: {a} vs {b}"
        for k in a:
            _close(a[k], b[k], rtol, f"{path}[{k!r}]")
        return
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, rtol, f"{path}[{i}]")
        return
    if isinstance(a, float) or isinstance(b, float):
        if math.isnan(a) and math.isnan(b):
            return
        assert math.isclose(a, b, rel_tol=rtol, abs_tol=rtol), f"{path}: {a!r} != {b!r}"
        return
    assert a == b, f"{path}: {a!r} != {b!r}"


def _check_config(cls: type[Metric], metric: Metric) -> None:
    """Every constructor parameter is read back by ``config()`` (from an attribute of the same name).

    ``config()`` is what the results file records and what the resume key compares; a parameter missing from it
    would let a resumed run mix states built with different values
    (docs/plugins.md#parameters-per-text-results-and-diagnostics)."""
    config = metric.config()
    missing = [n for n in cls.parameter_names() if n not in config]
    assert not missing, (
        f"{cls.__name__}: parameter(s) {missing} are not reported by config(); store each one under an attribute of "
        f"the same name in __init__ (self.{missing[0]} = {missing[0]}), or results files and resume keys miss it")


def check_metric(cls: type[Metric], kwargs: Mapping[str, Any] | None = None, n: int = 24, dim: int = 6,
                 seed: int = 0, rtol: float = 1e-9) -> None:
    """Assert that ``config()`` reports every parameter, batch-split invariance, exact shard merging, state
    round-trips and picklability of ``cls``, and that ``work_note`` (what ``--dry-run`` prints) is a line or None."""
    kwargs = dict(kwargs or {})
    assert isinstance(cls.name, str) and cls.name, f"{cls.__name__} needs a non-empty `name`"
    assert cls.full_state_update is False, f"{cls.__name__}: full_state_update must be False"
    one = cls(**kwargs)
    _check_config(cls, one)
    for tokens, width in ((16, 4096), (4096, 64)):
        try:
            note = one.work_note(tokens, width)
        except Exception as exc:  # noqa: BLE001 - any error of the plugin's, named
            raise AssertionError(f"{cls.name}: work_note({tokens}, {width}) raised {type(exc).__name__}: {exc}") \
                from exc
        assert note is None or (isinstance(note, str) and note.strip() and "\n" not in note), \
            f"{cls.name}: work_note({tokens}, {width}) must return one line or None, got {note!r}"
    (whole,) = _random_batch(cls.consumes, n, dim, seed, views=int(getattr(one, "n_views", 2)))
    one.update(whole)
    expected = one.compute()

    pieces = cls(**kwargs)
    for lo in range(0, n, 5):
        pieces.update(_slice(whole, lo, lo + 5))
    _close(pieces.compute(), expected, rtol, f"{cls.name} (batches of 5 vs one batch)")

    a, b = cls(**kwargs), cls(**kwargs)
    a.update(_slice(whole, 0, n // 3))
    b.update(_slice(whole, n // 3, n))
    _close(a.merge(b).compute(), expected, rtol, f"{cls.name} (two merged shards vs one pass)")

    restored = cls(**kwargs)
    restored.load_state_dict(one.state_dict())
    _close(restored.compute(), expected, rtol, f"{cls.name} (after state_dict round trip)")

    clone = pickle.loads(pickle.dumps(one))
    _close(clone.compute(), expected, rtol, f"{cls.name} (after pickling)")
    _close(copy.deepcopy(one).compute(), expected, rtol, f"{cls.name} (after deepcopy)")


# -- local data for the lm-eval tasks ----------------------------------------------------------------------------

TASK_SCHEMAS = ("mmlu", "arc_challenge", "arc_easy", "hellaswag", "piqa", "wikitext")
MMLU_TEST_SUBJECTS = ("abstract_algebra", "anatomy", "world_religions")


def task_records(schema: str, n: int, seed: int = 0, words: tuple[int, int] = (3, 10)) -> list[dict[str, Any]]:
    """``n`` records in the schema of a repgeom lm-eval task (``repgeom_eval.lmeval.documents.SCHEMAS``), made of
    random words of Python's own documentation: real words, short enough for a tiny model's 128-token context."""
    import random

    rng = random.Random(seed)
    vocab = " ".join(training_text()[:30]).split()

    def text(lo: int = words[0], hi: int = words[1]) -> str:
        return " ".join(rng.choice(vocab) for _ in range(rng.randint(lo, hi)))

    out: list[dict[str, Any]] = []
    for _ in range(n):
        if schema == "mmlu":
            out.append({"question": text(), "subject": rng.choice(MMLU_TEST_SUBJECTS),
                        "choices": [text(1, 3) for _ in range(4)], "answer": rng.randrange(4)})
        elif schema in ("arc_challenge", "arc_easy"):
            k = rng.choice((3, 4))
            labels = list("ABCD"[:k]) if rng.random() < 0.8 else [str(i + 1) for i in range(k)]
            out.append({"id": f"q{len(out)}", "question": text(),
                        "choices": {"text": [text(1, 4) for _ in range(k)], "label": labels},
                        "answerKey": rng.choice(labels)})
        elif schema == "hellaswag":
            out.append({"activity_label": text(1, 2), "ctx_a": text(), "ctx_b": text(1, 3),
                        "endings": [text(2, 5) + (" [title] x" if rng.random() < 0.2 else "") for _ in range(4)],
                        "label": str(rng.randrange(4))})
        elif schema == "piqa":
            out.append({"goal": text(), "sol1": text(2, 6), "sol2": text(2, 6), "label": rng.randrange(2)})
        elif schema == "wikitext":
            out.append({"page": " = " + text(1, 3) + " = \n " + text(20, 120) + " @-@ " + text(5, 60) + " \n"})
        else:
            raise ValueError(f"unknown schema {schema!r} (valid: {', '.join(TASK_SCHEMAS)})")
    return out


def write_task_data(schema: str, path: str | Path, n: int = 40, seed: int = 0, **kwargs: Any) -> Path:
    """Write :func:`task_records` as JSON lines to ``path`` (a ``repgeom_data`` file)."""
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for record in task_records(schema, n, seed, **kwargs):
            fh.write(json.dumps(record) + "\n")
    return path


def write_lm_eval_task(folder: str | Path, name: str, pairs: Sequence[tuple[str, str]]) -> Path:
    """A local lm-eval loglikelihood task ``name`` in ``folder`` (``--include_path``): one document per
    (question, answer) pair, in a JSON-lines file beside its YAML. Returns the folder."""
    import json

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    docs = folder / f"{name}.jsonl"
    docs.write_text("".join(json.dumps({"q": q, "a": a}) + "\n" for q, a in pairs), encoding="utf-8")
    (folder / f"{name}.yaml").write_text(
        f'task: {name}\noutput_type: loglikelihood\ndoc_to_text: "{{{{q}}}}"\ndoc_to_target: " {{{{a}}}}"\n'
        "metric_list:\n  - {metric: acc}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {docs.resolve()}\ntest_split: test\nmetadata:\n  version: 1.0\n", encoding="utf-8")
    return folder

