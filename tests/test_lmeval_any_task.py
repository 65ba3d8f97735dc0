"""``--model repgeom-hf`` with ``repgeom_metrics``: geometry rows in every task of a run (docs/lmeval.md#any-task).

A user's YAML task per output type (loglikelihood, multiple_choice, loglikelihood_rolling, generate_until) over a
local JSON-lines file: each value in lm-eval's results, and each per-sample value of ``--log_samples``, equals
``repgeom measure`` over the same texts (the very tokens lm-eval ran) with the same layer and pooling; without a
``repgeom_*`` option ``repgeom-hf`` gives exactly ``hf``'s numbers; the degenerate-number and massive-activation
warnings of ``repgeom measure`` reach the results (``repgeom_warnings``) and the log. The model runs in float64
in both places, so what is compared is the pipeline (tokens, positions, pooling, metric states).
"""

from __future__ import annotations

import json
import logging
import math
import random

import pytest

import lm_eval  # noqa: F401  (dev extra: missing must fail, not skip)
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

import repgeom_eval as rg
from repgeom_eval.lmeval.model import RepgeomHFLM
from repgeom_eval.lmeval.registered import score_name

TOL = 1e-6
WORDS = "the cat sat on a mat while dogs ran over green hills near old towns and birds sang".split()
OUTPUT_TYPES = {
    "loglikelihood": 'doc_to_text: "{{q}}"\ndoc_to_target: " {{a}}"\nmetric_list:\n  - {metric: acc}\n',
    "multiple_choice": 'doc_to_text: "Q: {{q}}\\nA:"\ndoc_to_choice: choices\ndoc_to_target: label\n'
                       "metric_list:\n  - {metric: acc}\n",
    "loglikelihood_rolling": 'doc_to_text: ""\ndoc_to_target: "{{q}}"\nmetric_list:\n  - {metric: word_perplexity}\n',
    "generate_until": 'doc_to_text: "Q: {{q}}\\nA:"\ndoc_to_target: "{{a}}"\n'
                      'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 4\n  do_sample: false\n'
                      "metric_list:\n  - {metric: exact_match}\n",
}
TASKS = {f"rg_any_{kind}": kind for kind in OUTPUT_TYPES}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """One YAML task per output type, all reading one local JSON-lines file (absolute path: no Hub)."""
    folder = tmp_path_factory.mktemp("any-task")
    rng = random.Random(3)
    with open(folder / "docs.jsonl", "w") as fh:
        for _ in range(9):
            fh.write(json.dumps({"q": " ".join(rng.choices(WORDS, k=rng.randint(3, 8))), "a": rng.choice(WORDS),
                                 "choices": rng.sample(WORDS, 3), "label": rng.randrange(3)}) + "\n")
    for task, kind in TASKS.items():
        (folder / f"{task}.yaml").write_text(
            f"task: {task}\noutput_type: {kind}\n{OUTPUT_TYPES[kind]}dataset_path: json\ndataset_kwargs:\n"
            f"  data_files:\n    test: {folder / 'docs.jsonl'}\ntest_split: test\nmetadata:\n  version: 1.0\n")
    return folder


def evaluate(lm, task_dir, tasks, **kwargs):
    tm = TaskManager(include_defaults=False, include_path=str(task_dir))
    return simple_evaluate(model=lm, tasks=list(tasks), task_manager=tm, log_samples=True, bootstrap_iters=0,
                           **kwargs)


def measured(model_dir, texts, **options):
    return rg.measure(model_dir, texts, dtype="float64", batch_size=3, per_text=True, progress=False, **options)


def the_texts(lm, kind, samples):
    """The text of each document and, checked, that measure tokenizes it into exactly the tokens lm-eval ran."""
    texts = []
    for sample in samples:
        args = sample["arguments"]
        first = args[0] if isinstance(args, list) else args["gen_args_0"]
        if kind == "generate_until":
            text = first["arg_0"] if isinstance(first, dict) else first[0]
            ran = lm.tok_batch_encode([text], left_truncate_len=lm.max_length - 4)[0][0].tolist()
        elif kind == "loglikelihood_rolling":
            doc = sample["target"]
            tokens = lm.tok_encode(doc)
            assert len(tokens) < lm.max_length  # one window: the scored positions are the prefix and doc[:-1]
            ran = [lm.prefix_token_id, *tokens[:-1]]
            text = lm.tokenizer.decode(ran)
        else:
            ctx, cont = first
            ctx_enc, cont_enc = lm._encode_pair(ctx, cont)
            ran = ctx_enc
            text = ctx.rstrip()  # lm-eval moves a context's trailing spaces to the continuation
        texts.append(text)
        assert lm.tokenizer(text)["input_ids"] == ran, (kind, text)
    return texts


