"""The explicit routes to the tasks, and the switch that turns the automatic one off.

* ``REPGEOM_LM_EVAL_AUTOLOAD=0``: lm-eval no longer sees the tasks (checked in a fresh interpreter);
* ``--include_path $(repgeom tasks-dir)``: finds them again;
* ``repgeom lm-eval …``: lm-eval's own command line with the tasks loaded, whatever the switch says (one real run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lm_eval  # noqa: E402,F401  (dev extra: missing must fail, not skip)

from repgeom_eval.testing import write_task_data  # noqa: E402

LIST_TASKS = ("from lm_eval.tasks import TaskManager; import sys, json; "
              "print(json.dumps(TaskManager(include_defaults=False, include_path=sys.argv[1] or None).all_tasks))")


def env(**extra: str) -> dict[str, str]:
    out = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    out.pop("REPGEOM_LM_EVAL_AUTOLOAD", None)
    out.update(extra)
    return out


def visible_tasks(include_path: str = "", **extra: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", LIST_TASKS, include_path], capture_output=True, text=True,
                          env=env(**extra), timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def tasks_dir() -> str:
    proc = subprocess.run([sys.executable, "-m", "repgeom_eval", "tasks-dir"], capture_output=True, text=True,
                          env=env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_autoload_switch_and_include_path():
    assert "repgeom_hardness_mmlu" in visible_tasks()
    for off in ("0", "false", "off"):
        assert visible_tasks(REPGEOM_LM_EVAL_AUTOLOAD=off) == []
    folder = tasks_dir()
    assert (Path(folder) / "repgeom_hardness_mmlu.yaml").is_file()
    assert "repgeom_ppl_wikitext" in visible_tasks(folder, REPGEOM_LM_EVAL_AUTOLOAD="0")
    # with the hook on as well, the folder is searched once (no "overrides existing task" duplicates)
    assert visible_tasks(folder).count("repgeom_ppl_wikitext") == 1


def test_start_up_hook_is_light():
    """The .pth line imports only the standard-library hook; nothing of repgeom_eval or torch loads until a
    program imports lm-eval's task manager."""
    code = ("import sys; print(int('_repgeom_lm_eval_hook' in sys.modules), int('repgeom_eval' in sys.modules), "
            "int('torch' in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), timeout=120)
    assert proc.stdout.split() == ["1", "0", "0"]


def test_repgeom_lm_eval_wrapper_runs_with_the_hook_off(tiny_model_dir, tmp_path):
    """Also the ``--model_args`` route of the settings (docs/lmeval.md#settings---metadata): ``repgeom-hf`` keeps
    them from the model, lm-eval hands them to the task beside ``--metadata``, which wins where both give a key."""
    data = write_task_data("piqa", tmp_path / "piqa.jsonl", n=12, seed=5)
    cmd = [sys.executable, "-m", "repgeom_eval", "lm-eval", "--model", "repgeom-hf", "--model_args",
           f"pretrained={tiny_model_dir('gpt2')},repgeom_layer=resid_post:0,repgeom_slice_size=3", "--tasks",
           "repgeom_hardness_piqa", "--batch_size", "4", "--output_path", str(tmp_path / "out"),
           "--metadata", json.dumps({"repgeom_data": str(data), "repgeom_slice_size": 4})]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=env(REPGEOM_LM_EVAL_AUTOLOAD="0"))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "repgeom_slice_spearman" in proc.stdout and "acc_norm" in proc.stdout
    (results,) = (tmp_path / "out").rglob("results_*.json")
    record = json.loads(results.read_text())["configs"]["repgeom_hardness_piqa"]["metadata"]["repgeom"]
    assert record["layer"] == record["address"] == "resid_post:0"
    assert record["slice_size"] == 4


def test_pth_file_is_part_of_the_installed_distribution():
    """pip uninstall removes exactly the files the distribution's RECORD lists: the .pth and the hook are there."""
    from importlib.metadata import distributions

    # the installed .dist-info (a source checkout's repgeom_eval.egg-info on sys.path has no RECORD)
    (dist,) = [d for d in distributions(name="repgeom-eval") if d.read_text("RECORD")]
    names = {str(f) for f in dist.files or []}
    assert "repgeom_lm_eval.pth" in names
    pth = dist.locate_file("repgeom_lm_eval.pth")
    line = Path(pth).read_text().strip()
    assert line.startswith("import os;") and "import _repgeom_lm_eval_hook" in line and "\n" not in line
