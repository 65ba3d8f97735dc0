"""The repgeom lm-eval tasks in-process: fused capture against an independent forward pass, log-likelihoods
untouched, geometry values against brute force, the fallback, and the errors that keep a metric from going missing.

lm-eval runs through its Python API here (``simple_evaluate`` with a ``TaskManager`` that skips lm-eval's own
14 000 task files); tests/test_lmeval_cli.py runs the real console script.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

import lm_eval  # noqa: E402,F401  (dev extra: missing must fail, not skip)
import torch  # noqa: E402

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from repgeom_eval.spec.errors import RepgeomError  # noqa: E402
from repgeom_eval.functional.dispersion import pairwise_dispersion  # noqa: E402
from repgeom_eval.analyses.queries import decode_vector  # noqa: E402
from repgeom_eval.testing import write_task_data  # noqa: E402

GEOMETRY = ("repgeom_dispersion", "repgeom_dispersion_correct", "repgeom_dispersion_incorrect", "repgeom_auroc",
            "repgeom_acc_low_c", "repgeom_acc_high_c", "repgeom_slice_spearman")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def lm(model_dir):
    return HFLM(pretrained=model_dir, batch_size=4, device="cpu")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("lmeval-data")
    return {schema: write_task_data(schema, d / f"{schema}.jsonl", n=n, seed=1)
            for schema, n in [("mmlu", 36), ("arc_easy", 16), ("hellaswag", 16), ("piqa", 16), ("wikitext", 8)]}


def run(lm, task, data_file, log_samples=True, **metadata):
    """simple_evaluate on one repgeom task over a local file; returns (results of the task, samples)."""
    tm = TaskManager(include_defaults=False, metadata={"repgeom_data": str(data_file), "repgeom_slice_size": 6,
                                                       "repgeom_slice_seeds": 3, **metadata})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # small pools shrink the slices
        out = simple_evaluate(model=lm, tasks=[task] if isinstance(task, (str, dict)) else task, task_manager=tm,
                              log_samples=log_samples, bootstrap_iters=0)
    name = task["task"] if isinstance(task, dict) else task
    return out["results"][name], (out["samples"][name] if log_samples else None), out


def context_tokens(lm, sample):
    """The exact context tokens HFLM scored for the first choice of a sample (as lm-eval encodes them)."""
    ctx, cont = sample["arguments"][0]
    ctx_enc, cont_enc = lm._encode_pair(ctx, cont)
    inp = (ctx_enc + cont_enc)[-(lm.max_length + 1):][:-1]
    return inp[: len(inp) - len(cont_enc) + 1]


def hidden(lm, tokens, index=-1):
    with torch.no_grad():
        out = lm.model(torch.tensor([tokens]), output_hidden_states=True)
    return out.hidden_states[index][0].double()


def brute_d(vectors):
    return float(pairwise_dispersion(torch.as_tensor(np.stack(vectors))))


def test_tasks_are_found_with_no_include_path():
    names = TaskManager(include_defaults=False).all_tasks
    for task in ("repgeom_hardness_mmlu", "repgeom_hardness_arc_challenge", "repgeom_hardness_arc_easy",
                 "repgeom_hardness_hellaswag", "repgeom_hardness_piqa", "repgeom_ppl_wikitext"):
        assert task in names


@pytest.mark.parametrize("task,schema", [("repgeom_hardness_mmlu", "mmlu"), ("repgeom_hardness_arc_easy",
                                                                             "arc_easy")])
def test_fused_vectors_equal_an_independent_forward_pass(lm, data, task, schema):
    """One-token (MMLU) and multi-token (ARC) continuations: the vector is the final-layer state of the last
    context token, exactly what a separate forward pass over that context gives."""
    results, samples, out = run(lm, task, data[schema])
    assert out["configs"][task]["metadata"]["repgeom"]["capture"] == "fused"
    vectors = []
    for sample in samples:
        got = decode_vector(sample["repgeom_slice_spearman"]["vector"])
        want = hidden(lm, context_tokens(lm, sample))[-1].float().numpy()
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
        vectors.append(got.astype(np.float64))
    # the table's numbers are the brute-force ones over those vectors
    correct = np.array([s["acc"] for s in samples], dtype=bool)
    assert results["repgeom_dispersion,none"] == pytest.approx(brute_d(vectors), abs=1e-9)
    assert results["repgeom_dispersion_correct,none"] == pytest.approx(
        brute_d([v for v, ok in zip(vectors, correct) if ok]), abs=1e-9)
    assert results["repgeom_dispersion_incorrect,none"] == pytest.approx(
        brute_d([v for v, ok in zip(vectors, correct) if not ok]), abs=1e-9)
    u = np.stack(vectors) / np.linalg.norm(np.stack(vectors), axis=1, keepdims=True)
    c = 1 - ((u @ u.T).sum(1) - 1) / (len(u) - 1)
    np.testing.assert_allclose([s["repgeom_dispersion"] for s in samples], c, atol=1e-9)  # c_i in --log_samples
    from sklearn.metrics import roc_auc_score

    assert results["repgeom_auroc,none"] == pytest.approx(roc_auc_score(correct, c), abs=1e-9)
    k = len(c) // 10
    order = np.lexsort((correct, c))
    assert results["repgeom_acc_low_c,none"] == pytest.approx(correct[order[:k]].mean())
    assert results["repgeom_acc_high_c,none"] == pytest.approx(correct[order[-k:]].mean())
    assert -1 <= results["repgeom_slice_spearman,none"] <= 1


def test_loglikelihoods_and_accuracy_identical_with_and_without_geometry(lm, data):
    """The same YAML without the repgeom class and metrics is stock lm-eval: no capture is installed."""
    from _repgeom_lm_eval_hook import tasks_dir
    from lm_eval.tasks._yaml_loader import load_yaml

    stock = load_yaml(f"{tasks_dir()}/repgeom_hardness_arc_easy.yaml", resolve_func=True)
    stock.pop("class")
    stock["task"] = "stock_arc_easy"
    stock["metric_list"] = [m for m in stock["metric_list"] if not m["metric"].startswith("repgeom_")]
    plain, plain_samples, _ = run(lm, stock, data["arc_easy"])
    geo, geo_samples, _ = run(lm, "repgeom_hardness_arc_easy", data["arc_easy"])
    assert type(plain_samples[0]["resps"][0][0]) is tuple  # untouched lm-eval results: nothing was captured
    assert not {"_model_call", "_loglikelihood_tokens"} & set(lm.__dict__)  # HFLM's own methods after a run
    assert [s["resps"] for s in plain_samples] == [[[tuple(r) for r in rs] for rs in s["resps"]] for s in geo_samples]
    for key in ("acc,none", "acc_norm,none"):
        assert plain[key] == geo[key]


def test_batch_size_does_not_change_the_geometry(lm, model_dir, data):
    one = HFLM(pretrained=model_dir, batch_size=1, device="cpu")
    a, sa, _ = run(lm, "repgeom_hardness_piqa", data["piqa"])
    b, sb, _ = run(one, "repgeom_hardness_piqa", data["piqa"])
    for x, y in zip(sa, sb):
        np.testing.assert_allclose(decode_vector(x["repgeom_slice_spearman"]["vector"]),
                                   decode_vector(y["repgeom_slice_spearman"]["vector"]), atol=2e-5)
    assert a["repgeom_dispersion,none"] == pytest.approx(b["repgeom_dispersion,none"], abs=1e-5)


def test_extra_pass_fallback_gives_the_same_vectors(lm, data):
    fused, fs, _ = run(lm, "repgeom_hardness_hellaswag", data["hellaswag"])
    extra, es, out = run(lm, "repgeom_hardness_hellaswag", data["hellaswag"], repgeom_capture="extra")
    assert out["configs"]["repgeom_hardness_hellaswag"]["metadata"]["repgeom"]["capture"] == "extra"
    for x, y in zip(fs, es):
        np.testing.assert_allclose(decode_vector(x["repgeom_slice_spearman"]["vector"]),
                                   decode_vector(y["repgeom_slice_spearman"]["vector"]), atol=2e-5)
    assert fused["acc,none"] == extra["acc,none"]


def test_missed_rows_are_detected_and_filled_by_an_extra_pass(lm, data, monkeypatch):
    """If lm-eval's private call order changed (rows not read), the run warns and still gets every vector."""
    from repgeom_eval.lmeval.fused import HiddenStates

    monkeypatch.setattr(HiddenStates, "_read_row", lambda self, *a: None)
    tm = TaskManager(include_defaults=False, metadata={"repgeom_data": str(data["piqa"])})
    with pytest.warns(RuntimeWarning, match="fused capture missed"):
        out = simple_evaluate(model=lm, tasks=["repgeom_hardness_piqa"], task_manager=tm, log_samples=True,
                              bootstrap_iters=0)
    sample = out["samples"]["repgeom_hardness_piqa"][0]
    want = hidden(lm, context_tokens(lm, sample))[-1].float().numpy()
    np.testing.assert_allclose(decode_vector(sample["repgeom_slice_spearman"]["vector"]), want, atol=2e-5)


