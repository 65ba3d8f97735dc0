"""repgeom perturb: prompt entropy and token dispersion under repetition, random tokens and length."""

import json

import numpy as np
import pytest
import torch

from repgeom_eval.analyses.corpus import Document, tokenize_documents
from repgeom_eval.analyses.perturb import perturb, random_tokens, repeat_tokens
from repgeom_eval.entrypoints.cli import main
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.functional.dispersion import dispersion
from repgeom_eval.functional.entropy import prompt_entropy
from repgeom_eval.modeling.loading import load_model


@pytest.fixture(scope="module")
def docs():
    from pydoc_data.topics import topics

    return [topics[k][:400] for k in sorted(topics)[:6]]


@pytest.fixture(scope="module")
def gpt2(tiny_model_dir):
    return load_model(tiny_model_dir("gpt2"))


def test_perturbations():
    ids = list(range(10, 60))
    rng = np.random.default_rng(0)
    assert repeat_tokens(ids, 0.0, rng) == ids and random_tokens(ids, 0.0, rng, np.arange(5)) == ids
    rep = repeat_tokens(ids, 1.0, rng)
    assert rep[0] == 10 and len(set(rep[1:])) == 1 and rep[1] in ids
    rnd = random_tokens(ids, 1.0, rng, np.arange(3))
    assert set(rnd) <= {0, 1, 2}
    half = random_tokens(ids * 20, 0.5, np.random.default_rng(1), np.arange(3))
    assert 0.4 < np.mean([h != t for h, t in zip(half, ids * 20)]) < 0.6


def _direct(loaded, prompts, layer):
    ent, disp = [], []
    for ids in prompts:
        with torch.no_grad():
            h = loaded.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[layer][0]
        ent.append(prompt_entropy(h)["normalized"])
        disp.append(float(dispersion(h)))
    return np.mean(ent), np.mean(disp)


def test_values_match_direct_computation(gpt2, docs):
    result = perturb(gpt2, docs, ps=[0.0, 0.5, 1.0], lengths=[8, 24], n_prompts=4, batch_size=3, progress=False)
    res = result.results
    assert res["layers"] == ["embed", "resid_post:0", "final"] and result.data["n_prompts"] == 4
    rep, rnd, length = (res["sweeps"][s] for s in ("repetition", "random", "length"))
    assert rep["values"] == [0.0, 0.5, 1.0] and length["values"] == [8, 24]
    # unperturbed = full length: the three sweeps agree there
    assert rep["prompt_entropy"][0] == pytest.approx(rnd["prompt_entropy"][0], abs=1e-12)
    assert rep["prompt_entropy"][0] == pytest.approx(length["prompt_entropy"][-1], abs=1e-12)
    prompts = [ids[:24] for ids in tokenize_documents(gpt2.tokenizer, [Document(t, "all", i)
                                                                         for i, t in enumerate(docs)])
               if len(ids) >= 24][:4]
    for layer in range(3):
        e, d = _direct(gpt2, [p[:8] for p in prompts], layer)
        assert length["prompt_entropy"][0][layer] == pytest.approx(e, abs=1e-6)
        assert length["token_dispersion"][0][layer] == pytest.approx(d, abs=1e-6)
    # seeded: the same numbers again, and a sweep's draws do not depend on the other sweeps
    alone = perturb(gpt2, docs, sweeps=["random"], ps=[0.0, 0.5, 1.0], lengths=[8, 24], n_prompts=4,
                    progress=False)
    assert alone.results["sweeps"]["random"] == rnd and list(alone.results["sweeps"]) == ["random"]
    # full repetition: every token after the first is the same, so the embeddings differ only by position
    assert rep["token_dispersion"][-1][0] < rep["token_dispersion"][0][0]


def test_errors(gpt2, docs):
    with pytest.raises(RepgeomError, match="exceeds the model context of 128"):
        perturb(gpt2, docs, lengths=[16, 512], progress=False)
    with pytest.raises(RepgeomError, match="no text has 100 tokens"):
        perturb(gpt2, ["a short text", "another one"], lengths=[100], progress=False)
    with pytest.raises(RepgeomError, match=r"probabilities must lie in \[0, 1\]"):
        perturb(gpt2, docs, ps=[1.5], progress=False)
    with pytest.raises(RepgeomError, match="sweeps: unknown value .shuffle."):
        perturb(gpt2, docs, sweeps=["shuffle"], progress=False)
    with pytest.raises(RepgeomError, match="at least 2 tokens"):
        perturb(gpt2, docs, lengths=[1, 8], progress=False)


def test_cli(tiny_model_dir, docs, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    out = tmp_path / "pt.json"
    assert main(["perturb", "--model", tiny_model_dir("gpt2"), "--data", str(data), "--p", "0", "1",
                 "--lengths", "8", "16", "--n-prompts", "3", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kind"] == "perturb" and result["config"]["ps"] == [0.0, 1.0]
    assert (tmp_path / "pt.png").read_bytes()[:4] == b"\x89PNG"
    assert "prompt entropy" in capsys.readouterr().out
    assert main(["perturb", "--model", tiny_model_dir("gpt2"), "--data", str(data), "--layers", "resid_mid:4"]) == 2
    assert "out of range" in capsys.readouterr().err
