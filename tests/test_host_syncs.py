"""The hot loop of a run makes no tensor-to-host conversion per batch (issue 32, item 4): on a GPU each one would make
the host wait for the device. Counted on the CPU by wrapping every Tensor method that hands a value to Python or to
the host, per call site, over runs of 2 and 6 batches: a site whose count grows with the batches converts per batch.
The only ones allowed read the tokenizer's mask, which lives on the host whatever the model's device is."""

import collections
import sys
from pathlib import Path

import pytest
import torch

from repgeom_eval.measurement.engine import measure
from repgeom_eval.measurement.forward import DeferredChecks, Forward
from repgeom_eval.modeling.loading import load_model
from repgeom_eval.spec.errors import NonFiniteError

CONVERSIONS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
# (method, module, function): reads of the tokenizer's host mask (padding side, real-token count, the per-text
# layout the token metrics read; a block without the host's copy reads it in tokens._wait_for instead)
HOST_SIDE = {("__bool__", "measurement/forward.py", "padding_side_of"),
             ("__int__", "measurement/forward.py", "host_tokens"),
             ("tolist", "functional/tokens.py", "host")}
TOKEN_SUITE = ["token_dispersion", "prompt_entropy", "curvature"]
POOLED_SUITE = ["dispersion", "dataset_entropy", "effective_rank", "vendi"]
ROOT = Path(__file__).resolve().parent.parent


def _site(filename: str) -> str | None:
    """The package-relative path of a file of this project, None for others: ``repgeom_eval/...`` and the
    built-in plugins, which an editable install runs from the repository's ``plugins/`` folder (installed,
    ``repgeom_eval/plugins/``)."""
    for root, prefix in ((ROOT / "plugins", "plugins/"), (ROOT / "repgeom_eval", "")):
        if filename.startswith(str(root).replace("\\", "/") + "/"):
            return prefix + filename[len(str(root)) + 1:]
    if "/repgeom_eval/" in filename:  # an installed wheel
        return filename.split("/repgeom_eval/")[-1]
    return None


def _conversions(monkeypatch, loaded, texts, n_batches, metrics, **options):
    counts = collections.Counter()

    def wrap(method):
        original = getattr(torch.Tensor, method)

        def counted(self, *args, **kwargs):
            frame = sys._getframe(1)
            where = frame.f_code.co_filename.replace("\\", "/")
            site = _site(where)
            if site:
                counts[(method, site, frame.f_code.co_name)] += 1
            return original(self, *args, **kwargs)
        return counted

    with monkeypatch.context() as m:
        for method in CONVERSIONS:
            m.setattr(torch.Tensor, method, wrap(method))
        measure(loaded, texts[: 4 * n_batches], layers="all", metrics=metrics, batch_size=4, progress=False,
                **options)
    return counts


def _per_batch(monkeypatch, loaded, texts, metrics, **options):
    few = _conversions(monkeypatch, loaded, texts, 2, metrics, **options)
    many = _conversions(monkeypatch, loaded, texts, 6, metrics, **options)
    return {site: (many[site] - few[site]) / 4 for site in many if many[site] != few[site]}


@pytest.fixture
def loaded(tiny_model_dir):
    return load_model(tiny_model_dir("llama"))


def test_the_pooled_suite_converts_nothing_per_batch_on_the_device_path(monkeypatch, loaded, texts):
    monkeypatch.setattr(Forward, "check_each_batch", False)  # what a GPU runs
    per_batch = _per_batch(monkeypatch, loaded, texts, POOLED_SUITE)
    assert set(per_batch) <= HOST_SIDE, per_batch


@pytest.mark.parametrize("alpha", [1.0, 2.0])
def test_the_token_metrics_convert_nothing_per_batch_on_the_device_path(monkeypatch, loaded, texts, alpha):
    # their states live beside the vectors and the per-text layout is read from the host's copy of the mask (at
    # alpha 1 a GPU's eigvalsh still waits for its own result, which no tensor method shows)
    monkeypatch.setattr(Forward, "check_each_batch", False)
    per_batch = _per_batch(monkeypatch, loaded, texts, POOLED_SUITE + TOKEN_SUITE,
                           metric_params={"prompt_entropy": {"alpha": alpha}})
    assert set(per_batch) <= HOST_SIDE, per_batch


