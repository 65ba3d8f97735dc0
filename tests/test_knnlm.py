"""repgeom knnlm: a real kNN-LM (faiss datastore + interpolation) on tiny models."""

import json
import math

import numpy as np
import pytest
import torch

from repgeom_eval.analyses.corpus import Document, corpus_chunks
from repgeom_eval.measurement.forward import Forward, next_token_logprobs
from repgeom_eval.modeling.addresses import resolve_request
from repgeom_eval.analyses.knnlm import Datastore, build_index, interpolate, knn_logprob, knnlm
from repgeom_eval.entrypoints.cli import main
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.modeling.loading import load_model

import faiss  # noqa: E402,F401  (dev extra: missing must fail, not skip)

SAME_TEXT = "the datastore is built from the evaluation text"


@pytest.fixture(scope="module")
def docs():
    from pydoc_data.topics import topics

    return [topics[k][:700] for k in sorted(topics)[:4]]  # ~90 chunks of 16 tokens


@pytest.fixture(scope="module")
def gpt2(tiny_model_dir):
    return load_model(tiny_model_dir("gpt2"))


def _brute_force(keys, values, queries, targets, k, temperature):
    d = ((queries[:, None, :].astype(np.float64) - keys[None].astype(np.float64)) ** 2).sum(-1)
    out = []
    for row, t in zip(d, targets):
        nn = np.argsort(row, kind="stable")[:k]
        w = np.exp(-(row[nn] - row[nn].min()) / temperature)
        out.append(math.log(w[values[nn] == t].sum() / w.sum()) if (values[nn] == t).any() else -math.inf)
    return np.array(out)


def test_knn_logprob_matches_brute_force():
    rng = np.random.default_rng(0)
    keys = rng.normal(size=(300, 8)).astype(np.float32)
    values = rng.integers(0, 5, size=300)
    queries = rng.normal(size=(40, 8)).astype(np.float32)
    targets = rng.integers(0, 5, size=40)
    index, kind, _ = build_index(keys, "flat")
    store = Datastore("x", keys, values, index, kind, {})
    got, hit = knn_logprob(store, queries, targets, k=16, temperature=3.0)
    want = _brute_force(keys, values, queries, targets, 16, 3.0)
    assert np.array_equal(np.isinf(got), np.isinf(want)) and np.array_equal(hit, np.isfinite(want))
    assert got[hit] == pytest.approx(want[hit], abs=1e-4)
    # k larger than the store is clamped; IVF probing every cell is exact; fp16 keys are close
    all_k, _ = knn_logprob(store, queries, targets, k=5000, temperature=3.0)
    assert all_k == pytest.approx(_brute_force(keys, values, queries, targets, 300, 3.0), abs=1e-4)
    ivf, kind, params = build_index(keys, "ivf", nlist=4, nprobe=4)
    assert kind == "ivf" and params["nlist"] == 4
    ivf_lp, _ = knn_logprob(Datastore("x", keys, values, ivf, kind, params), queries, targets, 16, 3.0)
    assert ivf_lp[hit] == pytest.approx(got[hit], abs=1e-4)
    half, _, _ = build_index(keys.astype(np.float16), "flat", fp16=True)
    half_lp, _ = knn_logprob(Datastore("x", keys, values, half, "flat", {}), queries, targets, 16, 3.0)
    assert half_lp[hit] == pytest.approx(got[hit], abs=0.05)


def test_interpolate_edges():
    lm, knn = np.log(np.array([0.1, 0.5])), np.array([np.log(0.9), -np.inf])
    assert np.array_equal(interpolate(lm, knn, 0.0), lm)
    assert interpolate(lm, knn, 1.0)[0] == pytest.approx(np.log(0.9)) and interpolate(lm, knn, 1.0)[1] == -np.inf
    assert interpolate(lm, knn, 0.25)[0] == pytest.approx(np.log(0.25 * 0.9 + 0.75 * 0.1))
    with pytest.raises(RepgeomError, match="λ must lie in"):
        interpolate(lm, knn, 1.5)


@pytest.mark.filterwarnings(f"ignore:{SAME_TEXT}")
def test_lambda_zero_is_the_lm_and_retrieval_from_the_eval_text_helps(gpt2, docs, tmp_path):
    result = knnlm(gpt2, docs, docs, keys=["resid_mid:-1", "resid_post:-1"], k=8, lambdas=[0.0, 0.25, 0.5],
                   chunk_len=16, store_dir=tmp_path / "store", batch_size=7, progress=False)
    res = result.results
    # base perplexity, recomputed independently: one forward pass per chunk, no padding
    chunks = corpus_chunks(gpt2.tokenizer, [Document(t, "all", i) for i, t in enumerate(docs)], 16)
    lps = []
    with Forward.at(gpt2, list(resolve_request("final", gpt2).addresses), logits=True) as runner:
        for c in chunks:
            out = runner.token_ids([c.ids])
            lp, valid = next_token_logprobs(out.logits, out.ids, out.mask)
            lps.append(lp[valid])
    assert res["n_eval_tokens"] == len(chunks) * 15
    assert res["base_ppl"] == pytest.approx(math.exp(-torch.cat(lps).mean().item()), rel=1e-9)
    for name in ("resid_mid:1", "resid_post:1"):
        ppl = res["keys"][name]["ppl"]
        assert ppl["0.0"] == res["base_ppl"]  # exactly: λ = 0 drops the kNN term
        assert ppl["0.25"] < res["base_ppl"] and ppl["0.5"] < ppl["0.25"]
        # every query's own key is in the store at distance 0; a few lose their place to exact ties (repeated
        # contexts give identical keys), so nearly all, not all, find their target
        assert res["keys"][name]["hit_rate"] > 0.95
        assert res["keys"][name]["datastore"]["n_keys"] == len(chunks) * 15
    assert res["best_key"]["0.25"] in ("resid_mid:1", "resid_post:1")
    assert any(SAME_TEXT in w for w in result.warnings) is False  # in-memory texts: no path to compare
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert set(manifest["keys"]) == {"resid_mid:1", "resid_post:1"}
    keys = np.load(tmp_path / "store" / "keys_resid_mid_1.npy", mmap_mode="r")
    assert keys.shape == (len(chunks) * 15, 32) and keys.dtype == np.float32
    assert (tmp_path / "store" / "index_resid_post_1.faiss").exists()


