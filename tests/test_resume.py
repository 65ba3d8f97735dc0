"""Resumable runs: a run killed mid-way and resumed gives exactly the numbers of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.measurement.engine import measure

# The child run sleeps after each checkpoint so that the test can kill it between shards, like a real crash.
SLOW_CHILD = """
import sys, time
from repgeom_eval.measurement import checkpoint
save = checkpoint.RunDir.save
def slow_save(self, state):
    save(self, state)
    time.sleep(0.4)
checkpoint.RunDir.save = slow_save
from repgeom_eval.entrypoints.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _args(model, data, run_dir, out):
    return ["measure", "--model", model, "--data", str(data), "--layers", "resid_post:0,final",
            "--metrics", "dispersion", "token_dispersion", "effective_rank", "dataset_entropy",
            "--batch-size", "3", "--shard-size", "4", "--run-dir", str(run_dir), "--output", str(out),
            "--per-text", str(out.with_suffix(".jsonl")), "--no-progress"]


@pytest.fixture
def corpus(tmp_path, texts):
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:40]))
    return data


@pytest.mark.fault("exact")
def test_killed_run_resumes_to_the_same_numbers(tmp_path, tiny_model_dir, corpus):
    model = tiny_model_dir("gpt2")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    run_dir, out = tmp_path / "run", tmp_path / "resumed.json"
    child = subprocess.Popen([sys.executable, "-c", SLOW_CHILD, *_args(model, corpus, run_dir, out)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    state_file = run_dir / "state.rank0-of-1.pt"
    deadline = time.monotonic() + 120
    done = 0
    while time.monotonic() < deadline and child.poll() is None:
        if state_file.exists():
            try:
                done = torch.load(state_file, weights_only=True)["next_shard"]
            except Exception:  # noqa: BLE001 - being replaced right now; look again
                done = 0
            if done >= 3:
                break
        time.sleep(0.05)
    assert child.poll() is None, f"the run ended before it could be killed: {child.communicate()}"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert 3 <= done < 10 and not out.exists()

    resumed = subprocess.run([sys.executable, "-m", "repgeom_eval", *_args(model, corpus, run_dir, out), "--resume"],
                             capture_output=True, text=True, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    fresh = tmp_path / "fresh.json"
    whole = subprocess.run([sys.executable, "-m", "repgeom_eval", *_args(model, corpus, tmp_path / "run2", fresh)],
                           capture_output=True, text=True, env=env, timeout=300)
    assert whole.returncode == 0, whole.stderr
    a, b = json.loads(out.read_text()), json.loads(fresh.read_text())
    assert a["config"]["resumed_from_shard"] >= 3 and b["config"]["resumed_from_shard"] is None
    assert a["results"] == b["results"]  # bit for bit: saved states are exact, remaining batches are the same
    assert a["data"] == b["data"]
    assert out.with_suffix(".jsonl").read_text() == fresh.with_suffix(".jsonl").read_text()


@pytest.mark.fault("refused")
def test_checkpoint_mismatch_and_corruption_are_reported(tmp_path, tiny_model_dir, texts):
    model, run_dir = tiny_model_dir("gpt2"), tmp_path / "run"
    first = measure(model, texts[:12], shard_size=4, run_dir=run_dir, progress=False)
    with pytest.raises(RepgeomError, match="already holds a checkpoint.*--resume"):
        measure(model, texts[:12], shard_size=4, run_dir=run_dir, progress=False)
    again = measure(model, texts[:12], shard_size=4, run_dir=run_dir, resume=True, progress=False)
    assert again.results == first.results and again.config["resumed_from_shard"] == 3
    with pytest.raises(RepgeomError, match="different run.*addresses"):
        measure(model, texts[:12], layers="embed", shard_size=4, run_dir=run_dir, resume=True, progress=False)
    with pytest.raises(RepgeomError, match="different run.*data"):
        measure(model, texts[:13], shard_size=4, run_dir=run_dir, resume=True, progress=False)
    (run_dir / "state.rank0-of-1.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(RepgeomError, match="corrupt.*delete it"):
        measure(model, texts[:12], shard_size=4, run_dir=run_dir, resume=True, progress=False)
    with pytest.raises(RepgeomError, match="--run-dir"):
        measure(model, texts[:12], resume=True, progress=False)


def test_shard_size_does_not_change_the_numbers(tiny_model_dir, texts):
    model = tiny_model_dir("llama")
    whole = measure(model, texts[:20], metrics=["dispersion", "token_dispersion"], layers="all", progress=False)
    sharded = measure(model, texts[:20], metrics=["dispersion", "token_dispersion"], layers="all", shard_size=3,
                      progress=False)
    for addr, per_metric in whole.results.items():
        for metric, value in per_metric.items():
            assert sharded.results[addr][metric] == pytest.approx(value, abs=1e-5)
    assert sharded.data["n_texts"] == 20 and sharded.data["n_tokens"] == whole.data["n_tokens"]
