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
from repgeom_eval.spec.errors import PluginError, UnknownNameError
from repgeom_eval.plugin_system.host import PluginHost, PluginLoadWarning, disabled_from_env


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


# -- strict mode, switching plugins off, unavailable names, provenance (issue 14) ------------------------------------

def test_strict_mode_lists_every_failed_plugin():
    broken = md.EntryPoint("broken", "repgeom_no_such_module_xyz", "repgeom_eval")
    also = md.EntryPoint("also_broken", "repgeom_no_such_module_abc", "repgeom_eval")
    typo = plugin_module("typo", repgeom_register_metric=registers(Extra))
    with pytest.raises(PluginError) as info:
        PluginHost(entry_points=[broken, also], strict=True, extra_plugins=[("typo", typo)])
    message = str(info.value)
    assert message.startswith("3 repgeom-eval plugins failed to load: (1) plugin 'also_broken' failed at import")
    assert "(2) plugin 'broken' failed at import: ModuleNotFoundError" in message
    assert "(3) plugin 'typo' failed at validate: unknown hook 'repgeom_register_metric'" in message
    assert message.endswith("[REPGEOM_STRICT_PLUGINS is set]") and "\n" not in message
    assert isinstance(info.value.__cause__, ModuleNotFoundError)  # --debug shows the first one's traceback


def test_a_plugin_can_be_switched_off_without_importing_it(monkeypatch):
    eps = list(md.entry_points(group="repgeom_eval"))
    never = md.EntryPoint("never", "repgeom_no_such_module_xyz", "repgeom_eval")  # would fail if imported
    host = PluginHost(entry_points=[*eps, never], strict=True, disable=["never", "views"],
                      extra_plugins=[("extra", plugin_module("extra", repgeom_register_metrics=registers(Extra)))])
    assert not host.failures and {p.name for p in host.disabled} == {"never", "views"}
    assert "dispersion" in host.metrics and "extra_metric" in host.metrics
    assert not {"infonce", "lidar", "dime"} & set(host.metrics.names())
    rows = [r for r in host.listing() if r["kind"] == "plugin"]
    assert {r["name"] for r in rows} == {"never", "views"} and all(r["disabled"] and "error" not in r for r in rows)
    views = next(r for r in rows if r["name"] == "views")
    assert (views["distribution"], views["version"]) == ("repgeom-eval", repgeom_eval.__version__)
    # extra (in-process) plugins too
    off = PluginHost(entry_points=[], disable=["extra"],
                     extra_plugins=[("extra", plugin_module("extra", repgeom_register_metrics=registers(Extra)))])
    assert "extra_metric" not in off.metrics and [p.name for p in off.disabled] == ["extra"]
    # REPGEOM_DISABLE_PLUGINS: commas or spaces; get_host() follows a change of the variable
    monkeypatch.setenv("REPGEOM_DISABLE_PLUGINS", "views, condensation")
    assert disabled_from_env() == ("views", "condensation")
    assert "infonce" not in repgeom_eval.get_host().metrics and "condensation" not in repgeom_eval.get_host().metrics
    monkeypatch.delenv("REPGEOM_DISABLE_PLUGINS")
    assert "infonce" in repgeom_eval.get_host().metrics


def test_switching_off_an_unknown_plugin_warns():
    with pytest.warns(PluginLoadWarning, match="names no installed plugin: 'nope'"):
        PluginHost(entry_points=[], disable=["nope"])


def test_a_name_whose_plugin_failed_or_is_off_is_reported_as_unavailable():
    from repgeom_eval.spec.errors import PluginUnavailableError

    eps = list(md.entry_points(group="repgeom_eval"))
    broken = md.EntryPoint("broken", "repgeom_no_such_module_xyz", "repgeom_eval")
    with pytest.warns(PluginLoadWarning):
        host = PluginHost(entry_points=[*eps, broken], strict=False)
    with pytest.raises(PluginUnavailableError, match=r"^metric 'mean_norm' is not registered, and a plugin that may "
                       r"provide it is not loaded: plugin 'broken' failed at import: ModuleNotFoundError"):
        host.metrics.get("mean_norm")
    # a near miss of a registered name is still reported as a typo, the failed plugin as a hint
    with pytest.raises(UnknownNameError, match="did you mean 'dispersion'.*perhaps providing it: plugin 'broken'"):
        host.metrics.get("dispersoin")

    # a hook that failed after adding the name: that plugin is named for sure
    @repgeom_eval.hookimpl
    def repgeom_register_metrics(registry):
        registry.add(Extra)
        raise RuntimeError("boom")

    with pytest.warns(PluginLoadWarning):
        host = PluginHost(entry_points=[], strict=False,
                          extra_plugins=[("bad", plugin_module("bad", repgeom_register_metrics=repgeom_register_metrics))])
    with pytest.raises(PluginUnavailableError, match=r"^metric 'extra_metric' is unavailable: plugin 'bad' failed at "
                       r"repgeom_register_metrics: RuntimeError: boom"):
        host.metrics.get("extra_metric")

    # a built-in switched off: named even though the name is close to a registered one
    host = PluginHost(entry_points=eps, disable=["dispersion"])
    with pytest.raises(PluginUnavailableError, match="'dispersion' .*is switched off .*-p no:dispersion"):
        host.metrics.get("dispersion")
    # nothing failed and nothing is off: the plain unknown-name error
    with pytest.raises(UnknownNameError, match="^unknown metric 'mean_nrom'"):
        PluginHost(entry_points=eps).metrics.get("mean_nrom")


