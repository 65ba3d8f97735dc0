"""Every warning the library can emit fires in a test here, through the command or API a user runs (issue 36).

:data:`SITES` is the table of every place in the code that warns: ``warnings.warn``, a logger's ``warning``, an
analysis result's ``warn`` (kept in its output), a console warning line, a metric's diagnostics ``"warning"``. An AST
scan of the package finds them all (:func:`scan`), so a new warning without a test here fails the suite. Each test
drives the path that warns on the tiny random models of tests/conftest.py and checks both that the warning was
emitted and that the run still finished with its outputs written. The formatters that word those warnings never
raise, whatever the numbers (:func:`test_warning_formatters_never_raise`).
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import logging
import shutil
import sys
import types
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import repgeom_eval as rg
from repgeom_eval.entrypoints.cli import main

ROOT = Path(__file__).resolve().parents[1]
clean = pytest.mark.fault("clean")  # each case runs to the end and says what it did (tests/conftest.py counts them)

# site (file::function[#n-th warning in it]) → (message start, surfaces, the test(s) that make it fire)
SITES: dict[str, tuple[str, str, str | tuple[str, ...]]] = {
    "_repgeom_lm_eval_hook.py::_warn": ("(relay of the two below)", "lm-eval", "test_hook_callback_failure"),
    "_repgeom_lm_eval_hook.py::_run_callbacks": ("repgeom-eval: its hook for M failed", "lm-eval",
                                                 "test_hook_callback_failure"),
    "_repgeom_lm_eval_hook.py::with_tasks_dir": ("repgeom-eval: its lm-eval tasks are not available", "lm-eval",
                                                 "test_hook_without_tasks_dir"),
    "entrypoints/cli.py::build_parser": ("command C from plugin P is unavailable", "cli",
                                         "test_cli_command_unavailable"),
    "entrypoints/compare_cmd.py::run": ("warning (FILE): ... (a results file's warnings)", "compare",
                                        "test_compare_prints_the_files_warnings"),
    "entrypoints/gap_cmd.py::run": ("warning: the vocabularies differ (--force)", "gap",
                                    "test_gap_prints_vocab_differ"),
    "entrypoints/plugins_cmd.py::run": ("N plugin(s) failed to load", "plugins", "test_plugins_lists_failures"),
    "entrypoints/slices_cmd.py::run": ("note: (every warning of the slices, printed)", "slices",
                                       "test_slices_prints_its_notes"),
    "plugins/massive.py::MassiveActivations.diagnostics": (
        "top_k = K exceeds the layer's D dimensions", "measure, lm-eval, mteb",
        ("test_top_k_clamp_measure", "test_top_k_clamp_lm_eval", "test_top_k_clamp_mteb")),
    "repgeom_eval/analyses/clusters.py::clusters#1": ("--clusters N: the corpus has only", "clusters",
                                                      "test_clusters_fewer_than_asked"),
    "repgeom_eval/analyses/clusters.py::clusters#2": ("K of N clusters have fewer than C contexts", "clusters",
                                                      "test_clusters_small_clusters"),
    "repgeom_eval/analyses/envelope.py::AnalysisResult.warn": ("(relay: an analysis's caveat, kept in its output)",
                                                               "analyses", "test_analysis_warnings_are_kept"),
    "repgeom_eval/analyses/gap/screening.py::screen#1": ("comparing models with different vocabularies", "gap",
                                                         "test_gap_different_vocabularies"),
    "repgeom_eval/analyses/gap/screening.py::screen#2": ("N token(s) are in both the domain and the reference set",
                                                         "gap", "test_gap_overlap"),
    "repgeom_eval/analyses/gap/screening.py::screen#3": ("model M: ... rows of the output embedding are all zero",
                                                         "gap", "test_gap_degenerate_rows"),
    "repgeom_eval/analyses/knn_keys.py::knn_keys": ("the most dispersed candidate changes with N", "knn-keys",
                                                    "test_knn_keys_inconsistent"),
    "repgeom_eval/analyses/knnlm.py::knnlm#1": ("the datastore is built from the evaluation text", "knnlm",
                                                "test_knnlm_same_text"),
    "repgeom_eval/analyses/knnlm.py::knnlm#2": ("--neighbors K is more than the N keys", "knnlm",
                                                "test_knnlm_more_neighbors_than_keys"),
    "repgeom_eval/analyses/ppl_bins.py::ppl_bins#1": ("source S: no per-source correlation", "ppl-bins",
                                                      "test_ppl_bins_source_without_correlation"),
    "repgeom_eval/analyses/ppl_bins.py::ppl_bins#2": ("domain confound: the sources' median chunk perplexities",
                                                      "ppl-bins", "test_ppl_bins_confound"),
    "repgeom_eval/analyses/ppl_bins.py::ppl_bins#3": ("the pooled Spearman correlation has the opposite sign",
                                                      "ppl-bins", "test_ppl_bins_sign_reversal"),
    "repgeom_eval/analyses/queries.py::_column": ("FILE: K of N records have no ppl", "slices",
                                                  "test_slices_records_without_ppl"),
    "repgeom_eval/analyses/slices.py::controlled_slices": ("controlled slices: ... cannot fill slices", "slices",
                                                           "test_slices_too_few_queries"),
    "repgeom_eval/analyses/slices.py::calibrate": ("calibration: the parts cannot fill slices", "slices",
                                                   "test_slices_calibration_shrinks"),
    "repgeom_eval/lmeval/feeding.py::BankFeeder.feed_views": ("repgeom: M (task T) compare augmented views",
                                                              "lm-eval", "test_lm_eval_views_extra_pass"),
    "repgeom_eval/lmeval/fused.py::HiddenStates.__init__": ("repgeom: fused capture disabled", "lm-eval",
                                                            "test_lm_eval_fused_disabled"),
    "repgeom_eval/lmeval/fused.py::HiddenStates._missed": ("repgeom: fused capture missed", "lm-eval",
                                                           "test_lm_eval_fused_missed"),
    "repgeom_eval/lmeval/registered.py::_pooling_into": ("repgeom_metric_params.M.pooling is deprecated", "lm-eval",
                                                         "test_lm_eval_deprecated_pooling"),
    "repgeom_eval/lmeval/session.py::with_warnings": ("repgeom (task T): ... (lm-eval's log)", "lm-eval",
                                                      "test_lm_eval_log_has_the_metric_warning"),
    "repgeom_eval/lmeval/session.py::hidden_states_for": ("repgeom: N requests needed an extra forward pass",
                                                          "lm-eval", "test_lm_eval_extra_requests"),
    "repgeom_eval/lmeval/task.py::GeometryTask._data_source": ("task T: repgeom_data applies to the shipped",
                                                               "lm-eval", "test_lm_eval_repgeom_data_ignored"),
    "repgeom_eval/measurement/engine.py::_with_model_pooling": ("pooling P: the sentence-transformers model's own",
                                                                "measure", "test_measure_st_pooling"),
    "repgeom_eval/measurement/engine.py::MeasureRun._finish#1": ("N text(s) tokenize to no tokens and are skipped",
                                                                 "measure", "test_measure_empty_texts"),
    "repgeom_eval/measurement/engine.py::MeasureRun._finish#2": ("K of N texts are longer than C tokens", "measure",
                                                                 "test_measure_truncated"),
    "repgeom_eval/measurement/metric_specs.py::_Guard.__exit__": ("metric M of plugin P raised in S at A: E; the "
                                                                  "run goes on without it", "measure",
                                                                  "test_measure_goes_on_without_a_failing_plugin"),
    "repgeom_eval/measurement/forward.py::context_length": ("--max-length L exceeds the model context",
                                                            "measure, analyses, mteb", "test_max_length_capped"),
    "repgeom_eval/measurement/forward.py::Forward.__exit__": ("model M: every token vector ... is zero",
                                                              "measure, analyses, mteb", "test_zero_token_vectors"),
    "repgeom_eval/measurement/forward.py::Forward._rows_alone": ("model M: padding on the S changes its hidden",
                                                                 "measure, analyses", "test_rows_alone"),
    "repgeom_eval/measurement/results.py::report#1": ("M: <its diagnostics warning> (at ADDRESSES)", "measure",
                                                      "test_measure_metric_warning_said_once"),
    "repgeom_eval/measurement/results.py::report#2": ("one hidden dimension carries at least P", "measure",
                                                      "test_measure_massive_dimension"),
    "repgeom_eval/measurement/results.py::report#3": ("model M: every vector at every measured address is zero",
                                                      "measure", "test_measure_degenerate_results"),
    "repgeom_eval/measurement/results.py::kept_warnings": ("(relay: a run's warnings into its results file)",
                                                           "measure", "test_measure_keeps_its_warnings"),
    "repgeom_eval/modeling/addresses.py::resolve": ("A: read where the architecture table T says", "every",
                                                    "test_unverified_site"),
    "repgeom_eval/modeling/addresses.py::resolve_request#1": ("A and B are the same tensor", "every",
                                                              "test_same_tensor"),
    "repgeom_eval/modeling/addresses.py::resolve_request#2": ("hidden-state indices are reported under", "every",
                                                              "test_bare_index"),
    "repgeom_eval/modeling/discovery.py::_apply_table": ("architecture table T reads S:I at P, which differs",
                                                         "every", "test_table_differs_from_discovery"),
    "repgeom_eval/modeling/gguf_cache.py::save_gguf_cache": ("could not cache the converted GGUF model", "every",
                                                             "test_gguf_cache_unwritable"),
    "repgeom_eval/modeling/loading.py::load_model": ("model M: t5 is an encoder-decoder model", "every",
                                                     "test_encoder_of_an_encoder_decoder"),
    "repgeom_eval/modeling/st_config.py::read_st_config": ("the model's Pooling excludes prompt tokens",
                                                           "measure, mteb", "test_st_include_prompt"),
    "repgeom_eval/modeling/weights_check.py::check_loading_report": ("model M: ... keep their random init",
                                                                     "every", "test_random_init"),
    "repgeom_eval/mteb_layers/embedder.py::LayerEmbedder.__init__": ("the model's Dense module(s) after pooling",
                                                                     "mteb", "test_mteb_st_skipped_modules"),
    "repgeom_eval/mteb_layers/embedder.py::LayerEmbedder.embed": ("N text(s) tokenize to no tokens; their embed",
                                                                  "mteb", "test_mteb_empty_text"),
    "repgeom_eval/mteb_layers/geometry.py::_evaluate#1": ("(logger repgeom_eval.mteb_layers) degenerate numbers",
                                                          "mteb", "test_mteb_logs_its_warnings"),
    "repgeom_eval/mteb_layers/geometry.py::_evaluate#2": ("model M: degenerate results (mteb.evaluate)", "mteb",
                                                          "test_mteb_evaluate_warns"),
    "repgeom_eval/mteb_layers/metrics.py::SweepMetrics.__init__": ("M reads N augmented views of every text",
                                                                   "mteb", "test_mteb_views_extra_passes"),
    "repgeom_eval/mteb_layers/runner.py::run_layers": ("model M: on T, degenerate results ... (once per task)",
                                                       "mteb", "test_mteb_sweep_warns_once"),
    "repgeom_eval/plugin_system/host.py::PluginHost.__init__": ("-p no:NAME names no installed plugin", "every",
                                                                "test_unknown_plugin_switched_off"),
    "repgeom_eval/plugin_system/host.py::PluginHost._fail": ("repgeom-eval plugin P failed at S", "every",
                                                             "test_plugin_failure"),
    "repgeom_eval/plugin_system/host.py::PluginHost._code_version": ("plugin P: its code says version", "every",
                                                                     "test_plugin_stale_metadata"),
    "repgeom_eval/training/data.py::pack_domains": ("domain D has no evaluation block", "train",
                                                    "test_train_domain_without_eval_block"),
    "repgeom_eval/training/geometry.py::GeometryCallback._gap": ("model M: ... rows of the output embedding are",
                                                                 "train", "test_train_probe_degenerate_rows"),
}


# -- the scan: every warning call in the package, by enclosing function --------------------------------------------

MARKUP = ("warning", "[yellow]", "[red]", "[bold red]")  # a console line that is a warning


def _literals(node: ast.AST) -> str:
    return " ".join(n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str))


def _warns(node: ast.AST) -> bool:
    if isinstance(node, ast.Dict):  # a metric's diagnostics {"warning": ...}
        return any(isinstance(k, ast.Constant) and k.value == "warning" for k in node.keys)
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    if name in ("warn", "warn_explicit", "warning", "_warn"):
        return True
    return name == "print" and any(m in _literals(a).lower() for a in node.args for m in MARKUP)


def scan() -> list[str]:
    """``file::Qualified.function`` of every warning call (``#n`` for the n-th of several in one function)."""
    files = [ROOT / "_repgeom_lm_eval_hook.py"]
    files += sorted(p for d in ("repgeom_eval", "plugins", "entrypoints") for p in (ROOT / d).rglob("*.py"))
    out = []
    for path in files:
        hits: list[str] = []

        def visit(node: ast.AST, qual: tuple[str, ...]) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(child, (*qual, child.name))
                    continue
                if _warns(child):
                    hits.append(".".join(qual) or "<module>")
                visit(child, qual)

        visit(ast.parse(path.read_text(encoding="utf-8")), ())
        total, seen = Counter(hits), Counter()
        for q in hits:
            seen[q] += 1
            out.append(f"{path.relative_to(ROOT).as_posix()}::{q}" + (f"#{seen[q]}" if total[q] > 1 else ""))
    return out


def test_every_warning_site_is_listed_with_a_test():
    found = scan()
    assert len(found) == len(set(found))
    missing, stale = sorted(set(found) - set(SITES)), sorted(set(SITES) - set(found))
    assert not missing, f"warning sites without a test in tests/test_every_warning.py (add each to SITES): {missing}"
    assert not stale, f"SITES lists sites the code no longer has (the n-th warning of a function moved?): {stale}"
    tests = {t for _, _, named in SITES.values() for t in ((named,) if isinstance(named, str) else named)}
    assert not sorted(t for t in tests if not callable(globals().get(t))), "SITES names tests this file lacks"


def test_the_scan_finds_each_kind_of_warning():
    code = ("import warnings\ndef f(result, log, console):\n    warnings.warn('a')\n    log.warning('b')\n"
            "    result.warn('c')\n    console.print('[yellow]warning[/] d')\n    console.print('plain')\n"
            "    return {'warning': 'e'}\n")
    assert sum(_warns(n) for n in ast.walk(ast.parse(code))) == 5


# -- running a command or the API, warnings, output and log kept ---------------------------------------------------

@dataclass
class Ran:
    rc: Any = None
    said: list[str] = field(default_factory=list)  # the messages of the warnings raised
    out: str = ""
    err: str = ""
    logged: list[str] = field(default_factory=list)  # WARNING records of any logger

    def says(self, fragment: str) -> str:
        hits = [m for m in self.said if fragment in m]
        assert hits, f"no warning says {fragment!r}; warnings: {self.said}"
        return hits[0]


class _Log(logging.Handler):
    def __init__(self, into: list[str]):
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


@contextlib.contextmanager
def watching():
    """Every warning (each time it is raised), stdout, stderr and the WARNING log records of the block."""
    ran = Ran()
    handler, out, err = _Log(ran.logged), io.StringIO(), io.StringIO()
    logging.getLogger().addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            warnings.simplefilter("always")
            yield ran
    finally:
        logging.getLogger().removeHandler(handler)
        ran.said = [str(w.message) for w in caught]
        ran.out, ran.err = out.getvalue(), err.getvalue()


def cli(*argv: Any) -> Ran:
    with watching() as ran:
        ran.rc = main([str(a) for a in argv])
    return ran


def call(fn, *args: Any, **kwargs: Any) -> Ran:
    with watching() as ran:
        ran.rc = fn(*args, **kwargs)
    return ran


def read(path: Path) -> dict:
    return json.loads(Path(path).read_text())


TEXTS = ["one two three four", "five six seven", "eight nine ten eleven twelve", "thirteen fourteen",
         "a longer sentence about rivers and hills", "numbers like 3 and 4"]


def _edit(src: str, dst: Path, change) -> str:
    """A copy of model ``src`` whose safetensors went through ``change(tensors) -> tensors``."""
    shutil.copytree(src, dst)
    save_file(change(load_file(dst / "model.safetensors")), dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One torch thread for the tiny models: on a shared machine two threads spin against each other (5x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_dir, texts):
    """The tiny GPT-2, a text file, and a memo of runs several tests read (each run once per module)."""
    root = tmp_path_factory.mktemp("every-warning")
    data = root / "texts.txt"
    data.write_text("\n".join(texts[:12]) + "\n")
    memo: dict[str, Any] = {}

    def once(key: str, make):
        if key not in memo:
            memo[key] = make()
        return memo[key]

    return SimpleNamespace(model=tiny_model_dir("gpt2"), data=data, root=root, once=once, texts=texts)


@pytest.fixture(scope="module")
def zero_model(env):
    """The tiny GPT-2 with every weight zero: every hidden state is a zero vector."""
    return env.once("zero", lambda: _edit(env.model, env.root / "zero", lambda t: {k: torch.zeros_like(v)
                                                                                   for k, v in t.items()}))


@pytest.fixture(scope="module")
def st_folder(env, tiny_model_dir):
    """A tiny sentence-transformers folder: Transformer, Pooling (mean, prompt excluded), Dense."""
    def make():
        folder = env.root / "st"
        shutil.copytree(tiny_model_dir("bert"), folder)
        (folder / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True, "include_prompt": False}))
        return str(folder)

    return env.once("st", make)


