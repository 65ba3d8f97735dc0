"""Every model type of the installed transformers that can be built at tiny size is measured right, or refused in one
line (repgeom_eval.testing.coverage.check_type: every hidden state through Forward equals the model's own
output_hidden_states; the verified sub-layers satisfy the residual identities on real texts). The coverage
table of docs/how-to/own-model.md is the committed sweep, written by benchmarks/any_model.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from repgeom_eval.testing.coverage import check_type, markdown, sublayer_class
from repgeom_eval.testing.tiny_models import causal_lm_types, encoder_types

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("kind", ["causal", "encoder"])
def test_every_buildable_type_is_measured_right_or_refused_in_one_line(kind, tmp_path):
    types = causal_lm_types() if kind == "causal" else encoder_types()
    rows = []
    for model_type in types:
        rows.append(check_type(model_type, kind, str(tmp_path)))
        shutil.rmtree(tmp_path / f"{kind}-{model_type}", ignore_errors=True)
    built = [r for r in rows if r["status"] != "not built"]
    assert len(built) >= 0.9 * len(types), [r["type"] for r in rows if r["status"] == "not built"]
    assert [r for r in built if r["status"] == "measured wrong"] == []
    refused = [r for r in built if r["status"] == "refused"]
    assert all("\n" not in r["reason"] and r["reason"] for r in refused)
    equal = [r for r in built if r["status"] == "equal"]
    assert len(equal) >= 0.95 * len(built), [(r["type"], r["reason"]) for r in refused]
    verified = [r for r in equal if sublayer_class(r).startswith(("all six", "every site"))]
    assert len(verified) >= 0.8 * len(built)


def test_coverage_table_is_the_committed_sweep():
    doc = json.loads((ROOT / "benchmarks" / "results" / "any_model.json").read_text(encoding="utf-8"))
    page = (ROOT / "docs" / "how-to" / "own-model.md").read_text(encoding="utf-8")
    section = page.split("<!-- any-model:start -->\n", 1)[1].split("\n<!-- any-model:end -->", 1)[0]
    assert section == markdown(doc), "the coverage table of docs/how-to/own-model.md differs from " \
                                     "benchmarks/results/any_model.json: rerun `make any-model`"
    assert doc["summary"]["causal"]["measured_wrong"] == doc["summary"]["encoder"]["measured_wrong"] == 0
