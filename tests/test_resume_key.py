"""Resume is exact or refused: the run key holds the content of every input (not paths), and a checkpoint state
that does not fit the run is refused in one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.measurement.engine import measure

BASE = dict(layers="resid_post:0,final", metrics=["dispersion", "token_dispersion"], shard_size=4, batch_size=3,
            progress=False)


@pytest.fixture
def run(tmp_path, tiny_model_dir, texts):
    """A completed checkpointed run: its model folder, data file and run directory, all private copies."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("gpt2"), model)
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(texts[:12]) + "\n")
    run_dir = tmp_path / "run"
    first = measure(str(model), str(data), run_dir=run_dir, **BASE)
    return model, data, run_dir, first


def _resume(model, data, run_dir, **changes):
    return measure(str(model), str(data), run_dir=run_dir, resume=True, **(BASE | changes))


CHANGES = {
    "layers": dict(layers="final"),
    "metric parameter": dict(metric_params={"dispersion": {"pooling": "mean"}}),
    "max_length": dict(max_length=16),
    "dtype": dict(dtype="float64"),
    "batch_size": dict(batch_size=2),
    "shard_size": dict(shard_size=5),
    "padding_side": dict(padding_side="left"),
    "seed": dict(seed=3),
}


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_every_option_that_changes_the_numbers_is_in_the_key(run, field):
    model, data, run_dir, _ = run
    with pytest.raises(RepgeomError, match="belongs to a different run"):
        _resume(model, data, run_dir, **CHANGES[field])


def test_the_key_holds_contents_not_paths(run, tmp_path):
    model, data, run_dir, first = run
    moved_data, moved_model = tmp_path / "elsewhere.txt", tmp_path / "model-moved"
    shutil.copy(data, moved_data)
    shutil.copytree(model, moved_model)
    again = _resume(moved_model, moved_data, run_dir)  # same contents, other paths: the run continues
    assert again.results == first.results
    data.write_text(data.read_text().replace("the", "a", 1))  # same path, other content: refused
    with pytest.raises(RepgeomError, match="different run.*data"):
        _resume(model, data, run_dir)
    weights = load_file(model / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1e-3
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RepgeomError, match="different run.*model"):
        _resume(model, moved_data, run_dir)


def test_the_preprocessing_statistics_file_is_keyed_by_content(tmp_path, tiny_model_dir, texts):
    model, data = tiny_model_dir("gpt2"), texts[:12]
    stats = tmp_path / "stats.safetensors"
    measure(model, texts[12:24], preprocess="center", save_preprocess_stats=stats, progress=False)
    kw = dict(preprocess="center", preprocess_stats=stats, run_dir=tmp_path / "run", shard_size=4, progress=False)
    measure(model, data, **kw)
    measure(model, texts[24:36], preprocess="center", save_preprocess_stats=stats, progress=False)  # rewritten
    with pytest.raises(RepgeomError, match="different run.*preprocess_stats"):
        measure(model, data, resume=True, **kw)


def _tamper(run_dir: Path, edit) -> None:
    """Edit the saved state and write its field digests anew, as a consistent rewrite would: what is checked is
    then the state against the run, not the digests (a plain edit is named by its digest: test_fault_injection)."""
    from repgeom_eval.measurement.checkpoint import field_digests

    path = run_dir / "state.rank0-of-1.pt"
    state = torch.load(path, weights_only=True)
    edit(state)
    state["digests"] = field_digests({k: v for k, v in state.items() if k not in ("version", "key", "digests")})
    torch.save(state, path)


def _first_state(state, metric="dispersion"):
    return next(iter(state["metrics"].values()))[metric]


TAMPERS = {
    "NaN in a sum": lambda s: next(iter(_first_state(s).values())).fill_(float("nan")),
    "wrong dtype": lambda s: _first_state(s).update({k: v.float() for k, v in _first_state(s).items()}),
    "missing tensor": lambda s: _first_state(s).pop(next(iter(_first_state(s)))),
    "shard index past the data": lambda s: s.update(next_shard=99),
    "negative count": lambda s: s.update(counts=[-1, 0, 0, 0, 0]),
    "a metric missing": lambda s: next(iter(s["metrics"].values())).pop("token_dispersion"),
}


@pytest.mark.fault("refused")
@pytest.mark.parametrize("case", sorted(TAMPERS))
def test_a_state_that_does_not_fit_is_refused_in_one_line(run, case):
    model, data, run_dir, _ = run
    _tamper(run_dir, TAMPERS[case])
    with pytest.raises(RepgeomError, match="does not fit this run.*delete the run directory") as info:
        _resume(model, data, run_dir)
    assert "\n" not in str(info.value)


def test_a_run_without_a_run_dir_does_not_hash_the_model_files(tmp_path, tiny_model_dir, texts, monkeypatch):
    """The model's content hash keys checkpoints and statistics files only: a plain run never reads the weights a
    second time to hash them (a full read of every file, 0.46 s of the 15 s SmolLM2 benchmark)."""
    import repgeom_eval.measurement.checkpoint as checkpoint

    data = tmp_path / "texts.txt"
    data.write_text("\n".join(texts[:6]) + "\n")
    hashed = []
    original = checkpoint.file_fingerprint
    monkeypatch.setattr(checkpoint, "file_fingerprint", lambda path: hashed.append(path) or original(path))
    measure(tiny_model_dir("gpt2"), str(data), **BASE)
    assert not [p for p in hashed if p.suffix in (".safetensors", ".bin", ".gguf")]
    measure(tiny_model_dir("gpt2"), str(data), run_dir=tmp_path / "run", **BASE)
    assert [p for p in hashed if p.suffix == ".safetensors"]  # a checkpointed run is keyed by the content