def test_untested_lm_eval_version_switches_to_the_extra_pass(lm, data, monkeypatch):
    from repgeom_eval.lmeval import fused

    monkeypatch.setattr(fused, "fused_capture_problem", lambda lm: "lm-eval 9.9 is outside the tested range")
    tm = TaskManager(include_defaults=False, metadata={"repgeom_data": str(data["piqa"])})
    with pytest.warns(RuntimeWarning, match="fused capture disabled"):
        out = simple_evaluate(model=lm, tasks=["repgeom_hardness_piqa"], task_manager=tm, bootstrap_iters=0)
    meta = out["configs"]["repgeom_hardness_piqa"]["metadata"]["repgeom"]
    assert meta["capture"] == "extra" and "outside the tested range" in meta["fused_disabled_because"]


def test_fused_preconditions_hold_for_the_installed_lm_eval(lm):
    """The private HFLM call path this integration reads is the one installed (lm-eval pinned <0.5)."""
    from repgeom_eval.lmeval.fused import fused_capture_problem

    assert fused_capture_problem(lm) is None


def test_layer_and_mean_pooling_from_metadata(lm, data):
    _, samples, out = run(lm, "repgeom_hardness_piqa", data["piqa"], repgeom_layer="resid_post:0",
                          repgeom_pooling="mean")
    assert out["configs"]["repgeom_hardness_piqa"]["metadata"]["repgeom"]["address"] == "resid_post:0"
    for sample in samples[:5]:
        tokens = context_tokens(lm, sample)
        want = hidden(lm, tokens, index=1).mean(0).float().numpy()  # hidden_states[1] = output of block 0
        np.testing.assert_allclose(decode_vector(sample["repgeom_slice_spearman"]["vector"]), want, atol=2e-5)


