"""MTEB at any layer (repgeom_eval.mteb_layers): encoder vs hand-pooled hidden states, sweeps vs single-layer
runs, local tasks of all four types, geometry in the cached results, mteb registry, summaries and the CLI.

Tiny random models (BERT and decoders) and small tasks generated from Python's documentation; all offline.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import mteb
import numpy as np
import pytest
import torch

from repgeom_eval.modeling.addresses import Address
from repgeom_eval.entrypoints.cli import main
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.mteb_layers import (
    GENERIC_NAME,
    LayerEmbedder,
    LayerEncoder,
    geometry_scores,
    layer_encoder,
    load_tasks_file,
    make_task,
    register_model,
    run_layers,
    summarize,
    write_summary,
)
from repgeom_eval.mteb_layers.examples import build_tasks, pydoc_documents, write_example_tasks
from repgeom_eval.mteb_layers.summary import best_vs_last, to_markdown

TEXTS = ["A short one.", "The quick brown fox jumps over the lazy dog near the river bank today.",
         "Numbers such as 3 and 4 appear here.", "x", "Another sentence, of middling length, to pad the batch."]


@pytest.fixture(scope="module")
def specs():
    return build_tasks(pydoc_documents(), "pydoc", size="small", seed=0)


def fresh_tasks(specs, names=None):
    """New task instances (fresh random state, no data loaded), as a separate run would build them."""
    return [make_task({"name": n, **s}) for n, s in specs.items() if names is None or n in names]


def _meta():
    return make_task({"name": "Probe", "type": "STS", "data": [{"sentence1": "a", "sentence2": "b", "score": 1},
                                                               {"sentence1": "c", "sentence2": "d", "score": 0}]}
                     ).metadata


def _encode(encoder: LayerEncoder, texts, batch_size=2) -> np.ndarray:
    batches = [{"text": texts[i:i + batch_size]} for i in range(0, len(texts), batch_size)]
    return encoder.encode(batches, task_metadata=_meta(), hf_split="test", hf_subset="default",
                          batch_size=batch_size)


def _reference_hidden_states(model_dir: str, causal: bool, texts) -> list[tuple[torch.Tensor, ...]]:
    """All hidden states of each text run alone (no padding), straight from transformers."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = (AutoModelForCausalLM if causal else AutoModel).from_pretrained(model_dir).eval()
    with torch.no_grad():
        return [model(**tok(t, return_tensors="pt"), output_hidden_states=True).hidden_states for t in texts]


def _pool_by_hand(states, k: int, pooling: str) -> np.ndarray:
    rows = [{"mean": hs[k][0].mean(0), "last": hs[k][0][-1], "cls": hs[k][0][0]}[pooling] for hs in states]
    return torch.stack(rows).numpy()


# -- the embedding is the hidden state ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind,causal", [("bert", False), ("llama", True), ("gpt2", True)])
def test_layer_k_equals_hidden_states_k_pooled_by_hand(tiny_model_dir, kind, causal):
    from repgeom_eval.modeling.loading import load_model
    from repgeom_eval.mteb_layers import LayerSweep

    model_dir = tiny_model_dir(kind)
    loaded = load_model(model_dir)
    states = _reference_hidden_states(model_dir, causal, TEXTS)
    for pooling in ("mean", "last", "cls"):
        embedder = LayerEmbedder(loaded, pooling=pooling)
        addresses = embedder.addresses("all")
        assert len(addresses) == loaded.info.n_layers + 1
        sweep = LayerSweep(embedder, addresses)
        for k, addr in enumerate(addresses):
            got = _encode(sweep.encoder(addr, name="tiny/model", revision="r"), TEXTS, batch_size=2)
            np.testing.assert_allclose(got, _pool_by_hand(states, k, pooling), atol=2e-5, rtol=1e-4,
                                       err_msg=f"{kind} {pooling} layer {k}")
        assert sweep.forward_passes == 1  # every layer came out of the first encode call's forward passes


