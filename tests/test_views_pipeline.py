"""Augmented views in the measurement pipeline: seeded, batched with the originals, invariant to batching."""

import importlib.metadata as md
import types

import pytest
import torch

import repgeom_eval
from repgeom_eval import Consumes, Metric
from repgeom_eval.measurement.augment import Augmenter
from repgeom_eval.modeling.loading import load_model
from repgeom_eval.measurement.engine import measure
from repgeom_eval.plugin_system.host import PluginHost


class ViewRecorder(Metric):
    """Keeps every view it is given (test helper)."""

    name = "view_recorder"
    consumes = Consumes.VIEWS
    default_pooling = "mean"

    def __init__(self, n_views: int = 3):
        super().__init__()
        self.n_views = n_views
        self.add_state("views", [], "cat")
        self.add_state("index", [], "cat")

    def update(self, batch):
        assert batch.views.shape[1] == self.n_views
        self.views.append(batch.views)
        self.index.append(batch.index.double())

    def compute(self):
        order = torch.argsort(torch.cat(self.index))
        return {"views": torch.cat(self.views)[order].tolist()}


class TwoViews(ViewRecorder):
    name = "two_views"

    def __init__(self, n_views: int = 2):
        super().__init__(n_views)


@pytest.fixture(scope="module")
def views_host():
    @repgeom_eval.hookimpl
    def repgeom_register_metrics(registry):
        registry.add(ViewRecorder)
        registry.add(TwoViews)

    module = types.ModuleType("recorder")
    module.repgeom_register_metrics = repgeom_register_metrics
    return PluginHost(entry_points=list(md.entry_points(group="repgeom_eval")), strict=True,
                      extra_plugins=[("recorder", module)])


def views_of(result, metric="view_recorder", addr="final"):
    return torch.tensor(result.results[addr][metric]["views"], dtype=torch.float64)


def test_views_are_seeded_and_independent_of_batching(views_host, tiny_model_dir, texts):
    loaded = load_model(tiny_model_dir("llama"))
    kw = dict(metrics=["view_recorder", "two_views", "dispersion"], host=views_host, progress=False)
    a = measure(loaded, texts[:7], batch_size=16, seed=3, **kw)
    b = measure(loaded, texts[:7], batch_size=1, padding_side="left", seed=3, **kw)
    c = measure(loaded, texts[:7], batch_size=16, seed=4, **kw)
    assert views_of(a).shape == (7, 3, 32)
    assert torch.allclose(views_of(a), views_of(b), atol=1e-5)
    assert not torch.allclose(views_of(a), views_of(c), atol=1e-3)
    # a metric asking for fewer views gets the first ones
    assert torch.allclose(views_of(a, "two_views"), views_of(a)[:, :2], atol=0)
    assert a.data["n_views_per_text"] == 3
    assert a.config["augmentation"]["seed"] == 3 and a.config["metrics"]["view_recorder"]["n_views"] == 3
    assert a.config["metrics"]["view_recorder"]["pooling"] == "mean"  # the metric's default_pooling
    assert a.config["metrics"]["dispersion"]["pooling"] == "last"


def test_each_view_is_the_pooled_augmented_string(views_host, tiny_model_dir, texts):
    loaded = load_model(tiny_model_dir("gpt2"))
    result = measure(loaded, texts[:4], layers="resid_post:0", metrics=["two_views"], seed=11, host=views_host,
                     progress=False)
    got = views_of(result, "two_views", "resid_post:0")
    aug = Augmenter(seed=11)
    for i, text in enumerate(texts[:4]):
        for v in range(2):
            augmented = aug.view(text, i, v)
            assert augmented != text
            enc = loaded.tokenizer(augmented, return_tensors="pt", truncation=True, max_length=128)
            with torch.no_grad():
                h = loaded.model(**enc, output_hidden_states=True).hidden_states[1][0].double()
            assert torch.allclose(got[i, v], h.mean(0), atol=1e-5)


def test_pooling_override_and_bad_pooling(views_host, tiny_model_dir, texts):
    loaded = load_model(tiny_model_dir("gpt2"))
    r = measure(loaded, texts[:3], metrics=["two_views"], metric_params={"two_views": {"pooling": "last"}},
                host=views_host, progress=False)
    assert r.config["metrics"]["two_views"]["pooling"] == "last"
    with pytest.raises(repgeom_eval.RepgeomError, match="pooling 'tokens' does not apply"):
        measure(loaded, texts[:3], metrics=["two_views"], pooling="tokens", host=views_host, progress=False)


def test_view_metrics_through_the_pipeline_match_the_functional_core(views_host, tiny_model_dir, texts):
    from repgeom_eval.functional import dime, infonce, lidar

    loaded = load_model(tiny_model_dir("llama"))
    result = measure(loaded, texts[:10], layers="final,resid_post:0", seed=5, host=views_host, progress=False,
                     metrics=["view_recorder", "infonce", "dime", "lidar"],
                     metric_params={"lidar": {"n_views": 3}})
    for addr in ("final", "resid_post:0"):
        v = views_of(result, addr=addr)  # [10, 3, D], the same seeded views every metric saw
        u = torch.nn.functional.normalize(v, dim=-1)
        r = result.results[addr]
        assert r["infonce"] == pytest.approx(infonce(u[:, 0], u[:, 1], tau=0.1), abs=1e-9)
        assert r["dime"] == pytest.approx(dime(u[:, 0], u[:, 1], n_iters=10, seed=0), abs=1e-9)
        assert r["lidar"] == pytest.approx(lidar(u), abs=1e-6)
    assert result.data["n_views_per_text"] == 3
