"""Errors of the ``repgeom_*`` settings under plain ``lm_eval`` (docs/lmeval.md#errors): one line naming the plugin,
metric, parameter or key, no traceback unless ``REPGEOM_DEBUG=1``; every setting that can be checked without the
model is checked before it loads; one name for pooling (``repgeom_pooling``)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest

import lm_eval  # noqa: F401  (dev extra: missing must fail, not skip)

import _repgeom_lm_eval_hook as hook
import repgeom_eval as rg
from repgeom_eval import Metric
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.lmeval.precheck import check_settings
from repgeom_eval.lmeval.registered import MetricRequest
from repgeom_eval.spec.options.lmeval import Settings

LM_EVAL = str(Path(sys.executable).parent / "lm_eval")


def lm_eval_cli(tmp_path, model_args: str, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "t.yaml").write_text(
        "task: t\noutput_type: loglikelihood\ndoc_to_text: q\ndoc_to_target: a\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'd.jsonl'}\ntest_split: test\n")
    (tmp_path / "d.jsonl").write_text('{"q": "a b", "a": "c"}\n')
    full = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **env)
    full.pop("REPGEOM_LM_EVAL_AUTOLOAD", None)
    if "REPGEOM_DEBUG" not in env:
        full.pop("REPGEOM_DEBUG", None)
    return subprocess.run([LM_EVAL, "--model", "repgeom-hf", "--model_args", model_args, "--tasks", "t",
                           "--include_path", str(tmp_path), "--device", "cpu"],
                          capture_output=True, text=True, env=full, cwd=tmp_path, timeout=300)


def test_plain_lm_eval_says_one_line_before_the_model_loads(tmp_path):
    """The model folder does not exist: had it been loaded first, the error would be transformers' own."""
    proc = lm_eval_cli(tmp_path, "pretrained=/nonexistent/model,repgeom_metrics=dispersoin")
    assert proc.returncode == 2
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "repgeom" in line and "INFO" not in line]
    assert lines == [lines[0]] and lines[0].startswith("repgeom: error: unknown metric 'dispersoin'"), lines
    assert "Traceback" not in proc.stderr and "--debug" not in proc.stderr
    debug = lm_eval_cli(tmp_path, "pretrained=/nonexistent/model,repgeom_metrics=dispersoin", REPGEOM_DEBUG="1")
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "UnknownNameError" in debug.stderr


@pytest.mark.parametrize("given,match", [
    ({"repgeom_metrics": "dispersoin"}, "unknown metric 'dispersoin'"),
    ({"repgeom_metrics": "dispersion", "repgeom_metric_params": {"dispersion": {"alpha": 2}}},
     r"metric 'dispersion' has no parameter\(s\) \['alpha'\]"),
    ({"repgeom_metrics": "dataset_entropy", "repgeom_metric_params": {"dataset_entropy": {"alpha": "x"}}},
     "dataset_entropy.*alpha"),
    ({"repgeom_metrics": "dispersion", "repgeom_pooling": "maxx"}, "repgeom_pooling: unknown pooling 'maxx'"),
    ({"repgeom_metrics": "dispersion", "repgeom_pooling": {"vendi": "mean"}},
     "repgeom_pooling sets the pooling of metric 'vendi'"),
    ({"repgeom_metrics": "dispersion", "repgeom_layers": "resid_pst:1"}, "repgeom_layers: unknown layer-address site"),
    ({"repgeom_metrics": "dispersion", "repgeom_layers": "resid_post:x"}, "not an integer"),
    ({"repgeom_layer": "bogus"}, "repgeom_layer: unknown layer address 'bogus'"),
    ({"repgeom_capture": "twice"}, "repgeom_capture must be fused or extra"),
    ({"repgeom_metrcs": "dispersion"}, "unknown metadata key 'repgeom_metrcs'"),
])
def test_every_setting_is_checked_without_the_model(given, match):
    with pytest.raises(RepgeomError, match=match):
        check_settings(given)


def test_selectors_and_stars_pass_the_check_without_the_model():
    check_settings({"repgeom_metrics": "dispersion", "repgeom_layers": ["all", "resid_post:*", "mlp_in:[0,-1]"]})


def test_repgeom_hf_checks_before_loading(tmp_path):
    from repgeom_eval.lmeval.model import RepgeomHFLM

    with pytest.raises(RepgeomError, match="unknown metric 'nosuch'"):
        RepgeomHFLM.create_from_arg_string(f"pretrained={tmp_path / 'missing'},repgeom_metrics=nosuch",
                                           {"device": "cpu"})


