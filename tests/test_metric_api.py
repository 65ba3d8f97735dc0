"""The metric API: mergeable states (two shards merged = the whole), invariances, conformance helper."""

import math
import pickle

import pytest
import torch

from repgeom_eval import Consumes, LayerBatch, Metric
from repgeom_eval.functional import pairwise_dispersion, per_sample_scores
from repgeom_eval.plugins.dispersion import Dispersion, TokenDispersion
from repgeom_eval.testing import check_metric


def pooled_batch(x, start=0):
    return LayerBatch("final", torch.arange(start, start + len(x)), pooled=x)


def token_batch(hidden, mask, start=0):
    return LayerBatch("final", torch.arange(start, start + len(hidden)), hidden=hidden, mask=mask)


def test_two_shards_merge_to_exactly_the_whole():
    # Axis-aligned vectors with dyadic scales: every unit vector and every partial sum is exact in float64,
    # so the merged state must be bit-identical to the single pass, whatever the summation order.
    g = torch.Generator().manual_seed(0)
    axes = torch.randint(0, 6, (40,), generator=g)
    signs = torch.randint(0, 2, (40,), generator=g) * 2 - 1
    x = torch.zeros(40, 6, dtype=torch.float64)
    x[torch.arange(40), axes] = signs.double() * 2.0 ** torch.randint(-3, 4, (40,), generator=g).double()
    whole = Dispersion()
    for lo in range(0, 40, 7):
        whole.update(pooled_batch(x[lo:lo + 7], lo))
    a, b = Dispersion(), Dispersion()
    a.update(pooled_batch(x[:13]))
    b.update(pooled_batch(x[13:], 13))
    merged = a.merge(b)
    for k, v in whole.state_dict().items():
        assert torch.equal(v, merged.state_dict()[k]), k
    assert merged.compute() == whole.compute()
    assert merged.compute() == pytest.approx(pairwise_dispersion(x).item(), abs=1e-12)


def test_merge_on_random_data_matches_single_pass_and_brute_force():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(101, 12, generator=g, dtype=torch.float64) + 0.4
    shards = [x[:30], x[30:31], x[31:]]
    metrics = []
    for i, s in enumerate(shards):
        m = Dispersion()
        m.update(pooled_batch(s))
        metrics.append(m)
    merged = metrics[0].merge(metrics[1]).merge(metrics[2])
    assert merged.compute() == pytest.approx(pairwise_dispersion(x).item(), rel=1e-12)


def test_merge_with_an_empty_shard():
    x = torch.randn(10, 4, dtype=torch.float64)
    full, empty = Dispersion(), Dispersion()
    full.update(pooled_batch(x))
    assert empty.merge(full).compute() == pytest.approx(full.compute(), abs=0)
    assert full.merge(Dispersion()).compute() == pytest.approx(empty.compute(), abs=0)


def test_merge_refuses_other_types_and_parameters():
    with pytest.raises(TypeError):
        Dispersion().merge(TokenDispersion())
    with pytest.raises(ValueError, match="different parameters"):
        Dispersion(per_text=True).merge(Dispersion())


def test_batch_size_1_and_16_agree():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 8, generator=g, dtype=torch.float64)
    ones, sixteens = Dispersion(), Dispersion()
    for i in range(48):
        ones.update(pooled_batch(x[i:i + 1], i))
    for lo in range(0, 48, 16):
        sixteens.update(pooled_batch(x[lo:lo + 16], lo))
    assert ones.compute() == pytest.approx(sixteens.compute(), abs=1e-13)


def test_per_text_scores_are_c_i_and_average_to_dispersion():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(20, 5, generator=g, dtype=torch.float64)
    m = Dispersion(per_text=True)
    perm = torch.randperm(20, generator=g)  # arrive out of order; index says where each belongs
    for lo in range(0, 20, 6):
        idx = perm[lo:lo + 6]
        m.update(LayerBatch("final", idx, pooled=x[idx]))
    idx, c = m.per_text_results()["dispersion"]
    order = torch.argsort(idx)
    assert torch.allclose(c[order], per_sample_scores(x), atol=1e-13)
    assert c.mean().item() == pytest.approx(m.compute(), abs=1e-13)


def test_memory_does_not_grow_with_n():
    m = Dispersion()
    for _ in range(5):
        m.update(pooled_batch(torch.randn(64, 16, dtype=torch.float64)))
    sizes = {k: v.numel() for k, v in m.state_dict().items()}
    assert sizes == {"sum_u": 16, "sum_sq": 1, "n": 1, "n_zero": 1}


def test_token_dispersion_skips_and_counts_short_texts():
    hidden = torch.randn(3, 4, 2, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    m = TokenDispersion()
    m.update(token_batch(hidden, mask))
    expected = (pairwise_dispersion(hidden[0, :3]) + pairwise_dispersion(hidden[2, :2])) / 2
    assert m.compute() == pytest.approx(expected.item(), abs=1e-13)
    assert m.diagnostics() == {"n_texts": 2, "n_skipped_short": 1}


def test_state_is_float64_and_picklable():
    m = Dispersion()
    m.update(pooled_batch(torch.randn(5, 3)))  # float32 input
    assert all(v.dtype == torch.float64 for v in m.state_dict().values())
    assert pickle.loads(pickle.dumps(m)).compute() == m.compute()


class _BadMerge(Metric):
    """A metric that (wrongly) keeps a mean of batch means: the conformance helper must catch it."""

    name = "bad_mean"
    consumes = Consumes.POOLED

    def __init__(self):
        super().__init__()
        self.add_state("mean_of_means", torch.zeros((), dtype=torch.float64), "sum")
        self.add_state("batches", torch.zeros((), dtype=torch.float64), "sum")

    def update(self, batch):
        self.mean_of_means = self.mean_of_means + batch.pooled.norm(dim=-1).mean()
        self.batches = self.batches + 1

    def compute(self):
        return float(self.mean_of_means / self.batches)


def test_conformance_helper_catches_a_non_mergeable_metric():
    with pytest.raises(AssertionError, match="bad_mean"):
        check_metric(_BadMerge)


def test_add_state_rejects_mean_reduction():
    m = Metric()
    with pytest.raises(ValueError, match="reduce must be one of"):
        m.add_state("x", torch.zeros(()), "mean")
    assert math.isnan(Dispersion().compute())
