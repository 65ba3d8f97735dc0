"""Build hook: put ``repgeom_lm_eval.pth`` at the root of every wheel, editable ones included.

Everything else about the package is declared in pyproject.toml. The ``.pth`` file makes lm-eval find
repgeom-eval's tasks with no ``--include_path`` (see ``_repgeom_lm_eval_hook.py``); being listed in the wheel, it
is removed by ``pip uninstall`` like every other file.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "repgeom_lm_eval.pth"
# One line, run by Python's site module at every start-up: the opt-out is checked before any import, and a hook
# module that is gone (a half-finished uninstall) is skipped instead of printing an error at every start-up.
PTH_LINE = ('import os; exec("try:\\n import _repgeom_lm_eval_hook\\nexcept Exception:\\n pass") '
            'if os.environ.get("REPGEOM_LM_EVAL_AUTOLOAD", "1").strip().lower() not in ("0", "false", "no", "off") '
            'else None\n')


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        target = self.build_lib
        if self.editable_mode:
            # An editable wheel is written from the `install` command's install_lib; build_lib is scratch there.
            target = self.get_finalized_command("install").install_lib
        os.makedirs(target, exist_ok=True)
        with open(os.path.join(target, PTH_NAME), "w", encoding="utf-8") as fh:
            fh.write(PTH_LINE)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH_NAME)]


setup(cmdclass={"build_py": BuildPyWithPth})