# -- measure ---------------------------------------------------------------------------------------------------------

def _measure(env, name: str, *args: Any, model: str | None = None) -> tuple[Ran, dict]:
    """``repgeom measure`` on the tiny model (once per module and ``name``); the run and its results file."""
    out = env.root / f"{name}.json"

    def run():
        ran = cli("measure", "-m", model or env.model, "-d", env.data, "-o", out, "--no-progress", *args)
        assert ran.rc == 0, ran.err
        return ran, read(out)

    return env.once(f"measure:{name}", run)


def _top_k(env):
    return _measure(env, "top-k", "--layers", "all", "--metrics", "massive_activations", "--metric-param",
                    "massive_activations.top_k=10000")


@clean
def test_top_k_clamp_measure(env):
    ran, doc = _top_k(env)
    line = ran.says("top_k = 10000 exceeds the layer's 32 dimensions")
    assert line in doc["warnings"]
    assert all(doc["diagnostics"][a]["massive_activations"]["top_k_used"] == 32 for a in doc["results"])
    assert len(doc["results"]["final"]["massive_activations"]["top_dimensions"]) == 32


@clean
def test_measure_metric_warning_said_once(env):
    ran, _ = _top_k(env)
    said = [m for m in ran.said if "exceeds the layer" in m]
    assert len(said) == 1 and said[0].startswith("massive_activations: ")
    assert said[0].endswith("(at embed, resid_post:0, final)")  # every address in one line