def test_normalize_and_batch_size_invariance(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2")
    plain = _encode(layer_encoder(model_dir, 1, pooling="mean"), TEXTS, batch_size=1)
    batched = _encode(layer_encoder(model_dir, 1, pooling="mean"), TEXTS, batch_size=5)
    np.testing.assert_allclose(plain, batched, atol=2e-6)
    unit = _encode(layer_encoder(model_dir, 1, pooling="mean", normalize=True), TEXTS)
    np.testing.assert_allclose(unit, plain / np.linalg.norm(plain, axis=1, keepdims=True), atol=1e-6)


def test_sentence_transformers_folder_matches_its_own_encode(tiny_model_dir, tmp_path):
    """A tiny sentence-transformers folder (CLS pooling, Normalize, max_seq_length 8): the final layer with the
    model's own recipe equals SentenceTransformer.encode."""
    from sentence_transformers import SentenceTransformer

    folder = tmp_path / "tiny-st"
    shutil.copytree(tiny_model_dir("bert"), folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 8, "do_lower_case": False}))
    encoder = layer_encoder(str(folder), "final")
    recipe = encoder.sweep.embedder.recipe
    assert (recipe.pooling, recipe.normalize, recipe.max_length) == ("first", True, 8)
    assert encoder.experiment_kwargs == {"layer": "final", "pooling": "first", "normalize": True}
    want = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_numpy=True)
    np.testing.assert_allclose(_encode(encoder, TEXTS), want, atol=1e-5)
    with pytest.raises(RepgeomError, match="not a sentence-transformers model"):
        LayerEmbedder(tiny_model_dir("bert"), pooling="st")


# -- identity: meta, registry ---------------------------------------------------------------------------------------

def test_meta_identity_and_canonical_layers(tiny_model_dir):
    model_dir = tiny_model_dir("bert")
    enc = layer_encoder(model_dir, 1, pooling="mean")
    meta = enc.mteb_model_meta
    assert meta.name.startswith("local/") and "/" in meta.name
    assert len(meta.revision) == 16  # content hash of the folder
    assert meta.similarity_fn_name is mteb.models.model_meta.ScoringFunction.COSINE
    assert enc.experiment_kwargs == {"layer": "resid_post:0", "pooling": "mean", "normalize": False}
    # one mteb model per layer and recipe: the recipe is in the name (and, canonical, in loader_kwargs)
    assert meta.name == enc.name + "@layer=resid_post_0,pooling=mean,normalize=False"
    assert meta.experiment_kwargs is None
    assert meta.loader_kwargs == {"model": model_dir, "layer": "resid_post:0", "pooling": "mean", "normalize": False}
    # hidden_states[1] == resid_post:0; on BERT the last block's output IS `final`; resid_pre:0 IS `embed`
    assert layer_encoder(model_dir, "resid_post:0").experiment_kwargs["layer"] == "resid_post:0"
    assert layer_encoder(model_dir, "resid_post:1").experiment_kwargs["layer"] == "final"
    assert layer_encoder(model_dir, "resid_pre:0").experiment_kwargs["layer"] == "embed"
    names = {layer_encoder(model_dir, k).mteb_model_meta.model_name_as_path() for k in range(3)}
    assert len(names) == 3  # one results folder per layer
    with pytest.raises(RepgeomError, match="names 3 addresses"):
        layer_encoder(model_dir, "all")


def test_mteb_get_model_after_import(tiny_model_dir):
    model_dir = tiny_model_dir("bert")
    enc = mteb.get_model(GENERIC_NAME, model=model_dir, layer=1, pooling="mean")
    assert isinstance(enc, LayerEncoder) and isinstance(enc, mteb.EncoderProtocol)
    # mteb assigns its own meta (experiment_kwargs = the raw keywords); the canonical identity survives
    assert enc.mteb_model_meta.loader_kwargs["layer"] == "resid_post:0"
    assert enc.mteb_model_meta.experiment_kwargs is None
    assert enc.mteb_model_meta.name.startswith("local/")
    register_model(model_dir, name="tiny/bert-layers")
    enc = mteb.get_model("tiny/bert-layers", layer=2)
    assert enc.name == "tiny/bert-layers"
    assert enc.mteb_model_meta.name == "tiny/bert-layers@layer=final,pooling=mean,normalize=False"
    # the meta mteb saves rebuilds the same layer encoder
    again = enc.mteb_model_meta.load_model()
    assert again.mteb_model_meta.name == enc.mteb_model_meta.name and again.address == enc.address
    with pytest.raises(RepgeomError, match="already has a model"):
        register_model(model_dir, name="sentence-transformers/all-MiniLM-L6-v2")
    with pytest.raises(RepgeomError, match="no option"):
        mteb.get_model(GENERIC_NAME, model=model_dir, layers=3)


