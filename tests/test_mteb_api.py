"""mteb's own API with layer encoders (issue 23, item 3 and the MTEB half of 5).

* ``mteb.evaluate(layer_encoder(...), task)`` and the legacy ``mteb.MTEB(tasks).run(...)`` carry the same
  ``repgeom_*`` keys as ``run_layers`` / ``repgeom mteb run``, in the returned result and in mteb's cache files;
* every layer is its own mteb model (name), so no cache of mteb's answers layer 3 with layer 1's score;
* in-memory models (a ``SentenceTransformer``, a transformers model with its tokenizer) can be wrapped at a layer;
* mteb's result loading (``ResultCache.load_results``, the deprecated ``mteb.load_results``) reads one model per
  layer;
* degenerate numbers (massive activations, zero vectors) are said in the results, the log and as warnings.

Tiny random BERT models and small local tasks from Python's documentation; all offline.
"""

from __future__ import annotations

import json
import logging
import warnings

import mteb
import pytest
import torch

from repgeom_eval.mteb_layers import layer_encoder, make_task, run_layers
from repgeom_eval.mteb_layers.examples import build_tasks, pydoc_documents

GEOMETRY = {"repgeom_dataset_entropy", "repgeom_dataset_entropy_raw", "repgeom_dispersion", "repgeom_effective_rank",
            "repgeom_n_texts", "repgeom_depth", "repgeom_main_score_name", "repgeom_massive_dimension",
            "repgeom_massive_share", "repgeom_zero_vectors", "repgeom_warnings"}


@pytest.fixture(scope="module")
def sts_spec():
    return build_tasks(pydoc_documents(), "pydoc", size="small", seed=0)["PydocSTS"]


@pytest.fixture
def sts(sts_spec):
    """A fresh STS task instance each call (fresh random state, no data loaded)."""
    return lambda: make_task({"name": "PydocSTS", **sts_spec})


@pytest.fixture(scope="module")
def bert4(tmp_path_factory):
    """A saved tiny BERT with 4 blocks (layers 1 and 3 are different hidden states)."""
    from repgeom_eval.testing import make_tiny_model

    return str(make_tiny_model("bert", tmp_path_factory.mktemp("bert4"), n_layers=4))


def _scores(result) -> dict:
    (task_result,) = result.task_results if hasattr(result, "task_results") else result
    return task_result.scores["test"][0]


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


# -- a. geometry through mteb.evaluate and mteb.MTEB(...).run ------------------------------------------------------

def test_mteb_evaluate_carries_the_geometry_of_run_layers(bert4, sts, tmp_path):
    cache = mteb.ResultCache(tmp_path / "evaluate")
    got = _scores(_quiet(mteb.evaluate, layer_encoder(bert4, layer=3), sts(), cache=cache, show_progress_bar=False))
    assert GEOMETRY <= set(got)
    sweep = _quiet(run_layers, bert4, [sts()], 3, output_folder=tmp_path / "sweep", progress=False)
    (row,) = sweep.rows
    for key in ("main_score", "repgeom_dataset_entropy", "repgeom_dispersion", "repgeom_effective_rank",
                "repgeom_n_texts", "repgeom_massive_share", "repgeom_zero_vectors"):
        assert got[key] == pytest.approx(row[key], abs=1e-9), key
    # the keys survive mteb's cache: a second call answers from it, and the file itself holds them
    again = _scores(_quiet(mteb.evaluate, layer_encoder(bert4, layer=3), sts(), cache=cache, show_progress_bar=False))
    assert GEOMETRY <= set(again) and again["repgeom_dispersion"] == pytest.approx(got["repgeom_dispersion"], abs=1e-6)
    (path,) = (tmp_path / "evaluate").rglob("PydocSTS.json")
    assert GEOMETRY <= set(mteb.TaskResult.from_disk(path).scores["test"][0])
    # and the legacy evaluator gets them too
    legacy = _quiet(mteb.MTEB([sts()]).run, layer_encoder(bert4, layer=3), output_folder=None, verbosity=0)
    assert legacy[0].scores["test"][0]["repgeom_dispersion"] == pytest.approx(got["repgeom_dispersion"], abs=1e-9)


def test_other_models_are_left_alone(bert4, sts):
    from sentence_transformers import SentenceTransformer

    st = _quiet(SentenceTransformer, bert4, device="cpu")
    got = _scores(_quiet(mteb.evaluate, st, sts(), cache=None, show_progress_bar=False))
    assert not [k for k in got if k.startswith("repgeom")]


# -- b. one mteb model per layer: no cache answers one layer with another's score ----------------------------------

