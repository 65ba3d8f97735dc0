"""Third-party metrics inside a run (issue 14, plugin authors' gaps): per-text scores keyed by metric and averaged per
text, exceptions that name the plugin in one line, ParameterError, provenance in every output and in the resume key,
and the config() check of ``check_metric``."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
import types

import pytest
import torch

import repgeom_eval as rg
from repgeom_eval import Consumes, LayerBatch, Metric, ParameterError
from repgeom_eval.spec.errors import PluginError, RepgeomError
from repgeom_eval.measurement.engine import measure
from repgeom_eval.plugin_system.host import PluginHost
from repgeom_eval.testing import check_metric


class Coordinate(Metric):
    """Per text: the first coordinate of its pooled vector (with tokens pooling, one per token)."""

    name = "coord"
    consumes = Consumes.POOLED

    def __init__(self, per_text: bool = False, score: str = "dispersion"):
        super().__init__()
        self.per_text, self.score = per_text, score
        self.add_state("values", [], "cat")
        self.add_state("index", [], "cat")

    def update(self, batch: LayerBatch) -> None:
        self.values.append(batch.pooled[:, 0].double())
        self.index.append(batch.index.double())

    def compute(self) -> float:
        return float(torch.cat(self.values).mean()) if self.values else float("nan")

    def per_text_results(self):
        if not self.per_text or not self.values:
            return None
        return {self.score: (torch.cat(self.index).long(), torch.cat(self.values))}


class Boom(Metric):
    """Fails on its first batch."""

    name = "boom"

    def update(self, batch):
        return 1 / 0

    def compute(self):
        return 0.0


class Picky(Metric):
    """Rejects a bad threshold."""

    name = "picky"

    def __init__(self, threshold: float = 1.0):
        super().__init__()
        if not isinstance(threshold, (int, float)) or threshold <= 0:
            raise ParameterError("threshold", threshold, "a number > 0")
        self.threshold = threshold

    def update(self, batch):
        pass

    def compute(self):
        return self.threshold


def plugin_host(*classes, name="third", version=None, **kwargs) -> PluginHost:
    """The installed plugins plus one in-process plugin registering ``classes`` (as ``(cls, name)`` or ``cls``)."""

    @rg.hookimpl
    def repgeom_register_metrics(registry):
        for item in classes:
            cls, as_name = item if isinstance(item, tuple) else (item, None)
            registry.add(cls, name=as_name)

    module = types.ModuleType(name)
    module.repgeom_register_metrics = repgeom_register_metrics
    if version:
        module.__version__ = version
    return PluginHost(extra_plugins=[(name, module)], **kwargs)


# -- per-text scores -------------------------------------------------------------------------------------------------

def test_a_plugin_score_named_like_a_builtin_does_not_replace_it(tiny_model_dir, texts):
    host = plugin_host(Coordinate)
    both = measure(tiny_model_dir("gpt2"), texts[:6], metrics=["dispersion", "coord"], per_text=True, host=host,
                   progress=False)
    alone = measure(tiny_model_dir("gpt2"), texts[:6], metrics=["dispersion"], per_text=True, progress=False)
    for row, ref in zip(both.per_text, alone.per_text):
        scores = row["scores"]["final"]
        assert set(scores) == {"dispersion", "coord.dispersion"}
        assert scores["dispersion"] == ref["scores"]["final"]["dispersion"]  # c_i, untouched


def test_builtin_per_text_keys_are_unchanged(tiny_model_dir, texts):
    names = ["dispersion", "token_dispersion", "prompt_entropy", "curvature", "condensation"]
    result = measure(tiny_model_dir("gpt2"), texts[:5], metrics=names, per_text=True, progress=False)
    assert set(result.per_text[0]["scores"]["final"]) == {
        "dispersion", "token_dispersion", "prompt_entropy", "prompt_entropy_normalized", "curvature", "condensation"}


def test_with_tokens_pooling_a_text_gets_the_mean_over_its_tokens(tiny_model_dir, texts):
    # the first coordinate is linear, so the mean over a text's tokens is the first coordinate of its mean pooling
    host = plugin_host(Coordinate)
    model = tiny_model_dir("llama")
    kw = dict(metrics=["coord"], metric_params={"coord": {"score": "x0"}}, per_text=True, host=host, progress=False)
    tokens = measure(model, texts[:7], pooling="tokens", batch_size=3, **kw)
    mean = measure(model, texts[:7], pooling="mean", batch_size=3, **kw)
    assert len(tokens.per_text) == 7
    for a, b in zip(tokens.per_text, mean.per_text):
        assert a["index"] == b["index"]
        assert a["scores"]["final"]["coord.x0"] == pytest.approx(b["scores"]["final"]["coord.x0"], abs=1e-9)


def test_two_metrics_claiming_one_name_keep_both(tiny_model_dir, texts):
    # metric "coord" with a score "coord_x" next to a metric named "coord_x" whose own score is "coord_x"
    host = plugin_host(Coordinate, (Coordinate, "coord_x"))
    result = measure(tiny_model_dir("gpt2"), texts[:4], metrics=["coord", "coord_x"], per_text=True, host=host,
                     metric_params={"coord": {"score": "coord_x"}, "coord_x": {"score": "coord_x"}}, progress=False)
    assert set(result.per_text[0]["scores"]["final"]) == {"coord.coord_x", "coord_x"}


def test_the_metric_bank_keys_per_text_scores_as_measure_does(tiny_model_dir, texts):
    from repgeom_eval.measurement.bank import MetricBank
    from repgeom_eval.measurement.forward import Forward
    from repgeom_eval.modeling.addresses import resolve_request
    from repgeom_eval.modeling.loading import load_model

    host = plugin_host(Coordinate)
    model = load_model(tiny_model_dir("gpt2"), host=host)
    want = measure(model, texts[:5], metrics=["dispersion", "coord"], pooling="tokens", per_text=True, host=host,
                   progress=False)
    plan = resolve_request("final", model, host)
    bank = MetricBank(["dispersion", "coord"], plan.addresses, pooling="tokens", per_text=True, host=host)
    with Forward(model, plan.points) as fwd:
        batch = fwd.texts(texts[:5], 128)
        bank.update(plan.addresses[0], batch.hidden[plan.addresses[0]], batch.mask, range(5))
    got = bank.per_text_scores()
    for row in want.per_text:
        for key, value in row["scores"]["final"].items():
            assert got[row["index"]]["final"][key] == pytest.approx(value, abs=1e-9), key


# -- errors ------------------------------------------------------------------------------------------------------------

def test_an_exception_inside_a_plugin_is_one_line_naming_it(tiny_model_dir, texts):
    host = plugin_host(Boom, name="boomer", version="0.2.0")
    with pytest.raises(PluginError) as info:
        measure(tiny_model_dir("gpt2"), texts[:4], metrics=["boom"], host=host, progress=False)
    assert str(info.value) == ("metric 'boom' of plugin 'boomer' (version 0.2.0) raised in update at final: "
                               "ZeroDivisionError: division by zero (repgeom --debug shows the traceback)")
    assert isinstance(info.value.__cause__, ZeroDivisionError)


class BoomAtFinal(Metric):
    """Per text, the first coordinate (kept per text), until it reaches the address ``final``: there it raises."""

    name = "boom_at_final"
    consumes = Consumes.POOLED

    def __init__(self, per_text: bool = False):
        super().__init__()
        self.per_text = per_text
        self.add_state("total", torch.zeros((), dtype=torch.float64), "sum", shape=())

    def update(self, batch):
        if batch.address == "final":
            raise ZeroDivisionError("division by zero")
        self.total = self.total + batch.pooled[:, 0].double().sum()

    def compute(self):
        return float(self.total)


class LendingBoom(Metric):
    """Owns the pooled Gram that effective_rank reads at the same pooling, and raises after feeding it."""

    name = "lending_boom"
    consumes = Consumes.POOLED

    def statistics(self):
        from repgeom_eval.spec.statistics import PooledGram

        return {"gram": PooledGram()}

    def update(self, batch):
        super().update(batch)
        raise ZeroDivisionError("division by zero")

    def compute(self):
        return 0.0


def test_a_plugin_metric_that_raises_is_left_out_and_the_others_run_on(tiny_model_dir, texts, monkeypatch):
    # docs/plugins.md#when-something-goes-wrong: the run drops the metric (said once, as a warning), leaves it out of
    # every address's results, and reports the others exactly as a run without it
    monkeypatch.delenv("REPGEOM_DEBUG", raising=False)
    host = plugin_host(BoomAtFinal, name="boomer", version="0.2.0")
    model = tiny_model_dir("gpt2")
    with pytest.warns(UserWarning, match="metric 'boom_at_final' of plugin 'boomer' .* raised in update at final: "
                                         "ZeroDivisionError: division by zero; the run goes on without it"):
        got = measure(model, texts[:8], layers="all", metrics=["boom_at_final", "dispersion", "effective_rank"],
                      per_text=True, host=host, progress=False, batch_size=4)
    alone = measure(model, texts[:8], layers="all", metrics=["dispersion", "effective_rank"], per_text=True,
                    progress=False, batch_size=4)
    assert set(got.failed_metrics) == {"boom_at_final"}
    assert got.to_dict()["failed_metrics"]["boom_at_final"].endswith("ZeroDivisionError: division by zero")
    assert got.results == alone.results and got.per_text == alone.per_text  # not at embed either
    assert all("boom_at_final" not in d for d in got.diagnostics.values())
    # alone, the failing metric still ends the run (nothing else to report); REPGEOM_DEBUG stops at it too
    with pytest.raises(PluginError, match="raised in update at final"):
        measure(model, texts[:8], layers="all", metrics=["boom_at_final"], host=host, progress=False)
    monkeypatch.setenv("REPGEOM_DEBUG", "1")
    with pytest.raises(PluginError, match="raised in update at final"):
        measure(model, texts[:8], layers="all", metrics=["boom_at_final", "dispersion"], host=host, progress=False)


class ComputeBoomAtFinal(BoomAtFinal):
    """Updates everywhere; its compute raises at the last address only (after the others have their values)."""

    name = "compute_boom"

    def update(self, batch):
        self.address = batch.address
        self.total = self.total + batch.pooled[:, 0].double().sum()

    def compute(self):
        if getattr(self, "address", None) == "final":
            raise ValueError("no value here")
        return float(self.total)


def test_a_metric_failing_in_compute_at_one_address_is_left_out_at_all(tiny_model_dir, texts, monkeypatch):
    monkeypatch.delenv("REPGEOM_DEBUG", raising=False)
    host = plugin_host(ComputeBoomAtFinal, name="late")
    with pytest.warns(UserWarning, match="metric 'compute_boom' .* raised in compute at final: ValueError"):
        got = measure(tiny_model_dir("gpt2"), texts[:6], layers="all", metrics=["compute_boom", "dispersion"],
                      host=host, progress=False)
    assert set(got.failed_metrics) == {"compute_boom"}
    assert all(set(r) == {"dispersion"} for r in got.results.values()) and "compute_boom" not in got.summary


def test_a_plugin_metric_another_reads_a_statistic_from_still_ends_the_run(tiny_model_dir, texts, monkeypatch):
    # effective_rank reads lending_boom's Gram: going on without the owner would leave it half-fed
    monkeypatch.delenv("REPGEOM_DEBUG", raising=False)
    host = plugin_host(LendingBoom, name="lender")
    with pytest.raises(PluginError, match="metric 'lending_boom' .* raised in update"):
        measure(tiny_model_dir("gpt2"), texts[:8], metrics=["lending_boom", "effective_rank"], pooling="mean",
                host=host, progress=False)


def test_a_dropped_metric_stays_dropped_after_a_resume(tiny_model_dir, texts, tmp_path, monkeypatch):
    monkeypatch.delenv("REPGEOM_DEBUG", raising=False)
    host = plugin_host(BoomAtFinal, name="boomer")
    options = dict(layers="all", metrics=["boom_at_final", "dispersion"], host=host, progress=False, batch_size=2,
                   shard_size=4, run_dir=str(tmp_path / "run"))
    with pytest.warns(UserWarning, match="the run goes on without it"):
        first = measure(tiny_model_dir("gpt2"), texts[:8], **options)
    again = measure(tiny_model_dir("gpt2"), texts[:8], resume=True, **options)  # every shard already done
    assert again.failed_metrics == first.failed_metrics and set(again.failed_metrics) == {"boom_at_final"}
    assert again.results == first.results and all(set(r) == {"dispersion"} for r in again.results.values())


def test_parameter_error_is_one_line_before_the_model_loads():
    host = plugin_host(Picky)
    with pytest.raises(ParameterError) as info:  # the model path does not exist: the parameter is checked first
        measure("no/such/model", ["a text", "another"], metrics=["picky"], metric_params={"picky": {"threshold": -1}},
                host=host, progress=False)
    assert str(info.value) == ("picky: parameter threshold=-1 is invalid; it must be a number > 0 "
                               "(set it with --metric-param picky.threshold=VALUE)")
    assert isinstance(info.value, ValueError) and isinstance(info.value, RepgeomError)
    assert rg.ParameterError is ParameterError and "ParameterError" in rg.__all__
    assert str(ParameterError("q", 2, "a number in [0, 1]")) == "parameter q=2 is invalid; it must be a number in [0, 1]"


PLUGIN_SOURCE = """
import repgeom_eval
import torch


