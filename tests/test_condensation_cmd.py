"""repgeom condensation: per-layer cosine histograms and the depth trend, one or several models."""

import json

import numpy as np
import pytest
import torch
from scipy import stats

from repgeom_eval.analyses.condensation import condensation
from repgeom_eval.entrypoints.cli import main
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.functional.condensation import cosine_matrix
from repgeom_eval.modeling.loading import load_model

pytestmark = pytest.mark.filterwarnings("ignore:.*texts are longer than")


@pytest.fixture(scope="module")
def short_texts(texts):
    return texts[:6]


def test_matches_brute_force_cosine_matrices(tiny_model_dir, short_texts):
    path = tiny_model_dir("llama")
    result = condensation([path], short_texts, bins=10, max_length=24, batch_size=4, progress=False)
    m = result.results["models"][next(iter(result.results["models"]))]
    assert m["layers"] == ["embed", "resid_post:0", "final"] and len(m["density"]) == 3
    # brute force: each text alone (no padding), every hidden state, the full S×S matrix, numpy histogram
    loaded = load_model(path)
    per_layer_mean = np.zeros(3)
    per_layer_hist = np.zeros((3, 10))
    for text in short_texts:
        enc = loaded.tokenizer(text, return_tensors="pt", truncation=True, max_length=24)
        with torch.no_grad():
            hs = loaded.model(**enc, output_hidden_states=True).hidden_states
        for ell, h in enumerate(hs):
            c = cosine_matrix(h[0]).numpy()
            per_layer_mean[ell] += c.mean() / len(short_texts)
            counts, _ = np.histogram(c.ravel(), bins=10, range=(-1, 1))
            per_layer_hist[ell] += counts / c.size / len(short_texts) / 0.2
    assert m["mean_cosine"] == pytest.approx(per_layer_mean.tolist(), abs=1e-6)
    assert np.asarray(m["density"]) == pytest.approx(per_layer_hist, abs=1e-6)
    assert np.asarray(m["density"]).sum(1) * 0.2 == pytest.approx(np.ones(3))
    assert m["spearman"] == pytest.approx(stats.spearmanr(m["mean_cosine"], range(3)).statistic)
    assert m["kendall"] == pytest.approx(stats.kendalltau(m["mean_cosine"], range(3)).statistic)
    assert result.results["edges"][0] == -1.0 and len(result.results["edges"]) == 11


def test_models_side_by_side_and_errors(tiny_model_dir, short_texts):
    deep = tiny_model_dir("gpt2", n_layers=4)
    result = condensation([tiny_model_dir("gpt2"), deep], short_texts, bins=8, max_length=16, progress=False)
    models = result.results["models"]
    assert len(models) == 2 and len(result.to_dict()["models"]) == 2
    first, second = models.values()
    assert len(first["layers"]) == 3 and len(second["layers"]) == 5  # the L + 1 hidden states
    assert second["relative_depth"][0] == 0.0 and second["relative_depth"][-1] == 1.0
    with pytest.raises(RepgeomError, match="at least 3 layer addresses"):
        condensation([deep], short_texts, layers="final", progress=False)
    with pytest.raises(RepgeomError, match="give at least one model"):
        condensation([], short_texts, progress=False)


def test_cli(tiny_model_dir, short_texts, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in short_texts))
    out = tmp_path / "cond.json"
    assert main(["condensation", "--model", tiny_model_dir("gpt2"), "--data", str(data), "--bins", "12",
                 "--max-length", "16", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kind"] == "condensation" and result["config"]["bins"] == 12
    assert (tmp_path / "cond.png").read_bytes()[:4] == b"\x89PNG"
    assert "Spearman" in capsys.readouterr().out
    assert main(["condensation", "--model", tiny_model_dir("gpt2"), "--data", str(data),
                 "--layers", "resid_post:7"]) == 2
    assert "out of range" in capsys.readouterr().err
