"""Streaming text sources: files validated up front, read shard by shard; datasets streams; in-memory lists."""

from __future__ import annotations

import json

import pytest

from repgeom_eval.measurement.texts import DatasetSource, FileSource, ListSource, load_texts, open_source
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.measurement.engine import measure


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_file_source_counts_hashes_and_shards(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": f"text number {i}", "id": f"x{i}"} for i in range(7)]
                       + [{"text": "   "}])
    src = FileSource(path)
    assert src.n_texts == 7 and src.fingerprint.startswith("sha256:")
    shards = list(src.shards(3))
    assert [len(s) for s in shards] == [3, 3, 1]
    assert [r.index for s in shards for r in s] == list(range(7))
    assert shards[0][0].id == "x0" and shards[2][0].text == "text number 6"
    assert src.counts() == {"path": str(path), "n_records": 8, "n_texts": 7, "n_skipped_empty": 1}
    assert FileSource(path).fingerprint == src.fingerprint
    path.write_text(path.read_text() + json.dumps({"text": "one more"}) + "\n")
    assert FileSource(path).fingerprint != src.fingerprint


def test_a_bad_line_anywhere_fails_before_any_work(tmp_path):
    rows = [json.dumps({"text": f"t{i}"}) for i in range(500)] + ["{not json"]
    (tmp_path / "bad.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(RepgeomError, match=r"bad.jsonl:501: not valid JSON"):
        FileSource(tmp_path / "bad.jsonl")


def test_load_texts_and_list_source_agree_with_the_stream(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("\ufefffirst line\n\nsecond line\nthird\n", encoding="utf-8")
    ts = load_texts(path)
    assert ts.texts == ["first line", "second line", "third"] and ts.ids == [1, 3, 4]
    assert ts.skipped_empty == [2] and ts.n_records == 4
    assert [(r.id, r.text) for r in FileSource(path)] == list(zip(ts.ids, ts.texts))
    assert [(r.id, r.text) for r in ListSource(ts)] == list(zip(ts.ids, ts.texts))
    with pytest.raises(RepgeomError, match="text #1 .* not a string"):
        ListSource(["a", 3])
    with pytest.raises(RepgeomError, match="at least 2"):
        open_source(["only one", " "])


def test_datasets_stream_gives_the_file_numbers(tmp_path, tiny_model_dir, texts):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts[:12]])
    model = tiny_model_dir("gpt2")
    from_file = measure(model, str(path), metrics=["dispersion", "token_dispersion"], progress=False)
    stream = measure(model, f"hf:json?data_files={path}&split=train", shard_size=5,
                     metrics=["dispersion", "token_dispersion"], progress=False)
    assert stream.data["n_texts"] == 12 and stream.config["shard_size"] == 5
    for metric, value in from_file.results["final"].items():
        assert stream.results["final"][metric] == pytest.approx(value, abs=1e-6)


def test_dataset_spec_errors(tmp_path):
    with pytest.raises(RepgeomError, match="unknown keys"):
        DatasetSource("hf:json?splitt=train")
    with pytest.raises(RepgeomError, match="cannot open dataset"):
        DatasetSource(f"hf:json?data_files={tmp_path / 'missing.jsonl'}")
    path = write_jsonl(tmp_path / "t.jsonl", [{"body": "x"}, {"body": "y"}])
    with pytest.raises(RepgeomError, match="no 'text' field.*--text-field"):
        list(DatasetSource(f"hf:json?data_files={path}"))
