"""Start-up stays cheap (issue 16): ``repgeom --help``, ``repgeom plugins`` and ``repgeom addresses --help`` import
neither torch nor transformers, and a command's module is imported only when that command runs.

Each case runs the command line in a fresh interpreter and reads back ``sys.modules``: a plugin or a command module
that starts importing torch at module level again fails here, not silently in a benchmark. Timings are in
``benchmarks/bench_startup.py``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import repgeom_eval
from repgeom_eval import Consumes, Metric
from repgeom_eval.plugin_system.lazy import is_lazy, lazy, resolve

ROOT = Path(__file__).resolve().parents[1]

HEAVY = ("torch", "transformers", "numpy", "safetensors", "tokenizers", "repgeom_eval.functional",
         "repgeom_eval.measurement", "repgeom_eval.modeling.loading", "repgeom_eval.modeling.addresses")

PROBE = r"""
import contextlib, io, json, sys
args = json.loads(sys.argv[1])
out = io.StringIO()
with contextlib.redirect_stdout(out):
    if args is None:  # what a third-party plugin module does first
        from repgeom_eval import Consumes, LayerBatch, Metric, hookimpl
        class Probe(Metric):
            name = "probe"
            consumes = Consumes.POOLED
        rc = 0
    else:
        from repgeom_eval.entrypoints.cli import main
        try:
            rc = main(args)
        except SystemExit as exc:  # --help exits through argparse
            rc = exc.code
print(json.dumps({"rc": rc, "modules": sorted(sys.modules), "stdout": out.getvalue()}))
"""


def _probe(args: list[str] | None) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def _heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)]


def _commands(modules: list[str]) -> set[str]:
    prefix = "repgeom_eval.entrypoints."
    return {m[len(prefix):] for m in modules if m.startswith(prefix) and m.endswith("_cmd")}


@pytest.mark.parametrize("args, commands", [
    (None, set()),
    (["--help"], set()),
    ([], set()),
    (["plugins"], {"plugins_cmd"}),
    (["plugins", "--json"], {"plugins_cmd"}),
    (["addresses", "--help"], {"addresses_cmd"}),  # the shared options are groups (option_groups), not a command
], ids=["import", "help", "no-command", "plugins", "plugins-json", "addresses-help"])
def test_start_up_paths_import_no_torch(args, commands):
    probe = _probe(args)
    assert probe["rc"] == 0
    assert _heavy(probe["modules"]) == [], f"repgeom {args} imported heavy modules"
    assert _commands(probe["modules"]) == commands


def test_the_cheap_paths_still_say_everything():
    """The help lists every command with its help line; the listing has every item's description and origin."""
    from repgeom_eval.plugin_system.host import get_host

    host = get_host()
    help_text = _probe(["--help"])["stdout"]
    for name in host.commands:
        assert name in help_text
    assert "Measure geometry metrics" in help_text
    rows = json.loads(_probe(["plugins", "--json"])["stdout"])
    assert rows == json.loads(json.dumps(host.listing()))
    metrics = {r["name"]: r for r in rows if r["kind"] == "metric"}
    assert {"dispersion", "prompt_entropy", "infonce", "condensation", "massive_activations"} <= set(metrics)
    assert all(r["description"] and r["distribution"] == "repgeom-eval" and r["version"] for r in metrics.values())
    assert "--model" in _probe(["addresses", "--help"])["stdout"]


def test_builtin_plugins_work_after_a_cheap_import(host):
    """The stand-ins resolve on first use: every built-in metric and aux loss builds and runs as before."""
    import torch

    from repgeom_eval import LayerBatch

    disp = host.metrics.get("dispersion")()
    disp.update(LayerBatch("final", torch.arange(3), pooled=torch.eye(3, dtype=torch.float64)))
    assert disp.compute() == pytest.approx(1.0)
    loss = host.aux_losses.get("push_away")(weight=0.1)
    assert loss(torch.randn(2, 4, 8), torch.ones(2, 4, dtype=torch.bool)) is not None


def test_condensation_defaults_are_declared_once():
    """The metric's, the math's and the command's defaults are the one declaration of repgeom_eval/spec/names.py."""
    import importlib

    from repgeom_eval.spec import names
    from repgeom_eval.spec.options.analyses import CondensationConfig  # the command's defaults (torch-free)

    functional = importlib.import_module("repgeom_eval.functional.condensation")  # the package has a function
    plugin = importlib.import_module("repgeom_eval.plugins.condensation")         # of that name
    declared = (names.CONDENSATION_EPS, names.CONDENSATION_BINS)
    assert (functional.CONDENSATION_EPS, functional.DEFAULT_BINS) == declared
    default = plugin.Condensation()
    assert (default.eps, default.bins) == declared
    command = CondensationConfig()
    assert (command.eps, command.bins) == declared
    for path in [*Path(ROOT, "plugins").glob("*.py"), *Path(ROOT, "repgeom_eval", "functional").glob("*.py")]:
        assert not re.search(r"^(CONDENSATION_EPS|DEFAULT_BINS|\w*VARIANTS|CENTERINGS) = [(\d]",
                             path.read_text(encoding="utf-8"), re.M), f"{path.name} declares a name list again"


