"""`repgeom slices` on a JSONL + vector file: the printed and written results are the library's, `--calibrate`
prints the MAE, and bad input is one clear line (exit 2) with nothing written."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest

from repgeom_eval.analyses import slices
from repgeom_eval.entrypoints.cli import main


@pytest.fixture
def planted(tmp_path):
    """600 queries: the correct ones spread over all directions, the incorrect ones clustered."""
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.normal(size=(300, 12)), np.ones((300, 12)) + 0.3 * rng.normal(size=(300, 12))])
    ok = np.arange(600) < 300
    ppl = np.where(ok, 5.0, 9.0) + rng.random(600)
    np.save(tmp_path / "vectors.npy", x)
    with open(tmp_path / "queries.jsonl", "w") as fh:
        for i in range(600):
            fh.write(json.dumps({"id": i, "is_right": bool(ok[i]), "ppl": float(ppl[i])}) + "\n")
    return tmp_path, x, ok, ppl


def test_vectors_and_calibration(planted, capsys):
    d, x, ok, ppl = planted
    out = d / "slices.json"
    code = main(["slices", str(d / "queries.jsonl"), "--vectors", str(d / "vectors.npy"), "--correct-field",
                 "is_right", "--seeds", "4", "--calibrate", "--output", str(out), "--plot", str(d / "s.png")])
    assert code == 0
    printed = capsys.readouterr().out
    assert "Calibration MAE on test slices" in printed and "Spearman" in printed
    result = json.loads(out.read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        curve = slices.controlled_slices(x, ok, ppl, size=100, seeds=4)
        calibration = slices.calibrate(x, ok, size=100, seeds=4)
    assert result["slices"]["dispersion_mean"] == pytest.approx(curve.dispersion_mean, abs=1e-12)
    assert result["slices"]["perplexity_mean"] == pytest.approx(curve.perplexity_mean, abs=1e-12)
    assert result["slices"]["spearman"] == pytest.approx(1.0)  # planted: dispersion rises with accuracy
    assert result["slices"]["spearman_perplexity"] == pytest.approx(-1.0)
    assert result["calibration"]["mae_mean"] == pytest.approx(calibration.mae_mean, abs=1e-12)
    assert f"{calibration.mae_mean:.4f}" in printed
    assert (d / "s.png").stat().st_size > 1000


def _edit_vectors(change):
    def apply(d):
        x = np.load(d / "vectors.npy")
        change(x)
        np.save(d / "vectors.npy", x)
    return apply


def _edit_record(line: int, **fields):
    def apply(d):
        rows = (d / "queries.jsonl").read_text().splitlines()
        record = json.loads(rows[line - 1])
        for k, v in fields.items():
            if v is ...:
                record.pop(k)
            else:
                record[k] = v
        rows[line - 1] = json.dumps(record)
        (d / "queries.jsonl").write_text("\n".join(rows) + "\n")
    return apply


def _raw_ppl(line: int, text: str):
    def apply(d):
        rows = (d / "queries.jsonl").read_text().splitlines()
        record = json.loads(rows[line - 1])
        rows[line - 1] = json.dumps(record).replace(f'"ppl": {json.dumps(record["ppl"])}', f'"ppl": {text}')
        (d / "queries.jsonl").write_text("\n".join(rows) + "\n")
    return apply


@pytest.mark.fault("refused")
@pytest.mark.parametrize("change,match", [
    (lambda d: np.save(d / "vectors.npy", np.zeros((5, 12))), "has 5 vectors but"),
    (lambda d: (d / "queries.jsonl").write_text((d / "queries.jsonl").read_text().replace("true", "2", 1)),
     "queries.jsonl:1: is_right: correct must be"),
    (lambda d: (d / "vectors.npy").unlink(), "does not exist"),
    (_edit_vectors(lambda x: x.__setitem__((7, 3), np.nan)), "vectors.npy: row 7 (the vector of"),
    (_edit_vectors(lambda x: x.__setitem__(4, 0.0)), "row 4 (the vector of"),
    (_raw_ppl(3, "NaN"), "queries.jsonl:3: ppl: a perplexity must be a positive finite number, got nan"),
    (_edit_record(5, ppl=-2.0), "queries.jsonl:5: ppl: a perplexity must be a positive finite number, got -2.0"),
    (_edit_record(6, ppl="9.1"), "queries.jsonl:6: ppl: a perplexity must be a positive finite number, got '9.1'"),
    (_edit_record(8, ppl=0), "queries.jsonl:8: ppl: a perplexity must be a positive finite number, got 0"),
    (_edit_record(2, is_right="yes"), "queries.jsonl:2: is_right: correct must be true/false or 0/1, got 'yes'"),
])
def test_bad_input_is_one_line_and_writes_nothing(planted, capsys, change, match):
    d = planted[0]
    change(d)
    code = main(["slices", str(d / "queries.jsonl"), "--vectors", str(d / "vectors.npy"), "--correct-field",
                 "is_right", "--output", str(d / "out.json")])
    err = capsys.readouterr().err
    assert code == 2 and match in err and "Traceback" not in err
    assert not (d / "out.json").exists()


def test_samples_without_vectors_are_named(tmp_path, capsys):
    (tmp_path / "samples_x_2026.jsonl").write_text('{"doc_id": 0, "acc": 1.0}\n')
    assert main(["slices", str(tmp_path)]) == 2
    assert "repgeom_slice_spearman" in capsys.readouterr().err


def test_both_perplexities_are_labelled(planted, capsys):
    """--prompt-ppl-field: the prompt's perplexity beside the gold answer's, each named for what it is."""
    d, x, ok, ppl = planted
    rows = [json.loads(line) for line in (d / "queries.jsonl").read_text().splitlines()]
    with open(d / "queries.jsonl", "w") as fh:
        for row, p in zip(rows, np.where(ok, 30.0, 10.0)):
            fh.write(json.dumps({**row, "prompt": float(p)}) + "\n")
    out = d / "slices.json"
    assert main(["slices", str(d / "queries.jsonl"), "--vectors", str(d / "vectors.npy"), "--correct-field",
                 "is_right", "--prompt-ppl-field", "prompt", "--seeds", "3", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "answer perplexity" in printed and "prompt perplexity" in printed and "gold answer" in printed
    result = json.loads(out.read_text())
    assert "gold answer" in result["config"]["slice_perplexity"]
    assert "prompt's own" in result["config"]["slice_prompt_perplexity"]
    assert result["slices"]["spearman_prompt_perplexity"] == pytest.approx(1.0)
    assert result["slices"]["prompt_perplexity_mean"][0] == pytest.approx(10.0)
    assert result["slices"]["prompt_perplexity_mean"][-1] == pytest.approx(30.0)


def test_samples_with_and_without_prompt_perplexity(tmp_path, capsys):
    """lm-eval samples: prompt_ppl is read when present; samples written before it existed still work."""
    from repgeom_eval.analyses.queries import encode_vector, from_samples

    rng = np.random.default_rng(0)
    for name, with_prompt in (("new", True), ("old", False)):
        with open(tmp_path / f"samples_{name}_2026.jsonl", "w") as fh:
            for i in range(40):
                item = {"doc_id": i, "correct": float(i % 2), "ppl": 2.0 + i, "vector": encode_vector(rng.normal(size=4))}
                if with_prompt:
                    item["prompt_ppl"] = 100.0 + i
                fh.write(json.dumps({"doc_id": i, "repgeom_slice_spearman": item}) + "\n")
    new = from_samples(tmp_path / "samples_new_2026.jsonl")
    old = from_samples(tmp_path / "samples_old_2026.jsonl")
    assert new.prompt_ppl.tolist() == [100.0 + i for i in range(40)] and old.prompt_ppl is None
    assert old.ppl.tolist() == [2.0 + i for i in range(40)]
    assert main(["slices", str(tmp_path / "samples_old_2026.jsonl"), "--size", "10", "--seeds", "2"]) == 0
    printed = capsys.readouterr().out
    assert "answer perplexity" in printed and "prompt perplexity" not in printed


def test_a_perplexity_some_records_lack_is_said_and_left_out_of_the_slice_means(planted, capsys):
    d, x, ok, ppl = planted
    _edit_record(9, ppl=...)(d)
    out = d / "slices.json"
    assert main(["slices", str(d / "queries.jsonl"), "--vectors", str(d / "vectors.npy"), "--correct-field",
                 "is_right", "--seeds", "2", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert any("1 of 600 records have no ppl (the first at line 9)" in n for n in result["notes"])
    assert all(math.isfinite(v) for v in result["slices"]["perplexity_mean"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        known = ppl.copy()
        known[8] = np.nan
        curve = slices.controlled_slices(x, ok, known, size=100, seeds=2)
    assert result["slices"]["perplexity_mean"] == pytest.approx(curve.perplexity_mean, abs=1e-12)