def test_provenance_names_plugin_distribution_and_version(host):
    assert host.provenance("metric", ["dispersion", "token_dispersion"]) == {
        name: {"plugin": "dispersion", "distribution": "repgeom-eval", "version": repgeom_eval.__version__}
        for name in ("dispersion", "token_dispersion")}
    assert host.provenance("architecture", ["gpt2"])["gpt2"]["plugin"] == "architectures"
    assert host.provenance("token_set", ["digits"])["digits"]["distribution"] == "repgeom-eval"
    module = plugin_module("versioned", repgeom_register_metrics=registers(Extra))
    module.__version__ = "2.1"
    h = PluginHost(entry_points=[], extra_plugins=[("versioned", module)])
    assert h.provenance("metric", ["extra_metric"]) == {
        "extra_metric": {"plugin": "versioned", "distribution": None, "version": "2.1"}}
    assert h.plugin_versions() == {"versioned": {"distribution": None, "version": "2.1"}}
    with pytest.raises(UnknownNameError, match="unknown plugin kind 'metrics'.*did you mean 'metric'"):
        h.provenance("metrics", ["extra_metric"])
    with pytest.raises(UnknownNameError, match="unknown metric 'nope'"):
        h.provenance("metric", ["nope"])
    assert all(row["version"] == repgeom_eval.__version__ for row in host.listing())


def test_aux_losses_must_be_auxloss_subclasses():
    from repgeom_eval.plugins.aux_losses import PushAway
    from repgeom_eval.training.auxloss import build_aux_loss

    def my_loss(hidden, mask=None, domains=None, weight=0.1):  # what "a callable" used to invite
        return hidden.pow(2).mean()

    @repgeom_eval.hookimpl
    def repgeom_register_aux_losses(registry):
        registry.add(my_loss, name="my_loss")

    with pytest.warns(PluginLoadWarning, match="expected a subclass of repgeom_eval.AuxLoss.*"
                      "register the class, not a loss function"):
        host = PluginHost(entry_points=[], strict=False, extra_plugins=[
            ("fn", plugin_module("fn", repgeom_register_aux_losses=repgeom_register_aux_losses))])
    assert "my_loss" not in host.aux_losses

    class Pull(PushAway):
        """Pull, for the test."""

        name = "pull"
        sign = 1.0

    @repgeom_eval.hookimpl
    def register_class(registry):
        registry.add(Pull)

    host = PluginHost(entry_points=[], strict=True,
                      extra_plugins=[("cls", plugin_module("cls", repgeom_register_aux_losses=register_class))])
    loss = build_aux_loss({"name": "pull", "weight": 0.5}, host)
    assert isinstance(loss, Pull) and loss.weight == 0.5


def test_cli_switches_plugins_off_with_p_no(monkeypatch, capsys):
    from repgeom_eval.entrypoints.cli import disabled_by_flags, main

    assert disabled_by_flags(["-p", "no:a", "--debug", "-pno:b", "measure", "-p", "no:c"]) == ["a", "b"]
    monkeypatch.setenv("REPGEOM_DISABLE_PLUGINS", "views")
    assert main(["-p", "no:condensation", "plugins", "--json", "--kind", "plugin"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["name"] for r in rows) == ["condensation", "views"] and all(r["disabled"] for r in rows)
    assert os.environ["REPGEOM_DISABLE_PLUGINS"] == "views"  # restored after the command
    assert main(["-p", "condensation", "plugins"]) == 2
    err = capsys.readouterr().err
    assert err == ("repgeom: error: -p condensation: expected no:NAME (switch plugin NAME off), got "
                   "'condensation'\n")
    assert main(["-p", "no:commands"]) == 2  # every built-in command is off: say so, and how to get them back
    assert "drop -p no:commands" in capsys.readouterr().err


def test_the_version_recorded_is_the_code_that_runs_and_compatible_releases_keep_saved_runs():
    """A stale .dist-info (pip install --target --upgrade) is caught by the code's own __version__; a release that
    declares repgeom_compatible_with is keyed, for resuming, by the release it keeps the states and numbers of."""
    import types

    import repgeom_eval
    from repgeom_eval.plugin_system.host import PluginHost, PluginLoadWarning

    module = types.ModuleType("fixed_metric_plugin")
    module.__version__ = "0.1.1"
    module.repgeom_compatible_with = "0.1.0"

    class Fixed(repgeom_eval.Metric):
        name = "fixed_metric"

        def update(self, batch):
            pass

        def compute(self):
            return 0.0

    @repgeom_eval.hookimpl
    def repgeom_register_metrics(registry):
        registry.add(Fixed)

    module.repgeom_register_metrics = repgeom_register_metrics
    host = PluginHost(entry_points=[], extra_plugins=[("fixed", module)])
    assert host.provenance("metric", ["fixed_metric"])["fixed_metric"]["version"] == "0.1.1"
    assert host.state_identity("metric", ["fixed_metric"])["fixed_metric"]["version"] == "0.1.0"
    with pytest.warns(PluginLoadWarning, match=r"code says version 0\.1\.1 but the installed metadata says 0\.1\.0"):
        assert host._code_version("fixed", module, "0.1.0") == "0.1.1"
