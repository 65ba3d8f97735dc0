"""repgeom_eval/output/files.py: no output replaces an input, and a failed run leaves no output."""

from __future__ import annotations

import errno
import os

import pytest

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.output.files import atomic_open, check_outputs, commit_together, write_json


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "data.jsonl").write_text('{"text": "a"}\n')
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "out").mkdir()
    return tmp_path


def test_distinct_paths_pass(tree):
    check_outputs({"--output": tree / "out" / "r.json", "--per-text": tree / "out" / "p.jsonl", "--none": None},
                  inputs={"--data": tree / "data.jsonl"}, folders={"--model": tree / "model"})
    check_outputs({"--output": tree / "model.json"}, folders={"--model": tree / "model"})  # a sibling, not inside


@pytest.mark.parametrize("output, message", [
    ("data.jsonl", r"--output '.*data\.jsonl': it is the --data input"),
    ("./out/../data.jsonl", r"it is the --data input"),  # the same file under another spelling
    ("model/out.json", r"inside the --model folder"),
    ("model", r"inside the --model folder"),
    ("model/sub/deeper/out.json", r"inside the --model folder"),
    (".", r"holds the --data input|holds the --model folder"),  # an output folder replaced whole
])
def test_refused(tree, output, message, monkeypatch):
    monkeypatch.chdir(tree)
    with pytest.raises(RepgeomError, match=message):
        check_outputs({"--output": output}, inputs={"--data": "data.jsonl"}, folders={"--model": "model"})


def test_links_are_followed(tree):
    os.symlink(tree / "data.jsonl", tree / "out" / "symlink.json")
    os.link(tree / "data.jsonl", tree / "out" / "hardlink.json")
    os.symlink(tree / "model", tree / "model-link")
    for out in ("symlink.json", "hardlink.json"):
        with pytest.raises(RepgeomError, match=r"it is the --data input"):
            check_outputs({"--output": tree / "out" / out}, inputs={"--data": tree / "data.jsonl"})
    with pytest.raises(RepgeomError, match=r"inside the --model folder"):  # through a link to the folder
        check_outputs({"--output": tree / "model-link" / "r.json"}, folders={"--model": tree / "model"})


def test_two_outputs_on_one_path(tree):
    with pytest.raises(RepgeomError, match=r"--output and --per-text are the same path"):
        check_outputs({"--output": tree / "out" / "r.json", "--per-text": tree / "out" / "r.json"})
    os.symlink(tree / "out" / "r.json", tree / "out" / "alias.json")
    with pytest.raises(RepgeomError, match=r"--output and --plot are the same file"):
        check_outputs({"--output": tree / "out" / "r.json", "--plot": tree / "out" / "alias.json"})


def test_lists_of_paths(tree):
    other = tree / "other-model"
    other.mkdir()
    with pytest.raises(RepgeomError, match=r"other-model"):
        check_outputs({"--plot-dir": [tree / "out" / "a.png", other / "b.png"]},
                      folders={"--model": [tree / "model", other]})


def test_commit_together_all_or_nothing(tree):
    a, b, checkpoint = tree / "out" / "a.json", tree / "out" / "b.json", tree / "out" / "state.json"
    with pytest.raises(RuntimeError):
        with commit_together([a, b]):
            write_json(a, {"x": 1})
            write_json(checkpoint, {"shard": 3})  # not listed: lands at once, as a checkpoint must
            assert not a.exists() and checkpoint.exists()
            raise RuntimeError("the run fails after its first output")
    assert not a.exists() and not b.exists()
    assert sorted(p.name for p in (tree / "out").iterdir()) == ["state.json"]  # no temporary file left
    with commit_together([a, b]):
        write_json(a, {"x": 1})
        write_json(a, {"x": 2})  # written twice: the last version wins
        write_json(b, {"y": 1})
    assert a.read_text().count('"x": 2') == 1 and b.exists()
    assert sorted(p.name for p in (tree / "out").iterdir()) == ["a.json", "b.json", "state.json"]


def test_write_errors_are_one_line_and_leave_nothing(tree, monkeypatch):
    target = tree / "out" / "r.json"

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("repgeom_eval.output.files.os.fsync", full)
    with pytest.raises(RepgeomError, match=r"cannot write '.*r\.json': no space left on the device"):
        write_json(target, {"x": 1})
    assert list((tree / "out").iterdir()) == []
    monkeypatch.undo()
    with pytest.raises(OSError):  # anything that is not a write failure stays what it is
        with atomic_open(target) as fh:
            fh.write("x")
            raise FileNotFoundError(errno.ENOENT, "unrelated")
    assert list((tree / "out").iterdir()) == []


def test_mteb_and_lm_eval_outputs_never_land_in_the_model_folder(tiny_model_dir, tmp_path, capsys):
    import shutil

    from repgeom_eval.entrypoints.cli import main

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("bert"), model)
    before = sorted(p.name for p in model.iterdir())
    assert main(["mteb", "run", "-m", str(model), "--layer", "final", "-t", "STS12",
                 "--output-folder", str(model / "results")]) == 2
    assert "inside the --model folder" in capsys.readouterr().err
    assert main(["lm-eval", "--model", "hf", "--model_args", f"pretrained={model}", "--tasks",
                 "repgeom_hardness_piqa", "--output_path", str(model / "out")]) == 2
    assert "pretrained" in capsys.readouterr().err
    assert sorted(p.name for p in model.iterdir()) == before
    assert main(["lm-eval", "--model", "hf", "--tasks", "x", "--metadata", "{not json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--metadata is not valid JSON" in err[0]
