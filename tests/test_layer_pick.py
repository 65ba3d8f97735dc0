"""``--layer auto`` (docs/picks.md): the label-free pick equals the rule's argmin/argmax of the recorded scores, the
scores are the geometry ``repgeom measure`` computes on the same texts, final is evaluated too, plugin rules are used,
and the layer encoder picks per task. Tiny random models and the example tasks; all offline."""

from __future__ import annotations

import json
import math
import types

import mteb
import numpy as np
import pytest

import repgeom_eval
from repgeom_eval.entrypoints.cli import main
from repgeom_eval.spec.errors import RepgeomError, UnknownNameError
from repgeom_eval.spec.layer_pick import LayerPick, MinDatasetEntropy, make_pick
from repgeom_eval.mteb_layers import layer_encoder, make_task, run_layers
from repgeom_eval.mteb_layers.examples import build_tasks, pydoc_documents, write_example_tasks
from repgeom_eval.mteb_layers.preprocess import task_texts
from repgeom_eval.plugin_system.host import PluginHost


@pytest.fixture(scope="module")
def specs():
    return build_tasks(pydoc_documents(), "pydoc", size="small", seed=0)


def fresh_tasks(specs, names=None):
    return [make_task({"name": n, **s}) for n, s in specs.items() if names is None or n in names]


def _argbest(scores: dict, direction: str) -> str:
    best = (min if direction == "min" else max)(scores.values())
    return next(a for a, s in scores.items() if s == best)  # the shallowest of a tie


def test_auto_evaluates_the_argmin_and_final_and_records_the_pick(tiny_model_dir, specs, tmp_path):
    result = run_layers(tiny_model_dir("bert", 3), fresh_tasks(specs), "auto", output_folder=tmp_path / "out",
                        progress=False, batch_size=8)
    assert sorted(result.picks) == sorted(specs)
    assert result.forward_passes == len(specs)  # the pick's pass answers both evaluations
    for task, pick in result.picks.items():
        assert pick["rule"] == "min_dataset_entropy" and pick["direction"] == "min"
        assert pick["params"] == {"include_embed": False, "alpha": 1.0}
        assert list(pick["scores"]) == ["resid_post:0", "resid_post:1", "final"]  # embed left out by default
        assert all(math.isfinite(v) for v in pick["scores"].values())
        assert pick["chosen"] == _argbest(pick["scores"], "min")
        assert pick["plugin"]["plugin"] == "layer_selectors" and pick["plugin"]["distribution"] == "repgeom-eval"
        rows = [r for r in result.rows if r["task"] == task]
        assert {r["layer"] for r in rows} == {pick["chosen"], "final"}  # final is evaluated too
        assert all(r["repgeom_layer_pick"] == pick for r in rows)
        assert {r["pick_role"] for r in rows} == ({"pick+final"} if pick["chosen"] == "final" else {"pick", "final"})
        for r in rows:  # the pick is in mteb's own result files, next to the score
            meta = layer_encoder(tiny_model_dir("bert", 3), r["layer"]).mteb_model_meta
            cached = mteb.ResultCache(tmp_path / "out").load_task_result(task, meta)
            assert json.loads(cached.scores["test"][0]["repgeom_layer_pick"]) == pick
    # a second run: the same picks, every evaluation from the cache
    again = run_layers(tiny_model_dir("bert", 3), fresh_tasks(specs), "auto", output_folder=tmp_path / "out",
                       progress=False, batch_size=8)
    assert again.picks == result.picks
    first = {(r["task"], r["layer"]): r["main_score"] for r in result.rows}
    cached = {(r["task"], r["layer"]): r["main_score"] for r in again.rows}
    assert cached.keys() == first.keys()
    assert all(cached[k] == pytest.approx(first[k], abs=1e-6) for k in first)  # mteb's files round to 6 digits


def test_scores_equal_measure_on_the_same_texts(tiny_model_dir, specs):
    model = tiny_model_dir("llama", 3)
    (task,) = fresh_tasks(specs, ["PydocSTS"])
    result = run_layers(model, [task], "auto", output_folder=None, progress=False, pooling="mean",
                        layer_pick_params={"include_embed": True})
    pick = result.picks["PydocSTS"]
    assert list(pick["scores"]) == ["embed", "resid_post:0", "resid_post:1", "final"]
    (task,) = fresh_tasks(specs, ["PydocSTS"])
    task.load_data()
    from repgeom_eval.mteb_layers import LayerEmbedder

    embedder = LayerEmbedder(model, pooling="mean")
    texts = task_texts(task, layer_encoder(model, "final").mteb_model_meta, embedder, {"batch_size": 32})
    assert pick["n_texts"] == len(texts)
    measured = repgeom_eval.measure(model, texts, layers=list(pick["scores"]), metrics=["dataset_entropy"],
                                    pooling="mean", progress="never")
    for address, score in pick["scores"].items():
        assert score == pytest.approx(measured.results[address]["dataset_entropy"]["normalized"], abs=1e-6)


class Spread(LayerPick):
    """The layer whose texts are most spread out (largest mean pairwise cosine distance)."""

    name = "max_spread"
    quantity = "mean pairwise cosine distance of the pooled vectors"
    direction = "max"
    defaults = {"power": 1.0}

    def score(self, vectors):
        u = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
        n = len(u)
        return float((1 - (np.square(u.sum(0)).sum() - n) / (n * (n - 1))) ** self.params["power"])


