"""Nothing silent, round 4: the cases a hostile pass found, each as a new user would meet it.

Outputs that are devices or links, ``compare`` keeping models and recipes apart, the MTEB layout ``repgeom mteb run``
writes today, warnings that must never crash and must reach every surface, the right diagnosis first (NaN weights),
resumed states checked against their texts (tests/test_fault_injection.py), hostile YAML, and one-line errors where
tracebacks were.
"""

from __future__ import annotations

import json
import math
import os
import stat
import warnings
from pathlib import Path

import pytest
import torch

import repgeom_eval as rg
from repgeom_eval.entrypoints.cli import main

TEXTS = ["one two three four", "five six seven", "eight nine ten eleven twelve", "thirteen fourteen",
         "a longer sentence about rivers and hills", "numbers like 3 and 4"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("silent")
    data = tmp / "texts.txt"
    data.write_text("\n".join(TEXTS) + "\n")
    return tiny_model_dir("gpt2"), data, tmp


def one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("repgeom: warning:")]
    assert len(lines) == 1 and lines[0].startswith("repgeom: error:"), err
    return lines[0]


# -- outputs that are not regular files --------------------------------------------------------------------------------

@pytest.mark.fault("clean")
@pytest.mark.parametrize("flag", ["--output", "--per-text"])
def test_a_link_to_a_device_is_written_through_never_replaced(setup, tmp_path, flag):
    model, data, _ = setup
    link = tmp_path / "out.json"
    link.symlink_to(os.devnull)
    other = ["--per-text", str(tmp_path / "scores.jsonl")] if flag == "--output" else ["-o", str(tmp_path / "r.json")]
    assert main(["measure", "-m", model, "-d", str(data), flag, str(link), *other, "--no-progress"]) == 0
    assert link.is_symlink() and os.readlink(link) == os.devnull
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)  # still the device


@pytest.mark.fault("clean")
def test_both_outputs_on_dev_null_and_a_link_to_a_file_keeps_the_link(setup, tmp_path):
    model, data, _ = setup
    null = tmp_path / "null"
    null.symlink_to(os.devnull)
    assert main(["measure", "-m", model, "-d", str(data), "-o", str(null), "--per-text", str(null),
                 "--no-progress"]) == 0
    real = tmp_path / "real.json"
    real.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert main(["measure", "-m", model, "-d", str(data), "-o", str(link), "--no-progress"]) == 0
    assert link.is_symlink() and json.loads(real.read_text())["results"]["final"]["dispersion"] > 0


@pytest.mark.fault("clean")
def test_compare_csv_and_report_write_through_a_device(setup, tmp_path):
    model, data, _ = setup
    result = tmp_path / "r.json"
    assert main(["measure", "-m", model, "-d", str(data), "-o", str(result), "--no-progress"]) == 0
    null = tmp_path / "null"
    null.symlink_to(os.devnull)
    assert main(["compare", str(result), "--csv", str(null)]) == 0
    assert main(["report", str(result), "-o", str(null)]) == 0
    assert null.is_symlink() and stat.S_ISCHR(os.stat(os.devnull).st_mode)


@pytest.mark.fault("refused")
def test_a_prediction_folder_inside_the_model_folder_is_refused(setup, tmp_path, capsys):
    model, _, good = setup
    line = _mteb_refused(model, ["--prediction-folder", str(Path(model) / "preds")], tmp_path, capsys)
    assert "--prediction-folder" in line and "inside the --model folder" in line
    assert not (Path(model) / "preds").exists()


def _mteb_refused(model: str, extra: list[str], tmp_path: Path, capsys) -> str:
    tasks = tmp_path / "tasks.yaml"
    (tmp_path / "sts.jsonl").write_text("".join(json.dumps({"sentence1": a, "sentence2": b, "score": float(i)}) + "\n"
                                                for i, (a, b) in enumerate(zip(TEXTS, TEXTS[1:]))))
    tasks.write_text("tasks:\n  - {name: TinySTS, type: STS, data: sts.jsonl}\n")
    capsys.readouterr()
    rc = main(["mteb", "run", "-m", model, "--tasks-file", str(tasks), "-t", "TinySTS", "--no-progress",
               "--output-folder", str(tmp_path / "out"), *extra])
    assert rc == 2
    return one_error_line(capsys.readouterr().err)


# -- compare ------------------------------------------------------------------------------------------------------------

