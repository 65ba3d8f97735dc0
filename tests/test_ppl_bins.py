"""repgeom ppl-bins: Algorithm 1, per-chunk perplexity and dispersion from one pass, sources and confounds."""

import json
import math
import random

import numpy as np
import pytest
import torch
from scipy import stats

from repgeom_eval.analyses.corpus import Document, chunk_documents, corpus_chunks, read_documents, sample_chunks
from repgeom_eval.analyses.ppl_bins import (bin_and_correlate, chunk_statistics, confound_check, ppl_bins,
                                            uniform_ppl_groups)
from repgeom_eval.modeling.addresses import resolve_request
from repgeom_eval.entrypoints.cli import main
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.functional.dispersion import pairwise_dispersion
from repgeom_eval.modeling.loading import load_model


def reference_selection(ppl, group_size, n_bins):
    """Brute force: nearest group mean to each target by full scan, ties to the larger index."""
    order = sorted(range(len(ppl)), key=lambda i: ppl[i])
    groups = [order[i:i + group_size] for i in range(0, len(order) - group_size + 1, group_size)]
    if len(groups) <= n_bins:
        return groups
    means = [sum(ppl[i] for i in g) / group_size for g in groups]
    keep = set()
    for t in np.linspace(means[0], means[-1], n_bins):
        best = min(range(len(means)), key=lambda k: (abs(means[k] - t), -k))
        keep.add(best)
    return [groups[k] for k in sorted(keep)]


def test_algorithm1_small_oracle():
    groups, n = uniform_ppl_groups([float(v) for v in range(10, 0, -1)], 2, 3)  # sorted to 1..10, means 1.5 .. 9.5
    assert n == 5
    assert [sorted(g) for g in groups] == [[8, 9], [4, 5], [0, 1]]  # targets 1.5, 5.5, 9.5


def test_algorithm1_ties_prefer_the_right_neighbour_and_incomplete_tail_is_dropped():
    groups, n = uniform_ppl_groups([0.0, 1.0, 3.0, 4.0], 1, 3)  # targets 0, 2, 4: 2 is equidistant from 1 and 3
    assert n == 4 and groups == [[0], [2], [3]]
    groups, n = uniform_ppl_groups([5.0, 1.0, 2.0, 3.0, 4.0], 2, 10)
    assert n == 2 and groups == [[1, 2], [3, 4]]  # the highest chunk (5.0) is the incomplete tail


def test_algorithm1_matches_brute_force_on_random_inputs():
    rng = random.Random(0)
    for trial in range(30):
        ppl = [rng.lognormvariate(2, 0.7) for _ in range(rng.randint(5, 400))]
        g, b = rng.randint(1, 6), rng.randint(1, 30)
        assert uniform_ppl_groups(ppl, g, b)[0] == reference_selection(ppl, g, b), trial


def test_chunking_concat_and_document():
    docs = [Document("a", "x", 0), Document("b", "y", 1), Document("c", "x", 2)]
    ids = [[1, 2, 3, 4, 5], [10, 11, 12], [6, 7, 8]]
    concat = chunk_documents(docs, ids, 3, "concat", separator=[0])
    assert [(c.ids, c.source, c.doc, c.start) for c in concat] == [
        ((1, 2, 3), "x", 0, 0), ((4, 5, 0), "x", 0, 3), ((6, 7, 8), "x", 2, 6), ((10, 11, 12), "y", 1, 0)]
    per_doc = chunk_documents(docs, ids, 3, "document", min_len=2)
    assert [c.ids for c in per_doc] == [(1, 2, 3), (4, 5), (10, 11, 12), (6, 7, 8)]
    assert sample_chunks(concat, None, 0) == [0, 1, 2, 3]
    assert sample_chunks(concat, 2, 42) == random.Random(42).sample(range(4), 2)


def test_read_documents_sources_must_be_all_or_none(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"text": "a b", "source": "s"}) + "\n" + json.dumps({"text": "c d"}) + "\n")
    with pytest.raises(RepgeomError, match="lacks the 'source' field"):
        read_documents(p)
    p.write_text(json.dumps({"text": "a b", "source": "s"}) + "\n" + json.dumps({"text": " ", "source": "t"}) + "\n")
    assert [(d.text, d.source) for d in read_documents(p)] == [("a b", "s")]


@pytest.fixture(scope="module")
def gpt2(tiny_model_dir):
    return load_model(tiny_model_dir("gpt2"))


