"""Preprocessing of the vectors metrics see, the massive-activation diagnostic and its warning."""

import pytest
import torch

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.functional import pairwise_dispersion
from repgeom_eval.modeling.loading import load_model
from repgeom_eval.measurement.engine import measure
from repgeom_eval.measurement.preprocess import Preprocessor, VectorStats


def final_vectors(loaded, texts, pooling="mean"):
    out = []
    for text in texts:
        enc = loaded.tokenizer(text, return_tensors="pt", truncation=True, max_length=128)
        with torch.no_grad():
            h = loaded.model(**enc, output_hidden_states=True).hidden_states[-1][0].double()
        out.append(h.mean(0) if pooling == "mean" else h[-1])
    return torch.stack(out)


@pytest.mark.parametrize("method", ["center", "standardize", "whiten"])
def test_preprocess_equals_a_hand_computation(method, tiny_model_dir, texts):
    loaded = load_model(tiny_model_dir("gpt2"))
    sample = texts[:40]
    result = measure(loaded, sample, metrics=["dispersion"], pooling="mean", preprocess=method, progress=False)
    x = final_vectors(loaded, sample)
    mu = x.mean(0)
    if method == "center":
        z = x - mu
    elif method == "standardize":
        z = (x - mu) / x.std(0, unbiased=False)
    else:
        cov = (x - mu).T @ (x - mu) / len(x)
        evals, evecs = torch.linalg.eigh(cov)
        evals = evals.clamp(min=1e-6 * evals.max())
        z = (x - mu) @ evecs @ torch.diag(evals.rsqrt()) @ evecs.T
    assert result.results["final"]["dispersion"] == pytest.approx(pairwise_dispersion(z).item(), abs=1e-6)
    assert result.config["preprocess"] == {"method": method, "statistics": "same data"}


def test_reference_statistics_file_round_trip(tmp_path, tiny_model_dir, texts):
    loaded = load_model(tiny_model_dir("llama"))
    stats = tmp_path / "ref.safetensors"
    kw = dict(metrics=["dispersion", "token_dispersion"], layers="all", progress=False)
    first = measure(loaded, texts[:20], preprocess="standardize", save_preprocess_stats=stats, **kw)
    again = measure(loaded, texts[:20], preprocess="standardize", preprocess_stats=stats, **kw)
    for addr in first.results:
        for m in first.results[addr]:
            assert again.results[addr][m] == pytest.approx(first.results[addr][m], abs=1e-9)
    assert again.config["preprocess"]["statistics"] == str(stats)
    with pytest.raises(RepgeomError, match="holds 'standardize' statistics but --preprocess 'center'"):
        measure(loaded, texts[:5], preprocess="center", preprocess_stats=stats, **kw)
    with pytest.raises(RepgeomError, match="no entry for resid_mid:0"):
        measure(loaded, texts[:5], preprocess="standardize", preprocess_stats=stats, layers="resid_mid:0",
                metrics=["dispersion"], progress=False)


@pytest.mark.fault("refused")
def test_statistics_of_another_model_of_the_same_width_are_refused_unless_allowed(tmp_path, tiny_model_dir, texts):
    import shutil

    from safetensors.torch import load_file, save_file

    model = tiny_model_dir("llama")
    other = tmp_path / "other"  # the same architecture and width, other weights
    shutil.copytree(model, other)
    weights = load_file(other / "model.safetensors")
    save_file({k: v + 0.01 for k, v in weights.items()}, other / "model.safetensors", metadata={"format": "pt"})
    stats = tmp_path / "ref.safetensors"
    kw = dict(metrics=["dispersion"], layers="final", progress=False)
    written = measure(model, texts[:12], preprocess="center", save_preprocess_stats=stats, **kw)
    identity = Preprocessor.load(stats, "center").identity
    assert identity["model_name"] == str(model) and identity["addresses"] == ["final"]
    assert identity["model"].startswith("sha256:") and identity["data"].startswith("sha256:")
    assert identity["poolings"] and identity["method"] == "center"
    assert written.config["preprocess"]["statistics"] == "same data"
    with pytest.raises(RepgeomError, match=r"ref\.safetensors were computed on .*, not on .*other.*"
                                           r"--allow-other-stats"):
        measure(other, texts[:6], preprocess="center", preprocess_stats=stats, **kw)
    allowed = measure(other, texts[:6], preprocess="center", preprocess_stats=stats, allow_other_stats=True, **kw)
    record = allowed.config["preprocess"]["allow_other_stats"]
    assert record["statistics_model"] == identity["model"] != record["this_model"]
    same = measure(model, texts[:6], preprocess="center", preprocess_stats=stats, **kw)
    assert "allow_other_stats" not in same.config["preprocess"]
    legacy = tmp_path / "legacy.safetensors"  # a file written before identities were recorded
    tensors = load_file(stats)
    save_file(tensors, legacy, metadata={"repgeom_preprocess": '{"method": "center"}'})
    with pytest.raises(RepgeomError, match="record no model identity"):
        measure(model, texts[:6], preprocess="center", preprocess_stats=legacy, **kw)