@clean
def test_measure_keeps_its_warnings(env):
    ran, doc = _measure(env, "truncated", "--max-length", "4")
    kept = doc["warnings"]
    assert kept and all(k in ran.said for k in kept)


@clean
def test_measure_truncated(env):
    ran, doc = _measure(env, "truncated", "--max-length", "4")
    assert ran.says("texts are longer than 4 tokens and were truncated") in doc["warnings"]
    assert doc["results"]["final"]["dispersion"] > 0


@clean
def test_measure_goes_on_without_a_failing_plugin(env, monkeypatch):
    # a third-party metric raising in update: one warning naming it, the others' results, and the run's record of it
    from repgeom_eval.plugin_system.host import PluginHost

    class Fails(rg.Metric):
        name = "fails_in_update"

        def update(self, batch):
            raise ValueError("bad batch")

        def compute(self):
            return 0.0

    @rg.hookimpl
    def repgeom_register_metrics(registry):
        registry.add(Fails)

    module = types.ModuleType("failing_plugin")
    module.repgeom_register_metrics = repgeom_register_metrics
    monkeypatch.delenv("REPGEOM_DEBUG", raising=False)
    ran = call(rg.measure, env.model, env.texts[:6], metrics=["fails_in_update", "dispersion"], progress=False,
               host=PluginHost(extra_plugins=[("failing_plugin", module)]))
    said = ran.says("metric 'fails_in_update' of plugin 'failing_plugin'")
    assert "raised in update at final: ValueError: bad batch; the run goes on without it" in said
    assert set(ran.rc.failed_metrics) == {"fails_in_update"} and set(ran.rc.results["final"]) == {"dispersion"}
    assert said in ran.rc.warnings  # kept in the results file too


@clean
def test_max_length_capped(env):
    ran, doc = _measure(env, "capped", "--max-length", "100000")
    assert ran.says("--max-length 100000 exceeds the model context (128); using 128") in doc["warnings"]


@clean
def test_measure_massive_dimension(env):
    def offset(t):  # a constant offset in dimension 5 of every token embedding, as in real massive activations
        t["transformer.wte.weight"][:, 5] += 50.0
        return t

    model = env.once("massive", lambda: _edit(env.model, env.root / "massive", offset))
    ran, doc = _measure(env, "massive", "--layers", "all", model=model)
    line = ran.says("one hidden dimension carries at least 50% of the squared norm of the mean-pooled vectors")
    assert line in doc["warnings"] and "embed (dim 5: " in line
    assert doc["diagnostics"]["embed"]["energy"]["top_dimensions"][0] == 5


def _zero(env, zero_model):
    return _measure(env, "zero", "--layers", "all", model=zero_model)


@clean
def test_zero_token_vectors(env, zero_model):
    ran, doc = _zero(env, zero_model)
    assert ran.says("every token vector at every address is zero") in doc["warnings"]


@clean
def test_measure_degenerate_results(env, zero_model):
    ran, doc = _zero(env, zero_model)
    assert ran.says("every vector at every measured address is zero") in doc["warnings"]
    assert all(r["dispersion"] == 1.0 for r in doc["results"].values())


