"""The reproduction gallery (experiments/) keeps working.

Cheap checks run with every ``make test``: the shared module's text sources and its one-line stop when a Debian
package is missing, the result files, the gallery section of experiments/README.md, and ``repgeom report`` on the
gallery layout. Every experiment's ``run.py --smoke`` (tiny size, real models) runs here too when it is cheap;
the others carry the ``reproduce`` marker and run with ``make reproduce-smoke``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"
sys.path.insert(0, str(EXPERIMENTS))

import gallery  # noqa: E402

RUNS = sorted(p.parent.name for p in EXPERIMENTS.glob("*/run.py"))
# every committed result folder: each finding's "results", and the paper-protocol run of ppl_vs_dispersion
RESULTS = [(name, "results") for name in RUNS] + [("ppl_vs_dispersion", "results_paper")]
CHEAP = {"dispersion_training"}  # smoke runs under a minute: part of make test


def test_every_finding_has_a_run_script_and_committed_results():
    assert len(RUNS) >= 1
    for name in RUNS:
        assert (EXPERIMENTS / name / "run.py").is_file()
        result = EXPERIMENTS / name / "results" / "result.json"
        if result.is_file():  # committed full-size results: complete, and not a smoke run
            doc = json.loads(result.read_text(encoding="utf-8"))
            assert doc["kind"] == "experiment" and doc["name"] == name and not doc["smoke"]
            assert len(doc["summary"]) == 3 and doc["mirrors"] and doc["seconds"] > 0
            for fig in doc["figures"]:
                assert (result.parent / fig["file"]).is_file(), fig
            assert (result.parent / "result.md").is_file()


def test_the_gallery_readme_section_is_up_to_date():
    """experiments/README.md shows what the committed results say (rewrite with `python experiments/gallery.py
    readme`)."""
    text = (EXPERIMENTS / "README.md").read_text(encoding="utf-8")
    start = text.index(gallery.GALLERY_START)
    end = text.index(gallery.GALLERY_END) + len(gallery.GALLERY_END)
    assert text[start:end] == gallery.gallery_section(EXPERIMENTS)


def test_text_sources_read_what_is_installed():
    paragraphs = gallery.pydoc_paragraphs()
    assert len(paragraphs) > 500 and all(len(p) >= 80 for p in paragraphs[:50])
    code = gallery.stdlib_sources()
    assert len(code) > 200 and any("def " in c for c in code[:20])


@pytest.mark.parametrize("reader, package, attr, value", [
    ("fortunes", "fortunes", "FORTUNES_DIR", Path("/nonexistent/fortunes")),
    ("wordnet_synsets", "wordnet", "WORDNET_DIR", Path("/nonexistent/wordnet")),
    ("bible_books", "bible-kjv", "BIBLE", "no-such-bible-command"),
])
def test_a_missing_debian_package_stops_with_the_line_that_installs_it(monkeypatch, reader, package, attr, value):
    monkeypatch.setattr(gallery, attr, value)
    with pytest.raises(SystemExit) as exc:
        getattr(gallery, reader)()
    assert str(exc.value).endswith(f"sudo apt-get install -y {package}")
    assert "\n" not in str(exc.value)


@pytest.mark.skipif(not gallery.WORDNET_DIR.is_dir(), reason="Debian package wordnet not installed")
def test_wordnet_synsets_parse():
    synsets = gallery.wordnet_synsets()
    assert len(synsets) > 50_000
    s = next(s for s in synsets if "dog" in s.words)
    assert s.pos == "noun" and s.definition and '"' not in s.definition


def _fake_result(tmp_path: Path, name: str = "demo_finding") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    exp = gallery.Experiment(name, "A finding", "paper A Fig. 0", argv=["--workdir", str(tmp_path / "work"),
                                                                     "--out", str(tmp_path / name / "results")])
    with exp.step("compute"):
        fig, ax = plt.subplots()
        ax.plot([0, 1], [1, 0])
        exp.figure(fig, "curve", "a falling line")
    exp.table("numbers", ["layer", "r"], [["final", -0.5], ["embed", float("nan")]])
    exp.warn("a warning | with a pipe")
    return exp.finish(["line one", "line two", "line three"], {"x": 1}, ["a note"])


def test_results_files_markdown_and_gallery_section(tmp_path):
    path = _fake_result(tmp_path)
    doc = json.loads(path.read_text(encoding="utf-8"))
    assert doc["kind"] == "experiment" and doc["figures"] == [{"file": "curve.png", "caption": "a falling line"}]
    assert doc["steps"][0]["step"] == "compute" and doc["versions"]["repgeom_eval"]
    md = (path.parent / "result.md").read_text(encoding="utf-8")
    assert "| final | -0.5 |" in md and "| embed | nan |" in md and "- a warning | with a pipe" in md
    assert "![a falling line](curve.png)" in md and "Mirrors: paper A Fig. 0." in md
    section = gallery.gallery_section(tmp_path)
    assert "### [A finding](demo_finding/results/result.md)" in section
    assert "![a falling line](demo_finding/results/curve.png)" in section and "- line three" in section


def test_report_renders_the_gallery_layout(tmp_path):
    _fake_result(tmp_path, "one")
    _fake_result(tmp_path, "two")
    out = tmp_path / "gallery.html"
    proc = subprocess.run([sys.executable, "-m", "repgeom_eval", "report", str(tmp_path), "-o", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    page = out.read_text(encoding="utf-8")
    assert page.count("<section") == 2 and page.count("data:image/png;base64,") == 2
    assert "A finding (experiment)" in page and "line two" in page and "paper A Fig. 0" in page


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in CHEAP else [pytest.mark.reproduce]) for n in RUNS])
def test_smoke_run(name, tmp_path):
    """``run.py --smoke``: the whole pipeline at a tiny size, results written where the flags say."""
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, str(EXPERIMENTS / name / "run.py"), "--smoke", "--workdir",
                           str(tmp_path / "work"), "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "result.json").read_text(encoding="utf-8"))
    assert doc["kind"] == "experiment" and doc["name"] == name and doc["smoke"] is True
    assert len(doc["summary"]) == 3 and doc["figures"] and doc["tables"]
    for fig in doc["figures"]:
        assert (out / fig["file"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _run_module(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"gallery_run_{name}", EXPERIMENTS / name / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name,folder", RESULTS)
def test_committed_results_are_what_the_code_writes_from_their_raw_data(name, folder):
    """No hand edits: ``run.py --from-raw`` recomputes the summary, intervals, verdicts and tables from the raw
    values in the committed result.json, and gives back result.json and result.md byte for byte."""
    from repgeom_eval.output.files import jsonable

    result = EXPERIMENTS / name / folder / "result.json"
    assert result.is_file(), f"{name} has no committed results"
    doc = json.loads(result.read_text(encoding="utf-8"))
    new = _run_module(name).summarize(doc)
    assert json.dumps(jsonable(new), indent=2) + "\n" == result.read_text(encoding="utf-8")
    assert gallery.markdown(new) == (result.parent / "result.md").read_text(encoding="utf-8")
    assert new["data"]["intervals"] and len(new["summary"]) == 3
    for fig in new["figures"]:
        assert (result.parent / fig["file"]).is_file(), fig


def _tests_in(value):
    """Every test record (a dict with estimate, low, high, p and interval) anywhere in a result's data."""
    if isinstance(value, dict):
        if {"estimate", "low", "high", "p", "interval", "verdict"} <= set(value):
            yield value
        else:
            for v in value.values():
                yield from _tests_in(v)
    elif isinstance(value, list):
        for v in value:
            yield from _tests_in(v)


