"""Value tests: ``repgeom clusters`` and ``repgeom perturb`` against numpy on ``transformers`` hidden states.

Both commands are run through the CLI (``--dtype float64``, results read back from ``--output``) and, for the
checkpoint series of ``clusters``, through the Python function. The reference re-derives everything from the
documented definitions: the tokenization (no special tokens), the n-gram clusters, the contexts, the vectors (one
forward per token sequence with ``transformers``, float64) and the statistics (numpy).
"""

import json
from collections import Counter

import numpy as np
import pytest

import values_reference as ref

TOL = 1e-9  # float64 on both sides


def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


def cli(args, capsys):
    from repgeom_eval.entrypoints.cli import main  # the `repgeom` console script

    code = main(args)
    out = capsys.readouterr()
    assert code == 0, out.err
    return out


@pytest.fixture(scope="module")
def docs():
    from pydoc_data.topics import topics

    keys = sorted(topics)
    # many short documents: occurrences right at the left-context boundary of a document matter for the counts
    return [topics[k][:260] for k in keys[10:34]]


# -- clusters ---------------------------------------------------------------------------------------------------

def reference_clusters(token_docs, ngram, min_count, context_len, n_clusters):
    """Paper A §2.3 as repgeom documents it: n-grams with ≥ min_count occurrences that have context_len tokens of
    left context in their document, most frequent first (ties: first occurrence first); every occurrence's left
    context (the corpora here are small enough that no cluster is subsampled)."""
    counts, where = Counter(), {}
    for d, ids in enumerate(token_docs):
        for i in range(context_len, len(ids) - ngram + 1):
            g = tuple(ids[i:i + ngram])
            counts[g] += 1
            where.setdefault(g, []).append(ids[i - context_len:i])
    frequent = sorted((g for g in counts if counts[g] >= min_count), key=lambda g: -counts[g])[:n_clusters]
    return [(g, counts[g], where[g]) for g in frequent]


def reference_distances(model_dir, found, layers):
    """within = mean over clusters of mean_i (1 − cos(x_i, c)), c = mean of the members' unit vectors;
    between = mean pairwise cosine distance of the centroids. x_i = hidden state at the context's last token."""
    states = [ref.token_id_states(model_dir, contexts) for _, _, contexts in found]
    per_layer = {}
    for k in layers:
        centroids, within = [], []
        for members in states:
            x = np.stack([s[k][-1] for s in members])
            u = ref.units(x)
            c = u.mean(0)
            centroids.append(c)
            within.append(float(np.mean(1.0 - u @ (c / np.linalg.norm(c)))))
        mean_within = float(np.mean(within))
        between = ref.mean_cosine_distance(np.stack(centroids))
        per_layer[k] = {"within": mean_within, "between": between, "ratio": between / mean_within,
                        "per_cluster_within": within}
    return per_layer


def assert_model_values(got, want, names):
    assert got["layers"] == names
    for j, k in enumerate(want):
        for key in ("within", "between", "ratio"):
            assert got[key][j] == pytest.approx(want[k][key], rel=TOL, abs=TOL), (names[j], key)
        assert got["per_cluster_within"][names[j]] == pytest.approx(want[k]["per_cluster_within"], rel=TOL, abs=TOL)


@pytest.mark.filterwarnings("ignore:.*clusters have fewer than")
def test_clusters_cli_equals_numpy(tiny_model_dir, docs, tmp_path, capsys):
    model_dir = tiny_model_dir("gpt2")
    params = dict(ngram=3, min_count=4, context_len=7, n_clusters=6)
    out = tmp_path / "clusters.json"
    cli(["clusters", "--model", model_dir, "--data", str(write_jsonl(tmp_path / "d.jsonl", docs)),
         "--ngram", "3", "--min-count", "4", "--contexts", "1000", "--context-len", "7", "--clusters", "6",
         "--dtype", "float64", "--batch-size", "5", "--output", str(out), "--no-progress"], capsys)
    result = json.loads(out.read_text())

    tok = tokenizer(model_dir)
    token_docs = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
    found = reference_clusters(token_docs, **params)
    assert len(found) == 6 and len({c for _, c, _ in found}) > 1  # several cluster sizes: the order matters
    assert result["results"]["clusters"] == [{"ngram": tok.decode(list(g)), "count": c, "n_contexts": len(ctx)}
                                             for g, c, ctx in found]
    assert result["data"]["n_contexts"] == sum(len(ctx) for _, _, ctx in found)
    (label, got), = result["results"]["models"].items()
    assert_model_values(got, reference_distances(model_dir, found, [0, 1, -1]), ["embed", "resid_post:0", "final"])