def test_mock_run_passes(tiny_model_dir):
    result = mteb.mock_run(layer_encoder(tiny_model_dir("bert"), 1))
    ran = [name for name, status in result.items() if status is not None]
    assert result.all_passed, result.to_markdown()
    assert len(ran) >= 10


# -- local tasks, sweeps, geometry, cache ---------------------------------------------------------------------------

def _rows_by_key(rows):
    return {(r["task"], r["layer"], r["split"], r["subset"]): r for r in rows}


def _check_rows(rows, n_layers: int) -> None:
    assert sorted({r["task_type"] for r in rows}) == ["Classification", "Clustering", "Retrieval", "STS"]
    assert len(rows) == 4 * n_layers  # one split and subset per task
    for r in rows:
        assert math.isfinite(r["main_score"])
        assert 0.0 <= r["repgeom_dispersion"] <= 2.0 and 0.0 <= r["repgeom_dataset_entropy"] <= 1.0
        assert 1.0 <= r["repgeom_effective_rank"] <= 32.0 and r["repgeom_n_texts"] > 1


def test_sweep_equals_single_layer_runs_on_all_task_types(tiny_model_dir, specs, tmp_path):
    model_dir = tiny_model_dir("bert")
    sweep = run_layers(model_dir, fresh_tasks(specs), "all", output_folder=tmp_path / "sweep", progress=False,
                       batch_size=8)
    _check_rows(sweep.rows, 3)
    swept = _rows_by_key(sweep.rows)
    single_passes = 0
    for layer in sweep.layers:
        single = run_layers(model_dir, fresh_tasks(specs), layer, output_folder=tmp_path / f"one-{layer}",
                            progress=False, batch_size=8)
        single_passes = max(single_passes, single.forward_passes)
        for key, row in _rows_by_key(single.rows).items():
            for field, value in row.items():
                if isinstance(value, float):
                    assert value == pytest.approx(swept[key][field], abs=1e-9), (key, field)
    # one forward sweep per distinct list of texts, however many layers
    assert sweep.forward_passes == single_passes


def test_predictions_are_kept_per_layer(tiny_model_dir, specs, tmp_path):
    """--prediction-folder: mteb names a prediction file after the task alone, so every layer gets its own folder;
    each layer's saved STS similarities give back that layer's main score."""
    from scipy.stats import spearmanr

    result = run_layers(tiny_model_dir("bert"), fresh_tasks(specs, ["PydocSTS"]), [0, 2], output_folder=None,
                        prediction_folder=tmp_path / "preds", progress=False, pooling="mean")
    files = sorted((tmp_path / "preds").rglob("PydocSTS_predictions.json"))
    assert len(files) == 2 and len({f.parent for f in files}) == 2
    gold = [row["score"] for row in specs["PydocSTS"]["data"]]
    scores = {r["layer"]: r["main_score"] for r in result.rows}
    for f in files:
        saved = json.loads(f.read_text())
        layer = saved["mteb_model_meta"]["model_name"].split("@layer=")[1].split(",")[0]
        assert f.parent.name == saved["mteb_model_meta"]["model_name"].replace("/", "__")
        cosine = saved["default"]["test"]["cosine_scores"]
        assert spearmanr(cosine, gold).statistic == pytest.approx(scores[layer], abs=1e-6)


def test_decoder_on_all_task_types(tiny_model_dir, specs, tmp_path):
    # (pooling "last" would give every sentence of the embedding layer the same vector: they all end in ".")
    result = run_layers(tiny_model_dir("llama"), fresh_tasks(specs), "all", pooling="mean",
                        output_folder=tmp_path / "out", progress=False)
    _check_rows(result.rows, 3)
    assert result.layers == ["embed", "resid_post:0", "final"]


