"""The plugin core: entry-point loading, failure isolation, strict mode, duplicates, unknown hooks, listing."""

import importlib.metadata as md
import json
import os
import subprocess
import sys
import types

import pytest

import repgeom_eval
from repgeom_eval import Consumes, Metric
from repgeom_eval.errors import PluginError, UnknownNameError
from repgeom_eval.plugin_system.host import PluginHost, PluginLoadWarning


class Extra(Metric):
    name = "extra_metric"
    consumes = Consumes.POOLED

    def update(self, batch):
        pass

    def compute(self):
        return 1.0


def plugin_module(name, **hooks):
    mod = types.ModuleType(name)
    for hook_name, fn in hooks.items():
        setattr(mod, hook_name, fn)
    return mod


def registers(*objs, name=None):
    @repgeom_eval.hookimpl
    def repgeom_register_metrics(registry):
        for obj in objs:
            registry.add(obj, name=name)

    return repgeom_register_metrics


def test_builtins_come_through_the_entry_points(host):
    entry = host.metrics.entry("dispersion")
    assert entry.plugin == "dispersion" and entry.distribution == "repgeom-eval"
    assert {"architectures", "layer_selectors", "dispersion", "commands"} <= {p.name for p in host.plugins}
    assert {"gpt2", "llama", "bert", "qwen2", "qwen3", "gpt_neox", "roberta"} <= set(host.architectures.names())
    assert {"measure", "plugins", "demo", "addresses", "gap"} <= set(host.commands.names())
    assert {"digits", "python_keywords", "general"} <= set(host.token_sets.names())
    assert not host.failures
    # nothing is registered behind the entry points' back
    empty = PluginHost(entry_points=[], strict=False)
    assert len(empty.metrics) == 0 and len(empty.architectures) == 0


def test_a_plugin_that_fails_to_import_is_reported_and_the_rest_keep_working():
    eps = list(md.entry_points(group="repgeom_eval"))
    broken = md.EntryPoint("broken", "repgeom_no_such_module_xyz", "repgeom_eval")
    with pytest.warns(PluginLoadWarning, match="broken.*ModuleNotFoundError"):
        host = PluginHost(entry_points=eps + [broken], strict=False)
    assert [f.plugin for f in host.failures] == ["broken"]
    assert host.failures[0].stage == "import"
    assert "dispersion" in host.metrics
    row = next(r for r in host.listing() if r["kind"] == "plugin")
    assert row["name"] == "broken" and "ModuleNotFoundError" in row["error"]


