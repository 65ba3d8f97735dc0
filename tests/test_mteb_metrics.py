"""Registered metrics next to MTEB's scores (``repgeom mteb run --metrics``): the value written into mteb's task
result equals ``repgeom measure`` on the same texts (the distinct texts of the task split), layer and pooling, for
built-in metrics of every kind and for the third-party ``mean_norm`` of examples/repgeom-example-metric, installed
for real; cached results gain missing metrics without losing others; the summary shows them.

Tiny random models and the small example tasks generated from Python's documentation; all offline.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import mteb
import pytest
import yaml

import repgeom_eval as rg
from repgeom_eval.entrypoints.cli import main
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.measurement.bank import flatten_result
from repgeom_eval.mteb_layers import make_task, run_layers, summarize
from repgeom_eval.mteb_layers.examples import build_tasks, pydoc_documents, write_example_tasks
from repgeom_eval.mteb_layers.metrics import CONFIG_KEY, RESULT_PREFIX, stored_configs
from repgeom_eval.mteb_layers.summary import to_markdown

TOL = 1e-6  # mteb writes every score rounded to 6 decimals: |rounding| <= 5e-7


@pytest.fixture(scope="module")
def specs():
    return build_tasks(pydoc_documents(), "pydoc", size="small", seed=0)


def fresh_tasks(specs, names=None):
    return [make_task({"name": n, **s}) for n, s in specs.items() if names is None or n in names]


def distinct_texts(spec: dict) -> list[str]:
    """The distinct texts a task split embeds, in the order mteb asks for them, from the task's own records."""
    kind = spec["type"]
    if kind == "STS":
        texts = [r["sentence1"] for r in spec["data"]] + [r["sentence2"] for r in spec["data"]]
    elif kind == "Classification":
        texts = [r["text"] for r in spec["test"]]  # the evaluated split; the training texts are not measured
    elif kind == "Clustering":
        texts = [r["text"] for r in spec["data"]]
    else:  # Retrieval: queries and documents (the example documents have no title)
        assert all(not r.get("title") for r in spec["corpus"])
        texts = [r["text"] for r in spec["queries"]] + [r["text"] for r in spec["corpus"]]
    return list(dict.fromkeys(texts))


def cached_scores(folder: Path, task: str) -> dict[str, dict]:
    """layer → the test split's score dict, read back through mteb's own TaskResult."""
    out = {}
    for path in sorted(folder.rglob(f"{task}.json")):
        layer = json.loads((path.parent / "model_meta.json").read_text())["loader_kwargs"]["layer"]
        (scores,) = mteb.TaskResult.from_disk(path).scores["test"]
        out[layer] = scores
    return out


def assert_equal_to_measure(scores: dict, want: dict, names: list[str], where: str) -> int:
    """Every flat value of ``names`` in measure's result equals its ``repgeom.*`` key in the score dict."""
    compared = 0
    for name in names:
        for flat, value in flatten_result(name, want[name]).items():
            got = scores[RESULT_PREFIX + flat]
            if math.isnan(value):
                assert math.isnan(got), (where, flat)
            else:
                assert abs(got - value) <= TOL, (where, flat, got, value)
            compared += 1
    return compared


# -- built-in metrics: pooled, token and dict-valued, every task type ----------------------------------------------

BUILTIN = ["dispersion", "token_dispersion", "dataset_entropy", "curvature"]


def test_builtin_metrics_in_mteb_results_equal_measure(tiny_model_dir, specs, tmp_path):
    model = tiny_model_dir("gpt2")
    out = tmp_path / "results"
    result = run_layers(model, fresh_tasks(specs), "all", pooling="mean", dtype="float64", batch_size=8,
                        output_folder=out, progress=False, metrics=BUILTIN)
    # the metrics ride on the sweep's own forward passes: exactly as many as without them
    plain = run_layers(model, fresh_tasks(specs), "all", pooling="mean", dtype="float64", batch_size=8,
                       output_folder=None, progress=False)
    assert result.forward_passes == plain.forward_passes
    compared = 0
    for name, spec in specs.items():
        texts = distinct_texts(spec)
        want = rg.measure(model, texts, layers="all", metrics=BUILTIN, pooling="mean", dtype="float64",
                          progress=False).results
        cached = cached_scores(out, name)
        assert sorted(cached) == sorted(want) == ["embed", "final", "resid_post:0"]
        for layer, scores in cached.items():
            assert scores["repgeom_n_texts"] == len(texts)  # the same distinct texts as the fixed geometry
            compared += assert_equal_to_measure(scores, want[layer], BUILTIN, f"{name} {layer}")
            configs = stored_configs(scores)
            assert sorted(configs) == sorted(BUILTIN)
            assert configs["dispersion"]["pooling"] == configs["dataset_entropy"]["pooling"] == "mean"
            assert "pooling" not in configs["token_dispersion"]  # token metrics read the token vectors
            # the fixed geometry keys are still there, computed as before
            assert {"repgeom_dataset_entropy", "repgeom_dispersion", "repgeom_effective_rank"} <= set(scores)
    assert compared == 4 * 3 * 8  # tasks × layers × flat values (dataset_entropy: 4, curvature: 2)
    # the rows of the run carry the same keys
    row = next(r for r in result.rows if r["task"] == "PydocSTS" and r["layer"] == "final")
    assert row["repgeom.dispersion"] == pytest.approx(cached_scores(out, "PydocSTS")["final"]["repgeom.dispersion"],
                                                      abs=TOL)