def test_results_on_disk_resume_and_summary(tiny_model_dir, specs, tmp_path):
    model_dir = tiny_model_dir("gpt2")
    out = tmp_path / "cache"
    first = run_layers(model_dir, fresh_tasks(specs, ["PydocSTS", "PydocRetrieval"]), [0, 2], output_folder=out,
                       progress=False, pooling="last")
    assert first.forward_passes > 0
    files = sorted(out.rglob("PydocSTS.json"))
    assert len(files) == 2 and len({f.parent.parent for f in files}) == 2  # one model folder per layer
    for f in files:
        scores = json.loads(f.read_text())["scores"]["test"][0]
        assert {"repgeom_dataset_entropy", "repgeom_dispersion", "repgeom_effective_rank", "repgeom_depth"} <= set(
            scores)
        meta = json.loads((f.parent / "model_meta.json").read_text())
        assert meta["loader_kwargs"]["layer"] in ("embed", "final")
        assert meta["name"].endswith(f"@layer={meta['loader_kwargs']['layer']},pooling=last,normalize=False")
        assert meta["similarity_fn_name"] == "cosine"
        # mteb's own loader reads the extra keys back
        loaded = mteb.TaskResult.from_disk(f)
        assert "repgeom_dispersion" in loaded.scores["test"][0]
    # resumed: nothing to compute, same numbers
    again = run_layers(model_dir, fresh_tasks(specs, ["PydocSTS", "PydocRetrieval"]), [0, 2], output_folder=out,
                       progress=False, pooling="last")
    assert again.forward_passes == 0
    before = _rows_by_key(first.rows)
    for key, row in _rows_by_key(again.rows).items():  # mteb stores scores rounded to 6 decimals
        assert row == {k: pytest.approx(v, abs=1e-6) if isinstance(v, float) else v for k, v in before[key].items()}
    # a new layer: only it is computed, the cached ones are read back
    more = run_layers(model_dir, fresh_tasks(specs, ["PydocSTS"]), [0, 1, 2], output_folder=out, progress=False,
                      pooling="last")
    assert more.forward_passes == 2 and len(more.rows) == 3  # sentence1 and sentence2 lists, layer 1 only
    rows = summarize(out)
    sts = [r for r in rows if r["task"] == "PydocSTS"]
    assert [r["layer"] for r in sts] == ["embed", "resid_post:0", "final"]  # depth order
    assert [r["depth"] for r in sts] == [0.0, 1.0, 2.0]
    written = write_summary(out)
    paths = written["paths"]
    assert paths["csv"].read_text().splitlines()[0].startswith("model,revision,pooling")
    assert "### PydocSTS" in paths["markdown"].read_text()
    assert len(paths["plots"]) == 1 and paths["plots"][0].stat().st_size > 1000
    # a new output folder is created; a file in its place is refused and left alone
    elsewhere = write_summary(out, tmp_path / "new" / "dir", plots=False)["paths"]
    assert elsewhere["csv"].read_text() == paths["csv"].read_text()
    (tmp_path / "a-file").write_text("keep")
    with pytest.raises(RepgeomError, match="is a file"):
        write_summary(out, tmp_path / "a-file")
    with pytest.raises(RepgeomError, match="cannot create output folder"):
        write_summary(out, tmp_path / "a-file" / "below")
    assert (tmp_path / "a-file").read_text() == "keep"


def test_geometry_scores_match_the_functional_core():
    from repgeom_eval.functional.dispersion import dispersion
    from repgeom_eval.functional.entropy import dataset_entropy
    from repgeom_eval.functional.rank import effective_rank

    x = np.random.default_rng(0).normal(size=(40, 12)) + 0.3
    got = geometry_scores(x)
    t = torch.from_numpy(x)
    assert got["repgeom_dispersion"] == pytest.approx(float(dispersion(t)), rel=1e-9)
    assert got["repgeom_dataset_entropy"] == pytest.approx(dataset_entropy(t)["normalized"], rel=1e-9)
    assert got["repgeom_dataset_entropy_raw"] == pytest.approx(dataset_entropy(t)["raw"], rel=1e-9)
    assert got["repgeom_effective_rank"] == pytest.approx(effective_rank(t)["rankme"], rel=1e-6)
    assert got["repgeom_n_texts"] == 40