@pytest.mark.parametrize("name,folder", RESULTS)
def test_each_finding_names_one_primary_test_and_its_holm_family(name, folder):
    """Issue 35: one primary test per finding, Holm over its stated family, verdicts from the adjusted p; every other
    test exploratory; no interval that leaves out its own estimate."""
    doc = json.loads((EXPERIMENTS / name / folder / "result.json").read_text(encoding="utf-8"))
    findings = doc["data"]["findings"]
    assert findings
    for f in findings.values():
        tests = f["tests"]
        assert [t["role"] for t in tests.values()].count(gallery.PRIMARY) == 1
        assert tests[f["primary"]]["role"] == gallery.PRIMARY and f["verdict"] == tests[f["primary"]]["verdict"]
        adjusted = gallery.holm([tests[n]["p"] for n in f["family"]])
        for n, q in zip(f["family"], adjusted):
            assert tests[n]["p_holm"] == pytest.approx(q, rel=1e-9, abs=1e-15)
            assert tests[n]["verdict"] == gallery.verdict_of(q, tests[n]["estimate"], tests[n]["null"],
                                                             tests[n]["expect"])
        assert any(t["title"].startswith("Finding:") and f"Primary test: {f['primary']};" in t["title"]
                   for t in doc["tables"]), f"no finding table for {f['primary']}"
    assert " ".join(doc["summary"]).lower().count("primary test") >= len(findings)  # the summary names them
    for t in _tests_in(doc["data"]):
        if t["low"] is not None and t["high"] is not None and t["estimate"] is not None:
            assert t["low"] - 1e-12 <= t["estimate"] <= t["high"] + 1e-12, t
        assert t["role"] in (gallery.PRIMARY, gallery.FAMILY, gallery.EXPLORATORY)
        if t["n"] <= gallery.SMALL:
            assert "bootstrap" not in t["interval"], t