@clean
def test_same_tensor(env):
    ran, doc = _measure(env, "alias", "--layers", "resid_pre:0", "final")
    assert ran.says("resid_pre:0 and embed are the same tensor") in doc["warnings"]
    assert set(doc["results"]) == {"embed", "final"}


@clean
def test_bare_index(env):
    ran, doc = _measure(env, "bare", "--layers", "1")
    assert ran.says("hidden-state indices are reported under their addresses") in doc["warnings"]
    assert set(doc["results"]) == {"resid_post:0"}


@clean
def test_random_init(env):
    model = env.once("random-init", lambda: _edit(env.model, env.root / "missing", lambda t: {
        k: v for k, v in t.items() if not k.startswith("transformer.h.1.")}))
    ran, doc = _measure(env, "random-init", "--allow-random-init", model=model)
    assert ran.says("keep their random initialisation (--allow-random-init)")
    assert doc["model"]["random_init_tensors"] and doc["results"]["final"]["dispersion"] > 0


@clean
def test_encoder_of_an_encoder_decoder(env):
    from repgeom_eval.testing.tiny_models import save_tiny

    t5 = env.once("t5", lambda: str(save_tiny("t5", env.root / "t5", "encoder")))
    ran, doc = _measure(env, "t5", model=t5)
    assert ran.says("t5 is an encoder-decoder model: its encoder is measured")
    assert doc["results"]["final"]["dispersion"] > 0


@clean
def test_measure_st_pooling(env, st_folder):
    ran, doc = _measure(env, "st", model=st_folder)
    ran.says("pooling 'mean': the sentence-transformers model's own")
    assert doc["config"]["pooling"] == "mean" and doc["results"]["final"]["dispersion"] > 0


def test_measure_st_pooling_is_kept_in_the_results_file(env, st_folder):
    ran, doc = _measure(env, "st", model=st_folder)
    assert ran.says("pooling 'mean': the sentence-transformers model's own") in doc.get("warnings", [])


@clean
def test_st_include_prompt(env, st_folder):
    ran, doc = _measure(env, "st", model=st_folder)
    ran.says("the model's Pooling excludes prompt tokens (include_prompt=false)")
    assert doc["results"]["final"]["dispersion"] > 0


@clean
def test_measure_empty_texts(env):
    from tokenizers import normalizers

    from repgeom_eval.modeling.loading import load_model

    loaded = load_model(env.model)
    loaded.tokenizer.backend_tokenizer.normalizer = normalizers.Replace("\x00", "")  # "\x00": no token at all
    ran = call(rg.measure, loaded, ["\x00", *TEXTS], progress=False)
    assert ran.says("1 text(s) tokenize to no tokens and are skipped") in ran.rc.warnings
    assert ran.rc.data["n_texts"] == len(TEXTS) + 1 and ran.rc.results["final"]["dispersion"] > 0


@clean
def test_rows_alone(env):
    from repgeom_eval.modeling.loading import load_model

    loaded = load_model(env.model)
    loaded.layout.padding_sides = ()  # as if its load check had found padding unsafe on both sides
    ran = call(rg.measure, loaded, TEXTS, batch_size=3, progress=False)
    assert ran.says("texts of each batch run one at a time") in ran.rc.warnings
    assert ran.rc.results["final"]["dispersion"] > 0


def _table_plugin(env, tiny_model_dir):
    """A plugin table for llama that reads mlp_in at the input of mlp.down_proj (not what discovery verifies)."""
    from types import ModuleType

    from repgeom_eval import hookimpl
    from repgeom_eval.modeling.architectures import pre_ln_decoder
    from repgeom_eval.modeling.hooks import HookPoint
    from repgeom_eval.plugin_system.host import PluginHost

    table = pre_ln_decoder("my-llama", blocks="layers", attn="self_attn", ln2="post_attention_layernorm", mlp="mlp",
                           final_norm="norm")
    table.sites["mlp_in"] = HookPoint("mlp.down_proj", "input")
    plugin = ModuleType("my_table")

    @hookimpl
    def repgeom_register_architectures(registry):
        registry.add(table, name="llama")

    plugin.repgeom_register_architectures = repgeom_register_architectures
    host = PluginHost(disable=["architectures"], extra_plugins=[("my_table", plugin)])
    return call(rg.measure, tiny_model_dir("llama"), TEXTS, host=host, layers=["mlp_in:0", "final"], progress=False)


@clean
def test_table_differs_from_discovery(env, tiny_model_dir):
    ran = env.once("table", lambda: _table_plugin(env, tiny_model_dir))
    ran.says("architecture table 'llama' reads mlp_in:0 at ")
    assert ran.rc.results["mlp_in:0"]["dispersion"] > 0


@clean
def test_unverified_site(env, tiny_model_dir):
    ran = env.once("table", lambda: _table_plugin(env, tiny_model_dir))
    line = ran.says("which the load check could not verify on this llama model")
    assert line.startswith("mlp_in:0 (") and line in ran.rc.warnings


@clean
def test_gguf_cache_unwritable(env, tmp_path):
    from repgeom_eval.modeling.gguf_cache import save_gguf_cache
    from repgeom_eval.modeling.loading import load_model

    loaded = load_model(env.model)
    (tmp_path / "a-file").write_text("not a folder")
    cache = tmp_path / "a-file" / "gguf" / "entry"  # its parent cannot be made
    ran = call(save_gguf_cache, loaded.model, loaded.tokenizer, cache)
    ran.says("could not cache the converted GGUF model under")
    assert not cache.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@clean
def test_views_only_metrics_say_nothing_about_zero_vectors(env):
    """lidar, infonce and dime read augmented views only: the energy diagnostic sees no original text, which is
    not a zero vector (no false 'every vector ... is zero')."""
    ran, doc = _measure(env, "views", "--metrics", "lidar", "infonce", "dime", "--layers", "all")
    assert not [m for m in ran.said if "zero" in m], ran.said
    assert not [w for w in doc.get("warnings", []) if "zero" in w]
    assert all(set(r) == {"lidar", "infonce", "dime"} for r in doc["results"].values()) and len(doc["results"]) == 3


# -- plugins, the command line, the lm-eval start-up hook ------------------------------------------------------------

def _plugin(name: str, **hooks: Any):
    from types import ModuleType

    module = ModuleType(name)
    for hook, fn in hooks.items():
        setattr(module, hook, fn)
    return module


def _broken_commands_host():
    """Every installed plugin, one whose command hook adds a command, then fails, and one that adds a command whose
    module cannot be imported."""
    import importlib.metadata as md

    from repgeom_eval import hookimpl
    from repgeom_eval.plugin_system.host import PluginHost
    from repgeom_eval.spec.hookspecs import Command

    @hookimpl(specname="repgeom_register_commands")
    def half(registry):
        registry.add(Command("half-cmd", "Added, then its plugin failed.", lambda p: None, lambda args: 0))
        raise RuntimeError("the command plugin broke")

    @hookimpl(specname="repgeom_register_commands")
    def ghost(registry):  # a lazy command whose module is not there
        registry.add("rg_no_such_module_xyz:command", name="ghost-cmd", description="Never importable.")

    plugins = [("half_cmds", _plugin("half_cmds", repgeom_register_commands=half)),
               ("ghost_cmds", _plugin("ghost_cmds", repgeom_register_commands=ghost))]
    return call(PluginHost, entry_points=list(md.entry_points(group="repgeom_eval")), strict=False,
                extra_plugins=plugins)


