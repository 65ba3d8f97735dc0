"""``repgeom mteb run --preprocess``: the scored embedding equals a hand standardization of the raw one (statistics
from the task's own texts, or from a ``measure --save-preprocess-stats`` file), the choice is recorded, and wrong
methods or statistics files fail with one clear line. Tiny random models, offline."""

from __future__ import annotations

import json
from pathlib import Path

import mteb
import numpy as np
import pytest

from repgeom_eval.entrypoints.cli import main
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.measurement.engine import measure
from repgeom_eval.measurement.preprocess import Preprocessor
from repgeom_eval.mteb_layers import LayerEmbedder, layer_encoder, make_task, run_layers
from repgeom_eval.mteb_layers.encoder import LayerSweep

PAIRS = [("The cat sat on the mat.", "A cat was sitting on a mat.", 4.5),
         ("Open the file for reading.", "The file is opened for reading.", 4.0),
         ("It rained all day.", "Prices rose in March.", 0.5),
         ("Lists are mutable sequences.", "A list can be changed in place.", 3.5),
         ("The train left early.", "Tuples cannot be modified.", 0.0),
         ("Numbers such as 3 and 4 appear here.", "The quick brown fox jumps over the lazy dog.", 1.0)]
TEXTS = list(dict.fromkeys([a for a, _, _ in PAIRS] + [b for _, b, _ in PAIRS]))


def sts_task(name: str = "TinySTS"):
    return make_task({"name": name, "type": "STS",
                      "data": [{"sentence1": a, "sentence2": b, "score": s} for a, b, s in PAIRS]})


def raw_embeddings(model: str, layer: str, texts, normalize: bool = False) -> np.ndarray:
    """The raw (unpreprocessed) embedding of ``texts`` at ``layer``, as `repgeom mteb run` scores it."""
    encoder = layer_encoder(model, layer, pooling="mean", normalize=normalize)
    meta = sts_task("Probe").metadata
    batches = [{"text": texts[i:i + 3]} for i in range(0, len(texts), 3)]
    return encoder.encode(batches, task_metadata=meta, hf_split="test", hf_subset="default").astype(np.float64)


@pytest.fixture
def scored(monkeypatch):
    """Records every (texts, address, vectors) the sweep hands to mteb."""
    calls: list[tuple[list[str], str, np.ndarray]] = []
    original = LayerSweep.vectors

    def vectors(self, texts, address, batch_size, context=None):
        out = original(self, texts, address, batch_size, context)
        calls.append((list(texts), str(address), np.asarray(out, dtype=np.float64)))
        return out

    monkeypatch.setattr(LayerSweep, "vectors", vectors)
    return calls


def check_against(calls, expected: dict[str, np.ndarray], atol=2e-5) -> int:
    """Every recorded vector equals the expected row of its text at its layer; returns how many were checked."""
    row = {t: i for i, t in enumerate(TEXTS)}
    n = 0
    for texts, address, vectors in calls:
        want = expected[address][[row[t] for t in texts]]
        np.testing.assert_allclose(vectors, want, atol=atol, rtol=1e-4)
        n += len(texts)
    return n


