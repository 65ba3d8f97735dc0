"""repgeom knn-keys: last-token dispersion per candidate key over seeded chunk samples."""

import json

import pytest
import torch

from repgeom_eval.modeling.addresses import parse_layers, resolve
from repgeom_eval.analyses.corpus import Document, corpus_chunks
from repgeom_eval.analyses.knn_keys import knn_keys, seeded_samples
from repgeom_eval.modeling.hooks import Capture
from repgeom_eval.entrypoints.cli import main
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.functional.dispersion import pairwise_dispersion
from repgeom_eval.modeling.loading import load_model


@pytest.fixture(scope="module")
def docs():
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)[:6]]


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return load_model(tiny_model_dir("llama"))


def test_seeded_samples_are_nested_distinct_and_reproducible():
    s = seeded_samples(50, [3, 10], 4, seed=7)
    assert set(s) == {(n, k) for n in (3, 10) for k in range(4)}
    for k in range(4):
        assert s[(3, k)] == s[(10, k)][:3] and len(set(s[(10, k)])) == 10
    assert s == seeded_samples(50, [10, 3], 4, seed=7)
    assert s[(10, 0)] != s[(10, 1)]


@pytest.mark.filterwarnings("ignore:the most dispersed candidate changes")
def test_values_match_brute_force_on_the_model(llama, docs):
    result = knn_keys(llama, docs, ns=[2, 6], n_seeds=3, chunk_len=16, batch_size=4, progress=False)
    res = result.results
    assert res["candidates"] == ["resid_mid:1", "resid_post:1", "mlp_in:1"]
    assert len(res["table"]) == 6 and all(len(r["values"]) == 3 for r in res["table"])
    chunks = corpus_chunks(llama.tokenizer, [Document(t, "all", i) for i, t in enumerate(docs)], 16)
    samples = seeded_samples(len(chunks), [2, 6], 3)
    addrs = parse_layers("resid_mid:1,resid_post:1", 2)
    with Capture(llama.model, resolve(addrs, llama), stop_early=False) as cap:
        vecs = {str(a): [] for a in addrs}
        for i in samples[(6, 2)]:
            got = cap.run(input_ids=torch.tensor([chunks[i].ids]))
            for a in addrs:
                vecs[str(a)].append(got[a][0, -1])
    for name in ("resid_mid:1", "resid_post:1"):
        row = next(r for r in res["table"] if r["address"] == name and r["N"] == 6)
        assert row["values"][2] == pytest.approx(pairwise_dispersion(torch.stack(vecs[name])).item(), abs=1e-9)
        assert row["mean"] == pytest.approx(sum(row["values"]) / 3)
    # mlp_in = RMSNorm(resid_mid) with unit gains at init: the same directions, so the same dispersion
    for n in (2, 6):
        mid = next(r for r in res["table"] if r["address"] == "resid_mid:1" and r["N"] == n)
        mlp = next(r for r in res["table"] if r["address"] == "mlp_in:1" and r["N"] == n)
        assert mlp["values"] == pytest.approx(mid["values"], abs=1e-6)
    assert res["recommended"] in res["candidates"] and set(res["ranking"]) == {"2", "6"}
    assert result.to_dict()["kind"] == "knn-keys"


def test_key_address_not_in_the_model(tiny_model_dir, docs):
    neox = load_model(tiny_model_dir("gpt_neox"))  # parallel residual: no resid_mid
    with pytest.raises(RepgeomError, match="resid_mid:1 is not available"):
        knn_keys(neox, docs, ns=[2], n_seeds=1, chunk_len=16, progress=False)


def test_corpus_too_small(llama, docs):
    with pytest.raises(RepgeomError, match="corpus too small.*N = 100"):
        knn_keys(llama, docs[:1], ns=[10, 100], n_seeds=2, chunk_len=64, progress=False)


@pytest.mark.filterwarnings("ignore:the most dispersed candidate changes")
def test_cli(tiny_model_dir, docs, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    out = tmp_path / "keys.json"
    assert main(["knn-keys", "--model", tiny_model_dir("gpt2"), "--data", str(data), "--chunk-len", "16",
                 "--n", "2", "4", "--seeds", "2", "--candidates", "knn_keys", "final", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kind"] == "knn-keys" and result["config"]["ns"] == [2, 4]
    assert result["results"]["candidates"] == ["resid_mid:1", "mlp_in:1", "resid_post:1", "final"]
    assert (tmp_path / "keys.png").read_bytes()[:4] == b"\x89PNG"
    assert "recommended key" in capsys.readouterr().out
    assert main(["knn-keys", "--model", tiny_model_dir("gpt2"), "--data", str(data), "--candidates", "resid_mid:9",
                 "--chunk-len", "16", "--n", "2"]) == 2
    assert "out of range" in capsys.readouterr().err