class Boom(repgeom_eval.Metric):
    name = "boom"

    def update(self, batch):
        return 1 / 0

    def compute(self):
        return 0.0


class Mean0(repgeom_eval.Metric):
    name = "coord"

    def __init__(self):
        super().__init__()
        self.add_state("total", torch.zeros((), dtype=torch.float64), "sum")
        self.add_state("n", torch.zeros((), dtype=torch.float64), "sum")

    def update(self, batch):
        self.total = self.total + batch.pooled[:, 0].sum()
        self.n = self.n + batch.pooled.shape[0]

    def compute(self):
        return float(self.total / self.n)


@repgeom_eval.hookimpl
def repgeom_register_metrics(registry):
    registry.add(Boom)
    registry.add(Mean0)
"""


@pytest.fixture
def fake_dist(tmp_path):
    """A real distribution (dist-info and module on a path) whose plugin registers ``boom`` and ``coord``:
    ``fake_dist(version)`` writes (or rewrites) it and returns the directory to put on the path."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "boom_plugin.py").write_text(PLUGIN_SOURCE)

    def write(version: str):
        for old in site.glob("boom_plugin-*.dist-info"):
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
        info = site / f"boom_plugin-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: boom-plugin\nVersion: {version}\n")
        (info / "entry_points.txt").write_text("[repgeom_eval]\nboomer = boom_plugin\n")
        return site

    return write


