"""Registered metrics in the repgeom lm-eval tasks (``--metadata`` ``repgeom_metrics``, ``repgeom_metric_params``,
``repgeom_layers``; docs/lmeval.md#any-registered-metric): the value lm-eval reports equals ``repgeom_eval.measure``
on the very contexts lm-eval scored, for a built-in metric and for the third-party example plugin, per-text scores
reach ``--log_samples``, VIEWS metrics take an extra pass, and the task's own outputs do not change.

The model runs in float64 in both places, so what is compared is the pipeline (which tokens, which positions,
which pooling, which metric states), not float32 rounding between a masked and an unmasked forward pass.
tests/test_lmeval_distributed.py covers two ranks.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
import warnings

import pytest

import lm_eval  # noqa: F401  (dev extra: missing must fail, not skip)
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

import repgeom_eval as rg
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.lmeval.registered import score_name
from repgeom_eval.testing import write_task_data

TOL = 1e-6


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def lm(model_dir):
    return HFLM(pretrained=model_dir, batch_size=4, device="cpu", dtype="float64")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("lmeval-registered")
    # short MMLU questions: the contexts (with the subject's description) fit the tiny model's 128 tokens
    return {schema: write_task_data(schema, d / f"{schema}.jsonl", n=n, seed=2, **kwargs)
            for schema, n, kwargs in [("mmlu", 14, {"words": (2, 5)}), ("arc_easy", 12, {}), ("piqa", 12, {}),
                                      ("wikitext", 5, {})]}


def run(lm, task, data_file, **metadata):
    tm = TaskManager(include_defaults=False, metadata={"repgeom_data": str(data_file), "repgeom_slice_size": 4,
                                                       "repgeom_slice_seeds": 2, **metadata})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # small pools shrink the slices
        out = simple_evaluate(model=lm, tasks=[task], task_manager=tm, log_samples=True, bootstrap_iters=0)
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    return out["results"][task], samples, out


def scored_contexts(lm, samples):
    """The context string of each query and the tokens lm-eval scored for it (its first choice's request, as
    HFLM encodes and truncates it)."""
    texts = []
    for sample in samples:
        ctx, cont = sample["arguments"][0]
        ctx_enc, cont_enc = lm._encode_pair(ctx, cont)
        inp = (ctx_enc + cont_enc)[-(lm.max_length + 1):][:-1]
        scored = inp[: len(inp) - len(cont_enc) + 1]
        text = ctx.rstrip()  # lm-eval moves a context's trailing spaces to the continuation
        # The honest comparison: measure tokenizes the string exactly into the tokens lm-eval scored (this
        # tokenizer adds no BOS, in lm-eval's tok_encode or in measure's tokenizer call; nothing was truncated).
        assert lm.tokenizer(text)["input_ids"] == scored, "measure would read other tokens than lm-eval scored"
        texts.append(text)
    return texts


def measured(model_dir, texts, **options):
    return rg.measure(model_dir, texts, dtype="float64", batch_size=3, per_text=True, progress=False, **options)


def assert_same_values(results, result, names_seen=None):
    """Every (address, metric, sub-score) of ``measure`` equals the lm-eval value of the same name."""
    from repgeom_eval.measurement.bank import flatten_result

    compared = 0
    for addr, by_metric in result.results.items():
        for metric, value in by_metric.items():
            for flat, number in flatten_result(metric, value).items():
                got = results[f"{score_name(flat, addr)},none"]
                assert got == pytest.approx(number, abs=TOL, rel=TOL) or (math.isnan(got) and math.isnan(number)), \
                    (addr, flat, got, number)
                compared += 1
    assert compared
    return compared


def test_builtin_metrics_equal_measure_on_the_scored_contexts(lm, model_dir, data, monkeypatch):
    """ARC (multi-token continuations, 3-4 choices per query): dispersion (last token, per-text c_i),
    dataset_entropy with a parameter (mean over the context), token_dispersion (every context token), at every
    hidden state (the ``all`` selector), curvature. The token metrics read each batch's layout from the host's mask,
    never from the device's (tokens._wait_for)."""
    import repgeom_eval.functional.tokens as tokens

    waits = []
    monkeypatch.setattr(tokens, "_wait_for", lambda rows: waits.append(1) or rows.tolist())
    params = {"dataset_entropy": {"alpha": 2}}
    metrics = ["dispersion", "dataset_entropy", "token_dispersion", "curvature"]
    results, samples, out = run(lm, "repgeom_hardness_arc_easy", data["arc_easy"], repgeom_metrics=metrics,
                                repgeom_metric_params=params, repgeom_layers=["all"])
    assert waits == []
    texts = scored_contexts(lm, samples)
    result = measured(model_dir, texts, layers="all", metrics=metrics, metric_params=params)
    assert_same_values(results, result)
    addresses = list(result.results)
    assert len(addresses) >= 3 and "final" in addresses and "embed" in addresses
    meta = out["configs"]["repgeom_hardness_arc_easy"]["metadata"]["repgeom"]
    assert meta["metric_addresses"] == addresses
    assert meta["metric_configs"]["dataset_entropy"]["alpha"] == 2
    assert meta["metric_configs"]["dataset_entropy"]["pooling"] == "mean"
    # per-query scores in --log_samples, keyed like the table: c_i and each query's token dispersion
    for sample, row in zip(samples, result.per_text):
        for addr in addresses:
            for key in ("dispersion", "token_dispersion"):
                assert sample[score_name(key, addr)] == pytest.approx(row["scores"][addr][key], abs=TOL)
        assert sample[score_name("dataset_entropy.raw", "final")] is None  # no per-text score: null
    # the new values sit beside the task's own, which are unchanged (the repgeom_dispersion vector is `last`)
    assert results["repgeom_dispersion,none"] == pytest.approx(results["repgeom:dispersion@final,none"], abs=1e-9)
    assert out["higher_is_better"]["repgeom_hardness_arc_easy"]["repgeom:dispersion@final"] is None


