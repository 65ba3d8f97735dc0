"""The lm-eval start-up hook (repgeom_lm_eval.pth) costs nothing measurable and cannot break Python or lm-eval."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pth_line() -> str:
    """The line setup.py writes into repgeom_lm_eval.pth."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    (value,) = [n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "PTH_LINE"]
    return ast.literal_eval(value)


def _run(code: str, *flags: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "REPGEOM_LM_EVAL_AUTOLOAD"} | env
    return subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, env=full, timeout=120)


def test_the_opt_out_is_checked_before_any_import_and_the_hook_imports_nothing_new():
    code = "import sys; print(int('_repgeom_lm_eval_hook' in sys.modules), sorted(sys.modules))"
    on = _run(code).stdout.split(" ", 1)
    off = _run(code, REPGEOM_LM_EVAL_AUTOLOAD="0").stdout.split(" ", 1)
    assert on[0] == "1" and off[0] == "0"
    added = set(eval(on[1])) - set(eval(off[1]))  # noqa: S307 - our own subprocess's output
    assert added == {"_repgeom_lm_eval_hook"}  # no importlib.abc, threading or warnings at start-up


@pytest.mark.parametrize("autoload", ["1", "0"])
def test_a_pth_line_without_its_module_is_silent(tmp_path, autoload):
    """A half-finished uninstall (the .pth left, the module gone) must not print an error at every start-up."""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "repgeom_lm_eval.pth").write_text(_pth_line())
    # -S: no site-packages, so the hook module cannot be found; then process only our .pth
    proc = _run(f"import site; site.addsitedir({str(site_dir)!r}); print('alive')", "-S",
                REPGEOM_LM_EVAL_AUTOLOAD=autoload)
    assert proc.stdout.strip() == "alive" and proc.stderr == ""


def test_lm_evals_task_manager_works_when_the_package_is_gone(monkeypatch):
    """The hook module left, repgeom-eval's task folder gone: TaskManager still builds, with one warning."""
    import _repgeom_lm_eval_hook as hook

    def gone():
        raise RuntimeError("repgeom-eval's task_configs folder is missing; reinstall repgeom-eval")

    monkeypatch.setattr(hook, "tasks_dir", gone)
    with pytest.warns(RuntimeWarning, match="lm-eval tasks are not available"):
        assert hook.with_tasks_dir(["my/tasks"]) == ["my/tasks"]