@clean
def test_plugin_failure(env):
    made = env.once("broken-host", _broken_commands_host)
    made.says("repgeom-eval plugin 'half_cmds' failed")
    assert "the other plugins are loaded" in made.says("half_cmds") and "dispersion" in made.rc.metrics


@clean
def test_cli_command_unavailable(env, monkeypatch):
    from repgeom_eval.plugin_system import host as host_module

    monkeypatch.setattr(host_module, "get_host", lambda: env.once("broken-host", _broken_commands_host).rc)
    out = env.root / "with-a-broken-command.json"
    ran = cli("measure", "-m", env.model, "-d", env.data, "-o", out, "--no-progress")
    ran.says("command 'ghost-cmd' from plugin 'ghost_cmds' is unavailable: ")
    assert ran.rc == 0 and read(out)["results"]["final"]["dispersion"] > 0


@clean
def test_plugins_lists_failures(env, monkeypatch):
    from repgeom_eval.plugin_system import host as host_module

    monkeypatch.setattr(host_module, "get_host", lambda: env.once("broken-host", _broken_commands_host).rc)
    ran = cli("plugins")
    assert ran.rc == 0 and "dispersion" in ran.out and "1 plugin(s) failed to load" in ran.err


@clean
def test_unknown_plugin_switched_off(env):
    out = env.root / "switched-off.json"
    ran = cli("-p", "no:nope", "measure", "-m", env.model, "-d", env.data, "-o", out, "--no-progress")
    ran.says("-p no:NAME names no installed plugin: 'nope'")
    assert ran.rc == 0 and read(out)["results"]["final"]["dispersion"] > 0


@clean
def test_plugin_stale_metadata():
    from repgeom_eval import hookimpl
    from repgeom_eval.plugin_system.host import PluginHost

    @hookimpl
    def repgeom_register_metrics(registry):
        pass

    module = _plugin("stale", repgeom_register_metrics=repgeom_register_metrics, __version__="2.0")
    entry = SimpleNamespace(name="stale", value="stale", load=lambda: module,
                            dist=SimpleNamespace(name="repgeom-stale", version="1.0"))
    ran = call(PluginHost, entry_points=[entry], strict=False)
    ran.says("plugin 'stale': its code says version 2.0 but the installed metadata says 1.0")
    assert ran.rc.plugin_versions()["stale"]["version"] == "2.0"


