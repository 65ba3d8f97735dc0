"""Value tests: ``preprocess=`` center / standardize / whiten, with statistics from another corpus or the same one.

Statistics are written by a run over corpus A (``save_preprocess_stats=``) and read by a run over corpus B
(``preprocess_stats=``). The reference (numpy on ``transformers`` hidden states, tests/values_reference.py) applies
A's mean / standard deviation / ZCA whitening matrix to B's vectors and computes each metric by hand. Code that
ignored the file, or recomputed the statistics from the measured texts, would give B's own statistics instead:
each test also checks that this alternative is far from the measured value, so the comparison can tell them apart.

Three kinds of vectors are covered, each with its own statistics: last-token vectors (``dispersion``), mean-pooled
vectors (``massive_activations``) and token vectors (``token_dispersion``).
"""

import numpy as np
import pytest

import repgeom_eval
import values_reference as ref

ADDRESSES = {"embed": 0, "resid_post:0": 1, "final": -1}
METRICS = ["dispersion", "massive_activations", "token_dispersion"]
TOL = 1e-9  # float64 models on both sides


def fit(x: np.ndarray, method: str) -> dict[str, np.ndarray]:
    """The documented affine maps: centre on the mean; divide by the (population) standard deviation; ZCA whitening
    C^(-1/2) of the (population) covariance, with variances / eigenvalues floored at 1e-6 of the largest (the
    relative floor repgeom documents; it matters at ``final`` of GPT-2, whose LayerNorm output has zero-sum rows,
    so its covariance is singular)."""
    mu = x.mean(0)
    if method == "center":
        return {"shift": mu}
    if method == "standardize":
        var = x.var(0)
        return {"shift": mu, "scale": np.sqrt(np.maximum(var, 1e-6 * var.max()))}
    cov = np.cov(x, rowvar=False, bias=True)
    evals, evecs = np.linalg.eigh(cov)
    evals = np.maximum(evals, 1e-6 * evals.max())
    return {"shift": mu, "matrix": (evecs / np.sqrt(evals)) @ evecs.T}


def transform(x: np.ndarray, t: dict[str, np.ndarray]) -> np.ndarray:
    z = x - t["shift"]
    if "scale" in t:
        z = z / t["scale"]
    if "matrix" in t:
        z = z @ t["matrix"]
    return z


def vectors(states, layer: int) -> dict[str, list[np.ndarray] | np.ndarray]:
    """The vectors each metric reads at ``layer``: last-token, mean-pooled, and every text's token vectors."""
    return {"last": ref.pooled(states, layer, "last"), "mean": ref.pooled(states, layer, "mean"),
            "tokens": [s[layer] for s in states]}


def expected_values(measured: dict, stats: dict, method: str) -> dict[str, object]:
    """Metric values of the ``measured`` vectors after the transforms fitted on the ``stats`` vectors."""
    last = transform(measured["last"], fit(stats["last"], method))
    mean = transform(measured["mean"], fit(stats["mean"], method))
    t_tok = fit(np.concatenate(stats["tokens"]), method)
    per_text = [ref.mean_cosine_distance(transform(t, t_tok)) for t in measured["tokens"] if len(t) >= 2]
    return {"dispersion": ref.mean_cosine_distance(last), "massive_activations": ref.energy_shares(mean),
            "token_dispersion": float(np.mean(per_text))}


def distance(got: dict, want: dict) -> float:
    """Largest absolute difference between measured metric values and expected ones.

    For ``massive_activations`` the reported dimensions must carry the reported shares and be the largest ones;
    their order is not compared where shares tie (standardizing on the same data makes every share exactly 1/D)."""
    ma = got["massive_activations"]
    shares = want["massive_activations"]
    k = len(ma["top_dimensions"])
    diffs = [abs(got["dispersion"] - want["dispersion"]), abs(got["token_dispersion"] - want["token_dispersion"]),
             float(np.abs(np.array(ma["top_shares"]) - shares[ma["top_dimensions"]]).max()),
             float(np.abs(np.array(ma["top_shares"]) - np.sort(shares)[::-1][:k]).max()),
             abs(ma["effective_dimensions"] - 1.0 / (shares ** 2).sum())]
    return max(diffs)


def run(model_dir, texts, **kw):
    return repgeom_eval.measure(model_dir, texts, layers=list(ADDRESSES), metrics=METRICS, dtype="float64",
                                batch_size=8, progress=False, **kw)


@pytest.fixture(scope="module")
def corpora():
    stats_corpus = ref.corpus(0, 64)  # N > D = 32: whitening needs more vectors than dimensions
    measured_corpus = ref.corpus(40, 36, skip_words=9, max_words=14)  # other topics, other passages
    assert not set(stats_corpus) & set(measured_corpus)
    return stats_corpus, measured_corpus


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("method", ["center", "standardize", "whiten"])
def test_statistics_from_another_corpus(kind, method, corpora, tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir(kind)
    stats_texts, texts = corpora
    path = tmp_path / f"{method}.safetensors"
    run(model_dir, stats_texts, preprocess=method, save_preprocess_stats=path)
    assert path.is_file()
    result = run(model_dir, texts, preprocess=method, preprocess_stats=path)
    recorded = dict(result.config["preprocess"])
    identity = recorded.pop("statistics_identity")  # where the file's statistics came from: this model, other texts
    assert recorded == {"method": method, "statistics": str(path)}
    assert identity["model_name"] == str(model_dir) and identity["method"] == method

    stats_states = ref.hidden_states(model_dir, stats_texts)
    states = ref.hidden_states(model_dir, texts)
    for addr, k in ADDRESSES.items():
        got = result.results[addr]
        measured, stats = vectors(states, k), vectors(stats_states, k)
        assert distance(got, expected_values(measured, stats, method)) < TOL, addr
        # what code that ignored the file (statistics of the measured corpus itself) would report: far away
        assert distance(got, expected_values(measured, measured, method)) > 1e-3, addr


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("method", ["center", "standardize", "whiten"])
def test_statistics_from_the_same_data(kind, method, corpora, tiny_model_dir):
    model_dir = tiny_model_dir(kind)
    _, texts = corpora
    result = run(model_dir, texts, preprocess=method)
    assert result.config["preprocess"] == {"method": method, "statistics": "same data"}
    states = ref.hidden_states(model_dir, texts)
    for addr, k in ADDRESSES.items():
        measured = vectors(states, k)
        assert distance(result.results[addr], expected_values(measured, measured, method)) < TOL, addr


def test_no_preprocessing_is_the_identity(corpora, tiny_model_dir):
    """The baseline the other tests move away from: ``preprocess="none"`` equals the untransformed vectors, and
    differs from every preprocessed value (so a preprocess flag that was silently dropped would be caught)."""
    model_dir = tiny_model_dir("gpt2")
    _, texts = corpora
    result = run(model_dir, texts)
    states = ref.hidden_states(model_dir, texts)
    for addr, k in ADDRESSES.items():
        m = vectors(states, k)
        raw = {"dispersion": ref.mean_cosine_distance(m["last"]), "massive_activations": ref.energy_shares(m["mean"]),
               "token_dispersion": float(np.mean([ref.mean_cosine_distance(t) for t in m["tokens"] if len(t) >= 2]))}
        assert distance(result.results[addr], raw) < TOL, addr
        for method in ("center", "standardize", "whiten"):
            assert distance(result.results[addr], expected_values(m, m, method)) > 1e-3, (addr, method)