def test_legacy_run_at_layer_3_after_layer_1_is_not_layer_1s_cached_score(bert4, sts, tmp_path):
    folder = str(tmp_path / "legacy")
    first = _quiet(mteb.MTEB([sts()]).run, layer_encoder(bert4, layer=1), output_folder=folder, verbosity=0)
    second = _quiet(mteb.MTEB([sts()]).run, layer_encoder(bert4, layer=3), output_folder=folder, verbosity=0)
    alone = _quiet(mteb.MTEB([sts()]).run, layer_encoder(bert4, layer=3), output_folder=None, verbosity=0)
    layer1, layer3 = first[0].scores["test"][0]["main_score"], second[0].scores["test"][0]["main_score"]
    assert layer3 == pytest.approx(alone[0].scores["test"][0]["main_score"], abs=1e-6)
    assert abs(layer3 - layer1) > 1e-3  # distinct hidden states, distinct scores (not layer 1's, from the cache)


def test_mteb_evaluate_cache_keeps_layers_apart(bert4, sts, tmp_path):
    cache = mteb.ResultCache(tmp_path / "c")
    scores = {}
    for layer in (1, 3, 1):  # the second layer 1 is answered from the cache
        scores.setdefault(layer, []).append(_scores(_quiet(
            mteb.evaluate, layer_encoder(bert4, layer=layer), sts(), cache=cache, show_progress_bar=False))["main_score"])
    alone = _scores(_quiet(mteb.evaluate, layer_encoder(bert4, layer=3), sts(), cache=None, show_progress_bar=False))
    assert scores[3][0] == pytest.approx(alone["main_score"], abs=1e-9)
    assert scores[1][1] == pytest.approx(scores[1][0], abs=1e-6) and abs(scores[3][0] - scores[1][0]) > 1e-3
    names = {p.parent.parent.name for p in (tmp_path / "c").rglob("PydocSTS.json")}
    assert names == {"local__" + layer_encoder(bert4, layer=k).mteb_model_meta.name.split("/", 1)[1] for k in (1, 3)}


def test_pooling_is_part_of_the_name(bert4):
    names = {layer_encoder(bert4, layer=2, pooling=p).mteb_model_meta.name for p in ("mean", "cls")}
    names.add(layer_encoder(bert4, layer=2, normalize=True).mteb_model_meta.name)
    assert len(names) == 3


# -- c. models in memory -------------------------------------------------------------------------------------------

def test_in_memory_models_at_a_layer(bert4, sts):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    from repgeom_eval.mteb_layers.encoder import weights_hash

    want = _scores(_quiet(mteb.evaluate, layer_encoder(bert4, layer=3), sts(), cache=None, show_progress_bar=False))
    st = _quiet(SentenceTransformer, bert4, device="cpu")
    hf, tok = _quiet(AutoModel.from_pretrained, bert4), AutoTokenizer.from_pretrained(bert4)
    for encoder in (layer_encoder(st, layer=3), layer_encoder(hf, layer=3, tokenizer=tok)):
        meta = encoder.mteb_model_meta
        assert meta.revision == weights_hash(hf)  # in memory: the weights, not a folder
        assert meta.name.endswith("@layer=resid_post_2,pooling=mean,normalize=False")
        got = _scores(_quiet(mteb.evaluate, encoder, sts(), cache=None, show_progress_bar=False))
        assert got["main_score"] == pytest.approx(want["main_score"], abs=1e-6)
        assert got["repgeom_dispersion"] == pytest.approx(want["repgeom_dispersion"], abs=1e-6)


# -- d. mteb's result loading: one model per layer -----------------------------------------------------------------

def test_mteb_result_loading_reads_one_model_per_layer(bert4, sts, tmp_path, monkeypatch):
    cache = mteb.ResultCache(tmp_path)
    want = {}
    for layer in (1, 3):
        encoder = layer_encoder(bert4, layer=layer)
        want[encoder.mteb_model_meta.name] = _scores(_quiet(
            mteb.evaluate, encoder, sts(), cache=cache, show_progress_bar=False))["main_score"]
    loaded = cache.load_results(include_remote=False)  # mteb's defaults
    got = {m.model_name: m.task_results[0].scores["test"][0] for m in loaded.model_results}
    assert set(got) == set(want) and all(m.experiment_name is None for m in loaded.model_results)
    for name, score in want.items():
        assert got[name]["main_score"] == pytest.approx(score, abs=1e-6)
        assert "repgeom_dispersion" in got[name]
    frame = loaded.to_dataframe()  # one column per layer, not an average of the layers
    for name, score in want.items():
        assert float(frame[name].iloc[0]) == pytest.approx(score, abs=1e-6)
    # the deprecated mteb.load_results reads the same folder layout (MTEB_CACHE, nothing downloaded)
    monkeypatch.setenv("MTEB_CACHE", str(tmp_path))
    old = _quiet(mteb.load_results, download_latest=False, validate_and_filter=False)
    assert {m.model_name: m.task_results[0].get_score() for m in old.model_results} == pytest.approx(want, abs=1e-6)