def test_perplexity_task_token_dispersion_against_brute_force(lm, data):
    from lm_eval import utils

    results, samples, _ = run(lm, "repgeom_ppl_wikitext", data["wikitext"])
    assert any(len(lm.tok_encode(s["target"])) > lm.max_length for s in samples)  # several windows per document
    dispersions, ppls = [], []
    for sample in samples:
        windows = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(
            token_list=lm.tok_encode(sample["target"]), prefix_token=lm.prefix_token_id,
            max_seq_len=lm.max_length, context_len=1)]
        vectors, ll, n = [], 0.0, 0
        for ctx, cont in windows:
            inp = (ctx + cont)[-(lm.max_length + 1):][:-1]
            with torch.no_grad():
                out = lm.model(torch.tensor([inp]), output_hidden_states=True)
            first = len(inp) - len(cont)
            vectors += list(out.hidden_states[-1][0, first:].double().numpy())
            logp = torch.log_softmax(out.logits[0, first:].double(), -1)
            ll += float(logp[torch.arange(len(cont)), torch.tensor(cont)].sum())
            n += len(cont)
        d = brute_d(vectors)
        assert sample["repgeom_token_dispersion"] == pytest.approx(d, abs=1e-6)
        assert sample["repgeom_ppl_spearman"][0] == pytest.approx(math.exp(-ll / n), rel=1e-4)
        dispersions.append(d)
        ppls.append(math.exp(-ll / n))
    from scipy.stats import pearsonr, spearmanr

    assert results["repgeom_token_dispersion,none"] == pytest.approx(np.mean(dispersions), abs=1e-6)
    assert results["repgeom_ppl_pearson,none"] == pytest.approx(pearsonr(ppls, dispersions).statistic, abs=1e-4)
    assert results["repgeom_ppl_spearman,none"] == pytest.approx(spearmanr(ppls, dispersions).statistic, abs=1e-9)
    assert results["word_perplexity,none"] > 0  # upstream's metrics are still there


def test_use_cache_is_refused(lm, data, tmp_path):
    tm = TaskManager(include_defaults=False, metadata={"repgeom_data": str(data["piqa"])})
    with pytest.raises(RepgeomError, match="--use_cache"):
        simple_evaluate(model=lm, use_cache=str(tmp_path / "cache"), tasks=["repgeom_hardness_piqa"],
                        task_manager=tm, bootstrap_iters=0)