def standardize(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    return (x - mean) / std


@pytest.mark.parametrize("normalize", [False, True])
def test_standardized_embedding_is_the_hand_standardized_raw_one(tiny_model_dir, tmp_path, scored, normalize):
    model = tiny_model_dir("gpt2")
    sweep = run_layers(model, [sts_task()], "all", pooling="mean", normalize=normalize, preprocess="standardize",
                       output_folder=tmp_path / "res", progress=False)
    calls = list(scored)  # what the sweep handed to mteb (the raw embeddings below go through a sweep too)
    layers = sweep.layers
    expected = {}
    for layer in layers:
        raw = raw_embeddings(model, layer, TEXTS)  # the task's own texts: both sides of every pair
        z = standardize(raw, raw.mean(0), raw.std(0))
        if normalize:
            z = z / np.linalg.norm(z, axis=1, keepdims=True)
        expected[layer] = z
    assert check_against(calls, expected) == 2 * len(PAIRS) * len(layers)  # every layer, both sides, checked
    assert sweep.forward_passes == 1  # the statistics pass is the sweep's only pass
    record = json.loads(sweep.rows[0]["repgeom_preprocess"])
    assert record["method"] == "standardize" and record["statistics"] == "task"
    assert record["n_texts"] == len(TEXTS) and record["pooling"] == "mean"
    assert {r["preprocess"] for r in sweep.rows} == {"standardize"}
    # the choice is part of the result's identity, written to disk and read back by mteb
    (path, *_) = sorted((tmp_path / "res").rglob("TinySTS.json"))
    model_folder = path.parent.parent.name  # one mteb model name per layer and recipe, preprocessing included
    assert "preprocess=standardize" in model_folder and "preprocess_stats=task" in model_folder
    scores = mteb.TaskResult.from_disk(path).scores["test"][0]
    assert json.loads(scores["repgeom_preprocess"])["n_texts"] == len(TEXTS)
    # the raw run of the same model lands in its own folder and is not mistaken for the standardized one
    raw_run = run_layers(model, [sts_task()], "all", pooling="mean", normalize=normalize,
                         output_folder=tmp_path / "res", progress=False)
    assert raw_run.forward_passes == 2 and "repgeom_preprocess" not in raw_run.rows[0]  # one per side of the pairs
    again = run_layers(model, [sts_task()], "all", pooling="mean", normalize=normalize, preprocess="standardize",
                       output_folder=tmp_path / "res", progress=False)
    assert again.forward_passes == 0  # resumed from the cache: nothing to compute
    assert [r["main_score"] for r in again.rows] == pytest.approx([r["main_score"] for r in sweep.rows], abs=1e-6)


def test_center_with_metrics_feeds_the_raw_hidden_states(tiny_model_dir, scored):
    model = tiny_model_dir("llama")
    sweep = run_layers(model, [sts_task()], ["1", "final"], pooling="mean", preprocess="center",
                       metrics=["dispersion"], output_folder=None, progress=False)
    calls = list(scored)
    expected = {}
    for layer in sweep.layers:
        raw = raw_embeddings(model, layer, TEXTS)
        expected[layer] = raw - raw.mean(0)
    assert check_against(calls, expected) == 2 * len(PAIRS) * len(sweep.layers)
    same = measure(model, TEXTS, layers=sweep.layers, metrics=["dispersion"], pooling="mean", progress=False)
    for row in sweep.rows:  # --metrics describe the raw hidden states, as measure without --preprocess
        assert row["repgeom.dispersion"] == pytest.approx(same.results[row["layer"]]["dispersion"], abs=1e-6)


def test_statistics_file_from_measure(tiny_model_dir, tmp_path, scored):
    model = tiny_model_dir("gpt2")
    reference = ["A reference corpus sentence about files.", "Another one, about cats and mats.",
                 "Rain, prices and trains.", "Mutable lists and immutable tuples.", "The lazy dog sleeps.",
                 "Reading and writing text files in Python."]
    stats = tmp_path / "ref.safetensors"
    measure(model, reference, layers="all", metrics=["dispersion"], pooling="mean", preprocess="standardize",
            save_preprocess_stats=stats, progress=False)
    sweep = run_layers(model, [sts_task()], "all", pooling="mean", preprocess="standardize",
                       preprocess_stats=stats, output_folder=tmp_path / "res", progress=False)
    calls = list(scored)
    expected = {}
    for layer in sweep.layers:
        ref = raw_embeddings(model, layer, reference)
        expected[layer] = standardize(raw_embeddings(model, layer, TEXTS), ref.mean(0), ref.std(0))
    assert check_against(calls, expected, atol=1e-4) == 2 * len(PAIRS) * len(sweep.layers)
    record = json.loads(sweep.rows[0]["repgeom_preprocess"])
    assert record["statistics"] == "file" and record["file"] == str(stats) and len(record["sha256"]) == 64
    (path, *_) = sorted((tmp_path / "res").rglob("TinySTS.json"))
    assert f"preprocess_stats=file-{record['sha256'][:16]}" in path.parent.parent.name

    # a file without every evaluated address, for another method, or from a model of another hidden size
    part = tmp_path / "part.safetensors"
    measure(model, reference, layers="final", metrics=["dispersion"], pooling="mean", preprocess="standardize",
            save_preprocess_stats=part, progress=False)
    with pytest.raises(RepgeomError, match=r"no entry for embed.* with mean pooling; they cover final\|mean"):
        run_layers(model, [sts_task()], "all", pooling="mean", preprocess="standardize", preprocess_stats=part,
                   output_folder=None, progress=False)
    with pytest.raises(RepgeomError, match="no entry for final with last pooling"):
        run_layers(model, [sts_task()], "final", pooling="last", preprocess="standardize", preprocess_stats=part,
                   output_folder=None, progress=False)
    with pytest.raises(RepgeomError, match="holds 'standardize' statistics but --preprocess 'center'"):
        run_layers(model, [sts_task()], "final", pooling="mean", preprocess="center", preprocess_stats=part,
                   output_folder=None, progress=False)
    other = tiny_model_dir("llama")
    wide = LayerEmbedder(other, pooling="mean").loaded.info.hidden_size
    narrow = Preprocessor.load(part, "standardize")
    narrow.transforms = {k: {n: t[: wide // 2] for n, t in v.items()} for k, v in narrow.transforms.items()}
    bad = tmp_path / "narrow.safetensors"
    narrow.save(bad)
    with pytest.raises(RepgeomError, match=r"narrow\.safetensors were computed on .*, not on .*--allow-other-stats"):
        run_layers(other, [sts_task()], "final", pooling="mean", preprocess="standardize", preprocess_stats=bad,
                   output_folder=None, progress=False)
    with pytest.raises(RepgeomError, match=rf"dimension {wide // 2}, but final .* has dimension {wide}"):
        run_layers(other, [sts_task()], "final", pooling="mean", preprocess="standardize", preprocess_stats=bad,
                   allow_other_stats=True, output_folder=None, progress=False)


def test_errors(tiny_model_dir, tmp_path, capsys):
    model = tiny_model_dir("gpt2")
    with pytest.raises(RepgeomError, match=r"preprocess: unknown value 'zscore' \(valid: none, center"):
        run_layers(model, [sts_task()], "final", preprocess="zscore", output_folder=None, progress=False)
    with pytest.raises(RepgeomError, match="--preprocess-stats has no effect without preprocessing"):
        run_layers(model, [sts_task()], "final", preprocess_stats="x.safetensors", output_folder=None,
                   progress=False)
    with pytest.raises(RepgeomError, match="does not exist"):
        run_layers(model, [sts_task()], "final", preprocess="center", preprocess_stats=tmp_path / "none.safetensors",
                   output_folder=None, progress=False)
    with pytest.raises(RepgeomError, match="more vectors than dimensions"):  # whiten on 12 texts of dimension 32
        run_layers(model, [sts_task()], "final", preprocess="whiten", output_folder=None, progress=False)
    with pytest.raises(SystemExit):
        main(["mteb", "run", "-m", model, "--preprocess", "zscore", "-t", "STS12"])
    assert "invalid choice: 'zscore'" in capsys.readouterr().err
    code = main(["mteb", "run", "-m", model, "--preprocess-stats", "x.safetensors", "-t", "STS12",
                 "--output-folder", str(tmp_path / "o")])
    assert code != 0 and "no effect without preprocessing" in capsys.readouterr().err


def test_cli_run_records_the_choice(tiny_model_dir, tmp_path, capsys):
    from repgeom_eval.mteb_layers.examples import write_example_tasks

    tasks_file = write_example_tasks(tmp_path / "tasks", size="small")
    out = tmp_path / "res"
    code = main(["mteb", "run", "-m", tiny_model_dir("gpt2"), "--layer", "all", "--pooling", "mean",
                 "--preprocess", "standardize", "--tasks-file", str(tasks_file), "-t", "PydocSTS", "--output-folder", str(out),
                 "--no-progress"])
    assert code == 0
    summary = (out / "repgeom_summary.md").read_text(encoding="utf-8")
    assert "preprocess standardize (task statistics)" in summary
    assert list(Path(out).rglob("*.png"))
