"""The literal lm-eval command line finds the repgeom tasks with no --include_path (the installed .pth start-up
hook) and prints the geometry next to acc in its own table; the samples feed `repgeom slices`.

One real `lm_eval` run in a subprocess (lm-eval indexes its 14 000 task files first: ~30-60 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lm_eval  # noqa: E402,F401  (dev extra: missing must fail, not skip)

from repgeom_eval.testing import write_task_data  # noqa: E402

BIN = Path(sys.executable).parent
GEOMETRY = ("repgeom_dispersion", "repgeom_dispersion_correct", "repgeom_dispersion_incorrect", "repgeom_auroc",
            "repgeom_acc_low_c", "repgeom_acc_high_c", "repgeom_slice_spearman")


def offline_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("REPGEOM_LM_EVAL_AUTOLOAD", None)
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def literal_run(tiny_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("lm-eval-cli")
    data = write_task_data("mmlu", work / "mmlu.jsonl", n=30, seed=2)
    cmd = [str(BIN / "lm_eval"), "--model", "hf", "--model_args", f"pretrained={tiny_model_dir('llama')}",
           "--tasks", "repgeom_hardness_mmlu", "--metadata", json.dumps({"repgeom_data": str(data)}),
           "--batch_size", "4", "--output_path", str(work / "out"), "--log_samples"]
    proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=offline_env(), timeout=600)
    assert proc.returncode == 0, f"lm_eval failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return work, proc


def test_table_shows_geometry_next_to_acc(literal_run):
    _, proc = literal_run
    rows = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    metrics = [cells[5].strip() for cells in (row.split("|") for row in rows) if len(cells) > 6]
    assert "acc" in metrics
    for name in GEOMETRY:
        assert name in metrics, f"{name} missing from lm-eval's table:\n{proc.stdout}"
    assert "repgeom_hardness_mmlu" in proc.stdout


def test_results_and_samples_files(literal_run):
    work, _ = literal_run
    (results_file,) = (work / "out").rglob("results_*.json")
    results = json.loads(results_file.read_text())
    task = results["results"]["repgeom_hardness_mmlu"]
    for name in GEOMETRY:
        assert isinstance(task[f"{name},none"], float)
    assert 0 <= task["acc,none"] <= 1
    meta = results["configs"]["repgeom_hardness_mmlu"]["metadata"]["repgeom"]
    assert meta["layer"] == "final" and meta["pooling"] == "last" and meta["capture"] == "fused"
    (samples_file,) = (work / "out").rglob("samples_repgeom_hardness_mmlu_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(samples) == 30
    c = [s["repgeom_dispersion"] for s in samples]  # per-query c_i; their mean is the dispersion
    assert sum(c) / len(c) == pytest.approx(task["repgeom_dispersion,none"], abs=1e-9)
    assert all(s["repgeom_auroc"][1] == s["acc"] for s in samples)


def test_slices_command_reads_the_samples(literal_run, tmp_path):
    from repgeom_eval.entrypoints.cli import main

    work, _ = literal_run
    out = tmp_path / "slices.json"
    assert main(["slices", str(work / "out"), "--size", "8", "--seeds", "3", "--output", str(out),
                 "--plot", str(tmp_path / "slices.png")]) == 0
    result = json.loads(out.read_text())
    assert result["n_queries"] == 30 and result["slices"]["size"] <= 8
    assert len(result["slices"]["dispersion_mean"]) == 11
    assert (tmp_path / "slices.png").stat().st_size > 1000