def test_best_vs_last_and_markdown():
    rows = [{"model": "m/x", "revision": "r", "pooling": "mean", "normalize": False, "max_length": 8, "task": "T",
             "split": "test", "subset": "default", "main_score_name": "accuracy", "layer": layer, "depth": depth,
             "main_score": score, "repgeom_dataset_entropy": 0.5, "repgeom_dispersion": 0.1,
             "repgeom_effective_rank": 3.0, "repgeom_n_texts": 10}
            for layer, depth, score in [("embed", 0.0, 0.2), ("resid_post:0", 1.0, 0.7), ("final", 2.0, 0.6)]]
    v = best_vs_last(rows)
    assert v["best_layer"] == "resid_post:0" and v["last_layer"] == "final" and v["intermediate_wins"]
    assert v["gain"] == pytest.approx(0.1)
    md = to_markdown(rows)
    assert "| resid_post:0 | 1.0000 | **0.7000** |" in md and "beats the last layer final" in md
    rows[2]["main_score"] = 0.9
    assert not best_vs_last(rows)["intermediate_wins"]


# -- the tasks file ---------------------------------------------------------------------------------------------------

@pytest.mark.fault("refused")
def test_example_tasks_never_replace_other_content_without_overwrite(tmp_path, capsys):
    from entrypoints.cli import main

    folder = tmp_path / "ex"
    tasks_file = write_example_tasks(folder, size="small")
    written = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert write_example_tasks(folder, size="small") == tasks_file  # the same files again: nothing to replace
    edited = tasks_file.read_text() + "# my note\n"
    tasks_file.write_text(edited)
    assert main(["mteb", "example-tasks", str(folder), "--size", "small"]) == 2
    assert "already holds tasks.yaml with other content" in capsys.readouterr().err
    assert tasks_file.read_text() == edited
    with pytest.raises(RepgeomError, match=r"already holds .*--overwrite"):  # other tasks: every file differs
        write_example_tasks(folder, size="small", seed=1)
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name != "tasks.yaml"} == {
        k: v for k, v in written.items() if k != "tasks.yaml"}
    assert main(["mteb", "example-tasks", str(folder), "--size", "small", "--overwrite"]) == 0
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == written


def test_xlarge_tasks_evaluate_300_items_and_write_tasks_takes_any_topics(tmp_path):
    """Size xlarge: 300 evaluated items a task (test texts, clustered texts, STS pairs); write_tasks writes the
    same form for topics of one's own (experiments/which_layer_embeds builds its Bible, WordNet and docstring tasks
    this way)."""
    import json

    from repgeom_eval.mteb_layers.examples import write_tasks

    groups = {f"topic{k}": [[f"Sentence number {i} of the topic {k} says a thing." for i in range(j, j + 3)]
                            for j in range(0, 90, 3)] for k in range(10)}
    specs = build_tasks(groups, "mine", size="xlarge", seed=0)
    assert len(specs["MineSTS"]["data"]) == 300
    assert len(specs["MineTopicClassification"]["test"]) == 300
    assert len(specs["MineTopicClustering"]["data"]) == 300
    tasks_file = write_tasks(tmp_path / "mine", specs, "my topics")
    assert tasks_file.read_text().startswith("# my topics\n")
    tasks = load_tasks_file(tasks_file)
    assert [t.metadata.name for t in tasks] == list(specs)
    rows = [json.loads(x) for x in (tmp_path / "mine" / "MineSTS.data.jsonl").read_text().splitlines()]
    assert rows == specs["MineSTS"]["data"]