@clean
def test_hook_callback_failure(tmp_path, monkeypatch):
    import importlib

    import _repgeom_lm_eval_hook as hook

    (tmp_path / "rg_every_warning_probe.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "rg_every_warning_probe", raising=False)

    def broken(module):
        raise RuntimeError("boom")

    hook.when_imported("rg_every_warning_probe", broken)
    ran = call(importlib.import_module, "rg_every_warning_probe")
    ran.says("repgeom-eval: its hook for rg_every_warning_probe failed (RuntimeError: boom)")
    assert ran.rc.VALUE == 7  # the import itself went through


@clean
def test_hook_without_tasks_dir(monkeypatch):
    import _repgeom_lm_eval_hook as hook

    def gone():
        raise ModuleNotFoundError("No module named 'repgeom_eval'")

    monkeypatch.setattr(hook, "tasks_dir", gone)
    ran = call(hook.with_tasks_dir, "/my/tasks")
    ran.says("repgeom-eval: its lm-eval tasks are not available (No module named 'repgeom_eval')")
    assert ran.rc == "/my/tasks"  # lm-eval goes on with the user's own folders


# -- the analyses ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def docs(env):
    """Six documents of Python's own documentation as JSONL, with a source each (a, a, b, b, b, c)."""
    from pydoc_data.topics import topics

    path = env.root / "docs.jsonl"
    texts = [topics[k][:400] for k in sorted(topics)[:6]]
    sources = ["a", "a", "b", "b", "b", "c"]
    texts[-1] = texts[-1][:60]  # source c: one or two chunks, too few for a correlation of its own
    path.write_text("".join(json.dumps({"text": t, "source": s}) + "\n" for t, s in zip(texts, sources)))
    return path


def _analysis(env, name: str, *argv: Any) -> tuple[Ran, dict]:
    out = env.root / f"{name}.json"

    def run():
        ran = cli(*argv, "-o", out)
        assert ran.rc == 0, ran.err
        return ran, read(out)

    return env.once(f"analysis:{name}", run)


def _clusters(env, docs):
    return _analysis(env, "clusters", "clusters", "-m", env.model, "-d", docs, "--ngram", "2", "--min-count", "2",
                     "--contexts", "6", "--context-len", "4", "--clusters", "100000", "--no-progress")


@clean
def test_clusters_fewer_than_asked(env, docs):
    ran, doc = _clusters(env, docs)
    assert ran.says("--clusters 100000: the corpus has only") in doc["warnings"]
    assert doc["results"]["clusters"] and doc["config"]["n_clusters_used"] == len(doc["results"]["clusters"])


@clean
def test_clusters_small_clusters(env, docs):
    ran, doc = _clusters(env, docs)
    assert ran.says("contexts (smallest: ") in doc["warnings"]


@clean
def test_analysis_warnings_are_kept(env, docs):
    ran, doc = _clusters(env, docs)
    assert doc["warnings"] and all(w in ran.said for w in doc["warnings"])


def _gap_models(env):
    from transformers import AutoModelForCausalLM

    from repgeom_eval.testing import make_tokenizer, tiny_config

    zero_rows = _edit(env.model, env.root / "zero-wte", lambda t: {
        **t, "transformer.wte.weight": torch.zeros_like(t["transformer.wte.weight"])})
    tok = make_tokenizer(vocab_size=300)
    torch.manual_seed(3)
    other = env.root / "other-vocab"
    AutoModelForCausalLM.from_config(tiny_config("llama", len(tok) + 16)).save_pretrained(other)
    tok.save_pretrained(other)
    return zero_rows, str(other)


def _gap(env):
    zero_rows, other = env.once("gap-models", lambda: _gap_models(env))
    return _analysis(env, "gap", "gap", "--models", zero_rows, other, "--force", "--domain", "digits",
                     "--reference", "general")


@clean
def test_gap_different_vocabularies(env):
    ran, doc = _gap(env)
    ran.says("comparing models with different vocabularies (1 differ from")
    assert doc["vocabulary"]["forced"] is True and len(doc["results"]) == 2


@clean
def test_gap_prints_vocab_differ(env):
    ran, _ = _gap(env)
    assert "warning: the vocabularies differ (--force)" in " ".join(ran.out.split())


@clean
def test_gap_degenerate_rows(env):
    ran, doc = _gap(env)
    line = ran.says("rows of the output embedding are all zero")
    row = next(r for r in doc["results"] if r["model"].endswith("zero-wte"))
    assert line in row["warnings"] and row["G"] == 2.0


@clean
def test_gap_overlap(env, monkeypatch, tmp_path):
    """The reference set is resolved without the domain ids (a token-set resolver that ignored the exclusion):
    the overlap is said, and counted in the row."""
    from repgeom_eval.analyses.gap import screening

    real = screening.resolve_token_set
    monkeypatch.setattr(screening, "resolve_token_set",
                        lambda spec, vocab, host=None, exclude=(), **kw: real(spec, vocab, host=host, **kw))
    out = tmp_path / "gap.json"
    ran = cli("gap", "--models", env.model, "--domain", "words:the,of,and", "--reference", "words:the,in,is",
              "-o", out)
    ran.says("token(s) are in both the domain and the reference set of")
    assert ran.rc == 0 and read(out)["results"][0]["n_overlap"] >= 1


@clean
def test_knn_keys_inconsistent(env, docs):
    """Two seeds per N of 2 and 16 chunks: on the tiny model the most dispersed candidate differs between them for
    at least one of four seeds (seed 0 today)."""
    for seed in range(4):
        ran, doc = _analysis(env, f"knn-keys-{seed}", "knn-keys", "-m", env.model, "-d", docs, "--n", "2", "16",
                             "--seeds", "2", "--seed", seed, "--chunk-len", "8", "--no-progress")
        if not doc["results"]["consistent_across_N"]:
            break
    assert ran.says("the most dispersed candidate changes with N: N=2: ") in doc["warnings"]


def _knnlm(env, docs):
    return _analysis(env, "knnlm", "knnlm", "--model", env.model, "--key", "resid_post:-1", "--datastore", docs,
                     "--eval", docs, "--chunk-len", "16", "--neighbors", "100000", "--lambda", "0.25")


@clean
def test_knnlm_same_text(env, docs):
    ran, doc = _knnlm(env, docs)
    assert ran.says("the datastore is built from the evaluation text itself") in doc["warnings"]


@clean
def test_knnlm_more_neighbors_than_keys(env, docs):
    ran, doc = _knnlm(env, docs)
    assert ran.says("--neighbors 100000 is more than the ") in doc["warnings"]
    assert doc["config"]["k_used"] < 100000


PPL_BINS = ("--chunk-len", "16", "--group-size", "2", "--bins", "8", "--layers", "embed", "final",
            "--source-field", "source")


@clean
def test_ppl_bins_source_without_correlation(env, docs):
    ran, doc = _analysis(env, "ppl-bins", "ppl-bins", "-m", env.model, "-d", docs, *PPL_BINS,
                         "--confound-ratio", "1.0", "--no-progress")
    assert ran.says("source 'c': no per-source correlation (corpus too small") in doc["warnings"]
    assert "error" in doc["results"]["by_source"]["c"] and doc["results"]["pooled"]["n_groups"] >= 3


@clean
def test_ppl_bins_confound(env, docs):
    ran, doc = _analysis(env, "ppl-bins", "ppl-bins", "-m", env.model, "-d", docs, *PPL_BINS,
                         "--confound-ratio", "1.0", "--no-progress")
    assert ran.says("domain confound: the sources' median chunk perplexities differ") in doc["warnings"]
    assert doc["results"]["confound"]["flagged"] is True


@clean
def test_ppl_bins_sign_reversal(env, docs, monkeypatch, tmp_path):
    """A Simpson's paradox planted in the per-chunk numbers (a random model does not make one on demand): within
    sources a and b dispersion falls with perplexity, pooled it rises; the command says so."""
    import numpy as np

    from repgeom_eval.analyses import ppl_bins

    real = ppl_bins.chunk_statistics

    def planted(loaded, chunks, addresses, *args, **kwargs):
        ppl, disp = real(loaded, chunks, addresses, *args, **kwargs)
        rng = np.random.default_rng(0)
        for i, chunk in enumerate(chunks):
            low = chunk.source == "a"
            ppl[i] = rng.uniform(5, 10) if low else rng.uniform(40, 80)
            disp[i, :] = 0.5 - 0.01 * ppl[i] if low else 0.9 - 0.002 * ppl[i]
        return ppl, disp

    monkeypatch.setattr(ppl_bins, "chunk_statistics", planted)
    out = tmp_path / "ppl.json"
    ran = cli("ppl-bins", "-m", env.model, "-d", docs, *PPL_BINS, "--no-progress", "-o", out)
    assert ran.rc == 0, ran.err
    doc = read(out)
    assert ran.says("the pooled Spearman correlation has the opposite sign of every source's at 2 of 2") \
        in doc["warnings"]
    assert doc["results"]["confound"]["sign_reversal_layers"] == ["embed", "final"]


def _slices(env):
    """200 queries (half correct) with 4-d vectors; record 9 has no ppl; slices of 150 asked, with --calibrate."""
    import numpy as np

    root = env.root / "slices"
    root.mkdir()
    rng = np.random.default_rng(0)
    np.save(root / "vectors.npy", rng.normal(size=(200, 4)))
    (root / "queries.jsonl").write_text("".join(
        json.dumps({"correct": i % 2 == 0, **({} if i == 8 else {"ppl": 2.0 + i % 7})}) + "\n" for i in range(200)))
    out = root / "slices.json"
    ran = cli("slices", root / "queries.jsonl", "--vectors", root / "vectors.npy", "--size", "150", "--seeds", "2",
              "--calibrate", "--output", out)
    assert ran.rc == 0, ran.err
    return ran, read(out)


@clean
def test_slices_records_without_ppl(env):
    ran, doc = env.once("slices", lambda: _slices(env))
    assert any("1 of 200 records have no ppl (the first at line 9)" in n for n in doc["notes"]), doc["notes"]


@clean
def test_slices_too_few_queries(env):
    ran, doc = env.once("slices", lambda: _slices(env))
    assert any(n.startswith("controlled slices: 100 correct and 100 incorrect queries cannot fill slices of 150")
               for n in doc["notes"]), doc["notes"]
    assert doc["config"]["size"] == 150 and doc["slices"]["size"] < 150


@clean
def test_slices_calibration_shrinks(env):
    ran, doc = env.once("slices", lambda: _slices(env))
    assert any(n.startswith("calibration: the parts cannot fill slices of 150") for n in doc["notes"])
    assert doc["calibration"] is not None


@clean
def test_slices_prints_its_notes(env):
    ran, doc = env.once("slices", lambda: _slices(env))
    printed = " ".join(ran.out.split())
    assert all(f"note: {' '.join(n.split())}"[:60] in printed for n in doc["notes"]), ran.out


@clean
def test_compare_prints_the_files_warnings(env):
    _, doc = _top_k(env)
    ran = cli("compare", env.root / "top-k.json")
    printed = " ".join(ran.out.split())
    assert ran.rc == 0 and f"warning ({env.root / 'top-k.json'}): massive_activations: top_k = 10000" in printed


@clean
@pytest.mark.parametrize("odd", [5, {"a": 1}, [None, 3, {"x": [1]}], "one line"], ids=["int", "dict", "mixed", "str"])
def test_compare_and_report_read_any_warnings_field(env, tmp_path, odd):
    """A results file edited by hand: whatever its ``warnings`` holds, compare and report print it, never a
    traceback."""
    _, doc = _top_k(env)
    path = tmp_path / "odd.json"
    path.write_text(json.dumps({**doc, "warnings": odd}))
    compared = cli("compare", path)
    assert compared.rc == 0 and "Traceback" not in compared.err
    assert ("one line" in compared.out) == (odd == "one line")
    assert cli("report", path, "-o", tmp_path / "odd.html").rc == 0 and (tmp_path / "odd.html").stat().st_size


# -- lm-eval ---------------------------------------------------------------------------------------------------------

def _lm_eval(env, name: str, model_class: str = "repgeom-hf", **repgeom: Any) -> Ran:
    """lm-eval's ``simple_evaluate`` on a local loglikelihood task over :data:`TEXTS`, with ``repgeom-hf`` (and
    ``repgeom`` as its repgeom_* arguments); the run, the results in ``ran.rc``."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from repgeom_eval.lmeval.model import RepgeomHFLM
    from repgeom_eval.testing import write_lm_eval_task

    folder = write_lm_eval_task(env.root / f"lm-{name}", "rg_every", [(t, "x") for t in TEXTS])

    def run():
        lm = RepgeomHFLM(pretrained=env.model, batch_size=3, device="cpu", **repgeom)
        return simple_evaluate(model=lm, tasks=["rg_every"], bootstrap_iters=0,
                               task_manager=TaskManager(include_defaults=False, include_path=str(folder)))

    ran = call(run)
    assert isinstance(ran.rc, dict) and ran.rc["results"]["rg_every"]["acc,none"] is not None
    return ran


def _lm_top_k(env):
    """massive_activations (top_k beyond the width, pooling in the deprecated place) and infonce (augmented views)."""
    return env.once("lm-top-k", lambda: _lm_eval(
        env, "top-k", repgeom_metrics="massive_activations,infonce",
        repgeom_metric_params={"massive_activations": {"top_k": 10_000, "pooling": "mean"}}))


@clean
def test_top_k_clamp_lm_eval(env):
    ran = _lm_top_k(env)
    results = ran.rc["results"]["rg_every"]
    assert results["repgeom:massive_activations.top_k_used@final,none"] == 32
    assert any("top_k = 10000 exceeds the layer's 32 dimensions" in line
               for line in ran.rc["repgeom_warnings"]["rg_every"])


@clean
def test_lm_eval_log_has_the_metric_warning(env):
    ran = _lm_top_k(env)
    assert any(m.startswith("repgeom (task rg_every): massive_activations: top_k = 10000 exceeds")
               and m.endswith("(at final)") for m in ran.logged), ran.logged


@clean
def test_lm_eval_deprecated_pooling(env):
    ran = _lm_top_k(env)
    ran.says("repgeom_metric_params.massive_activations.pooling is deprecated: give repgeom_pooling")
    assert ran.rc["results"]["rg_every"]["repgeom:massive_activations.top1_share@final,none"] > 0


@clean
def test_lm_eval_views_extra_pass(env):
    ran = _lm_top_k(env)
    ran.says("repgeom: infonce (task rg_every) compare augmented views that lm-eval does not run")
    assert "repgeom:infonce.raw@final,none" in ran.rc["results"]["rg_every"]


@clean
def test_lm_eval_fused_disabled(env, monkeypatch):
    from repgeom_eval.lmeval import fused

    monkeypatch.setattr(fused, "fused_capture_problem", lambda lm: "lm-eval 9.9 is outside the tested range")
    ran = _lm_eval(env, "fused-off", repgeom_metrics="dispersion")
    ran.says("repgeom: fused capture disabled (lm-eval 9.9 is outside the tested range)")
    assert ran.rc["results"]["rg_every"]["repgeom:dispersion@final,none"] > 0


def _lm_missed(env):
    """A shipped task under plain HFLM while lm-eval's private call order differs from the tested one (no row is
    read during scoring): the capture says so and an extra pass fills every vector."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from repgeom_eval.lmeval.fused import HiddenStates
    from repgeom_eval.testing import write_task_data

    data = write_task_data("piqa", env.root / "piqa.jsonl", n=8, seed=1)
    tm = TaskManager(include_defaults=False, metadata={"repgeom_data": str(data)})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HiddenStates, "_read_row", lambda self, *args: None)
        return call(lambda: simple_evaluate(model=HFLM(pretrained=env.model, batch_size=4, device="cpu"),
                                            tasks=["repgeom_hardness_piqa"], task_manager=tm, bootstrap_iters=0))