def test_a_switched_off_plugin_is_named_without_repgeom_cli_advice(monkeypatch):
    monkeypatch.setenv("REPGEOM_DISABLE_PLUGINS", "dispersion")
    with pytest.raises(RepgeomError) as info:
        check_settings({"repgeom_metrics": "dispersion"})
    line = hook.one_line(hook.repgeom_error(info.value))
    assert "plugin 'dispersion'" in line and "switched off (REPGEOM_DISABLE_PLUGINS)" in line
    assert "-p no:" not in line and "\n" not in line


class Boom(Metric):
    """A third party's metric that fails on its first batch."""

    name = "boom"

    def update(self, batch):
        return 1 / 0

    def compute(self):
        return 0.0


def test_a_failing_plugin_ends_lm_eval_in_one_line_naming_it(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from repgeom_eval.lmeval.model import RepgeomHFLM
    from repgeom_eval.plugin_system import host as host_module

    @rg.hookimpl
    def repgeom_register_metrics(registry):
        registry.add(Boom)

    module = types.ModuleType("boomplugin")
    module.repgeom_register_metrics = repgeom_register_metrics
    monkeypatch.setattr(host_module, "_HOST", host_module.PluginHost(extra_plugins=[("boomplugin", module)]))
    monkeypatch.setattr(host_module, "_HOST_SETTINGS", (host_module.disabled_from_env(),
                                                        host_module._strict_from_env()))
    (tmp_path / "t.yaml").write_text(
        "task: t\noutput_type: loglikelihood\ndoc_to_text: q\ndoc_to_target: a\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'd.jsonl'}\ntest_split: test\n")
    (tmp_path / "d.jsonl").write_text('{"q": "a b", "a": "c"}\n')
    lm = RepgeomHFLM(pretrained=tiny_model_dir("llama"), batch_size=2, device="cpu", repgeom_metrics="boom")

    class HarnessCLI:
        def execute(self):
            simple_evaluate(model=lm, tasks=["t"], bootstrap_iters=0,
                            task_manager=TaskManager(include_defaults=False, include_path=str(tmp_path)))

    fake = types.SimpleNamespace(HarnessCLI=HarnessCLI)
    hook.patch_cli(fake)
    monkeypatch.delenv("REPGEOM_DEBUG", raising=False)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        HarnessCLI().execute()
    assert info.value.code == 2
    captured = capsys.readouterr().err
    assert "Traceback" not in captured
    err = [line for line in captured.splitlines() if "repgeom" in line]
    assert len(err) == 1 and err[0].startswith("repgeom: error: ") and "boomplugin" in err[0], err
    assert "metric 'boom'" in err[0] and "--debug" not in err[0] and "REPGEOM_DEBUG=1" in err[0]
    with capsys.disabled():
        print("\n" + err[0])
    monkeypatch.setenv("REPGEOM_DEBUG", "1")
    with pytest.raises(rg.PluginError):
        HarnessCLI().execute()


def test_one_name_for_pooling():
    """``repgeom_pooling``: one name sets every POOLED metric (as ``repgeom measure --pooling``), a mapping sets
    single metrics; ``repgeom_metric_params.METRIC.pooling`` still works, with a DeprecationWarning."""
    one = MetricRequest.from_settings(Settings.from_metadata(
        {"repgeom_metrics": ["dispersion", "dataset_entropy"], "repgeom_pooling": "first"}, "any"))
    configs = {s.name: s.pooling for s in one.specs()}
    assert configs == {"dispersion": "first", "dataset_entropy": "first"}
    mapping = MetricRequest.from_settings(Settings.from_metadata(
        {"repgeom_metrics": ["dispersion", "dataset_entropy"], "repgeom_pooling": {"dispersion": "mean"}}, "any"))
    assert {s.name: s.pooling for s in mapping.specs()} == {"dispersion": "mean", "dataset_entropy": "mean"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = MetricRequest.from_settings(Settings.from_metadata(
            {"repgeom_metrics": ["dispersion"], "repgeom_metric_params": {"dispersion": {"pooling": "mean"}}}, "any"))
    assert [w.category for w in caught] == [DeprecationWarning] and "repgeom_pooling" in str(caught[0].message)
    assert {s.name: s.pooling for s in old.specs()} == {"dispersion": "mean"}
    with pytest.raises(RepgeomError, match="give it once, in repgeom_pooling"), pytest.warns(DeprecationWarning):
        MetricRequest.from_settings(Settings.from_metadata(
            {"repgeom_metrics": ["dispersion"], "repgeom_pooling": {"dispersion": "last"},
             "repgeom_metric_params": {"dispersion": {"pooling": "mean"}}}, "any"))
    # a hardness task's own geometry reads last or mean; a mapping leaves it at last
    assert Settings.from_metadata({"repgeom_pooling": {"dispersion": "mean"}}, "hardness").read_pooling(
        "hardness") == "last"