def _env(site):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.pop("REPGEOM_STRICT_PLUGINS", None)
    env.pop("REPGEOM_DISABLE_PLUGINS", None)
    return env


def test_cli_finishes_without_a_failing_plugin_metric_with_status_3(fake_dist, tiny_model_dir, texts, tmp_path):
    # boom raises on its first batch; coord (the same plugin) and dispersion run on: their results are written, the
    # failure is a warning when it happens and a last line, and the exit status is 3
    site = fake_dist("0.3")
    data, out = tmp_path / "t.txt", tmp_path / "out.json"
    data.write_text("\n".join(texts[:4]) + "\n")
    env = _env(site)
    env.pop("REPGEOM_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "repgeom_eval", "measure", "--model", tiny_model_dir("gpt2"), "--data",
                           str(data), "--metrics", "boom", "coord", "dispersion", "-o", str(out), "--no-progress"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("repgeom: warning: metric 'boom' of plugin 'boomer' (from boom-plugin 0.3) raised in "
                               "update at final: ZeroDivisionError: division by zero; the run goes on without it")
    assert lines[-1].startswith("repgeom: error: metric 'boom' raised and is left out of the results")
    doc = json.loads(out.read_text())
    assert set(doc["failed_metrics"]) == {"boom"} and set(doc["results"]["final"]) == {"coord", "dispersion"}


def test_cli_prints_a_plugin_exception_as_one_line(fake_dist, tiny_model_dir, texts, tmp_path):
    site = fake_dist("0.3")
    data = tmp_path / "t.txt"
    data.write_text("\n".join(texts[:4]) + "\n")
    args = [sys.executable, "-m", "repgeom_eval", "measure", "--model", tiny_model_dir("gpt2"), "--data", str(data),
            "--metrics", "boom", "--no-progress"]
    proc = subprocess.run(args, capture_output=True, text=True, env=_env(site), timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "repgeom: error: metric 'boom' of plugin 'boomer' (from boom-plugin 0.3) raised in update at final: "
        "ZeroDivisionError: division by zero (repgeom --debug shows the traceback)"]
    debug = subprocess.run([*args[:3], "--debug", *args[3:]], capture_output=True, text=True, env=_env(site),
                           timeout=300)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "return 1 / 0" in debug.stderr


# -- provenance --------------------------------------------------------------------------------------------------------

def test_provenance_is_in_the_config_and_a_resume_after_an_upgrade_is_refused(fake_dist, tiny_model_dir, texts,
                                                                               tmp_path, monkeypatch):
    site = fake_dist("0.3")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "boom_plugin", raising=False)
    builtins = [ep for ep in md.entry_points(group="repgeom_eval") if ep.name != "boomer"]

    def host():
        (dist,) = [d for d in md.distributions(path=[str(site)]) if d.metadata["Name"] == "boom-plugin"]
        return PluginHost(entry_points=[*builtins, *dist.entry_points], strict=True)

    model, run_dir = tiny_model_dir("gpt2"), tmp_path / "run"
    first = measure(model, texts[:8], metrics=["coord", "dispersion"], shard_size=4, run_dir=run_dir, host=host(),
                    progress=False)
    assert first.config["plugins"] == {
        "coord": {"plugin": "boomer", "distribution": "boom-plugin", "version": "0.3"},
        "dispersion": {"plugin": "dispersion", "distribution": "repgeom-eval", "version": rg.__version__}}
    assert json.loads((run_dir / "run.json").read_text())["plugins"] == first.config["plugins"]
    again = measure(model, texts[:8], metrics=["coord", "dispersion"], shard_size=4, run_dir=run_dir, resume=True,
                    host=host(), progress=False)
    assert again.results == first.results
    fake_dist("0.4")  # the plugin is upgraded
    with pytest.raises(RepgeomError, match=r"belongs to a different run \(plugins\.coord\.version: 0\.3 then, 0\.4 "
                                           r"now\)"):
        measure(model, texts[:8], metrics=["coord", "dispersion"], shard_size=4, run_dir=run_dir, resume=True,
                host=host(), progress=False)