def test_docs_picks_quotes_the_gallery_hit_rates_as_result_json_holds_them():
    """docs/picks.md copies the measured hit rates of the built-in layer pick from the gallery; they must be the
    lines which_layer_embeds' --from-raw wrote into result.json, and the sections it points to must exist."""
    import re

    text = (ROOT / "docs" / "picks.md").read_text(encoding="utf-8")
    doc = json.loads((EXPERIMENTS / "which_layer_embeds" / "results" / "result.json").read_text(encoding="utf-8"))
    block = re.search(r"<!-- hit-rates:start[^>]*-->\n(.*?)<!-- hit-rates:end -->", text, re.S)
    assert block, "docs/picks.md lost its hit-rates block"
    quoted = [line[2:] for line in block.group(1).splitlines() if line.startswith("- ")]
    assert quoted == doc["data"]["label_free_pick"]["quotes"]
    block = re.search(r"<!-- rules:start[^>]*-->\n(.*?)<!-- rules:end -->", text, re.S)
    assert block, "docs/picks.md lost its label-free rules block"
    quoted = [line[2:] for line in block.group(1).splitlines() if line.startswith("- ")]
    assert quoted == doc["data"]["label_free_rules"]["quotes"]
    from repgeom_eval.spec.layer_pick import MinDatasetEntropy

    primary = doc["data"]["label_free_pick"]["quotes"][0]  # SmolLM2-135M, raw: the gallery's primary setting
    assert primary.startswith("SmolLM2-135M, raw: ")
    assert primary.removeprefix("SmolLM2-135M, raw: ") in MinDatasetEntropy.evidence, \
        "the built-in rule's evidence (printed by --layer auto) is no longer what the gallery measured"
    flat = " ".join(text.split())
    for table in doc["tables"]:
        if table["title"].startswith("Label-free"):
            assert f'"{table["title"]}"' in flat, table["title"]


def test_which_layer_embeds_vectorised_v_measure_equals_sklearn():
    """The per-item clustering intervals resample with a row-wise V-measure; it must be sklearn's (mteb's)."""
    import numpy as np
    from sklearn.metrics import v_measure_score

    rng = np.random.default_rng(0)
    labels, clusters = rng.integers(0, 4, (40, 25)), rng.integers(0, 5, (40, 25))
    clusters[0] = 0  # one cluster: completeness 1, homogeneity 0
    labels[1] = 2  # one class
    clusters[2] = labels[2]  # a perfect clustering
    got = _run_module("which_layer_embeds").rowwise_v_measure(labels, clusters)
    want = [v_measure_score(a, k) for a, k in zip(labels, clusters)]
    assert np.allclose(got, want, atol=1e-12)


def test_hardness_class_dispersion_is_the_brute_force_one_and_one_value_on_every_machine():
    """The question bootstrap's dispersion of a weighted set (copies of one question are never paired) is
    the brute-force mean over pairs of draws of distinct questions, and its matrix product is exact: equal to math.fsum of each
    sum, so no BLAS kernel can move a committed digit."""
    import math

    import numpy as np

    hardness = _run_module("hardness_without_labels")
    rng = np.random.default_rng(1)
    u = rng.standard_normal((30, 7))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    weights = np.stack([np.bincount(rng.integers(0, 30, 30), minlength=30) for _ in range(5)]).astype(float)
    got = hardness.class_dispersion(weights, u)
    for row, value in zip(weights, got):
        draws = np.repeat(np.arange(30), row.astype(int))
        cos = [u[a] @ u[b] for a in draws for b in draws if a != b]  # copies of one question are never paired
        assert abs(value - (1.0 - np.mean(cos))) < 1e-12
    grid = hardness.on_grid(u, weights.sum(axis=1).max())
    assert np.abs(grid - u).max() < 1e-12
    product = weights @ grid
    exact = [[math.fsum(weights[r] * grid[:, c]) for c in range(7)] for r in range(5)]
    assert np.array_equal(product, np.asarray(exact))
    perturbed = hardness.class_dispersion(weights, u + 1e-3)  # the test can fail: a moved input moves the value
    assert np.abs(perturbed - got).max() > 1e-6
