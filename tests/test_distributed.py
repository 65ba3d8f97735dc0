"""Data-parallel measurement: torchrun with 2 CPU processes (gloo) gives the single-process numbers."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from repgeom_eval.measurement.distributed import Distributed

METRICS = ["dispersion", "token_dispersion", "prompt_entropy", "curvature", "condensation", "effective_rank",
           "dataset_entropy", "massive_activations", "infonce", "lidar"]


def _env() -> dict[str, str]:
    # One thread per process in both runs: torchrun's default, and GEMM results do not depend on thread counts.
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def _measure_args(model: str, data: Path, out: Path) -> list[str]:
    return ["measure", "--model", model, "--data", str(data), "--layers", "embed,resid_post:0,final",
            "--metrics", *METRICS, "--metric-param", "lidar.n_views=4", "--batch-size", "4", "--shard-size", "10",
            "--output", str(out), "--per-text", str(out.with_suffix(".jsonl")), "--no-progress"]


def _flat(results: dict) -> dict[str, float]:
    out = {}
    for addr, per_metric in results.items():
        for metric, value in per_metric.items():
            items = value.items() if isinstance(value, dict) else [("", value)]
            for k, v in items:
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[f"{addr}/{metric}/{k}"] = float(v)
    return out


def test_two_processes_equal_one(tmp_path, tiny_model_dir, texts):
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": t, "id": f"t{i}"}) + "\n" for i, t in enumerate(texts[:30])))
    model = tiny_model_dir("llama")
    single, multi = tmp_path / "single.json", tmp_path / "multi.json"
    one = subprocess.run([sys.executable, "-m", "repgeom_eval", *_measure_args(model, data, single)],
                         capture_output=True, text=True, env=_env(), timeout=300)
    assert one.returncode == 0, one.stderr
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    two = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", "29561", "-m", "repgeom_eval",
                          *_measure_args(model, data, multi)], capture_output=True, text=True, env=_env(),
                         timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = json.loads(single.read_text()), json.loads(multi.read_text())
    dist_a, dist_b = a["config"]["distributed"], b["config"]["distributed"]
    assert dist_b["world_size"] == 2 and dist_b["backend"] == "gloo"
    # The work was really split: both ranks ran sequences, and together exactly what one process ran.
    assert len(dist_b["sequences_by_rank"]) == 2 and min(dist_b["sequences_by_rank"]) > 0
    assert sum(dist_b["sequences_by_rank"]) == sum(dist_a["sequences_by_rank"]) == 30 * (1 + 4)
    assert a["data"] == b["data"]
    fa, fb = _flat(a["results"]), _flat(b["results"])
    assert fa.keys() == fb.keys() and len(fa) > 30
    for key, va in fa.items():  # the same batches run on both sides: only the order of the sums differs
        assert math.isclose(va, fb[key], rel_tol=1e-9, abs_tol=1e-12), (key, va, fb[key])
    rows_a = single.with_suffix(".jsonl").read_text().splitlines()
    rows_b = multi.with_suffix(".jsonl").read_text().splitlines()
    assert len(rows_a) == len(rows_b) == 30
    for ra, rb in zip(map(json.loads, rows_a), map(json.loads, rows_b)):
        assert ra["id"] == rb["id"] and ra["n_tokens"] == rb["n_tokens"]
        assert ra["scores"]["final"]["dispersion"] == pytest.approx(rb["scores"]["final"]["dispersion"], rel=1e-9)


def test_single_process_is_a_no_op(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    d = Distributed.from_env("cpu")
    assert not d.active and d.is_main and d.gather({"x": 1}) == [{"x": 1}] and d.all_gather(3) == [3]
    assert all(d.owns(u) for u in range(5))


def test_half_configured_environment_is_refused(monkeypatch):
    from repgeom_eval.spec.errors import RepgeomError

    monkeypatch.setenv("WORLD_SIZE", "2")
    for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RepgeomError, match="torchrun or accelerate launch"):
        Distributed.from_env("cpu")


def test_ppl_bins_two_processes_equal_one(tmp_path, tiny_model_dir, texts):
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:30]))
    model = tiny_model_dir("llama")

    def args(out: Path) -> list[str]:
        return ["ppl-bins", "--model", model, "--data", str(data), "--chunk-len", "16", "--group-size", "3",
                "--bins", "5", "--layers", "embed", "resid_post:0", "final", "--batch-size", "3", "--no-progress",
                "--output", str(out), "--per-chunk", str(out.with_suffix(".jsonl"))]

    single, multi = tmp_path / "single.json", tmp_path / "multi.json"
    one = subprocess.run([sys.executable, "-m", "repgeom_eval", *args(single)], capture_output=True, text=True,
                         env=_env(), timeout=300)
    assert one.returncode == 0, one.stderr
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    two = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", "29562", "-m", "repgeom_eval",
                          *args(multi)], capture_output=True, text=True, env=_env(), timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = json.loads(single.read_text()), json.loads(multi.read_text())
    assert b["config"]["distributed"] == {"world_size": 2, "backend": "gloo"}
    assert a["data"] == b["data"] and a["data"]["n_chunks_used"] >= 15
    rows_a = [json.loads(line) for line in single.with_suffix(".jsonl").read_text().splitlines()]
    rows_b = [json.loads(line) for line in multi.with_suffix(".jsonl").read_text().splitlines()]
    assert len(rows_a) == len(rows_b) == a["data"]["n_chunks_used"]
    for ra, rb in zip(rows_a, rows_b):  # every chunk's numbers, in the same order
        assert (ra["doc"], ra["start"]) == (rb["doc"], rb["start"])
        assert rb["ppl"] == pytest.approx(ra["ppl"], rel=1e-9)
        assert rb["dispersion"] == pytest.approx(ra["dispersion"], rel=1e-9)
    for layer, corr in a["results"]["pooled"]["correlation"].items():
        assert b["results"]["pooled"]["correlation"][layer] == pytest.approx(corr, rel=1e-9)


def test_mteb_sweep_spreads_tasks_over_two_processes(tmp_path, tiny_model_dir):
    from repgeom_eval.mteb_layers.examples import write_example_tasks

    tasks_file = write_example_tasks(tmp_path / "tasks", size="small")

    def args(out: Path) -> list[str]:
        return ["mteb", "run", "-m", tiny_model_dir("bert"), "--layer", "all", "--tasks-file", str(tasks_file),
                "-t", "PydocSTS", "PydocTopicClustering", "--batch-size", "4", "--no-progress",
                "--output-folder", str(out)]

    single, multi = tmp_path / "single", tmp_path / "multi"
    one = subprocess.run([sys.executable, "-m", "repgeom_eval", *args(single)], capture_output=True, text=True,
                         env=_env(), timeout=300)
    assert one.returncode == 0, one.stderr
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    two = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", "29563", "-m", "repgeom_eval",
                          *args(multi)], capture_output=True, text=True, env=_env(), timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "3 layer(s) × 2 task(s)" in two.stdout  # rank 0 reports every rank's tasks, once
    assert two.stdout.count("PydocSTS") == one.stdout.count("PydocSTS")

    def summary(folder: Path) -> list[str]:
        return sorted((folder / "repgeom_summary.csv").read_text().splitlines())

    assert summary(single) == summary(multi) and len(summary(single)) == 1 + 2 * 3


def _rank_process(launcher_pid: int, rank: int, timeout: float = 60.0):
    """The worker process of ``rank`` under a torchrun launcher (by the RANK in its environment)."""
    import time

    psutil = pytest.importorskip("psutil")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(launcher_pid).children(recursive=True):
            try:
                if child.environ().get("RANK") == str(rank):
                    return child
            except psutil.Error:
                continue
        time.sleep(0.05)
    raise AssertionError(f"no worker of rank {rank} appeared")


@pytest.mark.fault("exact")
def test_a_dying_rank_stops_the_survivor_in_one_line_and_the_run_resumes_exactly(tmp_path, tiny_model_dir, texts):
    """Kill rank 1 of 2 in the middle of a checkpointed run: rank 0 says in one line why it stopped, no output is
    written, every checkpoint loads, and --resume with two processes gives the one-process numbers."""
    import signal
    import time

    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": t, "id": f"t{i}"}) + "\n" for i, t in enumerate(texts[:40] * 4)))
    model = tiny_model_dir("llama")
    run_dir, single, multi = tmp_path / "run", tmp_path / "single.json", tmp_path / "multi.json"
    args = ["measure", "--model", model, "--data", str(data), "--layers", "embed,final", "--metrics", "dispersion",
            "token_dispersion", "dataset_entropy", "--batch-size", "2", "--shard-size", "4", "--no-progress"]
    one = subprocess.run([sys.executable, "-m", "repgeom_eval", *args, "--output", str(single)], capture_output=True,
                         text=True, env=_env(), timeout=300)
    assert one.returncode == 0, one.stderr
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    launch = [torchrun, "--nproc-per-node", "2", "--master-port", "29563", "-m", "repgeom_eval", *args,
              "--run-dir", str(run_dir), "--output", str(multi)]
    proc = subprocess.Popen(launch, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    victim = _rank_process(proc.pid, 1)
    state1 = run_dir / "state.rank1-of-2.pt"
    deadline = time.monotonic() + 120
    while not state1.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert state1.exists() and proc.poll() is None, "rank 1 checkpointed nothing before the run ended"
    victim.send_signal(signal.SIGSTOP)  # frozen after its first checkpoint, mid-run
    time.sleep(1.0)
    victim.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and not multi.exists()
    stopped = [line for line in err.splitlines() if line.startswith("repgeom: error: rank 0 of 2")]
    assert len(stopped) == 1, err[-3000:]
    assert "--resume" in stopped[0]
    # no traceback through our code (torchrun prints its own report of the failed rank)
    assert not [line for line in err.splitlines() if 'File "' in line and "repgeom_eval" in line], err[-3000:]
    resumed = subprocess.run([*launch[:4], "29564", *launch[5:], "--resume"], capture_output=True, text=True,
                             env=_env(), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = json.loads(single.read_text()), json.loads(multi.read_text())
    assert b["config"]["resumed_from_shard"] >= 1  # it continued from the checkpoint, not from the start
    fa, fb = _flat(a["results"]), _flat(b["results"])
    assert fa.keys() == fb.keys() and len(fa) > 5
    for key, va in fa.items():
        assert math.isclose(va, fb[key], rel_tol=1e-9, abs_tol=1e-12), (key, va, fb[key])


def test_the_launchers_sigterm_after_a_dead_peer_ends_the_rank_without_a_second_message():
    """The race CI once hit: a collective fails because a peer died (one line is printed), then torchrun's SIGTERM
    lands while the command is cleaning up (in a ``finally``). The signal must end the process quietly, not raise a
    second error with a traceback from wherever it landed."""
    script = """