# -- 5. degenerate numbers are said ---------------------------------------------------------------------------------

def _bert_with(bert4, scale: float):
    """The tiny BERT in memory, its embedding LayerNorm shifted: dimension 5 by ``scale`` (0: every vector zero)."""
    from transformers import AutoModel, AutoTokenizer

    model = _quiet(AutoModel.from_pretrained, bert4)
    with torch.no_grad():
        norm = model.embeddings.LayerNorm
        if scale == 0:
            norm.weight.zero_()
            norm.bias.zero_()
        else:
            norm.bias[5] = scale  # a constant offset in one dimension, as in real massive activations
    return model, AutoTokenizer.from_pretrained(bert4)


def test_massive_activation_is_said_in_results_log_and_warnings(bert4, sts, tmp_path, caplog):
    model, tok = _bert_with(bert4, 200.0)
    encoder = layer_encoder(model, layer="embed", tokenizer=tok)
    with caplog.at_level(logging.WARNING, logger="repgeom_eval.mteb_layers"), \
            pytest.warns(UserWarning, match="one hidden dimension carries at least 50%"):
        result = mteb.evaluate(encoder, sts(), cache=mteb.ResultCache(tmp_path), show_progress_bar=False)
    got = _scores(result)
    assert got["repgeom_massive_dimension"] == 5 and got["repgeom_massive_share"] > 0.9
    (said,) = json.loads(got["repgeom_warnings"])
    assert "dim 5" in said and "embed (PydocSTS, test, default)" in said
    assert any("carries at least 50%" in r.getMessage() for r in caplog.records)
    (path,) = tmp_path.rglob("PydocSTS.json")  # in mteb's cache file too
    assert json.loads(mteb.TaskResult.from_disk(path).scores["test"][0]["repgeom_warnings"]) == [said]
    # an ordinary layer of the unmodified model says nothing
    plain = _scores(_quiet(mteb.evaluate, layer_encoder(bert4, layer=3), sts(), cache=None, show_progress_bar=False))
    assert json.loads(plain["repgeom_warnings"]) == [] and plain["repgeom_massive_share"] < 0.5


def test_zero_vectors_are_said(bert4, sts):
    model, tok = _bert_with(bert4, 0.0)
    with pytest.warns(UserWarning, match="zero"):
        got = _scores(mteb.evaluate(layer_encoder(model, layer="embed", tokenizer=tok), sts(), cache=None,
                                    show_progress_bar=False))
    assert got["repgeom_zero_vectors"] == got["repgeom_n_texts"] > 0
    assert any("zero" in m for m in json.loads(got["repgeom_warnings"]))


def test_a_sweep_says_it_once_per_task(bert4, sts, tmp_path):
    model, tok = _bert_with(bert4, 200.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sweep = run_layers(model, [sts()], ["embed", 3], output_folder=tmp_path, progress=False,
                           name="tiny/massive", tokenizer=tok)
    said = [str(w.message) for w in caught if "carries at least 50%" in str(w.message)]
    assert len(said) == 1 and "model 'tiny/massive'" in said[0] and "embed (dim 5" in said[0]
    rows = {r["layer"]: r for r in sweep.rows}
    assert rows["embed"]["repgeom_warnings"] and rows["embed"]["repgeom_massive_dimension"] == 5


def test_summary_reads_both_layouts(tmp_path):
    """Per-layer names (today) and experiment folders (results written before) give the same summary rows."""
    from repgeom_eval.mteb_layers import summarize

    recipe = {"layer": "final", "pooling": "mean", "normalize": False}
    scores = {"test": [{"hf_subset": "default", "main_score": 0.5, "repgeom_dispersion": 0.25, "repgeom_depth": 2.0}]}
    for folder, meta in [
        (tmp_path / "new" / "local__x@layer=final,pooling=mean,normalize=False" / "r",
         {"name": "local/x@layer=final,pooling=mean,normalize=False", "revision": "r", "experiment_kwargs": None,
          "loader_kwargs": {"model": "/somewhere/x", **recipe}}),
        (tmp_path / "old" / "local__x" / "r" / "experiments" / "layer_final__normalize_False__pooling_mean",
         {"name": "local/x", "revision": "r", "experiment_kwargs": recipe, "loader_kwargs": {"model": "/somewhere/x"}}),
    ]:
        folder.mkdir(parents=True)
        (folder / "model_meta.json").write_text(json.dumps(meta))
        (folder / "T.json").write_text(json.dumps({"task_name": "T", "scores": scores}))
    new, old = summarize(tmp_path / "new"), summarize(tmp_path / "old")
    assert new == old and len(new) == 1
    assert (new[0]["model"], new[0]["layer"], new[0]["pooling"], new[0]["main_score"]) == ("local/x", "final", "mean",
                                                                                          0.5)