def test_each_distinct_text_counts_once(tiny_model_dir, tmp_path):
    """Texts repeated within and across the encoded lists are measured once; a whitespace-only text is left out,
    as measure leaves it out."""
    from pydoc_data.topics import topics

    sentences = [" ".join(topics[k].split()[:5 + i]) for i, k in enumerate(sorted(topics)[10:16])]
    pairs = [(sentences[0], sentences[1], 1.0), (sentences[1], sentences[2], 2.0), (sentences[0], sentences[3], 0.5),
             (sentences[4], sentences[4], 4.0), ("   ", sentences[5], 0.0), (sentences[5], sentences[0], 3.0)]
    spec = {"type": "STS", "data": [{"sentence1": a, "sentence2": b, "score": s} for a, b, s in pairs]}
    model = tiny_model_dir("llama")
    names = ["dispersion", "token_dispersion", "vendi"]
    run_layers(model, [make_task({"name": "DupSTS", **spec})], "final", pooling="mean", dtype="float64",
               batch_size=3, output_folder=tmp_path, progress=False, metrics=names)
    texts = distinct_texts(spec)
    assert len(texts) == 7  # six sentences and the blank one
    want = rg.measure(model, texts, layers="final", metrics=names, pooling="mean", dtype="float64",
                      progress=False).results["final"]
    assert assert_equal_to_measure(cached_scores(tmp_path, "DupSTS")["final"], want, names, "final") == 3


def test_view_metric_takes_extra_passes_and_equals_measure(tiny_model_dir, specs, tmp_path):
    import nlpaug  # noqa: F401 - dev extra: missing must fail, not skip

    model = tiny_model_dir("gpt2")
    with pytest.warns(UserWarning, match="augmented views of every text"):
        result = run_layers(model, fresh_tasks(specs, ["PydocSTS"]), [1, "final"], pooling="mean", dtype="float64",
                            output_folder=tmp_path / "r", progress=False, metrics=["infonce", "dispersion"], seed=3)
    texts = distinct_texts(specs["PydocSTS"])
    assert result.view_sequences == 2 * len(texts)  # two views of each distinct text, once for both layers
    want = rg.measure(model, texts, layers=["resid_post:0", "final"], metrics=["infonce", "dispersion"],
                      pooling="mean", dtype="float64", seed=3, progress=False).results
    for layer, scores in cached_scores(tmp_path / "r", "PydocSTS").items():
        assert_equal_to_measure(scores, want[layer], ["infonce", "dispersion"], layer)
        assert stored_configs(scores)["infonce"]["n_views"] == 2


# -- a third-party metric, installed with pip, through the command line --------------------------------------------

def _env(site: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]),
                "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
                "COLUMNS": "200"})
    env.pop("REPGEOM_STRICT_PLUGINS", None)
    return env


