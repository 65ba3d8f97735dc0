"""The one measurement engine: one run configuration, one layer-request rule, one place that builds model inputs."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import warnings
from pathlib import Path

import pytest

import repgeom_eval
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.spec.options.measure import POOLING_CHOICES, RunConfig
from repgeom_eval.measurement.engine import measure
from repgeom_eval.modeling.addresses import resolve_request
from repgeom_eval.spec.poolings import POOLING_ALIASES, POOLINGS
from repgeom_eval.modeling.loading import load_model

PACKAGE = Path(repgeom_eval.__file__).parent
ROOT = PACKAGE.parent
SOURCES = sorted([*PACKAGE.rglob("*.py"), *(ROOT / "plugins").glob("*.py"), *(ROOT / "entrypoints").glob("*.py")])


# -- the run configuration ---------------------------------------------------------------------------------------------

def _parse(argv: list[str]) -> RunConfig:
    parser = argparse.ArgumentParser()
    RunConfig.add_arguments(parser)
    return RunConfig.from_namespace(parser.parse_args(argv))


def test_cli_and_api_build_the_same_configuration():
    cli = _parse(["--layers", "final", "resid_post:0", "--metrics", "dispersion,token_dispersion", "vendi",
                  "--metric-param", "vendi.q=2", "--metric-param", "dispersion.per_text=true", "--batch-size", "3",
                  "--padding-side", "left", "--seed", "7", "--max-length", "32", "--no-progress"])
    api = RunConfig(layers=["final", "resid_post:0"], metrics=["dispersion", "token_dispersion", "vendi"],
                    metric_params={"vendi": {"q": 2}, "dispersion": {"per_text": True}}, batch_size=3,
                    padding_side="left", seed=7, max_length=32, progress=False)
    assert cli == api
    assert cli.metrics == ("dispersion", "token_dispersion", "vendi")
    default = _parse([])
    assert default == RunConfig(layers=["final"], progress=default.progress)  # the API defaults


def test_configuration_is_frozen_and_validated_once():
    config = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.batch_size = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.metric_params["dispersion"] = {}  # type: ignore[index]
    for bad, match in [({"batch_size": 0}, "--batch-size: expected a positive integer"), ({"metrics": []}, "no metric"),
                       ({"padding_side": "middle"}, "--padding-side: unknown value 'middle'"), ({"resume": True}, "--run-dir"),
                       ({"preprocess": "scale"}, "--preprocess: unknown value 'scale'"),
                       ({"save_preprocess_stats": "s.safetensors"}, "no effect without preprocessing")]:
        with pytest.raises(RepgeomError, match=match):
            RunConfig(**bad)


def test_every_flag_comes_from_a_field_and_pooling_choices_match_the_pooling_module():
    parser = argparse.ArgumentParser()
    RunConfig.add_arguments(parser)
    dests = {a.dest for a in parser._actions if a.dest not in ("help", "_config_file")}  # and --config FILE
    flagged = {f.name for f in dataclasses.fields(RunConfig) if f.metadata["flags"]}
    assert dests == flagged
    assert set(POOLING_CHOICES) == set(POOLINGS) | set(POOLING_ALIASES)


def test_key_and_config_block_come_from_the_configuration():
    config = RunConfig(layers="final", metrics="dispersion", seed=3, run_dir="somewhere")
    key = config.checkpoint_key({"addresses": ["final"]})
    assert key["seed"] == 3 and key["addresses"] == ["final"] and "run_dir" not in key and "progress" not in key
    block = config.config_block({"layers": ["final"]})
    assert block["layer_request"] == ["final"] and block["layers"] == ["final"] and block["run_dir"] == "somewhere"
    json.dumps(block)  # JSON-ready: no tuples or read-only mappings left


def test_a_configuration_object_and_keywords_give_the_same_run(tiny_model_dir, texts):
    model = load_model(tiny_model_dir("gpt2"))
    kw = dict(layers="resid_post:0,final", metrics=["dispersion", "token_dispersion"], batch_size=3,
              progress=False)
    a = measure(model, texts[:6], RunConfig(**kw))
    b = measure(model, texts[:6], **kw)
    assert a.results == b.results
    assert a.config == {**b.config, "device": a.config["device"]}
    with pytest.raises(RepgeomError, match="not both"):
        measure(model, texts[:6], RunConfig(), seed=2)


# -- one rule for two names of one tensor ------------------------------------------------------------------------------

def test_an_address_that_reads_an_aliased_tensor_is_reported_under_the_alias_everywhere(tiny_model_dir, texts):
    """BERT has no norm after its last block: ``resid_post:-1`` is ``final``; ``resid_pre:0`` is ``embed`` on every
    model. measure, the analyses and the MTEB sweep name them alike, and say so."""
    from repgeom_eval.mteb_layers import LayerEmbedder

    bert = load_model(tiny_model_dir("bert"))
    with pytest.warns(UserWarning, match="resid_post:1 and final are the same tensor on this bert model"):
        r = measure(bert, texts[:4], layers="resid_post:-1", progress=False)
    assert list(r.results) == ["final"]
    with pytest.warns(UserWarning, match="resid_pre:0 and embed are the same tensor"):
        assert [str(a) for a in resolve_request("resid_pre:0,resid_post:0", bert).addresses] == ["embed", "resid_post:0"]
    with pytest.warns(UserWarning, match="resid_post:1 and final"):
        assert [str(a) for a in LayerEmbedder(bert, pooling="mean").addresses("resid_post:1")] == ["final"]
    gpt2 = load_model(tiny_model_dir("gpt2"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # GPT-2's final norm makes final and resid_post:-1 different tensors
        assert [str(a) for a in resolve_request("final,resid_post:-1", gpt2).addresses] == ["resid_post:1", "final"]


def test_bare_hidden_state_indices_are_named_in_the_warning_and_the_results(tiny_model_dir, texts):
    """``--layers 2`` reads hidden_states[2] = resid_post:1; the last index is ``final``: the run says both, in a
    warning and in ``config.layers_reported_as``, so that no one has to redo the arithmetic."""
    llama = load_model(tiny_model_dir("llama"))  # 2 blocks: hidden states 0, 1, 2
    with pytest.warns(UserWarning, match=r"0 → embed, 1 → resid_post:0, 2 → final; 2 is the last hidden state, "
                                         r"which is `final`.*resid_post:1\)"):
        r = measure(llama, texts[:4], layers="0,1,2", progress=False)
    assert list(r.results) == ["embed", "resid_post:0", "final"]
    assert r.config["layers_reported_as"] == {"0": "embed", "1": "resid_post:0", "2": "final"}
    assert r.config["layer_request"] == ["0", "1", "2"]
    with pytest.warns(UserWarning, match=r"-1 → final"):
        assert [str(a) for a in resolve_request("-1", llama).addresses] == ["final"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no bare index, no alias: nothing to say
        plain = measure(llama, texts[:4], layers="resid_post:0,final", progress=False)
    assert plain.config["layers_reported_as"] == {}


# -- no copies of the engine's steps -----------------------------------------------------------------------------------

def _modules_containing(text: str) -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in SOURCES if text in p.read_text(encoding="utf-8"))


def test_model_inputs_are_built_in_one_place():
    assert _modules_containing('["position_ids"]') == ["repgeom_eval/modeling/probe.py"]
    assert _modules_containing('"use_cache"') == ["repgeom_eval/modeling/probe.py"]


def test_layer_requests_are_parsed_in_one_place():
    callers = [m for m in _modules_containing("parse_layers(") if m != "repgeom_eval/modeling/addresses.py"]
    assert callers == []


def test_no_module_imports_another_modules_private_names():
    offenders = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                offenders += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
    assert offenders == []


def test_a_metric_bank_fed_from_a_foreign_forward_pass_equals_measure(tiny_model_dir, texts):
    """The bank the lm-eval and MTEB integrations feed gives measure's numbers on the same texts and addresses."""
    from repgeom_eval.measurement.bank import MetricBank
    from repgeom_eval.measurement.forward import Forward
    from repgeom_eval.modeling.addresses import resolve_request

    model = load_model(tiny_model_dir("llama"))
    names = ["dispersion", "token_dispersion", "dataset_entropy", "curvature"]
    want = measure(model, texts[:9], layers="resid_post:0,final", metrics=names, progress=False, batch_size=4)
    plan = resolve_request("resid_post:0,final", model)
    bank = MetricBank(names, plan.addresses)
    with Forward(model, plan.points) as fwd:
        for lo in (0, 5):  # two uneven batches, in data order
            rows = list(range(lo, min(lo + 5, 9)))
            batch = fwd.texts([texts[i] for i in rows], 128)
            for addr in plan.addresses:
                bank.update(addr, batch.hidden[addr], batch.mask, rows)
    got = bank.compute()
    for addr in want.results:
        for name in names:
            a, b = want.results[addr][name], got[addr][name]
            if isinstance(a, dict):
                for k in a:
                    if isinstance(a[k], float):
                        assert b[k] == pytest.approx(a[k], abs=1e-6), (addr, name, k)
            else:
                assert b == pytest.approx(a, abs=1e-6), (addr, name)
    assert "dataset_entropy.normalized" in bank.flat()["final"]


