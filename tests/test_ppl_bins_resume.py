"""ppl-bins --run-dir / --resume: a run killed part-way and resumed gives the uninterrupted run's numbers, bit for
bit; a torn last line is recomputed; another run's folder is refused with the reason."""

import json

import numpy as np
import pytest

from repgeom_eval.analyses import chunk_log
from repgeom_eval.analyses.ppl_bins import ppl_bins
from repgeom_eval.entrypoints.cli import main
from repgeom_eval.spec.errors import RepgeomError

OPTIONS = dict(chunk_len=16, group_size=3, n_bins=8, n_chunks=30, layers=["embed", "final"], batch_size=4,
               progress=False)


@pytest.fixture(scope="module")
def corpus():
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)[:8]]


def per_chunk(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_killed_and_resumed_run_gives_the_uninterrupted_numbers(tiny_model_dir, corpus, tmp_path, monkeypatch):
    model = tiny_model_dir("llama")
    plain = ppl_bins(model, corpus, per_chunk_path=str(tmp_path / "plain.jsonl"), **OPTIONS)

    run_dir = tmp_path / "run"
    calls = {"n": 0}
    original = chunk_log.ChunkLog.append

    def dies_after_three_batches(self, *args):
        if calls["n"] == 3:
            raise KeyboardInterrupt("killed")
        calls["n"] += 1
        original(self, *args)

    monkeypatch.setattr(chunk_log.ChunkLog, "append", dies_after_three_batches)
    with pytest.raises(KeyboardInterrupt):
        ppl_bins(model, corpus, run_dir=str(run_dir), **OPTIONS)
    monkeypatch.setattr(chunk_log.ChunkLog, "append", original)
    rows = (run_dir / "chunks.jsonl").read_text().splitlines()
    assert len(rows) == 12  # three batches of four
    with (run_dir / "chunks.jsonl").open("a") as fh:  # a kill mid-write leaves a torn line
        fh.write('{"chunk": 12, "ppl": 3.')

    resumed = ppl_bins(model, corpus, run_dir=str(run_dir), resume=True,
                       per_chunk_path=str(tmp_path / "resumed.jsonl"), **OPTIONS)
    assert resumed.data["run_dir"]["chunks_read_back"] == 12
    assert resumed.data["run_dir"]["chunks_computed"] == 18
    assert per_chunk(tmp_path / "resumed.jsonl") == per_chunk(tmp_path / "plain.jsonl")  # exact, not close
    assert resumed.results["pooled"] == plain.results["pooled"]
    assert len(chunk_log.read_rows(run_dir / "chunks.jsonl", 2)) == 30

    again = ppl_bins(model, corpus, run_dir=str(run_dir), resume=True, **OPTIONS)  # nothing left to compute
    assert again.data["run_dir"]["chunks_computed"] == 0
    assert again.results["pooled"] == plain.results["pooled"]


def test_another_run_in_the_folder_is_refused_with_the_reason(tiny_model_dir, corpus, tmp_path):
    model = tiny_model_dir("llama")
    run_dir = tmp_path / "run"
    ppl_bins(model, corpus, run_dir=str(run_dir), **OPTIONS)
    with pytest.raises(RepgeomError, match="already holds a run.*--resume"):
        ppl_bins(model, corpus, run_dir=str(run_dir), **OPTIONS)
    with pytest.raises(RepgeomError, match="holds another run.*chunk_len"):
        ppl_bins(model, corpus, run_dir=str(run_dir), resume=True, **dict(OPTIONS, chunk_len=12))
    with pytest.raises(RepgeomError, match="holds no run to continue"):
        ppl_bins(model, corpus, run_dir=str(tmp_path / "empty"), resume=True, **OPTIONS)


def test_cli_resume_needs_a_run_dir(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "d.txt"
    data.write_text("some text\n")
    assert main(["ppl-bins", "--model", tiny_model_dir("llama"), "--data", str(data), "--resume"]) != 0
    assert "--run-dir" in capsys.readouterr().err
