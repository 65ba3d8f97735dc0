"""--progress auto|always|never: bars on a terminal, plain lines in logs (every 30 s or 10 %), nothing."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.spec.options.measure import RunConfig
from repgeom_eval.output.progress import LineProgress, duration, mode_of, progress_bar, progress_mode


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_lines_every_tenth_and_every_30_seconds():
    clock, out = Clock(), io.StringIO()
    bar = LineProgress(total=100, desc="measure", unit="seq", stream=out, clock=clock)
    for _ in range(25):
        clock.now += 1
        bar.update(1)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # at 10 % and 20 %
    assert lines[0] == "repgeom: measure: 10/100 seq (10%), 10s elapsed, about 1m30s left"
    bar2 = LineProgress(total=None, desc="slow", unit="chunk", stream=out, clock=clock)
    out.truncate(0), out.seek(0)
    for _ in range(4):
        clock.now += 10  # no total: a line every 30 s
        bar2.update(2)
    assert out.getvalue().splitlines() == ["repgeom: slow: 6 chunk, 30s elapsed"]
    bar2.set_postfix({"ce": "3.1"})
    bar2.close()
    assert out.getvalue().splitlines()[-1] == "repgeom: slow: 8 chunk, done in 40s [ce=3.1]"


def test_modes():
    assert mode_of(None) == "auto" and mode_of(True) == "auto" and mode_of(False) == "never"
    with progress_mode("always"):
        assert mode_of(True) == "always" and mode_of("never") == "never"
    with pytest.raises(RepgeomError, match="--progress"):
        mode_of("sometimes")
    assert RunConfig(progress=False).progress == "never" and RunConfig(progress=True).progress == "auto"
    assert RunConfig().progress == "auto"
    with pytest.raises(RepgeomError, match="--progress"):
        RunConfig(progress="sometimes")
    assert duration(0.4321) == "0.43s" and duration(7.46) == "7.5s" and duration(185) == "3m05s"
    assert duration(7380) == "2h03m00s"


def test_progress_bar_picks_lines_off_a_terminal(capsys):
    bar = progress_bar(total=10, desc="x", progress="auto")  # pytest's stderr is no terminal
    assert isinstance(bar, LineProgress)
    always = progress_bar(total=10, progress="always")
    assert not isinstance(always, LineProgress)
    always.close()
    capsys.readouterr()
    silent = progress_bar(total=10, progress="auto", disable=True)
    silent.update(10), silent.close()
    assert capsys.readouterr().err == ""


def test_measure_progress_lines_in_a_log(tiny_model_dir, texts, tmp_path):
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:40]), encoding="utf-8")
    base = [sys.executable, "-m", "repgeom_eval", "measure", "-m", tiny_model_dir("gpt2"), "-d", str(data),
            "-b", "4", "-o", str(tmp_path / "r.json")]
    logged = subprocess.run(base, capture_output=True, text=True, timeout=300)  # stderr is a pipe: lines
    assert logged.returncode == 0, logged.stderr
    lines = [x for x in logged.stderr.splitlines() if x.startswith("repgeom: measure: ")]
    assert len(lines) >= 5 and lines[-1].startswith("repgeom: measure: 40/40 seq (100%), done in "), logged.stderr
    assert "\r" not in logged.stderr
    quiet = subprocess.run(base + ["--progress", "never"], capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and "repgeom: measure:" not in quiet.stderr
    old = subprocess.run(base + ["--no-progress"], capture_output=True, text=True, timeout=300)
    assert old.returncode == 0 and "repgeom: measure:" not in old.stderr


def test_training_progress_lines_in_a_log(capsys):
    from types import SimpleNamespace

    from repgeom_eval.training.loop import _progress_callback

    callback = _progress_callback("auto")  # pytest's stderr is no terminal: lines
    state = SimpleNamespace(is_world_process_zero=True, max_steps=20, global_step=0)
    callback.on_train_begin(None, state, None)
    for step in range(1, 21):
        state.global_step = step
        callback.on_step_end(None, state, None)
        if step == 10:
            callback.on_log(None, state, None, logs={"ce": 3.25, "aux/push_away": 0.5})
    callback.on_train_end(None, state, None)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("repgeom: train: 2/20 step (10%)") and len(lines) == 10
    assert lines[-1].startswith("repgeom: train: 20/20 step (100%), done in ")
    assert "[ce=3.25, push_away=0.5]" in lines[-1]