def test_compare_keeps_two_models_of_one_folder_name_and_two_recipes_apart(tiny_model_dir, tmp_path, setup):
    import shutil

    from repgeom_eval.output.results_table import column_labels, read_results, wide

    _, data, _ = setup
    for folder, kind in (("a", "gpt2"), ("b", "llama")):
        shutil.copytree(tiny_model_dir(kind), tmp_path / folder / "gpt2")
    files = []
    for folder, pooling in (("a", None), ("b", None), ("a", "mean")):
        out = tmp_path / f"{folder}-{pooling}.json"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rg.measure(str(tmp_path / folder / "gpt2"), str(data), layers="all", pooling=pooling,
                       progress=False).write(out)
        files.append(out)
    rows, _ = read_results(files)
    labels, table = wide(rows)
    assert len(labels) == 3 and len(set(labels)) == 3, labels
    assert any(label.startswith("a/gpt2") for label in labels) and any(label.startswith("b/gpt2") for label in labels)
    assert any("pooling=mean" in label for label in labels)
    values = {label: {} for label in labels}
    for key, by_label in table:
        for label, value in by_label.items():
            values[label][key] = value
    a_last = next(label for label in labels if label.startswith("a/gpt2") and "mean" not in label)
    b = next(label for label in labels if label.startswith("b/gpt2"))
    assert values[a_last] != values[b]  # no column mixes the two models
    assert len(column_labels(rows)) == 3


def test_a_nan_result_shows_as_nan_in_its_own_column(tmp_path):
    from repgeom_eval.output.results_table import read_results, wide

    doc = {"model": {"name": "m1", "n_layers": 2}, "data": {"path": "t.txt"},
           "config": {"layers": ["final"], "pooling": None, "dtype": "float32"},
           "results": {"final": {"dispersion": None}}}
    other = {**doc, "model": {"name": "m2", "n_layers": 2}, "results": {"final": {"dispersion": 0.5}}}
    (tmp_path / "1.json").write_text(json.dumps(doc))
    (tmp_path / "2.json").write_text(json.dumps(other))
    labels, table = wide(read_results([tmp_path / "1.json", tmp_path / "2.json"])[0])
    (_, by_label), = table
    assert math.isnan(by_label["m1"]) and by_label["m2"] == 0.5


