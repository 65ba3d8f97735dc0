"""An out-of-memory error during a run is one line naming the stage and what to lower, and a ``--run-dir`` run
resumes after it to the numbers of an uninterrupted run (docs/how-to/large-models.md)."""

from __future__ import annotations

import json

import pytest
import torch

from repgeom_eval.entrypoints.cli import main
from repgeom_eval.measurement import engine, forward
from repgeom_eval.measurement.oom import is_out_of_memory


def texts(n):
    words = "rivers hills numbers code music weather stones letters trees ships".split()
    return [" ".join(words[(i * 3 + k) % 10] for k in range(2 + i % 5)) + f" {i}" for i in range(n)]


@pytest.mark.parametrize("threads", [1, 2], ids=["fed-during-the-pass", "fed-after-the-pass-in-threads"])
@pytest.mark.parametrize("stage, error", [("forward pass", torch.OutOfMemoryError("CUDA out of memory. Tried to "
                                                                                  "allocate 2.00 GiB")),
                                          ("metric update", RuntimeError("DefaultCPUAllocator: can't allocate "
                                                                         "memory: you tried to allocate 1 bytes"))])
def test_out_of_memory_is_one_line_and_the_run_resumes(tiny_model_dir, tmp_path, capsys, monkeypatch, stage, error,
                                                       threads):
    # threads=1 feeds each address inside the forward pass (as on a GPU), 2 after it (the CPU's threads): an error in
    # the metric update is named so on both
    monkeypatch.setattr(engine.MeasureRun, "_metric_threads", lambda self, host: threads)
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(texts(24)) + "\n")
    args = ["measure", "-m", tiny_model_dir("llama"), "-d", str(data), "--layers", "all", "--metrics", "dispersion",
            "vendi", "--shard-size", "8", "--batch-size", "4"]
    assert main(args + ["-o", str(tmp_path / "single.json")]) == 0
    target = (forward.Forward, "texts") if stage == "forward pass" else (engine._MeasureSink, "batch")
    original = getattr(*target)
    calls = []
    fail_at = 4 if stage == "forward pass" else 3 * 3 + 1  # the second batch of the second shard (3 addresses)

    def fails_on_the_fourth(*a, **k):
        calls.append(1)
        if len(calls) == fail_at:
            raise error
        return original(*a, **k)

    monkeypatch.setattr(*target, fails_on_the_fourth)
    capsys.readouterr()
    run_dir = tmp_path / "run"
    assert main(args + ["-o", str(tmp_path / "cut.json"), "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    errors = [line for line in err.splitlines() if line.startswith("repgeom: error")]
    assert len(errors) == 1 and "Traceback" not in err, err  # the other lines are progress
    err = errors[0]
    assert f"out of memory in the {stage}" in err and "--resume" in err and "--batch-size" in err
    monkeypatch.setattr(*target, original)
    assert main(args + ["-o", str(tmp_path / "resumed.json"), "--run-dir", str(run_dir), "--resume"]) == 0
    single = json.loads((tmp_path / "single.json").read_text())
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed["config"]["resumed_from_shard"] == 1
    for addr, metrics in single["results"].items():
        for name, value in metrics.items():
            assert abs(resumed["results"][addr][name] - value) <= 1e-12, (addr, name)


def test_only_memory_errors_are_rewritten():
    assert is_out_of_memory(torch.OutOfMemoryError("x")) and is_out_of_memory(MemoryError())
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch")) and not is_out_of_memory(ValueError("x"))
