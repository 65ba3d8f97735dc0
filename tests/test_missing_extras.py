"""A command whose optional package is missing ends with one line naming the extra that installs it, not a traceback
(scripts/check_install.py runs the same commands in a venv with the core install alone)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from repgeom_eval.entrypoints.cli import main


def hide(monkeypatch, *names: str) -> None:
    """Make ``names`` look uninstalled, both to ``find_spec`` and to ``import``."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name.partition(".")[0] in names else real(name, *a, **k))
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError


def error_line(capsys, printed_nothing: bool = False) -> str:
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.strip()]
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert not (printed_nothing and captured.out.strip()), captured.out
    return err[0]


@pytest.mark.fault("refused")
def test_train_without_accelerate_names_the_train_extra(monkeypatch, capsys, tiny_model_dir, tmp_path):
    (tmp_path / "t.txt").write_text("one sentence\nanother sentence\n")
    config = {"model": str(tiny_model_dir("llama")), "data": {"block_size": 8, "domains": {"t": str(tmp_path / "t.txt")}},
              "training": {"max_steps": 1, "use_cpu": True}, "output_dir": str(tmp_path / "out")}
    (tmp_path / "train.yaml").write_text(json.dumps(config))
    hide(monkeypatch, "accelerate")
    assert main(["train", "--config", str(tmp_path / "train.yaml"), "--no-progress"]) == 2
    assert "accelerate" in (line := error_line(capsys)) and "repgeom-eval[train]" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.fault("refused")
def test_a_gguf_file_without_gguf_names_the_gguf_extra(monkeypatch, capsys, tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")  # refused before the file is parsed
    (tmp_path / "t.txt").write_text("a text\nanother text\n")
    monkeypatch.setenv("REPGEOM_CACHE", str(tmp_path / "cache"))
    hide(monkeypatch, "gguf")
    assert main(["measure", "-m", str(tmp_path / "m.gguf"), "-d", str(tmp_path / "t.txt"), "-o",
                 str(tmp_path / "o.json"), "--no-progress"]) == 2
    assert "gguf" in (line := error_line(capsys)) and "repgeom-eval[gguf]" in line


@pytest.mark.fault("refused")
def test_peft_without_peft_names_the_peft_extra(monkeypatch, capsys, tiny_model_dir, tmp_path):
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (tmp_path / "t.txt").write_text("a text\nanother text\n")
    hide(monkeypatch, "peft")
    assert main(["measure", "-m", str(tiny_model_dir("llama")), "--peft", str(tmp_path / "adapter"), "-d",
                 str(tmp_path / "t.txt"), "-o", str(tmp_path / "o.json"), "--no-progress"]) == 2
    assert "repgeom-eval[peft]" in error_line(capsys)


@pytest.mark.fault("refused")
def test_compare_plot_without_matplotlib_is_one_line_before_the_table(monkeypatch, capsys, tiny_model_dir, tmp_path):
    (tmp_path / "t.txt").write_text("a text\nanother text\n")
    assert main(["measure", "-m", str(tiny_model_dir("llama")), "-d", str(tmp_path / "t.txt"), "-o",
                 str(tmp_path / "o.json"), "--no-progress"]) == 0
    capsys.readouterr()
    hide(monkeypatch, "matplotlib")
    assert main(["compare", str(tmp_path / "o.json"), "--plot", str(tmp_path / "p.png")]) == 2
    assert "repgeom-eval[plot]" in error_line(capsys, printed_nothing=True)  # no table first
