"""The ``repgeom_*`` settings are declared once (``repgeom_eval.spec.options.lmeval.Settings``): the docs list the
declared keys and defaults, every check names the key, each kind of task records what it reads, and ``repgeom-hf``
takes the keys out of ``--model_args`` (checked before the model loads, kept from ``from_pretrained``).
tests/test_lmeval_wrapper.py runs the ``--model_args`` route end to end."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

import lm_eval  # noqa: F401  (dev extra: missing must fail, not skip)

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.spec.options.lmeval import KEYS, Settings, key

DOCS = Path(__file__).resolve().parents[1] / "docs" / "lmeval.md"


def documented_settings() -> dict[str, str]:
    """key → default cell of the table under docs/lmeval.md's "Settings (`--metadata`)"."""
    section = DOCS.read_text(encoding="utf-8").split("## Settings (`--metadata`)")[1].split("\n## ")[0]
    return dict(re.findall(r"^\| `(repgeom_\w+)` \| ([^|]+?) \|", section, re.M))


def test_the_docs_list_the_declared_keys_and_defaults():
    documented = documented_settings()
    assert list(documented) == list(KEYS)
    for f in fields(Settings):
        if isinstance(f.default, (str, int)):
            assert documented[key(f.name)] == f"`{f.default}`", f.name


def test_each_kind_records_the_settings_it_reads():
    hardness = Settings.from_metadata({"repgeom_layer": 3, "repgeom_slice_size": 5, "repgeom_seed": 2}, "hardness")
    assert hardness.record("hardness") == {"data": None, "layer": "3", "pooling": "last", "correct": "acc",
                                           "capture": "fused", "slice_size": 5, "slice_seeds": 10}
    assert list(hardness.record("hardness")) == ["data", "layer", "pooling", "correct", "capture", "slice_size",
                                                 "slice_seeds"]  # the results' key order is the declaration's
    # one --metadata serves every task of a run: the perplexity task accepts the hardness keys, reads every
    # scored token whatever repgeom_pooling says, and records what it reads
    perplexity = Settings.from_metadata({"repgeom_pooling": "mean", "repgeom_correct": "acc_norm"}, "perplexity")
    assert perplexity.record("perplexity") == {"data": None, "layer": "final", "pooling": "tokens", "capture": "fused"}


def test_the_poolings_are_the_projects_own():
    from repgeom_eval.spec.options.lmeval import HARDNESS_POOLINGS
    from repgeom_eval.spec.poolings import POOLINGS

    assert set(HARDNESS_POOLINGS) | {"tokens"} <= set(POOLINGS)


@pytest.mark.parametrize("metadata,match", [
    ({"repgeom_layr": "final"}, r"unknown metadata key 'repgeom_layr' for repgeom tasks \(valid: repgeom_capture, "),
    ({"repgeom_pooling": "first"}, "repgeom_pooling must be last or mean, got 'first'"),
    ({"repgeom_capture": "twice"}, "repgeom_capture must be fused or extra, got 'twice'"),
    ({"repgeom_slice_seeds": True}, "repgeom_slice_seeds must be a positive integer, got True"),
    ({"repgeom_slice_size": "10"}, "repgeom_slice_size must be a positive integer, got '10'"),
])
def test_bad_settings_name_the_key(metadata, match):
    with pytest.raises(RepgeomError, match=match):
        Settings.from_metadata(metadata, "hardness")


def test_repgeom_hf_takes_the_settings_out_of_its_model_arguments(tiny_model_dir):
    """Under ``--model hf`` transformers refuses ``repgeom_layer`` as a model argument; ``repgeom-hf`` keeps it
    (and every other repgeom key) from the model, and an unknown key fails before the model loads."""
    from repgeom_eval.lmeval.model import RepgeomHFLM

    model = tiny_model_dir("llama")
    lm = RepgeomHFLM.create_from_arg_string(f"pretrained={model},repgeom_layer=resid_post:0,repgeom_slice_size=4",
                                            {"batch_size": 2, "device": "cpu"})
    assert not hasattr(lm.model.config, "repgeom_layer")
    with pytest.raises(RepgeomError, match="unknown metadata key 'repgeom_layr'"):
        RepgeomHFLM.create_from_arg_string("pretrained=/nonexistent,repgeom_layr=final", {"device": "cpu"})


@pytest.mark.parametrize("where", ["--metadata", "--model_args"])
def test_an_output_path_on_the_data_file_is_refused_wherever_the_data_is_given(tmp_path, where):
    import json

    from repgeom_eval.entrypoints.lm_eval_cmd import check_arguments

    data = tmp_path / "piqa.jsonl"
    data.write_text('{"goal": "a", "sol1": "b", "sol2": "c", "label": 0}\n')
    given = (["--metadata", json.dumps({"repgeom_data": str(data)}), "--model_args", "pretrained=gpt2"]
             if where == "--metadata" else ["--model_args", f"pretrained=gpt2,repgeom_data={data}"])
    with pytest.raises(RepgeomError, match="repgeom_data"):
        check_arguments(["--model", "repgeom-hf", *given, "--tasks", "repgeom_hardness_piqa",
                         "--output_path", str(data)])
    assert data.read_text().startswith('{"goal"')