@pytest.mark.parametrize("task", list(TASKS))
def test_every_output_type_equals_measure_on_the_texts_lm_eval_ran(model_dir, task_dir, task, capsys):
    kind = TASKS[task]
    lm = RepgeomHFLM(pretrained=model_dir, batch_size=4, device="cpu", dtype="float64",
                     repgeom_metrics="dispersion,dataset_entropy", repgeom_layers="resid_post:0,final")
    out = evaluate(lm, task_dir, [task])
    results = out["results"][task]
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    texts = the_texts(lm, kind, samples)
    result = measured(model_dir, texts, layers="resid_post:0,final", metrics=["dispersion", "dataset_entropy"])
    from repgeom_eval.measurement.bank import flatten_result

    worst, compared = 0.0, 0
    for addr, by_metric in result.results.items():
        for metric, value in by_metric.items():
            for flat, number in flatten_result(metric, value).items():
                got = results[f"{score_name(flat, addr)},none"]
                worst = max(worst, abs(got - number))
                compared += 1
        for sample, row in zip(samples, result.per_text):
            got = sample[score_name("dispersion", addr)]
            worst = max(worst, abs(got - row["scores"][addr]["dispersion"]))
            compared += 1
    with capsys.disabled():
        print(f"\n{task}: {compared} values, max |lm-eval - measure| = {worst:.3g}")
    assert compared >= 4 + 2 * len(samples) and worst < TOL
    record = out["configs"][task]["metadata"]["repgeom"]
    assert record["metric_addresses"] == ["resid_post:0", "final"] and record["population"].startswith("document")
    assert out["repgeom_warnings"] == {}  # nothing degenerate here; the key says the check ran
    held = out["repgeom_memory"]  # what the registered metrics held, and the process's peak
    assert held["peak_rss_bytes"] > 10 * 2**20 and "cuda_max_memory_allocated_bytes" not in held
    assert 0 < held["state_bytes"] < held["peak_rss_bytes"]


def numbers(results):
    return {task: {k: v for k, v in values.items() if isinstance(v, (int, float))} for task, values in results.items()}


def test_without_repgeom_options_repgeom_hf_is_hf(model_dir, task_dir):
    tasks = ["rg_any_loglikelihood", "rg_any_multiple_choice", "rg_any_generate_until"]
    hf = evaluate(HFLM(pretrained=model_dir, batch_size=4, device="cpu", dtype="float64"), task_dir, tasks)
    ours = evaluate(RepgeomHFLM(pretrained=model_dir, batch_size=4, device="cpu", dtype="float64"), task_dir, tasks)
    assert numbers(ours["results"]) == numbers(hf["results"])
    assert "repgeom_warnings" not in ours
    assert not [k for s in ours["samples"].values() for k in s[0] if k.startswith("repgeom")]
    assert ours["configs"] == hf["configs"]


def test_measures_warnings_reach_the_results_and_the_log(model_dir, task_dir, monkeypatch, caplog):
    """One document: dispersion is NaN (measure's degenerate-number warning); a threshold of 1% flags every address
    as dominated by one dimension (measure's massive-activation warning, at its default of 50% on a real model)."""
    from repgeom_eval.lmeval import diagnostics

    monkeypatch.setattr(diagnostics, "MASSIVE_SHARE", 0.01)
    lm = RepgeomHFLM(pretrained=model_dir, batch_size=4, device="cpu", dtype="float64", repgeom_metrics="dispersion")
    with caplog.at_level(logging.WARNING, logger="lm_eval.repgeom"):
        out = evaluate(lm, task_dir, ["rg_any_multiple_choice"], limit=1)
    said = out["repgeom_warnings"]["rg_any_multiple_choice"]
    assert any("one hidden dimension carries at least 1% of the squared norm" in line for line in said)
    assert any("degenerate results" in line and "NaN dispersion" in line for line in said)
    assert math.isnan(out["results"]["rg_any_multiple_choice"]["repgeom:dispersion@final,none"])
    logged = [r.getMessage() for r in caplog.records if r.name == "lm_eval.repgeom"]
    assert len(logged) == len(said) and all("rg_any_multiple_choice" in line for line in logged)