def test_the_count_sees_the_built_in_plugins(monkeypatch, loaded, texts):
    # the built-in plugins run from the repository's plugins/ folder here: their sites are counted too (condensation
    # reads its sums once, in compute)
    monkeypatch.setattr(Forward, "check_each_batch", False)
    counts = _conversions(monkeypatch, loaded, texts, 2, ["condensation"])
    assert counts[("__float__", "plugins/condensation.py", "compute")] == 3, counts  # its histogram, 3 addresses
    assert _site("/usr/lib/python3/dist-packages/torch/functional.py") is None


@pytest.mark.parametrize("metrics", [["condensation"], ["lidar"], ["infonce", "dime"]])
def test_the_other_built_in_metrics_convert_nothing_per_batch(monkeypatch, loaded, texts, metrics):
    # condensation's sums and histogram stay on the device (no bincount, which waits on a GPU); lidar's O(D²) sums
    # too; infonce and dime queue their kept views into host memory without waiting. What remains is the check of
    # the hidden states, read every DeferredChecks.EVERY batches (lidar's 16 views make many forward batches)
    monkeypatch.setattr(Forward, "check_each_batch", False)
    per_batch = _per_batch(monkeypatch, loaded, texts, metrics)
    periodic = {site: n for site, n in per_batch.items() if site[2] == "read_flags"}
    assert set(per_batch) - set(periodic) <= HOST_SIDE, per_batch
    forward_batches = per_batch[("__int__", "measurement/forward.py", "host_tokens")]
    assert all(n <= forward_batches / DeferredChecks.EVERY for n in periodic.values()), per_batch


def test_dataset_entropy_waits_for_its_queued_copies_before_any_read(monkeypatch):
    """On a GPU, dataset_entropy's kept vectors come to host memory without waiting (pinned, non-blocking); every
    read of them (compute, a checkpoint, a merge) first waits for those copies, once."""
    from repgeom_eval.plugins.layerwise import DatasetEntropy
    from repgeom_eval.spec.metric import LayerBatch

    waits = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device))
    assert DatasetEntropy().state_device == "cpu" and DatasetEntropy(centering="none").state_device == "input"
    for read in (lambda m: m.compute(), lambda m: m.state_dict(), lambda m: m.merge(DatasetEntropy())):
        m = DatasetEntropy()
        m.update(LayerBatch("final", torch.arange(3), pooled=torch.randn(3, 4, dtype=torch.float64)))
        assert not waits  # vectors already on the host: nothing queued
        m._copying = {torch.device("cuda", 0)}  # as _to_host leaves it after a copy from a GPU
        read(m)
        read(m)
        assert waits == [torch.device("cuda", 0)]
        waits.clear()
    # a model split over two GPUs: the copies from each are waited for on their own device
    m = DatasetEntropy()
    m._copying = {torch.device("cuda", 1), torch.device("cuda", 0)}
    m.compute()
    assert waits == [torch.device("cuda", 0), torch.device("cuda", 1)]
    # the two-view metrics keep their views the same way (plugins/host_copies.py)
    from repgeom_eval.plugins.views_metrics import DiME, InfoNCE

    for cls in (InfoNCE, DiME):
        waits.clear()
        m = cls()
        m.update(LayerBatch("final", torch.arange(3), views=torch.randn(3, 2, 4, dtype=torch.float64)))
        m._copying = {torch.device("cuda", 0)}
        m.compute()
        m.state_dict()
        assert waits == [torch.device("cuda", 0)] and cls.state_device == "cpu"


def test_the_count_sees_the_checks_of_the_cpu_path(monkeypatch, loaded, texts):
    # the counter is not blind: checking each batch at once (the CPU's way) converts per batch and per address
    monkeypatch.setattr(Forward, "check_each_batch", True)
    per_batch = _per_batch(monkeypatch, loaded, texts, ["dispersion"])
    assert ("__bool__", "measurement/finite.py", "check_finite") in per_batch, per_batch
    assert per_batch[("__bool__", "measurement/finite.py", "check_finite")] == 3  # 3 hidden states of 2 blocks