def test_the_analyses_envelope_records_every_loaded_plugin():
    from repgeom_eval.analyses.envelope import AnalysisResult

    config = AnalysisResult("test", config={"x": 1}, results={}).to_dict()["config"]
    assert config["x"] == 1 and set(config) == {"x", "plugins", "versions"}
    assert config["plugins"]["dispersion"] == {"distribution": "repgeom-eval", "version": rg.__version__}
    assert set(config["plugins"]) == {p.name for p in rg.get_host().plugins}


# -- check_metric -------------------------------------------------------------------------------------------------------

def test_check_metric_catches_a_parameter_missing_from_config():
    class Hidden(Metric):
        name = "hidden_param"

        def __init__(self, scale: float = 1.0):
            super().__init__()
            self._scale = scale  # not under its own name: config() cannot see it
            self.add_state("total", torch.zeros((), dtype=torch.float64), "sum")

        def update(self, batch):
            self.total = self.total + batch.pooled.sum() * self._scale

        def compute(self):
            return float(self.total)

    with pytest.raises(AssertionError, match=r"parameter\(s\) \['scale'\] are not reported by config\(\).*"
                                             r"self\.scale = scale"):
        check_metric(Hidden)
    check_metric(Coordinate, {"per_text": True})


def test_check_metric_catches_a_work_note_that_is_not_one_line():
    class Chatty(Coordinate):
        name = "chatty_note"

        def work_note(self, tokens, width):
            return ["a list", "is not a line"] if tokens > width else None

    with pytest.raises(AssertionError, match=r"chatty_note: work_note\(4096, 64\) must return one line or None"):
        check_metric(Chatty)

    class Broken(Coordinate):
        name = "broken_note"

        def work_note(self, tokens, width):
            raise ValueError("note broke")

    with pytest.raises(AssertionError, match=r"broken_note: work_note\(16, 4096\) raised ValueError: note broke"):
        check_metric(Broken)