def test_a_huge_text_is_cut_before_tokenization_without_changing_what_is_measured(tiny_model_dir, texts):
    from repgeom_eval.measurement.forward import token_lengths

    model = load_model(tiny_model_dir("llama"))
    tok = model.tokenizer
    huge = " ".join(texts) * 400  # about a million characters
    seen: list[int] = []

    def spy(strings, **kw):
        seen.extend(len(s) for s in strings)
        return tok(strings, **kw)

    (cut,), (n,) = token_lengths(spy, [huge], 64)
    assert max(seen) < len(huge) // 100 and n > 64
    full = tok(huge, add_special_tokens=True)["input_ids"][:64]
    assert tok(cut, add_special_tokens=True)["input_ids"][:64] == full  # the kept tokens are the full text's
    short = texts[:3]
    (s_cut, *_), (s_n, *_) = token_lengths(tok, short, 64)
    assert s_cut == short[0] and s_n == len(tok(short[0])["input_ids"])  # short texts are read whole
    a = measure(model, [huge, *texts[:5]], metrics=["dispersion", "token_dispersion"], max_length=64, progress=False)
    b = measure(model, [cut, *texts[:5]], metrics=["dispersion", "token_dispersion"], max_length=64, progress=False)
    assert a.results == b.results and a.data["n_truncated"] == b.data["n_truncated"] >= 1