def test_tasks_file_round_trip_and_errors(tmp_path):
    tasks_file = write_example_tasks(tmp_path / "ex", size="small")
    tasks = load_tasks_file(tasks_file)
    assert [t.metadata.type for t in tasks] == ["STS", "Classification", "Clustering", "Retrieval"]
    assert len({t.metadata.dataset["revision"] for t in tasks}) == 4
    bad = tmp_path / "bad.yaml"

    def check(doc: str, match: str, data: str | None = None):
        if data is not None:
            (tmp_path / "d.jsonl").write_text(data)
        bad.write_text(doc)
        with pytest.raises(RepgeomError, match=match):
            load_tasks_file(bad)

    check("tasks: [{name: A, type: Regression, data: d.jsonl}]", "not one of STS")
    check("tasks: [{name: A, type: STS, data: d.jsonl}]", r"record 2 has no 'score'",
          '{"sentence1": "a", "sentence2": "b", "score": 1}\n{"sentence1": "a", "sentence2": "b"}\n')
    check("tasks: [{name: A, type: STS, data: d.jsonl}]", r"d.jsonl:1: not valid JSON", "{oops\n")
    check("tasks: [{name: A, type: STS, data: nope.jsonl}]", "not found")
    check("tasks: [{name: A, type: STS}]", "needs 'data'")
    check("tasks: [{name: A, type: STS, data: d.jsonl, colour: red}]", "unknown key")
    check("tasks: [{name: A, type: STS, data: d.jsonl}, {name: A, type: STS, data: d.jsonl}]", "more than once",
          '{"sentence1": "a", "sentence2": "b", "score": 1}\n{"sentence1": "c", "sentence2": "d", "score": 3}\n')
    check("tasks: [{name: A, type: STS, data: d.jsonl}]", "scores span nothing",
          '{"sentence1": "a", "sentence2": "b", "score": 1}\n{"sentence1": "c", "sentence2": "d", "score": 1}\n')
    (tmp_path / "q.jsonl").write_text('{"query_id": "1", "doc_id": "zz"}\n')
    (tmp_path / "d.jsonl").write_text('{"id": "1", "text": "t"}\n')
    check("tasks: [{name: R, type: Retrieval, corpus: d.jsonl, queries: d.jsonl, qrels: q.jsonl}]",
          "document 'zz' is not in the corpus")
    check("just a string", "must hold a list of tasks")


# -- the command -------------------------------------------------------------------------------------------------------

def test_cli_run_and_summary(tiny_model_dir, tmp_path, capsys):
    tasks_file = write_example_tasks(tmp_path / "ex", size="small")
    out = tmp_path / "results"
    rc = main(["mteb", "run", "-m", tiny_model_dir("bert"), "--layer", "all", "--tasks-file", str(tasks_file),
               "-t", "PydocSTS", "PydocTopicClustering", "--output-folder", str(out), "--batch-size", "4"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "3 layer(s) × 2 task(s)" in text and "PydocTopicClustering" in text
    assert "peak memory: resident " in text and "GPU" not in text.split("peak memory:")[1].splitlines()[0]  # on CPU
    assert (out / "repgeom_summary.csv").is_file() and (out / "repgeom_summary.md").is_file()
    rc = main(["mteb", "summary", str(out), "-o", str(tmp_path), "--prefix", "again", "--no-plot"])
    assert rc == 0 and (tmp_path / "again.md").is_file()
    assert len((tmp_path / "again.csv").read_text().splitlines()) == 1 + 2 * 3


@pytest.mark.parametrize("argv,message", [
    (["mteb", "run", "-m", "MODEL", "--tasks-file", "missing.yaml"], "tasks file 'missing.yaml' not found"),
    (["mteb", "run", "-m", "MODEL", "-t", "NoSuchTaskAnywhere"], "NoSuchTaskAnywhere"),
    (["mteb", "run", "-m", "MODEL"], "no task selected"),
    (["mteb", "summary", "nowhere"], "results folder 'nowhere' not found"),
])
def test_cli_errors_are_one_line(tiny_model_dir, argv, message, capsys):
    argv = [tiny_model_dir("bert") if a == "MODEL" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("repgeom: error:") and message in err and len(err.splitlines()) == 1


def test_cli_bad_layer_and_unreachable_task_data(tiny_model_dir, tmp_path, capsys):
    tasks_file = write_example_tasks(tmp_path / "ex", size="small")
    assert main(["mteb", "run", "-m", tiny_model_dir("bert"), "--layer", "7", "--tasks-file", str(tasks_file),
                 "--output-folder", str(tmp_path / "r")]) == 2
    assert "out of range" in capsys.readouterr().err
    # a built-in MTEB task needs the Hub, which is unreachable here: a clear error, not a traceback
    assert main(["mteb", "run", "-m", tiny_model_dir("bert"), "-t", "STS12", "--output-folder",
                 str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "cannot load the data of task 'STS12'" in err and "--tasks-file" in err


def test_address_depth(tiny_model_dir):
    e = LayerEmbedder(tiny_model_dir("llama"))
    assert [e.depth(a) for a in e.addresses("all")] == [0.0, 1.0, 2.0]
    assert e.depth(Address("resid_mid", 1)) == 1.5