def test_strict_mode_makes_failures_fatal(monkeypatch):
    broken = md.EntryPoint("broken", "repgeom_no_such_module_xyz", "repgeom_eval")
    with pytest.raises(PluginError, match="broken"):
        PluginHost(entry_points=[broken], strict=True)
    monkeypatch.setenv("REPGEOM_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="REPGEOM_STRICT_PLUGINS"):
        PluginHost(entry_points=[broken])


def test_duplicate_names_are_an_error_naming_both_plugins():
    first = plugin_module("first", repgeom_register_metrics=registers(Extra))
    second = plugin_module("second", repgeom_register_metrics=registers(Extra))
    with pytest.warns(PluginLoadWarning) as record:
        host = PluginHost(entry_points=[], strict=False, extra_plugins=[("first", first), ("second", second)])
    message = str(record[0].message)
    assert "duplicate metric name 'extra_metric'" in message and "'first'" in message and "'second'" in message
    assert host.metrics.entry("extra_metric").plugin == "first"
    with pytest.raises(PluginError, match="duplicate"):
        PluginHost(entry_points=[], strict=True, extra_plugins=[("first", first), ("second", second)])


def test_a_third_party_cannot_shadow_a_builtin(host):
    eps = list(md.entry_points(group="repgeom_eval"))
    shadow = plugin_module("shadow", repgeom_register_metrics=registers(Extra, name="dispersion"))
    with pytest.warns(PluginLoadWarning, match="duplicate metric name 'dispersion'.*'dispersion'.*'shadow'"):
        h = PluginHost(entry_points=eps, strict=False, extra_plugins=[("shadow", shadow)])
    assert h.metrics.entry("dispersion").plugin == "dispersion"


def test_unknown_and_undecorated_hooks_are_caught():
    @repgeom_eval.hookimpl
    def repgeom_register_metric(registry):  # typo: missing "s"
        pass

    typo = plugin_module("typo", repgeom_register_metric=repgeom_register_metric)

    def repgeom_register_metrics(registry):  # forgot @hookimpl
        registry.add(Extra)

    undecorated = plugin_module("undecorated", repgeom_register_metrics=repgeom_register_metrics)
    with pytest.warns(PluginLoadWarning):
        host = PluginHost(entry_points=[], strict=False, extra_plugins=[("typo", typo), ("undecorated", undecorated)])
    errors = {f.plugin: f.error for f in host.failures}
    assert "unknown hook 'repgeom_register_metric'" in errors["typo"]
    assert "did you mean 'repgeom_register_metrics'" in errors["typo"]
    assert "not decorated" in errors["undecorated"]


def test_a_hook_that_raises_disables_only_its_plugin():
    @repgeom_eval.hookimpl
    def repgeom_register_metrics(registry):
        registry.add(Extra)
        raise RuntimeError("boom")

    bad = plugin_module("bad", repgeom_register_metrics=repgeom_register_metrics)
    good = plugin_module("good", repgeom_register_metrics=registers(Extra, name="good_metric"))
    with pytest.warns(PluginLoadWarning, match="bad.*repgeom_register_metrics.*boom"):
        host = PluginHost(entry_points=[], strict=False, extra_plugins=[("bad", bad), ("good", good)])
    assert host.metrics.names() == ["good_metric"]  # the failed hook's staged items were not committed


def test_wrong_kind_of_object_is_refused():
    bad = plugin_module("bad", repgeom_register_metrics=registers(object(), name="not_a_metric"))
    with pytest.warns(PluginLoadWarning, match="expected a subclass of repgeom_eval.Metric"):
        host = PluginHost(entry_points=[], strict=False, extra_plugins=[("bad", bad)])
    assert "not_a_metric" not in host.metrics


def test_lazy_registration_imports_on_use():
    lazy = plugin_module("lazy", repgeom_register_metrics=registers("repgeom_eval.plugins.dispersion:Dispersion",
                                                                    name="lazy_dispersion"))
    missing = plugin_module("missing", repgeom_register_metrics=registers("repgeom_nope:Thing", name="ghost"))
    host = PluginHost(entry_points=[], strict=False, extra_plugins=[("lazy", lazy), ("missing", missing)])
    from repgeom_eval.plugins.dispersion import Dispersion

    assert host.metrics.get("lazy_dispersion") is Dispersion
    with pytest.raises(PluginError, match="ghost.*missing.*could not be imported"):
        host.metrics.get("ghost")


def test_unknown_metric_suggests_the_closest_name(host):
    with pytest.raises(UnknownNameError, match="did you mean 'dispersion'"):
        host.metrics.get("dispersoin")


@pytest.fixture
def broken_dist(tmp_path):
    """A real installed distribution (dist-info on sys.path) whose plugin module does not exist."""
    info = tmp_path / "broken_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[repgeom_eval]\nbroken = broken_plugin_module_that_is_missing\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    env.pop("REPGEOM_STRICT_PLUGINS", None)
    return env


def test_cli_lists_plugins_as_json_with_failures(broken_dist):
    proc = subprocess.run([sys.executable, "-m", "repgeom_eval", "plugins", "--json"], env=broken_dist,
                          capture_output=True, text=True, check=True)
    rows = json.loads(proc.stdout)
    assert all({"name", "kind", "plugin"} <= set(r) for r in rows)
    disp = next(r for r in rows if r["name"] == "dispersion")
    assert disp["kind"] == "metric" and disp["plugin"] == "dispersion" and disp["distribution"] == "repgeom-eval"
    broken = next(r for r in rows if r["kind"] == "plugin")
    assert broken["name"] == "broken" and broken["distribution"] == "broken-plugin"
    assert "ModuleNotFoundError" in broken["error"]
    assert "warning: repgeom-eval plugin 'broken'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_strict_mode_exits_non_zero(broken_dist):
    env = dict(broken_dist, REPGEOM_STRICT_PLUGINS="1")
    proc = subprocess.run([sys.executable, "-m", "repgeom_eval", "plugins"], env=env, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "broken" in proc.stderr and "Traceback" not in proc.stderr
