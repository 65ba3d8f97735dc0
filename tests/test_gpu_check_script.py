"""benchmarks/gpu_check.py, the one script prepared for a lent GPU machine, run here on the CPU at tiny size
(``--device cpu --quick``): it must run end to end and write its JSON, so the device minutes are not spent on a
broken script. It drives benchmarks/bench_scale.py's measurement code too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# what benchmarks/gpu_check.sh installs from (pyproject.toml's packages, package-dir and readme)
PACKAGE_FILES = ("repgeom_eval", "plugins", "entrypoints", "task_configs", "benchmarks", "pyproject.toml", "setup.py",
                 "README.md", "_repgeom_lm_eval_hook.py")


def test_gpu_check_runs_on_the_cpu_at_tiny_size(tmp_path):
    """As the GPU machine runs it (benchmarks/gpu_check.sh): the checkout installed without dependencies into a
    scratch folder, and no editable install in sight (``python -S`` skips the .pth file that maps this checkout's
    plugins/ into repgeom_eval.plugins), so a script that imported the checkout's bare repgeom_eval folder, which
    registers no built-in plugin, fails here as it would there. In a copy: the install builds in the tree."""
    import shutil
    import sysconfig

    tree = tmp_path / "checkout"
    tree.mkdir()
    for name in PACKAGE_FILES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, tree / name, ignore=shutil.ignore_patterns("__pycache__", "results"))
        else:
            shutil.copy2(src, tree / name)
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHON": f"{sys.executable} -S", "REPGEOM_CHECK_SITE": str(tmp_path / "site"),
           "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    proc = subprocess.run(["sh", "benchmarks/gpu_check.sh", "--device", "cpu", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=tree, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["ok"] and set(doc["values"]) == {"gpt2", "llama"}
    for row in doc["values"].values():
        assert row["float32_max_abs_diff"] <= 1e-5 and row["bfloat16_max_abs_diff"] <= 0.02
    suites = doc["scale"]["suites"]
    assert set(suites) == {"dispersion", "layerwise"} and suites["layerwise"]["metrics_over_forward"] > 0
    assert [row["tokens"] for row in doc["scale"]["contexts"]] == [32, 64]
    assert all(row["prompt_entropy_alpha2"]["metrics_over_forward"] > 0 for row in doc["scale"]["contexts"])
    assert doc["finished_stages"] == ["values", "eigvalsh", "scale and memory", "routes", "context 32", "context 64",
                                      "syncs"]
    assert [row["n"] for row in doc["eigvalsh"]["per_matrix"]] == [32, 64]
    assert all(row["device_float64_ms"] > 0 and row["cpu_all_cores_float64_ms"] > 0
               for row in doc["eigvalsh"]["per_matrix"])
    assert doc["memory"]["layerwise"]["estimate_bytes"] > 0
    # the host route is the same LAPACK as the torch route on the CPU: the same values
    assert set(doc["routes"]) == {"torch", "spectra_host", "host_cores"}
    assert all(doc["routes"][route]["prompt_entropy_max_abs_diff"] <= 1e-12 for route in ("spectra_host", "host_cores"))


def test_gpu_check_skips_a_context_its_budget_cannot_hold(tmp_path):
    """A context length whose alpha-1 spectra the eigvalsh stage predicts past ``--budget-s`` is written down as
    skipped, with the prediction, instead of running the lease out."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--quick",
                           "--budget-s", "0", "--out", str(out)], capture_output=True, text=True, timeout=900,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["scale"]["contexts"]
    assert [row["tokens"] for row in rows] == [32, 64]
    assert all("predicted" in row["skipped"] and "budget" in row["skipped"] for row in rows)


def test_gpu_check_refuses_without_cuda_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        return
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "--device cpu" in proc.stderr


def test_the_gpu_sync_stage_counts_what_grows_with_the_batches(monkeypatch):
    """The CUDA-only stage run on the CPU, where a host read of a tensor (``aten::_local_scalar_dense``: what a
    ``bool()`` or ``.item()`` becomes) stands in for a CUDA synchronisation: the CPU path's per-batch finite check
    reads one per address and batch, and the stage must count it, name its call site, and fail the suite."""
    import repgeom_eval as rg
    from repgeom_eval.measurement.forward import Forward

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_check
    import gpu_profile

    load = rg.load_model
    monkeypatch.setattr(rg, "load_model", lambda path, device=None, **kw: load(path, device="cpu", **kw))
    monkeypatch.setattr(gpu_profile, "SYNC_CALLS", ("aten::_local_scalar_dense",))
    monkeypatch.setattr(gpu_profile, "SYNC_SUITES", gpu_profile.SYNC_SUITES[:1])  # the pooled suite: seconds
    monkeypatch.setattr(Forward, "check_each_batch", True)  # the CPU's at-once check
    out = gpu_check.sync_check("cuda")
    row = out["pooled"]
    assert set(out) == {"pooled"} and not row["ok"] and row["per_batch"] >= 3  # 3 addresses a batch, at least
    assert any("check_finite" in site for site in row["growing_sites"]), row["growing_sites"]
    monkeypatch.setattr(Forward, "check_each_batch", False)  # what a GPU runs: read every 64 batches
    row = gpu_check.sync_check("cuda")["pooled"]
    assert not any("check_finite" in site for site in row["growing_sites"]), row["growing_sites"]