def _plugin_host():
    @repgeom_eval.hookimpl
    def repgeom_register_layer_picks(registry):
        registry.add(Spread)

    module = types.ModuleType("spread_plugin")
    module.repgeom_register_layer_picks = repgeom_register_layer_picks
    return PluginHost(extra_plugins=[("spread", module)])


def test_a_plugin_rule_is_used(tiny_model_dir, specs):
    host = _plugin_host()
    assert "max_spread" in host.layer_picks and "min_dataset_entropy" in host.layer_picks
    result = run_layers(tiny_model_dir("gpt2", 3), fresh_tasks(specs, ["PydocTopicClustering"]), "auto",
                        output_folder=None, progress=False, pooling="mean", layer_pick="max_spread",
                        layer_pick_params={"power": "2"}, host=host)
    pick = result.picks["PydocTopicClustering"]
    assert pick["rule"] == "max_spread" and pick["params"]["power"] == 2.0 and pick["plugin"]["plugin"] == "spread"
    assert pick["chosen"] == _argbest(pick["scores"], "max")
    assert {r["layer"] for r in result.rows} == {pick["chosen"], "final"}


def test_unknown_rules_and_parameters_are_one_line_errors(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(UnknownNameError, match="unknown layer pick 'min_dataset_entropie'; did you mean "
                                               "'min_dataset_entropy'"):
        make_pick("min_dataset_entropie")
    with pytest.raises(RepgeomError, match="no parameter 'alpah'; did you mean 'alpha'"):
        make_pick(None, {"alpah": 2})
    with pytest.raises(RepgeomError, match="should be of type float"):
        make_pick(None, {"alpha": "two"})
    with pytest.raises(RepgeomError, match="cannot be combined"):
        run_layers("never-loaded", [], ["auto", "final"])
    with pytest.raises(RepgeomError, match="needs --layer auto"):
        run_layers("never-loaded", [], "final", layer_pick="min_dataset_entropy")
    tasks_file = str(write_example_tasks(tmp_path / "ex", size="small"))
    argv = ["mteb", "run", "--model", tiny_model_dir("gpt2"), "--layer", "auto", "--tasks-file", tasks_file,
            "--layer-pick", "min_entropy", "--output-folder", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "did you mean 'min_dataset_entropy'" in err


def test_cli_auto(tiny_model_dir, tmp_path, capsys):
    write_example_tasks(tmp_path / "ex", size="small")
    assert main(["mteb", "run", "--model", tiny_model_dir("gpt2"), "--layer", "auto", "--tasks-file",
                 str(tmp_path / "ex" / "tasks.yaml"), "-t", "PydocSTS", "--layer-pick-param", "include_embed=true",
                 "--output-folder", str(tmp_path / "o"), "--no-progress", "--no-summary"]) == 0
    out = capsys.readouterr().out
    assert "layer pick for PydocSTS:" in out and "by min_dataset_entropy (min of 3 layers: embed" in out
    flat = " ".join(out.split())
    assert "min_dataset_entropy measured against final: gallery, SmolLM2-135M, raw" in flat
    assert "Not a better default than final" in flat


def test_layer_encoder_auto_picks_on_the_first_encode(tiny_model_dir, specs):
    model = tiny_model_dir("bert", 3)
    encoder = layer_encoder(model, "auto", pooling="mean")
    assert encoder.mteb_model_meta.name.endswith("@layer=auto,pooling=mean,normalize=False,"
                                                 "layer_pick=min_dataset_entropy")
    (task,) = fresh_tasks(specs, ["PydocTopicClustering"])
    result = mteb.evaluate(encoder, task, cache=None, show_progress_bar=False)
    scores = result.task_results[0].scores["test"][0]
    pick = json.loads(scores["repgeom_layer_pick"])
    assert pick["chosen"] == _argbest(pick["scores"], "min") == str(encoder.address)
    assert "first encode call" in pick["texts"]
    # the same numbers as a plain encoder of the picked layer
    (task,) = fresh_tasks(specs, ["PydocTopicClustering"])
    plain = mteb.evaluate(layer_encoder(model, pick["chosen"], pooling="mean"), task, cache=None,
                          show_progress_bar=False).task_results[0].scores["test"][0]
    assert scores["main_score"] == pytest.approx(plain["main_score"], abs=1e-6)
    with pytest.raises(RepgeomError, match="needs layer='auto'"):
        layer_encoder(model, "final", layer_pick="min_dataset_entropy")


def test_built_in_rule_is_a_registered_plugin_item():
    from repgeom_eval.plugin_system.host import get_host

    entry = get_host().layer_picks.entry("min_dataset_entropy")
    assert entry.load() is MinDatasetEntropy and entry.plugin == "layer_selectors"
    with pytest.raises(repgeom_eval.PluginError, match="expected a subclass of repgeom_eval.spec.layer_pick.LayerPick"):
        host = PluginHost(extra_plugins=[])
        host.layer_picks.bound("x", None).add(lambda v: 0.0, name="not_a_class")


def test_auto_with_preprocess_and_metrics(tiny_model_dir, specs):
    result = run_layers(tiny_model_dir("gpt2", 3), fresh_tasks(specs, ["PydocRetrieval"]), "auto", output_folder=None,
                        progress=False, pooling="mean", preprocess="standardize", metrics=["dispersion"])
    pick = result.picks["PydocRetrieval"]
    assert {r["layer"] for r in result.rows} == {pick["chosen"], "final"}
    for r in result.rows:
        assert r["repgeom_layer_pick"] == pick and "repgeom.dispersion" in r and r["repgeom_preprocess"]