def test_state_device_cpu_moves_the_pooled_vectors_per_batch(monkeypatch, loaded, texts):
    monkeypatch.setattr(Forward, "check_each_batch", False)
    per_batch = _per_batch(monkeypatch, loaded, texts, POOLED_SUITE, state_device="cpu")
    # the vectors and their rows, of 2 poolings (last: dispersion; mean: the Gram metrics), at 3 addresses
    assert per_batch.get(("cpu", "measurement/feed.py", "_feed_block")) == 12


@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen3", "gemma", "phi3", "gpt_neox", "bert"])
def test_the_device_path_gives_the_cpu_paths_numbers(monkeypatch, tiny_model_dir, texts, kind):
    # deferred checks, states placed by the run, lazy layout: the same numbers on causal and encoder models alike,
    # token metrics included (they read the lazy per-text layout)
    model = load_model(tiny_model_dir(kind))
    kw = dict(layers="all", metrics=POOLED_SUITE + ["token_dispersion", "prompt_entropy"], batch_size=4,
              padding_side="left", progress=False)
    monkeypatch.setattr(Forward, "check_each_batch", False)
    deferred = measure(model, texts[:12], **kw)
    monkeypatch.setattr(Forward, "check_each_batch", True)
    at_once = measure(model, texts[:12], **kw)
    assert deferred.results == at_once.results
    assert deferred.diagnostics == at_once.diagnostics


def _nan_message(monkeypatch, loaded, texts, at_once):
    monkeypatch.setattr(Forward, "check_each_batch", at_once)
    calls: list[int] = []

    def poison_second_batch(module, args, output):
        calls.append(1)
        if len(calls) == 2:
            output = output.clone()
            output[2, 0] = float("nan")  # row 2's first position: a real token (right padding)
        return output

    handle = loaded.model.model.layers[1].register_forward_hook(poison_second_batch)
    try:
        with pytest.raises(NonFiniteError) as caught:
            measure(loaded, texts[:12], layers="resid_post:[0,1]", batch_size=4, progress=False)
    finally:
        handle.remove()
    return str(caught.value)


def test_a_nan_is_named_with_the_same_text_when_checked_later(monkeypatch, loaded, texts):
    at_once = _nan_message(monkeypatch, loaded, texts, True)
    deferred = _nan_message(monkeypatch, loaded, texts, False)
    assert "at address resid_post:1 for text id" in at_once and "(1 text(s) of this batch affected)" in at_once
    assert deferred == at_once


def test_deferred_zero_vectors_are_counted(monkeypatch, loaded, texts):
    monkeypatch.setattr(Forward, "check_each_batch", False)
    zero_text_0 = loaded.model.model.layers[0].register_forward_hook(
        lambda module, args, output: output.index_fill(0, torch.tensor([0]), 0.0))
    try:
        result = measure(loaded, texts[:6], layers="resid_post:0", batch_size=6, progress=False)
    finally:
        zero_text_0.remove()
    assert result.diagnostics["resid_post:0"]["dispersion"]["n_zero_vectors"] == 1


def test_states_in_host_memory_give_the_same_numbers(loaded, texts):
    kw = dict(layers="all", metrics=POOLED_SUITE, batch_size=4, progress=False)
    on_host = measure(loaded, texts[:12], state_device="cpu", **kw)
    assert on_host.results == measure(loaded, texts[:12], **kw).results
    assert on_host.config["state_device"] == "cpu"


def test_a_state_follows_the_vectors_it_is_fed():
    from repgeom_eval.spec.metric import LayerBatch
    from repgeom_eval.spec.statistics import PooledGram

    gram = PooledGram().to("meta")  # any device other than the host: the states move, the values follow
    gram.update(LayerBatch("x", torch.arange(3, device="meta"), pooled=torch.ones(3, 4, device="meta")))
    assert gram.n.device.type == "meta" and all(r.device.type == "meta" for r in gram.rows)