@clean
def test_lm_eval_fused_missed(env):
    ran = env.once("lm-missed", lambda: _lm_missed(env))
    ran.says("repgeom: fused capture missed ")
    assert ran.rc["results"]["repgeom_hardness_piqa"]["repgeom_dispersion,none"] > 0


@clean
def test_lm_eval_extra_requests(env):
    ran = env.once("lm-missed", lambda: _lm_missed(env))
    ran.says("requests needed an extra forward pass")
    assert ran.rc["configs"]["repgeom_hardness_piqa"]["metadata"]["repgeom"]["capture"] == "fused"


@clean
def test_lm_eval_repgeom_data_ignored(env, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    (tmp_path / "quiz.jsonl").write_text("".join(
        '{"q": "word %d", "choices": ["a", "b"], "answer": %d}\n' % (i, i % 2) for i in range(8)))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "quiz.yaml").write_text(
        "task: my_quiz\nclass: !function repgeom_eval.lmeval.task.HardnessTask\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'quiz.jsonl'}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{q}}:'\ndoc_to_choice: choices\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n  - metric: repgeom_dispersion\n")
    tm = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False,
                     metadata={"repgeom_data": "elsewhere.jsonl"})
    ran = call(lambda: simple_evaluate(model=HFLM(pretrained=env.model, batch_size=4, device="cpu"),
                                       tasks=["my_quiz"], task_manager=tm, bootstrap_iters=0))
    ran.says("task my_quiz: repgeom_data applies to the shipped repgeom tasks only")
    assert ran.rc["results"]["my_quiz"]["repgeom_dispersion,none"] > 0


# -- MTEB ------------------------------------------------------------------------------------------------------------

def _mteb_tasks(root: Path, blank: bool = False) -> Path:
    texts = [*TEXTS, ""] if blank else TEXTS
    (root / "sts.jsonl").write_text("".join(json.dumps({"sentence1": a, "sentence2": b, "score": float(i)}) + "\n"
                                            for i, (a, b) in enumerate(zip(texts, texts[1:]))))
    (root / "tasks.yaml").write_text("tasks:\n  - {name: TinySTS, type: STS, data: sts.jsonl}\n")
    return root / "tasks.yaml"


def _mteb_run(env, name: str, model: str, *args: Any, blank: bool = False) -> tuple[Ran, dict]:
    """``repgeom mteb run`` on TinySTS at every layer; the run, and layer → the test split's scores."""
    def run():
        root = env.root / f"mteb-{name}"
        root.mkdir()
        ran = cli("mteb", "run", "-m", model, "--tasks-file", _mteb_tasks(root, blank), "-t", "TinySTS",
                  "--layer", "all", "--output-folder", root / "out", "--no-progress", "--no-summary", *args)
        assert ran.rc == 0, ran.err
        scores = {}
        for path in (root / "out").rglob("TinySTS.json"):
            layer = path.parent.parent.name.split("@layer=")[1].split(",")[0]
            scores[layer] = read(path)["scores"]["test"][0]
        assert scores, "mteb run wrote no result"
        return ran, scores

    return env.once(f"mteb:{name}", run)


def _mteb_sweep(env):
    return _mteb_run(env, "sweep", env.model, "--metrics", "massive_activations", "--metric-param",
                     "massive_activations.top_k=10000", blank=True)


@clean
def test_top_k_clamp_mteb(env):
    ran, scores = _mteb_sweep(env)
    line = ran.says("massive_activations: top_k = 10000 exceeds the layer's 32 dimensions")
    assert "(at embed, resid_post:0, final)" in line  # once for the task, every layer named
    for layer_scores in scores.values():
        assert layer_scores["repgeom.massive_activations.top_k_used"] == 32
        assert any("top_k = 10000 exceeds" in w for w in json.loads(layer_scores["repgeom_warnings"]))


@clean
def test_mteb_empty_text(env):
    ran, scores = _mteb_sweep(env)
    ran.says("1 text(s) tokenize to no tokens; their embeddings are zero vectors")
    assert all(s["repgeom_zero_vectors"] == 1 for s in scores.values())