def test_a_plugin_metric_subclass_needs_no_torch_until_used():
    class Norm(Metric):
        name = "norm_probe"
        consumes = Consumes.POOLED

        def __init__(self):
            super().__init__()
            import torch

            self.add_state("total", torch.zeros((), dtype=torch.float64), "sum")

    assert Norm().state_dict()["total"].item() == 0.0
    assert set(repgeom_eval.__all__) >= {"Metric", "LayerBatch", "Consumes", "hookimpl", "Command"}
    for name in repgeom_eval.__all__:
        assert getattr(repgeom_eval, name) is not None


# -- the lazy stand-ins ------------------------------------------------------------------------------------------------

def test_lazy_stand_in_imports_on_first_use_and_rebinds_itself():
    namespace: dict = {}
    exec("from repgeom_eval.plugin_system.lazy import lazy\n"
         "json_mod = lazy('json')\n"
         "dumps = lazy('json:dumps')\n"
         "SEP = lazy('os:sep')\n"
         "twice = SEP\n", namespace)
    assert is_lazy(namespace["json_mod"]) and "not imported yet" in repr(namespace["dumps"])
    assert namespace["dumps"]([1]) == "[1]"
    assert namespace["dumps"] is json.dumps  # rebound in the namespace that made it
    assert namespace["json_mod"].loads("2") == 2 and namespace["json_mod"] is json
    import os

    stand_in = namespace["SEP"]
    assert os.sep in stand_in and len(stand_in) == len(os.sep) and f"{stand_in}" == os.sep and stand_in == os.sep
    assert namespace["SEP"] is os.sep and namespace["twice"] is os.sep  # every name that held it
    assert resolve(stand_in) is os.sep and resolve(3) == 3


def test_lazy_stand_in_protocols_and_errors():
    choices = lazy("repgeom_eval.plugin_system.host:PluginHost.KINDS")
    assert "metric" in choices and list(choices)[0] == "metric" and choices[1] == "architecture" and choices
    assert hash(choices) == hash(resolve(choices)) and f"{choices}" == str(resolve(choices))
    error_type = lazy("repgeom_eval.spec.errors:RepgeomError")
    assert isinstance(repgeom_eval.PluginError("x"), error_type) and issubclass(repgeom_eval.PluginError, error_type)
    missing = lazy("repgeom_no_such_module_for_lazy_test")
    with pytest.raises(ModuleNotFoundError):
        missing.anything
    with pytest.raises(ValueError):
        lazy(":name")


# -- a command whose options cannot be added ---------------------------------------------------------------------------

def test_a_command_whose_configure_fails_breaks_only_itself(monkeypatch, capsys):
    from repgeom_eval.entrypoints import cli
    from repgeom_eval.plugin_system import host as host_module
    from repgeom_eval.plugin_system.host import PluginHost
    from repgeom_eval.spec.hookspecs import Command

    def configure(parser):
        raise ImportError("no module named 'heavy_dependency'")

    @repgeom_eval.hookimpl
    def repgeom_register_commands(registry):
        registry.add(Command("broken-cmd", "A command whose options need a missing package.", configure,
                             lambda args: 0))
        registry.add(Command("fine-cmd", "A working command.", lambda p: p.add_argument("--x", type=int),
                             lambda args: args.x))

    import types

    module = types.ModuleType("cmds")
    module.repgeom_register_commands = repgeom_register_commands
    test_host = PluginHost(entry_points=[], strict=False, extra_plugins=[("cmds", module)])
    monkeypatch.setattr(host_module, "get_host", lambda: test_host)

    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "broken-cmd" in out and "A command whose options need a missing package." in out and "fine-cmd" in out
    assert cli.main(["fine-cmd", "--x", "7"]) == 7
    assert cli.main(["broken-cmd"]) == 2
    err = capsys.readouterr().err
    assert err == ("repgeom: error: command 'broken-cmd' from plugin 'cmds' is unavailable: ImportError: no module "
                   "named 'heavy_dependency'\n")
    parser = cli.build_parser(test_host)
    assert "--x" in cli.command_parser(parser, "fine-cmd").format_help()


def test_every_command_help_imports_no_torch():
    """``repgeom COMMAND --help`` for every command: the defaults it prints come from the torch-free configurations
    (repgeom_eval/spec/options/groups.py, repgeom_eval/spec/options/analyses.py)."""
    from repgeom_eval.plugin_system.host import get_host

    probe_all = r"""
import contextlib, io, json, sys
from repgeom_eval.entrypoints.cli import main
from repgeom_eval.plugin_system.host import get_host
heavy = ("torch", "transformers", "numpy")
bad = {}
for name in sorted(get_host().commands):
    if name == "lm-eval":  # prints lm-eval's own help, which imports lm-eval
        continue
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            main([name, "--help"])
        except SystemExit:
            pass
    loaded = [m for m in sys.modules if m.split(".")[0] in heavy]
    if loaded or "usage" not in out.getvalue():
        bad[name] = sorted(loaded)[:3] or "no usage"
print(json.dumps(bad))
"""
    proc = subprocess.run([sys.executable, "-c", probe_all], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {}
    assert len(get_host().commands) >= 15
