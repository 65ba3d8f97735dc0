"""repgeom report: every command's JSON output in one self-contained offline HTML page."""

import base64
import json
import re

import pytest

from repgeom_eval.analyses.html_report import build_report, classify
from repgeom_eval.entrypoints.cli import main
from repgeom_eval.spec.errors import RepgeomError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def outputs(tiny_model_dir, tmp_path_factory):
    """Real outputs of the commands on a tiny GPT-2, written with --output."""
    from pydoc_data.topics import topics

    d = tmp_path_factory.mktemp("results")
    data = d / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": topics[k][:300]}) + "\n" for k in sorted(topics)[:5]))
    model = tiny_model_dir("gpt2")
    common = ["--model", model, "--data", str(data)]
    runs = {
        "measure": ["measure", *common, "--layers", "all", "--metrics", "dispersion", "condensation"],
        "gap": ["gap", "--models", model, "--domain", "digits"],
        "ppl-bins": ["ppl-bins", *common, "--chunk-len", "16", "--group-size", "3", "--bins", "4"],
        "knn-keys": ["knn-keys", *common, "--chunk-len", "16", "--n", "2", "4", "--seeds", "2"],
        "knnlm": ["knnlm", "--model", model, "--datastore", str(data), "--eval", str(data), "--chunk-len", "16",
                  "--neighbors", "8", "--lambda", "0", "0.25"],
        "condensation": ["condensation", *common, "--max-length", "16", "--bins", "10"],
        "clusters": ["clusters", *common, "--ngram", "3", "--min-count", "3", "--contexts", "3", "--context-len",
                     "6", "--clusters", "4"],
        "perturb": ["perturb", *common, "--p", "0", "1", "--lengths", "8", "16", "--n-prompts", "3"],
    }
    paths = {}
    for kind, argv in runs.items():
        paths[kind] = d / f"{kind}.json"
        assert main([*argv, "--output", str(paths[kind])]) == 0, kind
    return paths


def test_every_kind_is_recognised(outputs):
    for kind, path in outputs.items():
        assert classify(json.loads(path.read_text())) == kind
    assert classify({"results": [1]}) == "unknown" and classify([]) == "unknown"


def test_page_is_self_contained(outputs, tmp_path, capsys):
    foreign = tmp_path / "other.json"
    foreign.write_text(json.dumps({"kind": "slices", "config": {"rho": [0.1]}, "results": {"x": "<b>1</b>"}}))
    page_path = tmp_path / "report.html"
    assert main(["report", *map(str, outputs.values()), str(foreign), "--output", str(page_path),
                 "--title", "tiny <run>"]) == 0
    assert "self-contained" in capsys.readouterr().out
    page = page_path.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<title>tiny &lt;run&gt;</title>" in page
    for kind in outputs:
        assert f"<h2>{kind}: " in page and f"<h2>{kind}: ?" not in page
    assert "<h2>slices: " in page and "&lt;b&gt;1&lt;/b&gt;" in page  # unknown kinds: escaped JSON
    # offline: no script, no stylesheet link, no remote source; every figure is an embedded, valid PNG
    assert "<script" not in page and "<link" not in page and not re.search(r'src="(?!data:)', page)
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    # measure profile, ppl scatter + by-depth, knn-keys, condensation, clusters, perturb
    assert len(images) == 7
    assert all(base64.b64decode(i)[:8] == b"\x89PNG\r\n\x1a\n" for i in images)
    assert "recommended key" in page and "(LM alone)" in page and "Kendall" in page
    # a directory stands for its *.json files
    assert build_report([outputs["knnlm"].parent]).count("<section") == len(outputs)


def test_errors(tmp_path, capsys):
    with pytest.raises(RepgeomError, match="does not exist"):
        build_report([tmp_path / "missing.json"])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(RepgeomError, match="bad.json is not a JSON results file"):
        build_report([bad])
    (tmp_path / "empty").mkdir()
    with pytest.raises(RepgeomError, match="holds no .json file"):
        build_report([tmp_path / "empty"])
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"kind": "knn-keys", "results": {}}))
    out = tmp_path / "r.html"
    assert main(["report", str(broken), "--output", str(out)]) == 2
    assert "looks like a knn-keys result but lacks" in capsys.readouterr().err
    assert not out.exists()  # nothing half-written