def test_plain_lm_eval_adds_rows_to_every_task_of_a_group_and_the_others(model_dir, task_dir, tmp_path):
    """The command line of the issue, with plain ``lm_eval`` (the start-up hook registers ``repgeom-hf``): a group of
    two tasks and two more tasks; rows in the results JSON, per-sample values in the samples files."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (task_dir / "rg_any_group.yaml").write_text(
        "group: rg_any_group\ntask: [rg_any_loglikelihood, rg_any_multiple_choice]\n"
        "aggregate_metric_list:\n  - {metric: acc, aggregation: mean, weight_by_size: true}\nmetadata:\n  version: 1\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("REPGEOM_LM_EVAL_AUTOLOAD", None)
    cmd = [str(Path(sys.executable).parent / "lm_eval"), "--model", "repgeom-hf", "--model_args",
           f"pretrained={model_dir},repgeom_metrics=dispersion,repgeom_layers=final", "--tasks",
           "rg_any_group,rg_any_loglikelihood_rolling,rg_any_generate_until", "--include_path", str(task_dir),
           "--device", "cpu", "--batch_size", "4", "--log_samples", "--output_path", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    saved = json.loads(results_file.read_text())
    tasks = ["rg_any_loglikelihood", "rg_any_multiple_choice", "rg_any_loglikelihood_rolling", "rg_any_generate_until"]
    for task in tasks:
        assert 0 < saved["results"][task]["repgeom:dispersion@final,none"] < 2, task
        (samples_file,) = (tmp_path / "out").rglob(f"samples_{task}_20*.jsonl")
        for line in samples_file.read_text().splitlines():
            assert isinstance(json.loads(line)["repgeom:dispersion@final"], float)
    assert "repgeom_warnings" in saved
    assert "repgeom:dispersion@final" in proc.stdout  # lm-eval's table


def test_the_metadata_route_and_the_cache_refusal(model_dir, task_dir, tmp_path):
    """``repgeom_metrics`` in ``--metadata`` (the TaskManager's metadata) reaches every task of a ``repgeom-hf`` run
    as well; with ``--use_cache`` the answers would skip the forward pass, so the run is refused before any compute."""
    from repgeom_eval.spec.errors import RepgeomError

    lm = RepgeomHFLM(pretrained=model_dir, batch_size=4, device="cpu", dtype="float64")
    tm = TaskManager(include_defaults=False, include_path=str(task_dir),
                     metadata={"repgeom_metrics": ["dispersion"], "repgeom_layers": ["resid_post:-1"]})
    out = simple_evaluate(model=lm, tasks=["rg_any_loglikelihood"], task_manager=tm, bootstrap_iters=0)
    assert 0 < out["results"]["rg_any_loglikelihood"]["repgeom:dispersion@resid_post:1,none"] < 2
    with pytest.raises(RepgeomError, match="--use_cache"):
        simple_evaluate(model=RepgeomHFLM(pretrained=model_dir, batch_size=4, device="cpu",
                                          repgeom_metrics="dispersion"),
                        tasks=["rg_any_loglikelihood"], bootstrap_iters=0, use_cache=str(tmp_path / "cache"),
                        task_manager=TaskManager(include_defaults=False, include_path=str(task_dir)))


def test_each_repgeom_setting_is_parsed_once_per_process(model_dir, task_dir, monkeypatch):
    """The model's own check, and every task of the run, read the same repgeom_* settings: one parse (issue 34)."""
    from repgeom_eval.spec.options import lmeval as settings_module

    calls = []
    original = settings_module.Settings._parse.__func__
    monkeypatch.setattr(settings_module, "_PARSED", {})
    monkeypatch.setattr(settings_module.Settings, "_parse",
                        classmethod(lambda cls, given, kind: calls.append((dict(given), kind)) or
                                    original(cls, given, kind)))
    lm = RepgeomHFLM(pretrained=model_dir, batch_size=3, device="cpu", dtype="float64", repgeom_metrics="dispersion",
                     repgeom_layers="final")
    out = evaluate(lm, task_dir, ["rg_any_loglikelihood", "rg_any_multiple_choice"])
    assert "repgeom:dispersion@final,none" in out["results"]["rg_any_multiple_choice"]
    assert len(calls) == 1, calls
    assert calls[0] == ({"metrics": "dispersion", "layers": "final"}, "any")
