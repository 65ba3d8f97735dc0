"""Shared statistics (docs/plugins.md#shared-statistics): metrics that read the same statistic of the same vectors
keep one state between them, fed once, saved once, merged once, and give the values they give alone."""

from __future__ import annotations

import math
import types
import warnings

import pytest
import torch

import repgeom_eval as rg
from repgeom_eval import Consumes, LayerBatch, Metric, Statistic
from repgeom_eval.measurement.bank import MetricBank
from repgeom_eval.spec.options.measure import RunConfig
from repgeom_eval.measurement.estimate import estimate
from repgeom_eval.measurement.metric_specs import fresh_metrics, instantiate_metrics
from repgeom_eval.modeling.addresses import Address
from repgeom_eval.plugin_system.host import get_host
from repgeom_eval.spec.statistics import PooledGram, UnitSums

GRAM_METRICS = ["vendi", "dataset_entropy", "effective_rank"]
NONE = {"dataset_entropy": {"centering": "none"}}


def texts(n: int) -> list[str]:
    words = "rivers hills numbers code music weather stones letters trees ships".split()
    return [" ".join(words[(i * 3 + k) % 10] for k in range(2 + i % 6)) + f" {i}" for i in range(n)]


def run(model, metrics, n, **kw):
    config = RunConfig(layers="all", metrics=tuple(metrics), progress=False, pooling="mean",
                       metric_params={k: v for k, v in NONE.items() if k in metrics}, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return rg.measure(model, texts(n), config=config)


def values(result, metric):
    return {addr: res[metric] for addr, res in result.results.items()}


def flat(value):
    return value.values() if isinstance(value, dict) else [value]


@pytest.mark.parametrize("n_texts", [10, 70])  # fewer and more texts than the tiny model's width (32)
def test_values_together_equal_values_alone(tiny_model_dir, n_texts):
    model = tiny_model_dir("llama")
    together = run(model, GRAM_METRICS + ["dispersion"], n_texts, batch_size=7)
    for metric in GRAM_METRICS + ["dispersion"]:
        alone = run(model, [metric], n_texts, batch_size=7)
        for addr, value in values(alone, metric).items():
            for a, b in zip(flat(value), flat(together.results[addr][metric])):
                assert math.isfinite(a) and abs(a - b) <= 1e-12, (metric, addr, a, b)


def test_one_gram_per_distinct_statistic(host):
    specs = instantiate_metrics(GRAM_METRICS, host, NONE, per_text=False, pooling="mean")
    pairs = dict((spec.name, m) for spec, m in fresh_metrics(specs))
    # vendi and dataset_entropy without centring read the Gram of the unit rows: one object, owned by vendi
    assert pairs["dataset_entropy"].stat("gram") is pairs["vendi"].stat("gram")
    assert "gram" in pairs["vendi"].owned_statistics() and not pairs["dataset_entropy"].owned_statistics()
    # effective_rank reads the Gram of the raw rows, packed in the same state as the unit one
    assert pairs["effective_rank"].stat("gram") is pairs["vendi"].stat("gram")
    assert not pairs["effective_rank"].owned_statistics()
    # a different pooling means different vectors: nothing shared
    specs = instantiate_metrics(GRAM_METRICS, host, {"dataset_entropy": {"centering": "none", "pooling": "last"}},
                                per_text=False, pooling="mean")
    pairs = dict((spec.name, m) for spec, m in fresh_metrics(specs))
    assert pairs["dataset_entropy"].stat("gram") is not pairs["vendi"].stat("gram")


def test_the_shared_state_is_held_and_estimated_once(tiny_model_dir):
    model = tiny_model_dir("llama")
    one = run(model, ["vendi"], 70).timings["state_bytes"]
    two = run(model, ["vendi", "dataset_entropy"], 70).timings["state_bytes"]
    assert two == one  # the second metric adds nothing: it reads vendi's Gram
    config = RunConfig(layers="all", metrics=("vendi", "dataset_entropy"), metric_params=NONE, pooling="mean")
    est = estimate(model, config)
    per_metric = {s.metric: s.fixed_bytes for s in est.per_address["final"]}
    assert per_metric["dataset_entropy"] == 0 and per_metric["vendi"] > 0
    assert any("dataset_entropy.gram ← vendi" in note for note in est.notes)


def test_shards_merge_with_shared_state():
    host = get_host()
    addr = [Address("final")]
    x = torch.randn(50, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    whole = MetricBank(GRAM_METRICS + ["dispersion"], addr, params=NONE, pooling="mean", host=host)
    parts = [MetricBank(GRAM_METRICS + ["dispersion"], addr, params=NONE, pooling="mean", host=host)
             for _ in range(3)]

    def feed(bank, rows):
        mask = torch.ones(len(rows), 1, dtype=torch.bool)
        bank.update(addr[0], x[rows].unsqueeze(1), mask, list(rows))

    for start in range(0, 50, 8):
        feed(whole, range(start, min(start + 8, 50)))
        feed(parts[(start // 8) % 3], range(start, min(start + 8, 50)))
    # the saved state of a shard holds the packed Grams once (under vendi), none under the other two
    state = parts[0].state()["final"]
    assert "grams" in state["vendi"] and state["dataset_entropy"] == {} and state["effective_rank"] == {}
    for other in parts[1:]:
        parts[0].merge_state(other.state())
    for metric, value in whole.compute()["final"].items():
        for a, b in zip(flat(value), flat(parts[0].compute()["final"][metric])):
            assert abs(a - b) <= 1e-12, (metric, a, b)


def test_a_resumed_run_with_shared_state_equals_a_single_pass(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    single = run(model, GRAM_METRICS, 40, shard_size=16)
    cut = run(model, GRAM_METRICS, 40, shard_size=16, run_dir=str(tmp_path / "run"))
    resumed = run(model, GRAM_METRICS, 40, shard_size=16, run_dir=str(tmp_path / "run"), resume=True)
    for metric in GRAM_METRICS:
        for addr, value in values(single, metric).items():
            for r in (cut, resumed):
                for a, b in zip(flat(value), flat(r.results[addr][metric])):
                    assert abs(a - b) <= 1e-12, (metric, addr)


class MeanResultantLength(Metric):
    """A third-party metric that shares dispersion's sums: ‖Σu‖ / n."""

    name = "mean_resultant_length"
    consumes = Consumes.POOLED

    def statistics(self):
        return {"sums": UnitSums()}

    def compute(self):
        s = self.stat("sums")
        return float(torch.linalg.vector_norm(s.sum_u) / s.n)


def test_a_plugin_metric_shares_a_built_in_statistic():
    @rg.hookimpl
    def repgeom_register_metrics(registry):
        registry.add(MeanResultantLength)

    module = types.ModuleType("mrl_plugin")
    module.repgeom_register_metrics = repgeom_register_metrics
    host = rg.PluginHost(extra_plugins=[("mrl", module)])
    specs = instantiate_metrics(["dispersion", "mean_resultant_length"], host, None, per_text=False, pooling="mean")
    (d_spec, disp), (_, mrl) = fresh_metrics(specs)
    assert mrl.stat("sums") is disp.stat("sums") and not mrl.owned_statistics()
    u = torch.randn(9, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    batch = LayerBatch("final", torch.arange(9), pooled=u)
    disp.update(batch)
    mrl.update(batch)  # a borrower feeds nothing: the owner's update did
    units = u / u.norm(dim=1, keepdim=True)
    assert mrl.compute() == pytest.approx(float(units.sum(0).norm() / 9), abs=1e-12)
    assert disp.stat("sums").n == 9


class RowPowerSums(Statistic):
    """Σ z^p of the pooled vectors: a statistic with a parameter."""

    def __init__(self, power: int = 2):
        super().__init__()
        self.power = power
        self.add_state("total", torch.zeros(0, dtype=torch.float64), "sum", shape=("D",))

    def update(self, batch):
        s = (batch.pooled.double() ** self.power).sum(0)
        self.total = s if self.total.numel() == 0 else self.total + s


class PowerMetric(Metric):
    name = "power_metric"
    consumes = Consumes.POOLED

    def statistics(self):
        return {"sums": RowPowerSums(power=2)}

    def compute(self):
        return float(self.stat("sums").total.sum())


def test_a_statistic_of_other_parameters_is_not_shared():
    assert RowPowerSums(power=2).key() != RowPowerSums(power=3).key()
    assert RowPowerSums(power=2).key() == RowPowerSums(power=2).key()
    assert PooledGram().key() == PooledGram().key()
    with pytest.raises(ValueError, match="cannot share"):
        PowerMetric().share("sums", RowPowerSums(power=3))
    with pytest.raises(ValueError, match="cannot share"):
        rg.get_host().metrics.get("vendi")().share("gram", RowPowerSums())


def test_the_raw_and_unit_grams_are_packed_in_one_state():
    """Both triangles of one (D+1)×D array: the raw Gram below, the unit Gram above; each equals the brute-force
    product, past the fold (N > D) and before it (N ≤ D, the N×N form)."""
    gen = torch.Generator().manual_seed(5)
    for n, d in ((40, 9), (6, 9), (1300, 600)):
        x = torch.randn(n, d, dtype=torch.float64, generator=gen) * torch.rand(n, 1, dtype=torch.float64,
                                                                               generator=gen)
        x[1] = 0
        st = PooledGram()
        for start in range(0, n, 7):
            st.update(LayerBatch("final", torch.arange(start, min(start + 7, n)), pooled=x[start:start + 7]))
        if n > d:
            assert tuple(st.grams.shape) == (d + 1, d) and not st.rows
        u = x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)
        for unit, z in ((False, x), (True, u)):
            g, got_n, got_d = st.gram_matrix(unit=unit)
            want = z.T @ z if n > d else z @ z.T
            assert (got_n, got_d) == (n, d) and torch.equal(g, g.T)
            assert torch.allclose(g, want, rtol=0, atol=1e-12 * float(want.abs().max()))
        assert (int(st.n_zero), int(st.n_zero_unit)) == (1, 1)


def test_rows_before_the_fold_are_one_block_no_larger_than_the_gram():
    """Before the first fold the rows sit in one block that doubles as it fills, never beyond (D+1)×D (the size of
    the Gram that replaces it), whatever the batches; a merged or moved state is gathered back into one block."""
    d = 40
    x = torch.randn(d, d, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    st = PooledGram()
    for start in range(0, d, 3):
        st.update(LayerBatch("final", torch.arange(start, min(start + 3, d)), pooled=x[start:start + 3]))
        held = min(start + 3, d)
        assert len(st.rows) == 1 and torch.equal(st.rows[0], x[:held])
        assert st.rows[0].untyped_storage().nbytes() <= (d + 1) * d * 8
    other = PooledGram()
    other.update(LayerBatch("final", torch.arange(2), pooled=x[:2]))
    st.merge(other)
    assert len(st.rows) == 2 and st.grams.numel() == 0
    st.update(LayerBatch("final", torch.arange(1), pooled=x[5:6]))  # d + 3 rows: folded
    assert not st.rows and st.grams.shape == (d + 1, d)
    z = torch.cat([x, x[:2], x[5:6]])
    assert torch.allclose(st.gram_matrix()[0], z.T @ z, rtol=0, atol=1e-12 * float((z.T @ z).abs().max()))
    small = PooledGram()
    small.update(LayerBatch("final", torch.arange(3), pooled=torch.ones(3, 5)))
    small.to("meta")  # the block moves whole; the rows stay its view and keep filling it
    small.update(LayerBatch("final", torch.arange(3, 5, device="meta"), pooled=torch.ones(2, 5, device="meta")))
    assert len(small.rows) == 1 and small.rows[0].device.type == "meta" and small.rows[0].shape == (5, 5)


def test_state_bytes_are_read_in_place_and_equal_the_saved_state(tiny_model_dir, monkeypatch):
    """The run's ``timings.state_bytes`` adds up the states where they are: no ``state_dict`` copy of every
    address's states at the end of a run (it doubled the states' memory there), and the same number."""
    model = tiny_model_dir("llama")
    specs = instantiate_metrics(GRAM_METRICS + ["dispersion"], get_host(), NONE, per_text=False, pooling="mean")
    pairs = fresh_metrics(specs)
    x = torch.randn(30, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    for _, m in pairs:
        for start in range(0, 30, 8):
            m.update(LayerBatch("final", torch.arange(start, min(start + 8, 30)), pooled=x[start:start + 8]))
    for _, m in pairs:
        saved = sum(t.numel() * t.element_size() for t in m.state_dict().values())
        assert m.state_bytes() == saved, m.name

    def no_copies(self):
        raise AssertionError("state_dict called while the run reports its memory")

    result = run(model, GRAM_METRICS, 20)
    monkeypatch.setattr(Metric, "state_dict", no_copies)
    again = run(model, GRAM_METRICS, 20)
    assert again.timings["state_bytes"] == result.timings["state_bytes"] > 0


def test_a_checkpoint_saves_the_held_states_not_a_copy_of_them():
    """``state_dict(copy=False)`` (what a ``--run-dir`` checkpoint saves) hands out the states themselves: saving
    does not hold a second copy of every address's states at once. A ``cat`` state in pieces is joined in place, a
    view of a larger block is copied alone, and the values and later updates are those of a copying save."""
    # dataset_entropy with global centring keeps its vectors (a ``cat`` state)
    specs = instantiate_metrics(GRAM_METRICS + ["dispersion"], get_host(), {}, per_text=False, pooling="mean")
    pairs = fresh_metrics(specs)
    x = torch.randn(40, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    shared = cats = 0
    for _, m in pairs:
        for start in range(0, 40, 8):
            m.update(LayerBatch("final", torch.arange(start, start + 8), pooled=x[start:start + 8]))
        copied, held = m.state_dict(), m.state_dict(copy=False)
        assert copied.keys() == held.keys()
        for k in copied:
            assert torch.equal(copied[k], held[k]), (m.name, k)
            assert copied[k].numel() == 0 or copied[k].data_ptr() != held[k].data_ptr()
            storage = held[k].untyped_storage().nbytes()
            assert storage == held[k].numel() * held[k].element_size(), (m.name, k)  # the view, not its block
        holders = [m, *m.owned_statistics().values()]
        sums = {getattr(h, n).data_ptr() for h in holders for n, r in h._reductions.items() if r == "sum"}
        shared += sum(t.data_ptr() in sums for t in held.values())  # the states themselves
        for h in holders:
            for name, reduce in h._reductions.items():
                if reduce == "cat" and getattr(h, name):
                    assert len(getattr(h, name)) == 1, (m.name, name)  # joined in place
                    cats += 1
    assert shared >= 3 and cats >= 1
    # the joined states go on as before: later updates and the values equal a run that never saved
    other = fresh_metrics(specs)
    for (_, a), (_, b) in zip(pairs, other):
        for start in range(0, 40, 8):
            b.update(LayerBatch("final", torch.arange(start, start + 8), pooled=x[start:start + 8]))
        for m in (a, b):
            m.update(LayerBatch("final", torch.arange(40, 44), pooled=x[:4] * 2))
        for u, v in zip(flat(a.compute()), flat(b.compute())):
            assert u == v or (math.isnan(u) and math.isnan(v)), a.name


def test_a_plugin_that_overrides_state_dict_without_copy_is_still_checkpointed():
    """A third-party metric or statistic written before ``state_dict(copy=...)`` existed overrides ``state_dict()``
    with no parameter: a checkpoint calls it as it is (a copy) instead of failing."""
    from repgeom_eval.spec.metric import state_of

    class OldSums(Statistic):
        def __init__(self):
            super().__init__()
            self.add_state("s", torch.zeros(3, dtype=torch.float64), "sum")

        def update(self, batch):
            self.s += batch.pooled.sum(0)

        def state_dict(self):
            return super().state_dict()

    class OldMetric(Metric):
        name = "old_metric"
        consumes = Consumes.POOLED

        def statistics(self):
            return {"sums": OldSums()}

        def compute(self):
            return float(self.stat("sums").s.sum())

    class OlderMetric(OldMetric):
        def state_dict(self):
            return super().state_dict()

    for cls in (OldMetric, OlderMetric):
        m = cls()
        m.update(LayerBatch("final", torch.arange(2), pooled=torch.ones(2, 3, dtype=torch.float64)))
        saved = state_of(m, copy=False)
        assert torch.equal(saved["s"], torch.full((3,), 2.0, dtype=torch.float64)), cls.__name__
        assert saved["s"].data_ptr() != m.stat("sums").s.data_ptr()  # their own call: a copy


class OwnMeanNorm(Metric):
    """A metric with a state of its own and no statistic (module level: check_metric pickles it)."""

    name = "own_mean_norm"
    consumes = Consumes.POOLED

    def __init__(self):
        super().__init__()
        self.add_state("total", torch.zeros((), dtype=torch.float64), "sum", shape=())

    def update(self, batch):
        super().update(batch)
        self.total = self.total + batch.pooled.double().norm(dim=-1).sum()

    def compute(self):
        return float(self.total)


class NoUpdate(Metric):
    name = "no_update"
    consumes = Consumes.POOLED

    def compute(self):
        return 0.0


def test_super_update_is_safe_whatever_the_statistics():
    # docs/plugins.md: a metric with states of its own calls super().update(batch) first. With no statistic to
    # feed (none declared, or none for these parameters) that call does nothing; a metric with neither statistics
    # nor an update of its own is still told what it lacks.
    m = OwnMeanNorm()
    m.update(LayerBatch("final", torch.arange(2), pooled=torch.ones(2, 4)))
    assert m.compute() == 4.0
    rg.check_metric(OwnMeanNorm)
    with pytest.raises(NotImplementedError, match="NoUpdate must implement update"):
        NoUpdate().update(LayerBatch("final", torch.arange(2), pooled=torch.ones(2, 4)))