def test_vector_stats_merge_exactly():
    x = torch.randn(30, 4, dtype=torch.float64)
    whole, a, b = VectorStats(True), VectorStats(True), VectorStats(True)
    whole.update(x)
    a.update(x[:11])
    b.update(x[11:])
    t1, t2 = whole.transform("whiten"), a.merge(b).transform("whiten")
    assert torch.allclose(t1["matrix"], t2["matrix"], atol=1e-12) and torch.allclose(t1["shift"], t2["shift"])
    with pytest.raises(RepgeomError, match="at least 2 vectors"):
        VectorStats(False).transform("center")
    with pytest.raises(RepgeomError, match="unknown preprocess"):
        Preprocessor("sphere")


def test_massive_dimension_is_measured_and_warned(tiny_model_dir, texts):
    loaded = load_model(tiny_model_dir("llama"))

    def plant(module, args, output):  # one dimension with a huge, constant activation, as in real LMs
        output = output.clone()
        output[..., 7] += 300.0
        return output

    handle = loaded.model.model.layers[0].register_forward_hook(plant)
    try:
        with pytest.warns(UserWarning, match=r"at 2 address\(es\): resid_post:0\.\.1 \(dim 7: (9\d|100)%") as caught:
            raw = measure(loaded, texts[:20], layers=["resid_post:0", "resid_post:1"],
                          metrics=["massive_activations", "dispersion"], pooling="mean", progress=False)
        assert sum("squared norm" in str(w.message) for w in caught) == 1  # the residual stream carries it on: one warning, not one per layer
        fixed = measure(loaded, texts[:20], layers="resid_post:0", metrics=["massive_activations", "dispersion"],
                        pooling="mean", preprocess="standardize", progress=False)
    finally:
        handle.remove()
    ma = raw.results["resid_post:0"]["massive_activations"]
    assert ma["top_dimensions"][0] == 7 and ma["top1_share"] > 0.99 and ma["effective_dimensions"] < 1.1
    assert raw.diagnostics["resid_post:0"]["energy"]["top_dimensions"][0] == 7
    assert raw.results["resid_post:0"]["dispersion"] < 1e-3  # cosine geometry sees only the planted dimension
    assert fixed.results["resid_post:0"]["dispersion"] > 0.5
    assert fixed.results["resid_post:0"]["massive_activations"]["top1_share"] < 0.2


def test_whitening_needs_more_vectors_than_dimensions(tiny_model_dir, texts):
    with pytest.raises(RepgeomError, match="needs more vectors than dimensions, got 5 vectors of dimension 32"):
        measure(tiny_model_dir("gpt2"), texts[:5], preprocess="whiten", progress=False)


@pytest.mark.parametrize("flag", ["preprocess_stats", "save_preprocess_stats"])
def test_stats_files_without_preprocessing_are_refused(flag, tmp_path, texts):
    # refused before the model is loaded: the path need not exist, the model is never opened
    with pytest.raises(RepgeomError, match="has no effect without preprocessing; add --preprocess"):
        measure(str(tmp_path / "no-model"), texts[:5], **{flag: tmp_path / "stats.pt"}, progress=False)
    assert not (tmp_path / "stats.pt").exists()