def test_third_party_metric_equals_measure(lm, model_dir, data, example_plugin_site, monkeypatch):
    """mean_norm from examples/repgeom-example-metric, installed by pip into a target folder and found through its
    entry point (nothing registers it by hand); MMLU (one-token continuations, one context for four requests),
    its default ``last`` pooling and, at a second address, ``mean`` set through repgeom_pooling."""
    from repgeom_eval.plugin_system.host import reset_host

    monkeypatch.syspath_prepend(str(example_plugin_site))
    reset_host()
    try:
        for pooling in ("last", "mean"):
            params = {"mean_norm": {"pooling": pooling}}
            results, samples, out = run(lm, "repgeom_hardness_mmlu", data["mmlu"], repgeom_metrics=["mean_norm"],
                                        repgeom_pooling={"mean_norm": pooling},
                                        repgeom_layers=["resid_post:0", "final"])
            texts = scored_contexts(lm, samples)
            result = measured(model_dir, texts, layers=["resid_post:0", "final"], metrics=["mean_norm"],
                              metric_params=params)
            assert assert_same_values(results, result) == 2
            assert results["repgeom:mean_norm@final,none"] > 0
            record = out["configs"]["repgeom_hardness_mmlu"]["metadata"]["repgeom"]
            assert record["metric_configs"] == {"mean_norm": {"pooling": pooling}}
            assert record["metric_plugins"]["mean_norm"]["distribution"] == "repgeom-example-metric"
    finally:
        sys.modules.pop("repgeom_example_metric", None)
        reset_host()
        importlib.invalidate_caches()


def test_views_metric_takes_one_extra_pass_and_equals_measure(lm, model_dir, data):
    """infonce compares two augmented views of each context: lm-eval never runs them, so they come from one extra
    pass, with a warning; same seed, same augmented strings and tokens as measure."""
    tm = TaskManager(include_defaults=False, metadata={"repgeom_data": str(data["piqa"]), "repgeom_slice_size": 4,
                                                       "repgeom_metrics": ["infonce", "dispersion"]})
    with pytest.warns(RuntimeWarning, match=r"infonce \(task repgeom_hardness_piqa\) compare augmented views"):
        out = simple_evaluate(model=lm, tasks=["repgeom_hardness_piqa"], task_manager=tm, log_samples=True,
                              bootstrap_iters=0)
    results = out["results"]["repgeom_hardness_piqa"]
    samples = sorted(out["samples"]["repgeom_hardness_piqa"], key=lambda s: s["doc_id"])
    texts = scored_contexts(lm, samples)
    result = measured(model_dir, texts, metrics=["infonce", "dispersion"])
    assert assert_same_values(results, result) == 3  # infonce.raw, infonce.mi_lower_bound, dispersion
    views = out["configs"]["repgeom_hardness_piqa"]["metadata"]["repgeom"]["views"]
    assert views["n_views"] == 2 and views["seed"] == 0 and views["extra_pass"] is True


def test_extra_capture_and_missed_rows_give_the_same_values(lm, data, monkeypatch):
    """The fallbacks feed the same metric states: repgeom_capture=extra, and rows fused capture did not read."""
    from repgeom_eval.lmeval.fused import HiddenStates

    meta = {"repgeom_metrics": "dispersion,token_dispersion,vendi", "repgeom_layers": "resid_post:[0,-1],final"}
    fused, _, _ = run(lm, "repgeom_hardness_piqa", data["piqa"], **meta)
    extra, _, out = run(lm, "repgeom_hardness_piqa", data["piqa"], repgeom_capture="extra", **meta)
    assert out["configs"]["repgeom_hardness_piqa"]["metadata"]["repgeom"]["capture"] == "extra"
    monkeypatch.setattr(HiddenStates, "_read_row", lambda self, *a: None)
    tm = TaskManager(include_defaults=False, metadata={"repgeom_data": str(data["piqa"]), "repgeom_slice_size": 4,
                                                       "repgeom_slice_seeds": 2, **meta})
    with pytest.warns(RuntimeWarning, match="fused capture missed"):
        missed = simple_evaluate(model=lm, tasks=["repgeom_hardness_piqa"], task_manager=tm,
                                 bootstrap_iters=0)["results"]["repgeom_hardness_piqa"]
    names = [k for k in fused if k.startswith("repgeom:") and "_stderr," not in k]
    assert len(names) == 3 * 3  # resid_post:0, resid_post:1, final
    for name in names:
        assert extra[name] == pytest.approx(fused[name], abs=TOL), name
        assert missed[name] == pytest.approx(fused[name], abs=TOL), name


