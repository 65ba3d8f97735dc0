"""Every registered metric passes the conformance check (``repgeom_eval.testing.check_metric``).

The metrics come from the plugin registry (``get_host().metrics``), not from a list kept by hand: a metric added to a
built-in plugin, or installed as a third-party plugin in the test environment, is checked without touching this
file. ``VARIANTS`` only adds parameter combinations worth checking on top of the defaults; a test keeps it in step
with the registry (no stale names, no unknown parameters).
"""

import importlib.metadata as md
import types

import pytest
import torch

import repgeom_eval
from repgeom_eval.plugin_system.host import PluginHost, get_host
from repgeom_eval.testing import check_metric

# Extra constructor arguments by metric name. Every registered metric is checked with its defaults ({}) whether or
# not it appears here.
VARIANTS = {
    "dispersion": [{"per_text": True}],
    "token_dispersion": [{"per_text": True}],
    "massive_activations": [{"top_k": 1}, {"top_k": 40}],  # 40 > D: k is capped at the dimension
    "infonce": [{"variant": "simclr", "tau": 0.5}],
    "dime": [{"n_iters": 3, "seed": 4}],
    "lidar": [{"n_views": 2}, {"n_views": 2, "variant": "information_flow"}],
    "prompt_entropy": [{"variant": "information_flow", "alpha": 2.0, "per_text": True}],
    "dataset_entropy": [{"centering": "batch", "batch_size": 3}, {"centering": "none"},
                        {"centering": "none", "variant": "information_flow"}],
    "curvature": [{"variant": "information_flow", "per_text": True}],
    "condensation": [{"bins": 0, "per_text": True}],
}
# (texts, dimension): N > D, where Gram-based states fold rows into a D×D matrix, and N < D, where they keep rows
SHAPES = [(24, 6), (5, 12)]


def metric_cases(host: PluginHost) -> list:
    """One pytest case per (registered metric, parameter set)."""
    cases = []
    for name in host.metrics.names():
        for i, kwargs in enumerate([{}, *VARIANTS.get(name, [])]):
            cases.append(pytest.param(name, kwargs, id=f"{name}-{'defaults' if not kwargs else i}"))
    return cases


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"n{s[0]}-d{s[1]}")
@pytest.mark.parametrize("name, kwargs", metric_cases(get_host()))
def test_registered_metric_conforms(name, kwargs, shape):
    n, dim = shape
    check_metric(get_host().metrics.get(name), kwargs, n=n, dim=dim)


def test_cases_are_exactly_the_registry():
    host = get_host()
    assert not host.failures, host.failures
    names = {p.values[0] for p in metric_cases(host)}
    assert names == set(host.metrics.names())
    # the built-in metrics at least (a third-party plugin in the environment may add more)
    assert {"dispersion", "token_dispersion", "massive_activations", "infonce", "lidar", "dime", "prompt_entropy",
            "dataset_entropy", "effective_rank", "curvature", "vendi", "condensation"} <= names


def test_variants_name_registered_metrics_and_their_parameters():
    host = get_host()
    for name, variants in VARIANTS.items():
        assert name in host.metrics, f"VARIANTS lists {name!r}, which is not registered"
        accepted = set(host.metrics.get(name).parameter_names())
        for kwargs in variants:
            assert set(kwargs) <= accepted, (name, set(kwargs) - accepted)


class _LateMetric(repgeom_eval.Metric):
    """A metric that exists only in this test: the mean squared norm of the pooled vectors."""

    name = "late_metric_for_test"
    consumes = repgeom_eval.Consumes.POOLED

    def __init__(self):
        super().__init__()
        self.add_state("total", torch.zeros((), dtype=torch.float64), "sum")
        self.add_state("n", torch.zeros((), dtype=torch.float64), "sum")

    def update(self, batch):
        x = batch.pooled.double()
        self.total = self.total + (x * x).sum()
        self.n = self.n + x.shape[0]

    def compute(self):
        return float(self.total / self.n)


def test_a_newly_registered_metric_is_covered():
    @repgeom_eval.hookimpl
    def repgeom_register_metrics(registry):
        registry.add(_LateMetric)

    module = types.ModuleType("late_plugin")
    module.repgeom_register_metrics = repgeom_register_metrics
    host = PluginHost(entry_points=list(md.entry_points(group="repgeom_eval")), strict=True,
                      extra_plugins=[("late_plugin", module)])
    cases = {p.values[0]: p for p in metric_cases(host)}
    assert "late_metric_for_test" in cases
    assert set(cases) == set(get_host().metrics.names()) | {"late_metric_for_test"}
    name, kwargs = cases["late_metric_for_test"].values
    check_metric(host.metrics.get(name), kwargs)
