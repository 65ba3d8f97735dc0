"""Value tests: the ``massive_activations`` metric and the energy diagnostic of ``measure`` against numpy.

The reference takes ``hidden_states`` from ``transformers`` directly (tests/values_reference.py: one text per
forward, float64 weights), pools them in numpy and computes the energy shares by hand, so a change in repgeom's
addressing, pooling, batching or metric code cannot be reproduced by the reference.
"""

import numpy as np
import pytest

import repgeom_eval
import values_reference as ref

# address → index into transformers' hidden_states for a 2-block model
ADDRESSES = {"embed": 0, "resid_post:0": 1, "final": -1}
TOL = 1e-10  # float64 model on both sides; only the summation order differs


def expected_massive(x: np.ndarray, top_k: int) -> dict:
    shares = ref.energy_shares(x)
    order = np.argsort(-shares, kind="stable")[:top_k]
    return {"top1_share": shares[order[0]], "topk_share": shares[order].sum(), "top_dimensions": order.tolist(),
            "top_shares": shares[order].tolist(), "effective_dimensions": 1.0 / (shares ** 2).sum()}


def assert_massive(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    assert got["top_dimensions"] == want["top_dimensions"]
    for key in ("top1_share", "topk_share", "effective_dimensions"):
        assert got[key] == pytest.approx(want[key], rel=TOL, abs=TOL), key
    assert got["top_shares"] == pytest.approx(want["top_shares"], rel=TOL, abs=TOL)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("pooling, top_k", [(None, 5), ("last", 3), ("first", 7)])
def test_massive_activations_equal_numpy(kind, pooling, top_k, tiny_model_dir):
    model_dir = tiny_model_dir(kind)
    texts = ref.corpus(0, 24)
    params = {"top_k": top_k} | ({"pooling": pooling} if pooling else {})
    result = repgeom_eval.measure(model_dir, texts, layers=list(ADDRESSES), metrics=["massive_activations"],
                                  metric_params={"massive_activations": params}, dtype="float64", batch_size=5,
                                  progress=False)
    assert list(result.results) == list(ADDRESSES)
    states = ref.hidden_states(model_dir, texts)
    for addr, k in ADDRESSES.items():
        x = ref.pooled(states, k, pooling or "mean")  # the metric's own default pooling is mean
        assert_massive(result.results[addr]["massive_activations"], expected_massive(x, top_k))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_energy_diagnostic_is_of_mean_pooled_vectors_whatever_the_metrics_pool(kind, tiny_model_dir):
    """``diagnostics[addr]["energy"]``: top 3 dimensions of the squared norm of the *mean*-pooled vectors, shares
    rounded to 6 decimals, even when every metric of the run pools otherwise (here: last token)."""
    model_dir = tiny_model_dir(kind)
    texts = ref.corpus(5, 30, skip_words=4)
    result = repgeom_eval.measure(model_dir, texts, layers=list(ADDRESSES), metrics=["dispersion"],
                                  pooling="last", dtype="float64", batch_size=7, progress=False)
    states = ref.hidden_states(model_dir, texts)
    for addr, k in ADDRESSES.items():
        shares = ref.energy_shares(ref.pooled(states, k, "mean"))
        top = np.argsort(-shares, kind="stable")[:3]
        energy = result.diagnostics[addr]["energy"]
        assert energy["pooling"] == "mean"
        assert energy["top_dimensions"] == top.tolist()
        assert energy["top_shares"] == pytest.approx(shares[top].tolist(), abs=5e-7 + 1e-12)  # rounded to 1e-6
        # the last-token shares are different numbers: the diagnostic really is of the mean-pooled vectors
        last = ref.energy_shares(ref.pooled(states, k, "last"))
        assert np.abs(np.sort(last)[::-1][:3] - shares[top]).max() > 1e-4


def test_massive_activations_default_dtype(tiny_model_dir):
    """The same comparison with the model loaded as repgeom loads it by default (float32 here): tolerance 1e-5."""
    model_dir = tiny_model_dir("llama")
    texts = ref.corpus(11, 20)
    result = repgeom_eval.measure(model_dir, texts, layers=list(ADDRESSES), metrics=["massive_activations"],
                                  progress=False)
    assert result.model["dtype"] == "float32"
    import torch

    states = ref.hidden_states(model_dir, texts, dtype=torch.float32)
    for addr, k in ADDRESSES.items():
        want = expected_massive(ref.pooled(states, k, "mean"), 5)
        got = result.results[addr]["massive_activations"]
        assert got["top_dimensions"] == want["top_dimensions"]
        assert got["top_shares"] == pytest.approx(want["top_shares"], rel=1e-5, abs=1e-7)
        assert got["effective_dimensions"] == pytest.approx(want["effective_dimensions"], rel=1e-5)