def test_perplexity_task_documents_span_their_rolling_windows(lm, data):
    """wikitext: a document is every scored position of all its windows, so the registered token_dispersion of each
    document equals the task's own repgeom_token_dispersion, and prompt_entropy gets one value per document."""
    results, samples, out = run(lm, "repgeom_ppl_wikitext", data["wikitext"],
                                repgeom_metrics=["token_dispersion", "prompt_entropy", "dispersion"],
                                repgeom_pooling={"dispersion": "mean"})
    assert any(len(lm.tok_encode(s["target"])) > lm.max_length for s in samples)  # several windows per document
    for sample in samples:
        assert sample["repgeom:token_dispersion@final"] == pytest.approx(sample["repgeom_token_dispersion"],
                                                                         abs=1e-9)
        assert isinstance(sample["repgeom:prompt_entropy@final"], float)
    assert results["repgeom:token_dispersion@final,none"] == pytest.approx(results["repgeom_token_dispersion,none"],
                                                                           abs=1e-9)
    assert 0 <= results["repgeom:dispersion@final,none"] <= 2
    assert results["word_perplexity,none"] > 0


def test_without_the_new_keys_the_outputs_are_todays(lm, data):
    results, samples, out = run(lm, "repgeom_hardness_piqa", data["piqa"])
    assert not [k for k in results if k.startswith("repgeom:")]
    assert not [k for k in samples[0] if k.startswith("repgeom:")]
    record = out["configs"]["repgeom_hardness_piqa"]["metadata"]["repgeom"]
    assert set(record) == {"data", "layer", "pooling", "correct", "capture", "slice_size", "slice_seeds", "address"}
    json.dumps(out["configs"])  # the task config stays JSON-serialisable


def test_names_are_safe_for_lm_eval():
    name = score_name("dataset_entropy.normalized", "resid_post:11")
    assert name == "repgeom:dataset_entropy.normalized@resid_post:11"
    assert score_name("plugin.a,b|c d", "final") == "repgeom:plugin.a_b_c_d@final"  # lm-eval splits keys at ","


@pytest.mark.parametrize("metadata,match", [
    ({"repgeom_metrics": ["no_such_metric"]}, "unknown metric 'no_such_metric'"),
    ({"repgeom_metrics": ["dispersion"], "repgeom_metric_params": {"dispersion": {"nope": 1}}},
     r"has no parameter\(s\) \['nope'\]"),
    ({"repgeom_metrics": ["dispersion"], "repgeom_metric_params": {"vendi": {"pooling": "mean"}}},
     "not requested"),
    ({"repgeom_metrics": ["dispersion"], "repgeom_metric_params": ["dispersion.pooling=mean"]},
     "repgeom_metric_params must map metric names"),
    ({"repgeom_metrics": ["infonce"], "repgeom_metric_params": {"infonce": {"n_views": 3}}}, "exactly 2 views"),
    ({"repgeom_layers": ["final"]}, "repgeom_layers selects the layers of repgeom_metrics"),
    ({"repgeom_metrics": {"dispersion": 1}}, "repgeom_metrics must be a list"),
])
def test_bad_requests_fail_when_the_task_loads(data, metadata, match):
    tm = TaskManager(include_defaults=False, metadata={"repgeom_data": str(data["piqa"]), **metadata})
    with pytest.raises(RepgeomError, match=match):
        tm.load(["repgeom_hardness_piqa"])


def test_unknown_layer_fails_before_any_compute(lm, data):
    tm = TaskManager(include_defaults=False, metadata={"repgeom_data": str(data["piqa"]),
                                                       "repgeom_metrics": ["dispersion"],
                                                       "repgeom_layers": ["resid_post:99"]})
    with pytest.raises(RepgeomError, match="resid_post:99|99"):
        simple_evaluate(model=lm, tasks=["repgeom_hardness_piqa"], task_manager=tm, bootstrap_iters=0)


def test_a_document_that_never_reaches_the_metric_states_is_an_error(lm, data, monkeypatch):
    """If requests could not be attributed to their documents (lm-eval changed what it hands to
    _loglikelihood_tokens), the task fails loudly instead of reporting metrics over fewer texts."""
    from repgeom_eval.lmeval.feeding import BankFeeder

    monkeypatch.setattr(BankFeeder, "register_contexts", lambda self, *a: None)
    tm = TaskManager(include_defaults=False, metadata={"repgeom_data": str(data["piqa"]),
                                                       "repgeom_metrics": ["dispersion"]})
    with pytest.raises(RepgeomError, match=r"no hidden states reached the registered metrics .* documents \[0, 1"):
        simple_evaluate(model=lm, tasks=["repgeom_hardness_piqa"], task_manager=tm, bootstrap_iters=0)