def test_backend_without_hidden_states_is_refused(data):
    from lm_eval.api.model import LM

    class ScoreOnly(LM):
        def loglikelihood(self, requests):
            return [(-1.0, False) for _ in requests]

        def loglikelihood_rolling(self, requests):
            return [-1.0 for _ in requests]

        def generate_until(self, requests):
            return ["" for _ in requests]

    tm = TaskManager(include_defaults=False, metadata={"repgeom_data": str(data["piqa"])})
    with pytest.raises(RepgeomError, match="backend has none"):
        simple_evaluate(model=ScoreOnly(), tasks=["repgeom_hardness_piqa"], task_manager=tm, bootstrap_iters=0)


@pytest.mark.parametrize("metadata,match", [
    ({"repgeom_layr": "final"}, "unknown metadata key 'repgeom_layr'"),
    ({"repgeom_pooling": "max"}, "repgeom_pooling must be last or mean"),
    ({"repgeom_correct": "f1"}, "repgeom_correct 'f1' is not a metric"),
    ({"repgeom_slice_size": 0}, "positive integer"),
])
def test_bad_settings_are_named(lm, data, metadata, match):
    tm = TaskManager(include_defaults=False, metadata={"repgeom_data": str(data["piqa"]), **metadata})
    with pytest.raises(RepgeomError, match=match):
        tm.load(["repgeom_hardness_piqa"])


def test_bad_local_data_is_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"goal": "a", "sol1": "b", "sol2": "c", "label": 1}\n{"goal": "a", "sol1": "b"}\n')
    tm = TaskManager(include_defaults=False, metadata={"repgeom_data": str(bad)})
    with pytest.raises(RepgeomError, match=r"record 2 has no field 'sol2'"):
        tm.load(["repgeom_hardness_piqa"])
    with pytest.raises(RepgeomError, match="does not exist"):
        TaskManager(include_defaults=False, metadata={"repgeom_data": str(tmp_path / "nope.jsonl")}).load(
            ["repgeom_hardness_piqa"])


def test_hub_default_fails_offline_with_the_local_route_named(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from repgeom_eval.lmeval.documents import load_dataset

    with pytest.raises(RepgeomError, match="repgeom_data.*question"):
        load_dataset("mmlu")


def prompt_perplexity(lm, tokens):
    """The context's own per-token perplexity (its tokens after the first), from a separate forward pass."""
    with torch.no_grad():
        logits = lm.model(torch.tensor([tokens])).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1)[:-1].gather(-1, torch.tensor(tokens[1:])[:, None]).sum()
    return math.exp(-float(lp) / (len(tokens) - 1))


@pytest.mark.parametrize("capture", ["fused", "extra"])
def test_samples_carry_the_gold_answer_and_the_prompt_perplexity(lm, data, capture):
    """``ppl`` is the gold answer's per-token perplexity given the prompt (lm-eval's own log-likelihood);
    ``prompt_ppl`` the prompt's own, read from the same forward pass (fused) or the extra one."""
    _, samples, _ = run(lm, "repgeom_hardness_arc_easy", data["arc_easy"], repgeom_capture=capture)
    for sample in samples:
        item = sample["repgeom_slice_spearman"]
        tokens = context_tokens(lm, sample)
        assert item["prompt_ppl"] == pytest.approx(prompt_perplexity(lm, tokens), rel=1e-4)
        gold = int(sample["target"])
        loglikelihood = sample["resps"][gold][0][0]
        n_answer = len(lm._encode_pair(*sample["arguments"][gold])[1])
        assert item["ppl"] == pytest.approx(math.exp(-loglikelihood / n_answer), rel=1e-9)


def test_a_yaml_of_ones_own_records_its_data_and_ignores_repgeom_data(tmp_path):
    """docs/lmeval.md#your-own-prompt-a-hardness-task-from-a-yaml: the task class in a user's YAML; repgeom_data is
    for the shipped tasks' loader and is ignored, with a warning, by a YAML naming its own dataset_path."""
    (tmp_path / "quiz.jsonl").write_text("".join(
        '{"q": "word %d", "choices": ["a", "b"], "answer": %d}\n' % (i, i % 2) for i in range(4)))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "quiz.yaml").write_text(
        "task: my_quiz\nclass: !function repgeom_eval.lmeval.task.HardnessTask\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'quiz.jsonl'}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{q}}:'\ndoc_to_choice: choices\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n  - metric: repgeom_slice_spearman\n")
    tm = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False,
                     metadata={"repgeom_data": "elsewhere.jsonl"})
    with pytest.warns(RuntimeWarning, match="repgeom_data applies to the shipped repgeom tasks only"):
        task = tm.load(["my_quiz"])["tasks"]["my_quiz"]
    record = task.config.metadata["repgeom"]
    assert record["data"].startswith("json ") and "quiz.jsonl" in record["data"]
    assert len(task.eval_docs) == 4