import os, signal, sys
from repgeom_eval.measurement.distributed import Distributed, RankStopped
d = Distributed(rank=0, world=2)
d.stop_on_sigterm()
def peer_gone():
    raise RuntimeError("Connection closed by peer")
try:
    try:
        d._collective(peer_gone)
    except RankStopped as exc:
        print(f"repgeom: error: {exc}", file=sys.stderr)
finally:
    os.kill(os.getpid(), signal.SIGTERM)
    import time; time.sleep(5)
print("not reached")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(), timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("repgeom: error: rank 0 of 2: another rank"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_first_sigterm_is_one_error_and_a_second_ends_quietly():
    script = """
import os, signal, sys
from repgeom_eval.measurement.distributed import Distributed, RankStopped
d = Distributed(rank=1, world=2)
d.stop_on_sigterm()
try:
    os.kill(os.getpid(), signal.SIGTERM)
    import time; time.sleep(5)
except RankStopped as exc:
    print(f"repgeom: error: {exc}", file=sys.stderr)
os.kill(os.getpid(), signal.SIGTERM)
import time; time.sleep(5)
print("not reached")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(), timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "stopped by the launcher" in lines[0], proc.stderr


RANK_BOOM = '''
import os
import repgeom_eval
import torch


class RankBoom(repgeom_eval.Metric):
    name = "rank_boom"

    def __init__(self):
        super().__init__()
        self.add_state("total", torch.zeros((), dtype=torch.float64), "sum", shape=())

    def update(self, batch):
        if os.environ.get("RANK") == "1":
            raise ValueError("fails on rank 1")
        self.total = self.total + batch.pooled[:, 0].double().sum()

    def compute(self):
        return float(self.total)


@repgeom_eval.hookimpl
def repgeom_register_metrics(registry):
    registry.add(RankBoom)
'''


def test_a_plugin_metric_failing_on_one_rank_is_left_out_of_the_merged_results(tmp_path, tiny_model_dir, texts):
    # docs/plugins.md#when-something-goes-wrong: rank 1 drops the metric, rank 0 learns it when the states merge and
    # leaves it out; the other metric's results are written and rank 0 exits with status 3
    site = tmp_path / "site"
    (site / "rankboom-0.1.dist-info").mkdir(parents=True)
    (site / "rankboom.py").write_text(RANK_BOOM)
    (site / "rankboom-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: rankboom\nVersion: 0.1\n")
    (site / "rankboom-0.1.dist-info" / "entry_points.txt").write_text("[repgeom_eval]\nrankboom = rankboom\n")
    data, out = tmp_path / "texts.txt", tmp_path / "out.json"
    data.write_text("\n".join(texts[:16]) + "\n")
    env = {**_env(), "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("REPGEOM_DEBUG", None)
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    run = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", "29567", "-m", "repgeom_eval", "measure",
                          "--model", tiny_model_dir("llama"), "--data", str(data), "--metrics", "rank_boom",
                          "dispersion", "--layers", "all", "--batch-size", "4", "--output", str(out),
                          "--no-progress"],
                         capture_output=True, text=True, env=env, timeout=300)
    said = run.stdout + run.stderr
    assert run.returncode != 0 and "exitcode  : 3" in said, said[-3000:]  # torchrun reports rank 0's status
    doc = json.loads(out.read_text())
    assert set(doc["failed_metrics"]) == {"rank_boom"} and "fails on rank 1" in doc["failed_metrics"]["rank_boom"]
    assert all(set(r) == {"dispersion"} for r in doc["results"].values())
    assert doc["config"]["distributed"]["world_size"] == 2 and min(doc["config"]["distributed"]["sequences_by_rank"])