@pytest.fixture(scope="module")
def doc_texts():
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)[:12]]


def test_one_pass_gives_hf_loss_and_hidden_state_dispersion(gpt2, doc_texts):
    addrs = list(resolve_request("all", gpt2).addresses)
    chunks = corpus_chunks(gpt2.tokenizer, [Document(t, "all", i) for i, t in enumerate(doc_texts)], 24)[:5]
    ppl, disp = chunk_statistics(gpt2, chunks, addrs, batch_size=5, progress=False)
    ppl1, disp1 = chunk_statistics(gpt2, chunks, addrs, batch_size=1, progress=False)
    np.testing.assert_allclose(ppl, ppl1, rtol=1e-5)
    np.testing.assert_allclose(disp, disp1, atol=1e-6)
    for i, c in enumerate(chunks):
        ids = torch.tensor([c.ids])
        with torch.no_grad():
            out = gpt2.model(input_ids=ids, labels=ids, output_hidden_states=True)
        assert ppl[i] == pytest.approx(math.exp(out.loss.item()), rel=1e-5)
        for j, h in enumerate(out.hidden_states):  # "all" = hidden_states[0..L]
            assert disp[i, j] == pytest.approx(pairwise_dispersion(h[0]).item(), abs=1e-6)


def test_correlations_match_scipy():
    rng = np.random.default_rng(1)
    ppl = rng.lognormal(2, 0.5, 60)
    disp = np.stack([0.01 * ppl + rng.normal(0, 0.05, 60), -ppl + rng.normal(0, 3, 60)], 1)
    out = bin_and_correlate(ppl, disp, ["a", "b"], group_size=4, n_bins=10)
    xs = [g["mean_ppl"] for g in out["groups"]]
    assert out["n_groups"] == 15 and out["n_selected"] == len(xs) <= 10
    for name in ("a", "b"):
        ys = [g["dispersion"][name] for g in out["groups"]]
        assert out["correlation"][name]["pearson"] == pytest.approx(stats.pearsonr(xs, ys)[0], abs=1e-12)
        assert out["correlation"][name]["spearman"] == pytest.approx(stats.spearmanr(xs, ys)[0], abs=1e-12)
    assert out["correlation"]["a"]["spearman"] > 0 > out["correlation"]["b"]["spearman"]


def test_confound_flag_and_sign_reversal():
    # Two domains: within each, dispersion falls with perplexity; the high-ppl domain is more dispersed overall.
    rng = np.random.default_rng(0)
    ppl_a, ppl_b = rng.uniform(5, 10, 80), rng.uniform(40, 80, 80)
    disp_a, disp_b = 0.5 - 0.01 * ppl_a, 0.9 - 0.002 * ppl_b
    layers = ["final"]
    a = bin_and_correlate(ppl_a, disp_a[:, None], layers, 4, 100)
    b = bin_and_correlate(ppl_b, disp_b[:, None], layers, 4, 100)
    pooled = bin_and_correlate(np.r_[ppl_a, ppl_b], np.r_[disp_a, disp_b][:, None], layers, 4, 100)
    assert a["correlation"]["final"]["spearman"] < 0 and b["correlation"]["final"]["spearman"] < 0
    assert pooled["correlation"]["final"]["spearman"] > 0
    check = confound_check(pooled, {"a": a, "b": b}, layers, 2.0)
    assert check["flagged"] and check["ratio"] > 5 and check["sign_reversal_layers"] == ["final"]
    assert not confound_check(pooled, {"a": a, "b": a}, layers, 2.0)["flagged"]


def test_corpus_too_small_for_the_bins(gpt2, doc_texts):
    with pytest.raises(RepgeomError, match="corpus too small.*lower --group-size"):
        ppl_bins(gpt2, doc_texts[:2], layers="final", chunk_len=32, group_size=100, progress=False)


def test_address_not_in_the_model(gpt2, doc_texts):
    with pytest.raises(RepgeomError, match="out of range"):
        ppl_bins(gpt2, doc_texts, layers="resid_mid:7", chunk_len=16, group_size=2, progress=False)


