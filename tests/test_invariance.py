"""Pipeline invariances: batch size, padding side, dtype, and equality with a hand computation."""

import pytest
import torch

from repgeom_eval.functional import pairwise_dispersion
from repgeom_eval.modeling.loading import load_model
from repgeom_eval.measurement.engine import measure

KINDS = ["gpt2", "llama", "bert"]
POOLINGS = ["last", "mean", "first", "tokens"]


def run(model, texts, **kw):
    kw.setdefault("layers", "all")
    kw.setdefault("metrics", ["dispersion", "token_dispersion"])
    return measure(model, texts, progress=False, **kw)


def assert_same(a, b, tol):
    assert a.results.keys() == b.results.keys()
    for addr in a.results:
        for metric, value in a.results[addr].items():
            assert value == pytest.approx(b.results[addr][metric], abs=tol), (addr, metric)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pooling", POOLINGS)
def test_batch_size_and_padding_side_do_not_change_results(kind, pooling, tiny_model_dir, texts):
    loaded = load_model(tiny_model_dir(kind))
    ref = run(loaded, texts[:20], pooling=pooling, batch_size=16, padding_side="right")
    one = run(loaded, texts[:20], pooling=pooling, batch_size=1, padding_side="right")
    left = run(loaded, texts[:20], pooling=pooling, batch_size=16, padding_side="left")
    assert_same(ref, one, 1e-5)
    assert_same(ref, left, 1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_float32_and_float64_models_agree(kind, tiny_model_dir, texts):
    r32 = run(tiny_model_dir(kind), texts[:12], dtype="float32")
    r64 = run(tiny_model_dir(kind), texts[:12], dtype="float64")
    assert r32.model["dtype"] == "float32" and r64.model["dtype"] == "float64"
    assert_same(r32, r64, 1e-5)


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_equals_brute_force_on_hidden_states(kind, tiny_model_dir, texts):
    """Pipeline value = brute-force pairwise dispersion of hidden_states pooled by hand, one text at a time."""
    loaded = load_model(tiny_model_dir(kind))
    sample = texts[:10]
    result = run(loaded, sample, layers="0,1,-1", pooling="mean", per_text=True)
    n = loaded.info.n_layers
    for k, addr in [(0, "embed"), (1, "resid_post:0"), (n, "final")]:
        pooled, token_values = [], []
        for text in sample:
            enc = loaded.tokenizer(text, return_tensors="pt", truncation=True, max_length=128)
            with torch.no_grad():
                h = loaded.model(**enc, output_hidden_states=True).hidden_states[k][0].double()
            pooled.append(h.mean(0))
            token_values.append(pairwise_dispersion(h))
        assert result.results[addr]["dispersion"] == pytest.approx(pairwise_dispersion(torch.stack(pooled)).item(),
                                                                    abs=1e-6)
        assert result.results[addr]["token_dispersion"] == pytest.approx(torch.stack(token_values).mean().item(),
                                                                          abs=1e-6)
        per_text = [row["scores"][addr]["token_dispersion"] for row in result.per_text]
        assert per_text == pytest.approx(torch.stack(token_values).tolist(), abs=1e-6)


def test_per_text_scores_average_to_dispersion_in_input_order(tiny_model_dir, texts):
    result = run(tiny_model_dir("llama"), texts[:15], per_text=True, batch_size=4)
    assert [row["index"] for row in result.per_text] == list(range(15))
    for addr, metrics in result.results.items():
        c = [row["scores"][addr]["dispersion"] for row in result.per_text]
        assert sum(c) / len(c) == pytest.approx(metrics["dispersion"], abs=1e-12)


def test_tokens_pooling_is_dispersion_over_all_token_vectors(tiny_model_dir, texts):
    loaded = load_model(tiny_model_dir("gpt2"))
    sample = texts[:6]
    result = run(loaded, sample, layers="final", metrics=["dispersion"], pooling="tokens")
    vecs = []
    for text in sample:
        enc = loaded.tokenizer(text, return_tensors="pt", truncation=True, max_length=128)
        with torch.no_grad():
            vecs.append(loaded.model(**enc, output_hidden_states=True).hidden_states[-1][0].double())
    expected = pairwise_dispersion(torch.cat(vecs)).item()
    assert result.results["final"]["dispersion"] == pytest.approx(expected, abs=1e-6)


SUITE = ["prompt_entropy", "dataset_entropy", "effective_rank", "curvature", "vendi", "condensation"]


def _flat(value, prefix=""):
    """Every number in a (nested) metric result, keyed by its path; lists and strings are compared as they are."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}"))
        return out
    return {prefix: value}


def assert_same_suite(a, b, tol):
    assert a.results.keys() == b.results.keys()
    for addr in a.results:
        fa, fb = _flat(a.results[addr]), _flat(b.results[addr])
        assert fa.keys() == fb.keys()
        for key, value in fa.items():
            if isinstance(value, float):
                assert value == pytest.approx(fb[key], abs=tol, rel=tol), (addr, key)
            elif isinstance(value, list) and value and isinstance(value[0], float):
                assert value == pytest.approx(fb[key], abs=tol, rel=tol), (addr, key)
            else:
                assert value == fb[key], (addr, key)


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_metric_suite_ignores_batch_size_padding_side_and_dtype(kind, tiny_model_dir, texts):
    path, sample = tiny_model_dir(kind), texts[:14]
    kw = dict(layers="0,1,-1", metrics=SUITE)
    ref = run(path, sample, batch_size=16, padding_side="right", **kw)
    assert_same_suite(ref, run(path, sample, batch_size=1, padding_side="right", **kw), 1e-5)
    assert_same_suite(ref, run(path, sample, batch_size=16, padding_side="left", **kw), 1e-5)
    assert_same_suite(ref, run(path, sample, batch_size=5, dtype="float64", **kw), 1e-5)
    for addr in ref.results:  # the comparison above saw real numbers, not NaN placeholders
        for m in SUITE:
            values = [v for v in _flat(ref.results[addr][m]).values() if isinstance(v, float)]
            assert values and all(v == v for v in values), (addr, m)
