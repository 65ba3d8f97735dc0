"""The load check's disk cache (repgeom_eval/modeling/layout_cache.py): a checkpoint is probed once; the layout read
back equals the one found; another checkpoint of the same config is probed again; switched off, nothing is kept."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

import repgeom_eval as rg
from repgeom_eval.modeling import discovery, layout_cache
from repgeom_eval.modeling.layout import describe
from repgeom_eval.modeling.loading import load_model


@pytest.fixture
def cache_on(monkeypatch, tmp_path):
    monkeypatch.setenv("REPGEOM_LAYOUT_CACHE", "1")
    monkeypatch.setenv("REPGEOM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "layouts"


def load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(str(path), dtype="float32", device="cpu")


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "t5"])
def test_a_checkpoint_is_probed_once_and_read_back_equal(cache_on, tmp_path, model_type, monkeypatch):
    path = rg.save_tiny(model_type, tmp_path / model_type, kind="encoder" if model_type == "t5" else "causal",
                        realistic=True)
    first = load(path)
    assert len(list(cache_on.glob("*.json"))) == 1
    probes = []
    monkeypatch.setattr(discovery, "_discover", lambda *a, **k: probes.append(1) or pytest.fail("probed again"))
    second = load(path)
    assert not probes
    assert layout_cache.to_dict(second.layout) == layout_cache.to_dict(first.layout)
    assert describe(second.layout) == describe(first.layout)
    assert second.timings["load_check_s"] < first.timings["load_check_s"]
    texts = ["one short text", "and another one, longer than the first", "a third"]
    a = rg.measure(first, texts, layers="all", metrics=["dispersion"], progress=False)
    b = rg.measure(second, texts, layers="all", metrics=["dispersion"], progress=False)
    assert a.results == b.results


def test_other_weights_of_the_same_config_are_probed_again(cache_on, tmp_path):
    a = rg.save_tiny("llama", tmp_path / "a", seed=0)
    b = rg.save_tiny("llama", tmp_path / "b", seed=1)
    load(a)
    load(b)
    assert len(list(cache_on.glob("*.json"))) == 2
    model = load(a).model
    key = layout_cache.key(model, None, True)
    with torch.no_grad():
        next(model.parameters()).mul_(2.0)
    assert layout_cache.key(model, None, True) != key


def test_switched_off_nothing_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("REPGEOM_LAYOUT_CACHE", "0")
    monkeypatch.setenv("REPGEOM_CACHE", str(tmp_path / "cache"))
    load(rg.save_tiny("llama", tmp_path / "m"))
    assert not (tmp_path / "cache" / "layouts").exists()


def test_a_broken_entry_is_probed_again_and_rewritten(cache_on, tmp_path):
    path = rg.save_tiny("llama", tmp_path / "m")
    load(path)
    entry = next(cache_on.glob("*.json"))
    entry.write_text("{not json")
    t0 = time.perf_counter()
    again = load(path)
    assert again.layout.n_layers == 2 and time.perf_counter() - t0 > 0
    assert layout_cache.load(entry.stem) is not None
