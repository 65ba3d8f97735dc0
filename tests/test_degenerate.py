"""Degenerate numbers are flagged: zero vectors, NaN results, an all-zero model, a gap of NaN or exactly 2."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from repgeom_eval.entrypoints.cli import main
from repgeom_eval.measurement.degenerate import (degenerate_diagnostics, degenerate_warning, find_degenerate,
                                                 zero_vector_warning)


def test_find_degenerate_on_a_report():
    results = {"embed": {"dispersion": 0.4, "effective_rank": 3.0},
               "resid_post:0": {"dispersion": 0.9, "effective_rank": float("nan")},
               "final": {"dispersion": 1.0, "effective_rank": float("nan")}}
    diagnostics = {"embed": {"dispersion": {"n_vectors": 10, "n_zero_vectors": 0}},
                   "resid_post:0": {"dispersion": {"n_vectors": 10, "n_zero_vectors": 3}},
                   "final": {"dispersion": {"n_vectors": 10, "n_zero_vectors": 10}}}
    found = find_degenerate(results, diagnostics)
    assert [d.address for d in found] == ["resid_post:0", "final"]
    assert found[0].n_zero == 3 and not found[0].all_zero and found[0].nan_metrics == ["effective_rank"]
    assert found[1].all_zero
    message = degenerate_warning("m", results, diagnostics)
    assert message.startswith("model 'm': degenerate results at 2 address(es): ")
    assert "resid_post:0 (3 of 10 vectors zero; NaN effective_rank)" in message
    assert "final (all 10 vectors zero; NaN effective_rank)" in message and "distance 1" in message
    assert degenerate_diagnostics(found)["final"] == {"zero_vectors": 10, "all_zero": True,
                                                      "nan_metrics": ["effective_rank"]}
    assert degenerate_warning("m", {"final": {"dispersion": 0.3}}, {}) is None  # a sound run: nothing to say


def test_zero_energy_means_zero_vectors_without_a_dispersion_metric():
    results = {"final": {"effective_rank": float("nan")}}
    energy = {"final": {"top1_share": float("nan"), "top_dimensions": []}}
    message = degenerate_warning(None, results, {}, energy)
    assert message.startswith("the model: every vector at every measured address is zero")


@pytest.fixture(scope="module")
def zero_model(tiny_model_dir, tmp_path_factory):
    """The tiny Llama with every weight set to zero (an untrained or wiped checkpoint)."""
    path = tmp_path_factory.mktemp("zero") / "model"
    shutil.copytree(tiny_model_dir("llama"), path)
    tensors = {k: torch.zeros_like(v) for k, v in load_file(path / "model.safetensors").items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_zero_vector_warning_names_the_dead_addresses():
    assert zero_vector_warning("m", {"embed": (0, 40), "final": (3, 40)}) is None  # some zeros: not dead
    message = zero_vector_warning("m", {"embed": (0, 40), "mlp_out:1": (40, 40), "final": (40, 40)})
    assert message.startswith("model 'm': every token vector is zero at 2 address(es): mlp_out:1, final; ")
    assert zero_vector_warning(None, {"final": (5, 5)}).startswith("the model: every token vector at every address")


def test_an_all_zero_model_is_flagged(zero_model, texts):
    """An all-zero model gives dispersion exactly 1.0 at every layer: the forward passes warn, naming the model, and
    the report-level detector says which numbers are affected."""
    import repgeom_eval as rg

    with pytest.warns(UserWarning, match=r"every token vector at every address is zero") as caught:
        result = rg.measure(str(zero_model), texts[:8], layers="all", metrics=["dispersion"], progress=False)
    assert any(str(zero_model) in str(w.message) for w in caught)
    assert all(r["dispersion"] == 1.0 for r in result.results.values())
    message = degenerate_warning(result.model["name"], result.results, result.diagnostics)
    assert message is not None and str(zero_model) in message
    assert "every vector at every measured address is zero" in message


def _gap_model(src: str, dst: Path, change) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    change(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("case, change, expect", [
    ("zero embedding", lambda t: t["transformer.wte.weight"].zero_(), r"rows of the output embedding are all zero"),
    ("NaN embedding", lambda t: t["transformer.wte.weight"].fill_(float("nan")), r"hold NaN or inf; its G is NaN"),
])
def test_gap_flags_degenerate_embeddings(case, change, expect, tiny_model_dir, tmp_path):
    import re

    model = _gap_model(tiny_model_dir("gpt2"), tmp_path / "model", change)
    out = tmp_path / "gap.json"
    with pytest.warns(UserWarning) as caught:
        assert main(["gap", "-m", str(model), "--domain", "digits", "--reference", "general", "-o", str(out)]) == 0
    warned = [str(w.message) for w in caught]
    assert any(re.search(expect, line) and str(model) in line for line in warned), warned
    row = json.loads(out.read_text())["results"][0]
    assert row["warnings"] and re.search(expect, row["warnings"][0])
    if case == "zero embedding":
        assert row["G"] == 2.0
    else:
        assert row["G"] is None or math.isnan(row["G"])


def test_gap_of_a_sound_model_has_no_warning(tiny_model_dir, tmp_path):
    import warnings

    out = tmp_path / "gap.json"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["gap", "-m", tiny_model_dir("gpt2"), "--domain", "digits", "--reference", "general",
                     "-o", str(out)]) == 0
    assert json.loads(out.read_text())["results"][0]["warnings"] == []


@pytest.mark.parametrize("command", [
    ["knn-keys", "--chunk-len", "8", "--n", "2", "4", "--seeds", "2"],
    ["clusters", "--ngram", "2", "--min-count", "3", "--contexts", "3", "--context-len", "4", "--clusters", "5"],
    ["perturb", "--lengths", "4", "8", "--n-prompts", "4"],
])
def test_analyses_of_an_all_zero_model_warn(command, zero_model, texts, tmp_path):
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(t for t in texts if len(t.split()) > 6) + "\n")
    with pytest.warns(UserWarning, match=r"every token vector at every address is zero"):
        assert main([*command, "-m", str(zero_model), "-d", str(data), "--no-progress"]) == 0


def test_a_sound_model_gives_no_zero_warning(tiny_model_dir, texts):
    import warnings

    import repgeom_eval as rg

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rg.measure(tiny_model_dir("llama"), texts[:8], layers="all", metrics=["dispersion"], progress=False)
    assert not [w for w in caught if "zero" in str(w.message)]