def test_third_party_metric_in_mteb_results_equals_measure(example_plugin_site, tiny_model_dir, tmp_path):
    """`repgeom mteb run --metrics mean_norm` and `repgeom measure --metrics mean_norm` in fresh interpreters that
    find the plugin through its entry point. --normalize true: the MTEB embedding is unit length, the metrics still
    read the pooled hidden states (as measure does), so mean_norm is not 1."""
    model = tiny_model_dir("gpt2")
    tasks_file = write_example_tasks(tmp_path / "tasks", size="small")
    sts = next(t for t in yaml.safe_load(tasks_file.read_text())["tasks"] if t["name"] == "PydocSTS")
    records = [json.loads(line) for line in (tasks_file.parent / sts["data"]).read_text().splitlines() if line]
    texts = distinct_texts({"type": "STS", "data": records})
    with open(tmp_path / "texts.jsonl", "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    names = ["mean_norm", "dispersion"]
    commands = {
        "mteb": ["mteb", "run", "-m", model, "--layer", "all", "--pooling", "last", "--normalize", "true",
                 "--dtype", "float64", "--tasks-file", str(tasks_file), "-t", "PydocSTS", "--metrics", *names,
                 "--output-folder", "results", "--no-progress"],
        "measure": ["measure", "--model", model, "--data", "texts.jsonl", "--layers", "all", "--metrics", *names,
                    "--pooling", "last", "--dtype", "float64", "--output", "out.json", "--no-progress"],
    }
    procs = {k: subprocess.Popen([sys.executable, "-m", "repgeom_eval", *args], cwd=tmp_path,
                                 env=_env(example_plugin_site), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for k, args in commands.items()}
    done = {}
    try:
        for k, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"repgeom {' '.join(commands[k])} failed:\n{stdout}\n{stderr}"
            done[k] = stdout
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert "mean_norm" in done["mteb"]  # the run's table shows it
    want = json.loads((tmp_path / "out.json").read_text())["results"]
    cached = cached_scores(tmp_path / "results", "PydocSTS")
    assert sorted(cached) == sorted(want) == ["embed", "final", "resid_post:0"]
    for layer, scores in cached.items():
        assert_equal_to_measure(scores, want[layer], names, layer)
        assert abs(scores["repgeom.mean_norm"] - 1.0) > 1e-3
        assert stored_configs(scores)["mean_norm"] == {
            "pooling": "last",  # and the plugin that computed it, as in every output
            "plugin": {"plugin": "example", "distribution": "repgeom-example-metric", "version": "0.1.0"}}
    # the summary (no plugin needed to read it back) shows the third-party metric
    summary = subprocess.run([sys.executable, "-m", "repgeom_eval", "mteb", "summary", "results", "--no-plot"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300,
                             env=_env(example_plugin_site) | {"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    assert summary.returncode == 0, summary.stderr
    assert "mean_norm" in summary.stdout and "cosine_spearman" in summary.stdout
    header = (tmp_path / "results" / "repgeom_summary.csv").read_text().splitlines()[0].split(",")
    assert {"repgeom.mean_norm", "repgeom.dispersion"} <= set(header)
    assert "| mean_norm |" in (tmp_path / "results" / "repgeom_summary.md").read_text()


# -- the cache: missing metrics are added, others kept; changed parameters recomputed --------------------------------

def test_resume_adds_missing_metrics_and_keeps_the_others(tiny_model_dir, specs, tmp_path):
    model = tiny_model_dir("gpt2")
    out = tmp_path / "cache"

    def run(**kwargs):
        return run_layers(model, fresh_tasks(specs, ["PydocSTS"]), [0, 2], pooling="mean", output_folder=out,
                          progress=False, **kwargs)

    first = run()
    assert first.forward_passes > 0
    before = cached_scores(out, "PydocSTS")
    assert all(not any(k.startswith(RESULT_PREFIX) for k in s) and CONFIG_KEY not in s for s in before.values())
    added = run(metrics=["dispersion"])
    assert added.forward_passes == first.forward_passes  # evaluated again, both layers in one sweep
    after = cached_scores(out, "PydocSTS")
    for layer, scores in after.items():
        assert scores["main_score"] == before[layer]["main_score"]
        assert math.isfinite(scores["repgeom.dispersion"])
    assert run(metrics=["dispersion"]).forward_passes == 0  # complete: read from the cache
    assert run().forward_passes == 0  # asking for fewer metrics never recomputes
    more = run(metrics=["vendi"])  # another metric: computed, the cached dispersion is kept
    assert more.forward_passes > 0
    both = cached_scores(out, "PydocSTS")
    for layer, scores in both.items():
        assert scores["repgeom.dispersion"] == after[layer]["repgeom.dispersion"]
        assert sorted(stored_configs(scores)) == ["dispersion", "vendi"] and "repgeom.vendi" in scores
    assert run(metrics=["dispersion", "vendi"]).forward_passes == 0
    other = run(metrics=["dispersion"], metric_params={"dispersion": {"pooling": "last"}})  # other parameters
    assert other.forward_passes > 0
    last = cached_scores(out, "PydocSTS")
    for layer, scores in last.items():
        assert stored_configs(scores)["dispersion"]["pooling"] == "last"
        assert scores["repgeom.dispersion"] != after[layer]["repgeom.dispersion"]
        assert scores["repgeom.vendi"] == both[layer]["repgeom.vendi"]
    # the summary names the main score of a local task and shows the metrics
    rows = summarize(out)
    assert {r["main_score_name"] for r in rows} == {"cosine_spearman"}
    markdown = to_markdown(rows)
    assert "| layer | depth | cosine_spearman |" in markdown and " dispersion | vendi |" in markdown


# -- errors ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra,message", [
    (["--metrics", "no_such_metric"], "unknown metric 'no_such_metric'"),
    (["--metrics", "dispersion", "--metric-param", "vendi.q=2"], "not requested"),
    (["--metric-param", "dispersion.pooling=last"], "no --metrics requested"),
    (["--metrics", "dispersion", "--metric-param", "dispersion.colour=1"], "has no parameter"),
])
def test_cli_metric_errors_are_one_line(tiny_model_dir, tmp_path, capsys, extra, message):
    argv = ["mteb", "run", "-m", tiny_model_dir("bert"), "-t", "PydocSTS", "--output-folder", str(tmp_path), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("repgeom: error:") and message in err and len(err.splitlines()) == 1, err


def test_metric_param_is_parsed_as_measure_parses_it(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["mteb", "run", "-m", "x", "--metric-param", "no-equals-sign"])
    assert exc.value.code == 2
    assert "expected METRIC.PARAM=VALUE" in capsys.readouterr().err


def test_python_api_refuses_unknown_metrics_before_loading(specs):
    with pytest.raises(RepgeomError, match="unknown metric"):
        run_layers("/nonexistent/model", fresh_tasks(specs, ["PydocSTS"]), "final", output_folder=None,
                   metrics=["no_such_metric"], progress=False)