@pytest.mark.filterwarnings("ignore:.*clusters have fewer than")
def test_clusters_checkpoint_series_equals_numpy(tiny_model_dir, docs):
    """Two models sharing a tokenizer (2 and 4 blocks) on the same clusters; addresses chosen per model."""
    from repgeom_eval.analyses.clusters import clusters

    small, deep = tiny_model_dir("gpt2"), tiny_model_dir("gpt2", n_layers=4)
    result = clusters([small, deep], docs, layers="embed,resid_post:1,final", ngram=2, min_count=6, contexts=1000,
                      context_len=5, n_clusters=5, dtype="float64", progress=False)
    tok = tokenizer(small)
    found = reference_clusters([tok(d, add_special_tokens=False)["input_ids"] for d in docs], 2, 6, 5, 5)
    assert [c["count"] for c in result.results["clusters"]] == [c for _, c, _ in found]
    got_small, got_deep = result.results["models"].values()
    names = ["embed", "resid_post:1", "final"]
    # resid_post:1 is the output of block 1 = hidden_states[2]; on the 2-block model that is also `final`'s input
    # (before GPT-2's final LayerNorm), which transformers does not return: compare embed and final there.
    want_small = reference_distances(small, found, [0, -1])
    assert got_small["layers"] == names
    for j, k in ((0, 0), (2, -1)):
        for key in ("within", "between"):
            assert got_small[key][j] == pytest.approx(want_small[k][key], rel=TOL, abs=TOL), (names[j], key)
    assert_model_values(got_deep, reference_distances(deep, found, [0, 2, -1]), names)


# -- perturb ----------------------------------------------------------------------------------------------------

def reference_perturb_values(model_dir, prompts):
    """Per layer: mean over prompts of the normalized prompt entropy and of the token dispersion."""
    states = ref.token_id_states(model_dir, prompts)
    n_layers = len(states[0])
    ent = [float(np.mean([ref.von_neumann_entropy_normalized(s[k]) for s in states])) for k in range(n_layers)]
    disp = [float(np.mean([ref.mean_cosine_distance(s[k]) for s in states])) for k in range(n_layers)]
    return ent, disp


def perturb_prompts(model_dir, docs, n_prompts, max_len):
    """The first n_prompts texts with at least max_len tokens (no special tokens), cut to max_len."""
    tok = tokenizer(model_dir)
    ids = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
    return [x[:max_len] for x in ids if len(x) >= max_len][:n_prompts]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_perturb_cli_length_sweep_and_unperturbed_conditions_equal_numpy(kind, tiny_model_dir, docs, tmp_path,
                                                                         capsys):
    model_dir = tiny_model_dir(kind)
    out = tmp_path / "perturb.json"
    cli(["perturb", "--model", model_dir, "--data", str(write_jsonl(tmp_path / "d.jsonl", docs)),
         "--p", "0", "0.5", "--lengths", "6", "13", "40", "--n-prompts", "4", "--batch-size", "3",
         "--dtype", "float64", "--output", str(out), "--no-progress"], capsys)
    res = json.loads(out.read_text())["results"]
    assert res["layers"] == ["embed", "resid_post:0", "final"]
    prompts = perturb_prompts(model_dir, docs, 4, 40)
    assert len(prompts) == 4
    length = res["sweeps"]["length"]
    assert length["values"] == [6, 13, 40]  # 40 tokens > D = 32: log min(N, D) is log D there
    for j, n in enumerate([6, 13, 40]):
        ent, disp = reference_perturb_values(model_dir, [p[:n] for p in prompts])
        assert length["prompt_entropy"][j] == pytest.approx(ent, rel=TOL, abs=TOL), n
        assert length["token_dispersion"][j] == pytest.approx(disp, rel=TOL, abs=TOL), n
    # p = 0 leaves the prompts as they are (full length) in both token sweeps
    ent, disp = reference_perturb_values(model_dir, prompts)
    for sweep in ("repetition", "random"):
        r = res["sweeps"][sweep]
        assert r["values"] == [0.0, 0.5]
        assert r["prompt_entropy"][0] == pytest.approx(ent, rel=TOL, abs=TOL), sweep
        assert r["token_dispersion"][0] == pytest.approx(disp, rel=TOL, abs=TOL), sweep
        # p = 0.5 does perturb (so the p = 0 equality above is not a coincidence of the sweep)
        assert max(abs(a - b) for a, b in zip(r["token_dispersion"][1], disp)) > 1e-3, sweep


def test_perturb_full_repetition_is_one_token_of_the_prompt_repeated(tiny_model_dir, docs):
    """p = 1: every token after the first is the same token, drawn from the prompt. Which one is the seeded draw's
    business; with a single prompt the reference tries every token of the prompt, and exactly the measured values
    (every layer, both statistics at once) must come out for one of them."""
    from repgeom_eval.analyses.perturb import perturb

    model_dir = tiny_model_dir("gpt2")
    result = perturb(model_dir, docs, sweeps=["repetition"], ps=[1.0], lengths=[12], n_prompts=1, seed=4,
                     dtype="float64", progress=False)
    r = result.results["sweeps"]["repetition"]
    (prompt,) = perturb_prompts(model_dir, docs, 1, 12)
    matches = []
    for t in dict.fromkeys(prompt):
        ent, disp = reference_perturb_values(model_dir, [[prompt[0]] + [t] * (len(prompt) - 1)])
        if np.allclose(r["prompt_entropy"][0], ent, rtol=0, atol=TOL) and \
                np.allclose(r["token_dispersion"][0], disp, rtol=0, atol=TOL):
            matches.append(t)
    assert len(matches) == 1, matches