def test_compare_reads_the_folder_repgeom_mteb_run_writes(setup, tmp_path):
    from repgeom_eval.mteb_layers import make_task, run_layers
    from repgeom_eval.output.results_table import read_results

    model, _, _ = setup
    task = make_task({"name": "TinySTS", "type": "STS",
                      "data": [{"sentence1": a, "sentence2": b, "score": float(i)}
                               for i, (a, b) in enumerate(zip(TEXTS, TEXTS[1:]))]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_layers(model, [task], "all", output_folder=tmp_path / "out", progress=False)
    rows, _ = read_results([tmp_path / "out"])
    assert {r["address"] for r in rows} == {"embed", "resid_post:0", "resid_post:1", "final"} - {"resid_post:1"}
    assert all(r["model"].endswith(Path(model).name) and "pooling=" in r["recipe"] for r in rows)
    assert main(["compare", str(tmp_path / "out")]) == 0


# -- warnings --------------------------------------------------------------------------------------------------------

def test_a_metric_warning_never_crashes_and_reaches_every_surface(setup, tmp_path):
    """massive_activations with top_k beyond the width: measure, the MTEB sweep and repgeom-hf all warn and record
    top_k_used (the warning once crashed measure's formatter after the whole run)."""
    model, data, _ = setup
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = rg.measure(model, str(data), layers="all", metrics=["massive_activations"],
                            metric_params={"massive_activations": {"top_k": 10_000}}, progress=False)
    said = [str(w.message) for w in caught if "exceeds the layer" in str(w.message)]
    assert said and "embed, resid_post:0..1, final" in said[0] or "embed" in said[0]
    assert result.diagnostics["final"]["massive_activations"]["top_k_used"] == 32

    from repgeom_eval.mteb_layers import make_task, run_layers

    task = make_task({"name": "TinySTS", "type": "STS", "data": [{"sentence1": a, "sentence2": b, "score": float(i)}
                                                                 for i, (a, b) in enumerate(zip(TEXTS, TEXTS[1:]))]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sweep = run_layers(model, [task], "final", output_folder=None, progress=False,
                           metrics=["massive_activations"], metric_params={"massive_activations": {"top_k": 10_000}})
    row = sweep.rows[0]
    assert row["repgeom.massive_activations.top_k_used"] == 32
    assert any("top_k = 10000 exceeds" in w for w in row["repgeom_warnings"])


@pytest.mark.fault("refused")
def test_an_sts_task_whose_scores_span_nothing_is_refused():
    from repgeom_eval.spec.errors import RepgeomError
    from repgeom_eval.mteb_layers import make_task

    with pytest.raises(RepgeomError, match="scores span nothing"):
        make_task({"name": "Flat", "type": "STS", "data": [{"sentence1": "a", "sentence2": "b", "score": 1},
                                                            {"sentence1": "c", "sentence2": "d", "score": 1}]})


def test_views_only_metrics_raise_no_false_all_zero_warning(setup):
    model, data, _ = setup
    for metric in ("infonce", "lidar"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rg.measure(model, str(data), metrics=[metric], progress=False)
        assert not [w for w in caught if "zero" in str(w.message)], metric


# -- the right diagnosis first ------------------------------------------------------------------------------------------

@pytest.mark.fault("refused")
def test_nan_weights_are_named_before_any_structural_check(setup, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, data, _ = setup
    broken = AutoModelForCausalLM.from_pretrained(model)
    with torch.no_grad():
        broken.transformer.h[1].mlp.c_fc.weight[0, 0] = float("nan")
    broken.save_pretrained(tmp_path / "nan")
    AutoTokenizer.from_pretrained(model).save_pretrained(tmp_path / "nan")
    capsys.readouterr()
    assert main(["measure", "-m", str(tmp_path / "nan"), "-d", str(data), "--no-progress"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "NaN or inf" in line and "transformer.h.1.mlp.c_fc.weight" in line and "table" not in line


# -- hostile configuration files ----------------------------------------------------------------------------------------

BOMB = 'a: &a ["x","x","x","x","x","x","x","x","x"]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: [*b,*b,*b,*b,*b,*b,*b]\n'


@pytest.mark.fault("refused")
@pytest.mark.parametrize("command", [["measure", "--config"], ["train", "--config"], ["mteb", "run", "-m", "M",
                                                                                      "--tasks-file"]])
def test_yaml_aliases_are_refused_in_every_reader(command, tmp_path, capsys):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    capsys.readouterr()
    assert main([*command, str(bomb)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "alias" in line and len(line) < 300


@pytest.mark.fault("refused")
def test_a_device_as_config_file_is_named_as_such(capsys):
    assert main(["measure", "--config", "/dev/zero"]) == 2
    assert "not a regular file" in one_error_line(capsys.readouterr().err)


# -- one line where a traceback was --------------------------------------------------------------------------------------

@pytest.mark.fault("refused")
def test_a_layer_pick_parameter_is_checked_before_the_model_runs(setup, tmp_path, capsys):
    model, _, _ = setup
    line = _mteb_refused(model, ["--layer", "auto", "--layer-pick-param", "alpha=-1"], tmp_path, capsys)
    assert "alpha=-1.0 must be > 0" in line


@pytest.mark.fault("refused")
def test_a_corrupt_vectors_file_is_one_line(tmp_path, capsys):
    (tmp_path / "q.jsonl").write_text("".join(json.dumps({"id": i, "correct": i % 2 == 0}) + "\n" for i in range(20)))
    (tmp_path / "v.safetensors").write_bytes(b"garbage that is no header")
    assert main(["slices", str(tmp_path / "q.jsonl"), "--vectors", str(tmp_path / "v.safetensors")]) == 2
    assert "not a readable .safetensors file" in one_error_line(capsys.readouterr().err)


@pytest.mark.fault("refused")
def test_a_missing_optional_package_names_the_extra(monkeypatch, capsys):
    """A command whose optional package is missing (scripts/check_install.py runs the real case: `mteb run` with the
    core install alone) is one line naming the extra to install."""
    import argparse

    from repgeom_eval.entrypoints import cli

    def missing(args):
        raise ModuleNotFoundError("No module named 'mteb'", name="mteb")

    monkeypatch.setattr(cli._Parser, "parse_args", lambda self, argv=None: argparse.Namespace(_run=missing))
    assert main(["plugins"]) == 2
    assert 'pip install "repgeom-eval[mteb]"' in one_error_line(capsys.readouterr().err)
    assert cli.extra_for("lm_eval.api") == "lmeval" and cli.extra_for("numpy") is None


@pytest.mark.fault("refused")
def test_switching_off_the_commands_plugin_says_what_to_do(capsys):
    assert main(["-p", "no:commands", "measure"]) == 2
    assert "drop -p no:commands" in one_error_line(capsys.readouterr().err)


def test_save_strategy_no_is_the_string_no():
    from repgeom_eval.spec.options.train import _training_arguments

    assert dict(_training_arguments({"save_strategy": False, "max_steps": 3})) == {"save_strategy": "no",
                                                                                   "max_steps": 3}


def test_a_metric_warning_reaches_repgeom_hf_with_its_numbers(setup, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from repgeom_eval.lmeval.model import RepgeomHFLM

    model, _, _ = setup
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"q": t, "a": "x"}) + "\n" for t in TEXTS))
    (tmp_path / "rg_warn.yaml").write_text(
        'task: rg_warn\noutput_type: loglikelihood\ndoc_to_text: "{{q}}"\ndoc_to_target: " {{a}}"\n'
        f"metric_list:\n  - {{metric: acc}}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'docs.jsonl'}\ntest_split: test\nmetadata:\n  version: 1.0\n")
    lm = RepgeomHFLM(pretrained=model, batch_size=3, device="cpu", repgeom_metrics="massive_activations",
                     repgeom_metric_params={"massive_activations": {"top_k": 10_000}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = simple_evaluate(model=lm, tasks=["rg_warn"], bootstrap_iters=0,
                              task_manager=TaskManager(include_defaults=False, include_path=str(tmp_path)))
    assert out["results"]["rg_warn"]["repgeom:massive_activations.top_k_used@final,none"] == 32
    assert any("top_k = 10000 exceeds" in line for line in out["repgeom_warnings"]["rg_warn"])