@clean
def test_mteb_sweep_warns_once(env):
    ran, _ = _mteb_sweep(env)
    said = [m for m in ran.said if "on TinySTS (test, default)" in m]
    assert len(said) == 1 and "degenerate results at 3 address(es)" in said[0], ran.said


@clean
def test_mteb_logs_its_warnings(env):
    ran, scores = _mteb_sweep(env)
    assert any("1 of 7 vectors zero" in m for m in ran.logged), ran.logged
    assert all(json.loads(s["repgeom_warnings"]) for s in scores.values())


@clean
def test_mteb_views_extra_passes(env, st_folder):
    ran, scores = _mteb_run(env, "st", st_folder, "--metrics", "infonce")
    ran.says("infonce reads 2 augmented views of every text: each evaluated task split costs extra forward passes")
    assert all("repgeom.infonce.raw" in s for s in scores.values())


@clean
def test_mteb_st_skipped_modules(env, st_folder):
    ran, scores = _mteb_run(env, "st", st_folder, "--metrics", "infonce")
    ran.says("the model's Dense module(s) after pooling are not applied")
    assert set(scores) >= {"embed", "final"}


@clean
def test_mteb_evaluate_warns(env, zero_model, tmp_path):
    import mteb

    from repgeom_eval.mteb_layers import layer_encoder, make_task

    task = make_task({"name": "ZeroSTS", "type": "STS", "data": [
        {"sentence1": a, "sentence2": b, "score": float(i)} for i, (a, b) in enumerate(zip(TEXTS, TEXTS[1:]))]})
    ran = call(mteb.evaluate, layer_encoder(zero_model, "final"), task, cache=mteb.ResultCache(tmp_path),
               show_progress_bar=False)
    ran.says("every vector at every measured address is zero")
    assert list(tmp_path.rglob("ZeroSTS.json"))


# -- training ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(env):
    """`repgeom train` (learning rate 0) on the tiny GPT-2 with a zero output embedding and the geometry probe; its
    domain's evaluation file is too short for a block."""
    def run():
        root = env.root / "train"
        root.mkdir()
        zero_rows, _ = env.once("gap-models", lambda: _gap_models(env))
        for name, texts in (("train", env.texts[:20]), ("eval", ["hi"]), ("probe", env.texts[:6])):
            (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        (root / "train.yaml").write_text(
            f"model: {zero_rows}\n"
            "data: {block_size: 16, domains: {docs: {train: train.jsonl, eval: eval.jsonl}}}\n"
            "training: {max_steps: 2, per_device_train_batch_size: 4, learning_rate: 0.0, use_cpu: true,\n"
            "           save_strategy: steps, save_steps: 1, save_only_model: true}\n"
            "geometry_probe: {texts: probe.jsonl, layers: [final], domain: 'words:the,of,and,to,in,is,a', size: 40,\n"
            "                 burn_in: 0.0}\noutput_dir: out\nsave_model: false\ntorch_threads: 1\n")
        ran = cli("train", "--config", root / "train.yaml", "--no-progress")
        assert ran.rc == 0, ran.err
        return ran, root / "out"

    return env.once("train", run)


@clean
def test_train_domain_without_eval_block(trained):
    ran, out = trained
    ran.says("domain 'docs' has no evaluation block of 16 tokens; its perplexity is not reported")
    assert read(out / "results.json")["train_log"]


@clean
def test_train_probe_degenerate_rows(trained):
    from repgeom_eval.training.geometry import FILE_NAME

    ran, out = trained
    ran.says("model 'the model in training': ")
    assert "rows of the output embedding are all zero" in ran.says("the model in training")
    assert len(read(out / FILE_NAME)["checkpoints"]) == 2


# -- formatters never raise --------------------------------------------------------------------------------------------

ODD = [None, float("nan"), float("inf"), -float("inf"), "text", "", True, 0, -1, 10**30, 1e-300, {"a": {"b": [1]}},
       [1, "x"], (), object(), b"bytes", "resid_post:²", "x:--1", "final:", ":", 0.5]


@clean
def test_warning_formatters_never_raise(request):
    """Every function that words a warning, fed what a broken result or score dict could hold."""
    from repgeom_eval.entrypoints.cli import _format_warning
    from repgeom_eval.measurement.degenerate import Degenerate, degenerate_warning, zero_vector_warning
    from repgeom_eval.measurement.results import address_runs, compact, massive_warning
    from repgeom_eval.modeling.addresses import Address
    from repgeom_eval.mteb_layers.geometry import geometry_warnings, metric_lines, sweep_warning
    from repgeom_eval.mteb_layers.metrics import METRIC_WARNINGS_KEY
    from repgeom_eval.output.console import fmt_number
    from repgeom_eval.output.results_table import warning_lines

    a0, a1 = Address("resid_post", 0), Address("resid_post", 1)
    cases = 0
    for x in ODD:
        flagged = [(a0, 5, x), (a1, 5, x), (x, x, x), x, (a0,), (a1, x, 0.9)]
        calls = [
            lambda: compact(flagged), lambda: compact([(a0, 5, x), (a1, 5, 0.7)]), lambda: address_runs([x, x, x]),
            lambda: address_runs([str(x), "resid_post:1", "resid_post:2"]), lambda: massive_warning(flagged, x),
            lambda: massive_warning([(a0, 3, 0.9)], 0.5, advice=x),
            lambda: degenerate_warning(x, {"final": {"m": x}, "embed": x}, {"final": {"dispersion": {
                "n_vectors": x, "n_zero_vectors": x}}, "embed": x}, {"final": x, "embed": {"top_dimensions": x}}),
            lambda: zero_vector_warning(x, {"final": (x, x), "embed": x, "mlp_out:0": (3, 3)}),
            lambda: Degenerate(str(x), x, x, bool(x) if x == x else True, [str(x)]).describe(),
            lambda: geometry_warnings({METRIC_WARNINGS_KEY: x, "repgeom_massive_share": x,
                                       "repgeom_massive_dimension": x, "repgeom_n_texts": x,
                                       "repgeom_zero_vectors": x, "repgeom_dispersion": x}, str(x), str(x)),
            lambda: metric_lines({METRIC_WARNINGS_KEY: json.dumps([x]) if x in (None, "text", 0) else x}),
            lambda: sweep_warning(str(x), [(a0, "T", {"repgeom_massive_share": x, "repgeom_massive_dimension": x,
                                                      METRIC_WARNINGS_KEY: x, "repgeom_n_texts": x}),
                                           (x, "T", {"repgeom_massive_share": 0.9, METRIC_WARNINGS_KEY: '["w"]'})]),
            lambda: _format_warning(x, UserWarning, "f.py", 1),
            lambda: fmt_number(x, se=x), lambda: fmt_number(0.5, se=x), lambda: warning_lines(x),
        ]
        for fn in calls:
            text = fn()
            assert text is None or isinstance(text, (str, list)), (x, text)
            cases += 1
    assert cases == len(ODD) * len(calls)
    request.node.user_properties.append(("fault_cases", len(ODD)))  # one case per hostile value (tests/conftest.py)
    # the merged forms stay what they were
    assert compact([(a0, 5, 0.53), (a1, 5, 0.98), (Address("final"), 17, 0.76)]) == \
        "resid_post:0..1 (dim 5: 53%-98%), final (dim 17: 76%)"
    assert address_runs(["embed", "resid_post:0", "resid_post:1", "resid_post:2", "final"]) == \
        "embed, resid_post:0..2, final"