def test_cli_with_sources_writes_kind_groups_and_plots(tiny_model_dir, doc_texts, tmp_path, capsys):
    data = tmp_path / "mixed.jsonl"
    with data.open("w") as fh:
        for i, t in enumerate(doc_texts):
            fh.write(json.dumps({"text": t, "source": "even" if i % 2 == 0 else "odd"}) + "\n")
    out = tmp_path / "ppl.json"
    rc = main(["ppl-bins", "--model", tiny_model_dir("gpt2"), "--data", str(data), "--chunk-len", "16",
               "--group-size", "3", "--bins", "8", "--n-chunks", "60", "--layers", "embed", "final",
               "--output", str(out), "--per-chunk", str(tmp_path / "chunks.jsonl")])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["kind"] == "ppl-bins" and result["results"]["layers"] == ["embed", "final"]
    pooled = result["results"]["pooled"]
    assert pooled["n_chunks"] == 60 and pooled["n_groups"] == 20 and pooled["n_selected"] <= 8
    means = [g["mean_ppl"] for g in pooled["groups"]]
    assert means == sorted(means)
    assert set(result["results"]["by_source"]) == {"even", "odd"}
    assert result["config"]["group_size"] == 3 and result["config"]["seed"] == 42
    assert len((tmp_path / "chunks.jsonl").read_text().splitlines()) == 60
    for name in ("ppl_scatter.png", "ppl_by_depth.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert "Spearman" in capsys.readouterr().out


# -- balancing the sources, the automatic group size, r and ρ per source (issue 17) ---------------------------------

def _chunks(counts):
    """Chunks of the given sources, ``counts[source]`` each, interleaved as a packed corpus is not."""
    from repgeom_eval.analyses.corpus import Chunk

    out = []
    for s, n in counts.items():
        out += [Chunk((len(out), len(out) + 1), s, f"{s}{i}", 2 * i) for i in range(n)]
    return out


def test_sample_per_source_draws_n_from_every_source_each_on_its_own():
    from repgeom_eval.analyses.corpus import sample_per_source

    chunks = _chunks({"big": 500, "small": 7, "mid": 40})
    picked = sample_per_source(chunks, 7, seed=42)
    assert len(picked) == len(set(picked)) == 21
    assert {s: sum(chunks[i].source == s for i in picked) for s in ("big", "small", "mid")} == \
        {"big": 7, "small": 7, "mid": 7}
    assert sample_per_source(chunks, 7, seed=42) == picked  # seeded
    assert sample_per_source(chunks, 7, seed=43) != picked
    # A source's sample does not depend on the other sources.
    alone = sample_per_source(_chunks({"big": 500}), 7, seed=42)
    assert [chunks[i].doc for i in picked if chunks[i].source == "big"] == [f"big{i}" for i in alone]
    # Every chunk of a source that has exactly N.
    assert sorted(chunks[i].doc for i in picked if chunks[i].source == "small") == sorted(f"small{i}" for i in range(7))


def test_sample_per_source_names_the_sources_that_are_too_small():
    from repgeom_eval.analyses.corpus import sample_per_source

    chunks = _chunks({"big": 500, "small": 7, "mid": 40})
    with pytest.raises(RepgeomError, match=r"--per-source 50: too few chunks in 2 of 3 source\(s\) \('small' has 7, "
                                           r"'mid' has 40\).*at most 7 per source"):
        sample_per_source(chunks, 50, seed=0)
    with pytest.raises(RepgeomError, match=r"'empty' has 0.*without a single chunk"):
        sample_per_source(chunks, 5, seed=0, sources=["big", "small", "mid", "empty"])


def test_auto_group_size_gives_every_source_enough_groups():
    from repgeom_eval.analyses.ppl_bins import GROUP_SIZE_MAX, GROUPS_PER_SOURCE, auto_group_size, resolve_group_size
    from repgeom_eval.spec.options.analyses import PplBinsConfig

    assert PplBinsConfig().group_size == "auto" and (GROUPS_PER_SOURCE, GROUP_SIZE_MAX) == (20, 100)
    size, rule = auto_group_size({"code": 5000, "docs": 130, "bible": 900})
    assert size == 130 // 20 == 6 and "source 'docs', the smallest, has 130 chunks" in rule
    assert auto_group_size({"a": 100_000, "b": 300_000})[0] == 100  # paper A's size at paper A's scale
    assert "capped" in auto_group_size({"a": 100_000})[1]
    assert auto_group_size({"a": 7})[0] == 1
    assert auto_group_size({"all": 400})[1].startswith("auto: the sample has 400 chunks")
    for counts in ({"a": 20}, {"a": 57, "b": 1999}, {"a": 2000}, {"x": 45, "y": 45}):
        size = auto_group_size(counts)[0]
        assert all(n // size >= GROUPS_PER_SOURCE for n in counts.values()), counts
    assert resolve_group_size(7, {"a": 100_000}) == (7, "given")  # a number is used exactly
    for bad in (0, -3, "many", 2.5, True):
        with pytest.raises(RepgeomError, match="positive number of chunks or 'auto'"):
            resolve_group_size(bad, {"a": 10})


def test_n_chunks_and_per_source_exclude_each_other(gpt2, doc_texts):
    with pytest.raises(RepgeomError, match="--n-chunks .* or --per-source .*not both"):
        ppl_bins(gpt2, doc_texts, layers="final", chunk_len=16, n_chunks=10, per_source=5, progress=False)
    with pytest.raises(RepgeomError, match="positive number of chunks or 'auto'"):
        ppl_bins(gpt2, doc_texts, layers="final", chunk_len=16, group_size="big", progress=False)


def _two_sources(tmp_path, doc_texts, small_docs=2):
    """A natural corpus, one record per document: 'topics' has ten documents, 'few' only ``small_docs``."""
    data = tmp_path / "two.jsonl"
    with data.open("w") as fh:
        for i, t in enumerate(doc_texts):
            source = "few" if i < small_docs else "topics"
            fh.write(json.dumps({"text": t, "source": source}) + "\n")
    return data


def test_cli_per_source_balances_and_auto_group_size_is_recorded(tiny_model_dir, doc_texts, tmp_path, capsys):
    data = _two_sources(tmp_path, doc_texts)
    out = tmp_path / "ppl.json"
    rc = main(["ppl-bins", "--model", tiny_model_dir("gpt2"), "--data", str(data), "--chunk-len", "16",
               "--per-source", "40", "--layers", "embed", "final", "--no-progress", "--output", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    cfg, res = doc["config"], doc["results"]
    assert doc["data"]["chunks_used_per_source"] == {"few": 40, "topics": 40}
    assert doc["data"]["chunks_per_source"]["topics"] > doc["data"]["chunks_per_source"]["few"] > 40
    assert cfg["per_source"] == 40 and cfg["n_chunks"] is None and cfg["sampling"] == "40 chunks from every source"
    assert cfg["group_size"] == 2 and cfg["group_size_rule"].startswith("auto: source 'few', the smallest, has 40")
    assert res["by_source"]["few"]["n_groups"] == res["by_source"]["topics"]["n_groups"] == 20
    assert res["pooled"]["n_chunks"] == 80
    printed = capsys.readouterr().out
    for head in ("Pearson", "Spearman", "pooled r", "pooled ρ", "few r", "few ρ", "topics r", "topics ρ"):
        assert head in printed, head
    few = res["by_source"]["few"]["correlation"]["final"]
    assert f"{few['pearson']:+.3f}" in printed and f"{few['spearman']:+.3f}" in printed
    assert "groups of 2 (auto:" in printed

    # An explicit group size is kept exactly; too many chunks per source is an error that names the source.
    rc = main(["ppl-bins", "--model", tiny_model_dir("gpt2"), "--data", str(data), "--chunk-len", "16",
               "--per-source", "40", "--group-size", "4", "--layers", "final", "--no-progress", "--output", str(out)])
    assert rc == 0
    cfg = json.loads(out.read_text())["config"]
    assert (cfg["group_size"], cfg["group_size_rule"]) == (4, "given")
    assert main(["ppl-bins", "--model", tiny_model_dir("gpt2"), "--data", str(data), "--chunk-len", "16",
                 "--per-source", "100000", "--layers", "final", "--no-progress"]) != 0
    assert "'few' has" in capsys.readouterr().err


def test_cli_rejects_n_chunks_with_per_source_and_a_bad_group_size(tiny_model_dir, doc_texts, tmp_path, capsys):
    data = _two_sources(tmp_path, doc_texts)
    base = ["ppl-bins", "--model", tiny_model_dir("gpt2"), "--data", str(data), "--chunk-len", "16"]
    assert main(base + ["--n-chunks", "10", "--per-source", "5"]) == 2  # checked by PplBinsConfig, before any work
    assert "give --n-chunks (a uniform sample) or --per-source" in capsys.readouterr().err
    assert main(base + ["--group-size", "lots"]) == 2
    assert "--group-size: expected a positive number of chunks or 'auto', got 'lots'" in capsys.readouterr().err


def test_help_states_the_automatic_group_size(capsys):
    with pytest.raises(SystemExit):
        main(["ppl-bins", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--per-source N" in text and "default: auto = the smallest source's sampled chunks // 20" in text
