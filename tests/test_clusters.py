"""repgeom clusters: contexts sharing an n-gram continuation, within/between-cluster distances."""

import json

import pytest
import torch

from repgeom_eval.analyses.clusters import cluster_distances, clusters, find_clusters
from repgeom_eval.entrypoints.cli import main
from repgeom_eval.spec.errors import RepgeomError

pytestmark = pytest.mark.filterwarnings("ignore:.*clusters have fewer than")


@pytest.fixture(scope="module")
def docs():
    from pydoc_data.topics import topics

    return [topics[k][:800] for k in sorted(topics)[:5]]


def test_find_clusters_counts_and_contexts():
    docs = [[9, 1, 2, 3, 5, 1, 2, 3, 6, 1, 2], [1, 2, 3, 7, 8, 1, 2, 4]]
    # eligible positions need 2 tokens of left context: (1,2) occurs at 1*, 5, 9 in doc 0 and 5 in doc 1 (* too early)
    found = find_clusters(docs, ngram=2, min_count=2, contexts=5, context_len=2, n_clusters=10)
    first = found[0]
    assert first.ngram == (1, 2) and first.count == 3
    assert first.contexts == ((3, 5), (3, 6), (7, 8))
    assert all(c.count >= 2 for c in found) and [c.ngram for c in found][:2] == [(1, 2), (2, 3)]
    few = find_clusters(docs, ngram=2, min_count=2, contexts=2, context_len=2, n_clusters=1, seed=3)
    assert len(few) == 1 and len(few[0].contexts) == 2 and set(few[0].contexts) <= set(first.contexts)
    assert few == find_clusters(docs, ngram=2, min_count=2, contexts=2, context_len=2, n_clusters=1, seed=3)
    with pytest.raises(RepgeomError, match="n-gram length must be positive"):
        find_clusters(docs, ngram=0)


def test_cluster_distances_match_brute_force():
    g = torch.Generator().manual_seed(0)
    vecs = [torch.randn(n, 6, generator=g, dtype=torch.float64) + shift
            for n, shift in ((5, 0.0), (3, 2.0), (7, -1.0))]
    got = cluster_distances(vecs)
    cos = torch.nn.functional.cosine_similarity
    centroids = [(v / v.norm(dim=1, keepdim=True)).mean(0) for v in vecs]
    within = [float((1 - cos(v, c.unsqueeze(0))).mean()) for v, c in zip(vecs, centroids)]
    pairs = [float(1 - cos(centroids[i], centroids[j], dim=0)) for i in range(3) for j in range(3) if i != j]
    assert got["per_cluster_within"] == pytest.approx(within, abs=1e-12)
    assert got["within"] == pytest.approx(sum(within) / 3, abs=1e-12)
    assert got["between"] == pytest.approx(sum(pairs) / len(pairs), abs=1e-12)
    # tight, well separated clusters: within ≈ 0, between ≈ that of the cluster means
    tight = cluster_distances([torch.eye(3)[i] + 1e-6 * torch.randn(4, 3, generator=g) for i in range(3)])
    assert tight["within"] < 1e-9 and tight["between"] == pytest.approx(1.0, abs=1e-5)


def test_on_models_and_checkpoint_series(tiny_model_dir, docs):
    a, b = tiny_model_dir("gpt2"), tiny_model_dir("gpt2", n_layers=4)
    result = clusters([a, b], docs, ngram=3, min_count=4, contexts=4, context_len=6, n_clusters=8,
                      progress=False)
    res = result.results
    assert len(res["clusters"]) == 8 and all(c["count"] >= 4 for c in res["clusters"])
    m1, m2 = res["models"].values()
    assert len(m1["layers"]) == 3 and len(m2["layers"]) == 5
    for m in (m1, m2):
        assert all(0 <= w <= 2 and 0 <= bt <= 2 for w, bt in zip(m["within"], m["between"]))
        assert all(len(v) == 8 for v in m["per_cluster_within"].values())
    # the same contexts for every model, and each model's numbers on its own
    alone = clusters([b], docs, ngram=3, min_count=4, contexts=4, context_len=6, n_clusters=8, progress=False)
    only = next(iter(alone.results["models"].values()))
    assert only["within"] == pytest.approx(m2["within"], abs=1e-9)
    assert only["between"] == pytest.approx(m2["between"], abs=1e-9)
    assert result.config["n_clusters_used"] == 8 and not any("--clusters" in w for w in result.warnings)


@pytest.mark.fault("clean")
def test_more_clusters_than_the_corpus_forms_is_said_and_recorded(tiny_model_dir, docs):
    result = clusters([tiny_model_dir("gpt2")], docs, ngram=3, min_count=4, contexts=4, context_len=6,
                      n_clusters=100_000, progress=False)
    formed = len(result.results["clusters"])
    assert 2 <= formed < 100_000 and result.config["n_clusters_used"] == formed
    assert result.config["n_clusters"] == 100_000  # what was asked stays beside what was used
    assert any(f"--clusters 100000: the corpus has only {formed}" in w for w in result.warnings)


def test_errors(tiny_model_dir, docs, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_model_dir("gpt2"), other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["zzqq"])
    tok.save_pretrained(other)
    with pytest.raises(RepgeomError, match="corpus too small.*--min-count"):
        clusters([tiny_model_dir("gpt2")], docs[:1], ngram=10, min_count=50, context_len=6, progress=False)
    with pytest.raises(RepgeomError, match="another tokenizer"):
        clusters([tiny_model_dir("gpt2"), str(other)], docs, ngram=3, min_count=4, contexts=2,
                 context_len=6, n_clusters=3, progress=False)
    with pytest.raises(RepgeomError, match="exceeds the model context"):
        clusters([tiny_model_dir("gpt2")], docs, context_len=1000, progress=False)


def test_cli(tiny_model_dir, docs, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    out = tmp_path / "cl.json"
    assert main(["clusters", "--model", tiny_model_dir("gpt2"), "--data", str(data), "--ngram", "3",
                 "--min-count", "4", "--contexts", "3", "--context-len", "6", "--clusters", "5",
                 "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kind"] == "clusters" and result["config"]["ngram"] == 3 and len(result["results"]["clusters"]) == 5
    assert (tmp_path / "cl.png").read_bytes()[:4] == b"\x89PNG"
    assert "between / within" in capsys.readouterr().out
    assert main(["clusters", "--model", tiny_model_dir("gpt2"), "--data", str(data), "--layers", "mlp_in:5"]) == 2
    assert "out of range" in capsys.readouterr().err