def test_fp16_and_ivf_store(gpt2, docs, tmp_path):
    store_docs, eval_docs = docs[:3], docs[3:]
    result = knnlm(gpt2, store_docs, eval_docs, keys=["resid_post:-1"], k=4, lambdas=[0.0, 0.25], chunk_len=16,
                   fp16=True, index="ivf", nlist=4, nprobe=2, store_dir=tmp_path, progress=False)
    store = result.results["keys"]["resid_post:1"]
    assert store["datastore"]["index"] == "ivf" and store["datastore"]["key_dtype"] == "float16"
    assert store["datastore"]["nprobe"] == 2 and store["ppl"]["0.0"] == result.results["base_ppl"]
    assert np.load(tmp_path / "keys_resid_post_1.npy", mmap_mode="r").dtype == np.float16


@pytest.mark.fault("clean")
@pytest.mark.filterwarnings("ignore:--neighbors")
def test_more_neighbors_than_keys_is_said_and_recorded(gpt2, docs):
    result = knnlm(gpt2, docs[:2], docs[2:4], keys=["resid_post:-1"], k=100_000, lambdas=[0.25], chunk_len=16,
                   progress=False)
    n_keys = result.results["keys"]["resid_post:1"]["datastore"]["n_keys"]
    assert result.config["k"] == 100_000 and result.config["k_used"] == n_keys < 100_000
    assert any(f"--neighbors 100000 is more than the {n_keys} keys" in w for w in result.warnings)


@pytest.mark.fault("refused")
def test_a_store_folder_is_replaced_only_with_overwrite(gpt2, docs, tmp_path):
    store = tmp_path / "store"
    args = dict(keys=["resid_post:-1"], k=4, lambdas=[0.25], chunk_len=16, progress=False)
    knnlm(gpt2, docs[:2], docs[2:4], store_dir=store, **args)
    before = (store / "manifest.json").read_bytes()
    with pytest.raises(RepgeomError, match=r"--store-dir .* already holds an earlier kNN store .*--overwrite"):
        knnlm(gpt2, docs[:3], docs[3:5], store_dir=store, **args)
    assert (store / "manifest.json").read_bytes() == before  # refused before anything was written
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("a user's file")
    with pytest.raises(RepgeomError, match=r"already holds 1 file\(s\) \(mine\.txt\)"):
        knnlm(gpt2, docs[:2], docs[2:4], store_dir=tmp_path / "notes", **args)
    stale = store / "keys_resid_mid_1.npy"  # a key file of another run's address
    stale.write_bytes(b"x")
    knnlm(gpt2, docs[:3], docs[3:5], store_dir=store, overwrite=True, **args)
    assert not stale.exists() and (store / "manifest.json").read_bytes() != before


def test_errors(tiny_model_dir, gpt2, docs):
    with pytest.raises(RepgeomError, match="resid_mid:9"):
        knnlm(gpt2, docs, docs, keys=["resid_mid:9"], chunk_len=16, progress=False)
    neox = load_model(tiny_model_dir("gpt_neox"))  # parallel residual: no resid_mid
    with pytest.raises(RepgeomError, match="resid_mid:1 is not available"):
        knnlm(neox, docs, docs, keys=["resid_mid:-1"], chunk_len=16, progress=False)
    with pytest.raises(RepgeomError, match="causal"):
        knnlm(tiny_model_dir("bert"), docs, docs, chunk_len=16, progress=False)
    with pytest.raises(RepgeomError, match="evaluation text .* gives no chunk of 64 tokens"):
        knnlm(gpt2, docs, ["too short"], chunk_len=64, progress=False)
    with pytest.raises(RepgeomError, match="exceeds the model context of 128"):
        knnlm(gpt2, docs, docs, chunk_len=4096, progress=False)
    with pytest.raises(RepgeomError, match="λ must lie"):
        knnlm(gpt2, docs, docs, lambdas=[-0.1], chunk_len=16, progress=False)


def test_cli(tiny_model_dir, docs, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    out = tmp_path / "knn.json"
    with pytest.warns(UserWarning, match=SAME_TEXT):
        code = main(["knnlm", "--model", tiny_model_dir("gpt2"), "--key", "resid_mid:-1", "resid_post:-1",
                     "--datastore", str(data), "--eval", str(data), "--chunk-len", "16", "--neighbors", "8",
                     "--lambda", "0", "0.25", "--output", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["kind"] == "knnlm" and result["config"]["k"] == 8 and result["config"]["lambdas"] == [0.0, 0.25]
    assert any(SAME_TEXT in w for w in result["warnings"])
    printed = capsys.readouterr().out
    assert "(LM alone)" in printed and "resid_post:1" in printed
    assert main(["knnlm", "--model", tiny_model_dir("gpt2"), "--key", "mlp_in:7", "--datastore", str(data),
                 "--eval", str(data), "--chunk-len", "16"]) == 2
    assert "out of range" in capsys.readouterr().err
