"""The fast paths of the measuring pipeline give the numbers of the plain float64 computations they replace (issue 16):
per-text float64 sums instead of [B, T, D] float64 copies, batched prompt-entropy eigendecompositions, pooling that
picks before it converts, and the finite check that reads one sum."""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F

import repgeom_eval as rg
from repgeom_eval import Consumes, LayerBatch, Metric
from repgeom_eval.spec.errors import NonFiniteError
from repgeom_eval.functional.condensation import condensation, condensation_batch, cosine_histogram, cosine_histogram_block
from repgeom_eval.functional.curvature import curvature, curvature_block
from repgeom_eval.functional.dispersion import dispersion_from_sums, token_dispersion
from repgeom_eval.functional.entropy import prompt_entropies, prompt_entropy, spectrum_entropies, spectrum_entropy
from repgeom_eval.functional.tokens import TokenBlock
from repgeom_eval.measurement.engine import measure
from repgeom_eval.measurement.forward import check_finite
from repgeom_eval.measurement.pooling import pool, pool64
from repgeom_eval.plugin_system.host import PluginHost

KEYS = ("raw", "normalized", "logN", "logD")


def batch(kind: str, b: int = 6, t: int = 11, d: int = 9, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 activations with garbage at the pads, and a mask of the given layout."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, t, d, generator=g) * 3 + torch.randn(d, generator=g) * 20  # a large shared direction
    lengths = [t, 1, 0, 2, t - 3, 5][:b]
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate(lengths):
        if kind == "right":
            mask[i, :n] = True
        elif kind == "left":
            mask[i, t - n:] = True
        else:  # holes: not contiguous
            mask[i, torch.randperm(t, generator=g)[:n]] = True
    h[~mask] = float("nan")  # pads may hold anything
    h[0, 3] = 0.0  # a zero vector
    h[4, mask[4].nonzero()[0, 0]] = 1e-5  # a vector shorter than condensation's eps
    return h, mask


def old_token_sums(h, mask, eps):
    """The padded float64 computation the pipeline used before."""
    x = h.double().masked_fill(~mask.unsqueeze(-1), 0.0)
    u = x / x.norm(dim=-1, keepdim=True).clamp(min=eps) * mask.unsqueeze(-1)
    return u.sum(1), (u * u).sum((1, 2))


@pytest.mark.parametrize("kind", ["right", "left", "holes"])
@pytest.mark.parametrize("eps", [1e-12, 1e-3])
def test_unit_sums_equal_the_padded_float64_sums(kind, eps):
    h, mask = batch(kind)
    s, q = TokenBlock(h, mask).unit_sums(eps)
    s0, q0 = old_token_sums(h, mask, eps)
    assert s.dtype == q.dtype == torch.float64
    torch.testing.assert_close(s, s0, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(q, q0, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("kind", ["right", "left", "holes"])
def test_token_dispersion_and_condensation_are_unchanged(kind):
    h, mask = batch(kind)
    values, n = token_dispersion(h, mask)
    u = F.normalize(h.double().masked_fill(~mask.unsqueeze(-1), 0.0), dim=-1) * mask.unsqueeze(-1)
    expected = dispersion_from_sums(u.sum(1), (u * u).sum((1, 2)), mask.sum(1))
    torch.testing.assert_close(values, expected, rtol=1e-12, atol=1e-12, equal_nan=True)
    assert n.tolist() == mask.sum(1).tolist()
    incl, excl = condensation_batch(h, mask)
    for i in range(len(h)):
        one = condensation(h[i][mask[i]])
        assert incl[i].item() == pytest.approx(one["mean_cosine"], rel=1e-12, abs=1e-12, nan_ok=True)
        assert excl[i].item() == pytest.approx(one["mean_cosine_excl_diag"], rel=1e-12, abs=1e-12, nan_ok=True)


@pytest.mark.parametrize("kind", ["right", "left", "holes"])
@pytest.mark.parametrize("method", ["last", "first", "mean", "tokens"])
def test_pool64_equals_pooling_the_float64_copy(kind, method):
    h, mask = batch(kind)
    h = torch.nan_to_num(h)  # pool() of the float64 copy multiplies pads by 0: NaN pads would poison its mean
    vecs, owner = pool64(h, mask, method)
    ref, ref_owner = pool(h.double(), mask, method)
    assert vecs.dtype == torch.float64 and torch.equal(owner, ref_owner)
    if method == "mean":
        torch.testing.assert_close(vecs, ref, rtol=1e-13, atol=1e-13)
    else:
        assert torch.equal(vecs, ref)  # picked, then converted: bit for bit


def test_a_block_hands_over_each_texts_real_tokens_as_captured():
    h, mask = batch("left")
    block = TokenBlock(h, mask)
    for i, row in enumerate(block.rows()):
        assert row.dtype == torch.float32 and torch.equal(row, h[i][mask[i]])
    padded = block.padded64()
    assert padded.dtype == torch.float64 and not torch.isnan(padded).any()
    assert torch.equal(padded[mask], h[mask].double())


def block_of(rows: list[torch.Tensor], kind: str, seed: int = 3) -> TokenBlock:
    """A padded float32 batch holding ``rows`` (NaN at the pads), laid out right, left or with holes."""
    g = torch.Generator().manual_seed(seed)
    t, d = max(r.shape[0] for r in rows) + 2, rows[0].shape[1]
    h = torch.full((len(rows), t, d), float("nan"))
    mask = torch.zeros(len(rows), t, dtype=torch.bool)
    for i, r in enumerate(rows):
        n = r.shape[0]
        pos = {"right": torch.arange(n), "left": torch.arange(t - n, t),
               "holes": torch.randperm(t, generator=g)[:n].sort().values}[kind]
        h[i, pos], mask[i, pos] = r.float(), True
    return TokenBlock(h, mask)


def prompts(d: int = 8, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(5, d, generator=g)
    rows = [torch.randn(n, d, generator=g) + 10 * torch.randn(d, generator=g) for n in (2, 3, 7, 8, 12, 30)]
    rows += [torch.randn(1, d, generator=g), torch.zeros(0, d), base[[0, 0, 1, 1, 2]].clone(),  # N<2, empty, rank 2
             torch.ones(4, d), base[[0, 1, 1, 2, 3, 3]].clone()]  # zero after centring; repeated tokens
    return [r.float() for r in rows]


@pytest.mark.parametrize("kind", ["right", "left", "holes"])
@pytest.mark.parametrize("variant", ["paper", "information_flow"])
@pytest.mark.parametrize("alpha", [1.0, 0.5, 2.0])
def test_batched_prompt_entropies_equal_one_prompt_at_a_time(kind, variant, alpha):
    rows = prompts()
    got = prompt_entropies(block_of(rows, kind), alpha, variant)
    assert got.shape == (len(rows), 4)
    for i, r in enumerate(rows):
        one = prompt_entropy(r, alpha, variant)
        for j, k in enumerate(KEYS):
            assert got[i, j].item() == pytest.approx(one[k], rel=1e-11, abs=1e-12, nan_ok=True), (i, k)


def test_collision_entropy_from_traces_equals_the_spectrum_route():
    """S_2 of a PSD Gram from ‖K‖_F² / (tr K)² equals the eigenvalue route on Grams of many shapes and scales,
    anisotropic, rank-deficient (centred: rank ≤ N−1; repeated rows) and rank one, and NaN on a zero Gram."""
    from repgeom_eval.functional.entropy import center_and_unit, collision_entropy, linear_gram, serial_eigvalsh

    g = torch.Generator().manual_seed(11)
    worst = 0.0
    for n, d in [(2, 8), (3, 8), (8, 16), (16, 8), (100, 64), (64, 100), (300, 24)]:
        for scale in (1e-6, 1.0, 1e6):
            z = torch.randn(n, d, generator=g, dtype=torch.float64) * scale
            z[:, : d // 2] *= 30  # a few strong directions
            z[n // 2:] = z[: n - n // 2] if n > 8 else z[n // 2:]  # repeated rows halve the rank
            for k in (linear_gram(center_and_unit(z)), linear_gram(z)):
                route = spectrum_entropy(serial_eigvalsh(k), 2.0).item()
                worst = max(worst, abs(collision_entropy(k).item() - route))
    assert worst < 1e-12
    ones = torch.ones(5, 3, dtype=torch.float64)
    assert collision_entropy(ones @ ones.T).item() == 0.0  # rank one: Σp² = 1, never −1e-16
    assert math.isnan(collision_entropy(torch.zeros(4, 4)).item())


@pytest.mark.parametrize("kind", ["right", "left", "holes"])
def test_prompt_entropy_at_alpha_2_diagonalises_nothing(kind, monkeypatch):
    """The paper variant's S_2 is read from traces: no eigendecomposition, so its cost does not grow as T³."""
    rows = prompts()
    expected = prompt_entropies(block_of(rows, kind), 2.0, "paper")

    def refuse(*args, **kwargs):
        raise AssertionError("eigvalsh called for S_2")

    monkeypatch.setattr(torch.linalg, "eigvalsh", refuse)
    assert torch.equal(prompt_entropies(block_of(rows, kind), 2.0, "paper").nan_to_num(-1), expected.nan_to_num(-1))
    with pytest.raises(AssertionError, match="eigvalsh"):
        prompt_entropies(block_of(rows, kind), 1.0, "paper")


@pytest.mark.parametrize("kind", ["right", "left", "holes"])
@pytest.mark.parametrize("variant", ["paper", "information_flow"])
def test_batched_curvature_equals_one_prompt_at_a_time(kind, variant):
    rows = prompts()
    got = curvature_block(block_of(rows, kind), variant)
    for i, r in enumerate(rows):
        one = curvature(r, variant)
        assert got[i, 0].item() == pytest.approx(one["raw"], rel=1e-12, abs=1e-12, nan_ok=True), i
        assert got[i, 1].item() == pytest.approx(one["logD"], rel=1e-12, abs=1e-12, nan_ok=True), i


@pytest.mark.parametrize("kind", ["right", "left", "holes"])
@pytest.mark.parametrize("max_elements", [1 << 22, 200, 10])
def test_batched_histogram_equals_one_text_at_a_time(kind, max_elements):
    rows = prompts()
    rows[3] = rows[3] * 1e-4  # shorter than condensation's eps
    got = cosine_histogram_block(block_of(rows, kind), 20, 1e-3, max_elements=max_elements)
    expected = sum(cosine_histogram(r, 20, 1e-3) / r.shape[0] ** 2 for r in rows if r.shape[0])
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("kind", ["right", "left", "holes"])
def test_prompts_longer_than_the_width_use_the_d_by_d_gram(kind):
    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(n, 4, generator=g) for n in (3, 9, 4, 6)]  # D = 4: N > D for two of them
    got = prompt_entropies(block_of(rows, kind), 1.0, "information_flow")
    for i, r in enumerate(rows):
        one = prompt_entropy(r, 1.0, "information_flow")
        assert got[i, 0].item() == pytest.approx(one["raw"], rel=1e-11, abs=1e-12), i


def test_spectrum_entropies_use_each_rows_own_round_off_floor():
    lam = torch.tensor([[0.0, 0.0, 1e-17, 0.5, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0], [-1e-3, 0.2, 0.3, 0.0, 0.0]],
                       dtype=torch.float64)
    sizes = torch.tensor([5, 2, 3])
    got = spectrum_entropies(lam, sizes, 1.0)
    assert got[0].item() == pytest.approx(spectrum_entropy(lam[0], 1.0).item(), abs=1e-15)
    assert math.isnan(got[1].item())
    assert got[2].item() == pytest.approx(spectrum_entropy(lam[2, :3], 1.0).item(), abs=1e-15)


# -- the finite check ------------------------------------------------------------------------------------------------
def test_finite_check_reads_real_tokens_only():
    h = torch.randn(3, 5, 4)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False
    check_finite("final", h, mask, ["a", "b", "c"])
    h[1, 4, 0] = float("nan")  # at a pad: allowed
    check_finite("final", h, mask, ["a", "b", "c"])
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = h.clone()
        x[2, 0, 1] = bad
        with pytest.raises(NonFiniteError, match="'c'"):
            check_finite("final", x, mask, ["a", "b", "c"])
    big = torch.full((2, 4, 3), 3e38)  # finite, but the sum overflows: the exact check decides
    check_finite("final", big, torch.ones(2, 4, dtype=torch.bool), [0, 1])


# -- the pipeline ----------------------------------------------------------------------------------------------------
class PaddedTokens(Metric):
    """A third-party TOKENS metric with no ``update_tokens``: it must still get the documented float64 padded tensor
    with zero pads."""

    name = "padded_tokens"
    consumes = Consumes.TOKENS

    def __init__(self):
        super().__init__()
        self.add_state("total", torch.zeros((), dtype=torch.float64), "sum")
        self.add_state("bad", torch.zeros((), dtype=torch.float64), "sum")

    def update(self, batch: LayerBatch) -> None:
        assert batch.hidden is not None and batch.mask is not None
        if batch.hidden.dtype != torch.float64 or bool(batch.hidden[~batch.mask].abs().sum() != 0):
            self.bad = self.bad + 1
        self.total = self.total + batch.hidden.sum()

    def compute(self) -> dict:
        return {"total": float(self.total), "bad": float(self.bad)}


def test_token_metrics_without_a_block_path_get_the_padded_float64_tensor(tiny_model_dir, texts):
    @rg.hookimpl
    def repgeom_register_metrics(registry):
        registry.add(PaddedTokens)

    module = types.ModuleType("padded_plugin")
    module.repgeom_register_metrics = repgeom_register_metrics
    host = PluginHost(extra_plugins=[("padded_plugin", module)])
    result = measure(tiny_model_dir("llama"), texts[:9], layers="0,-1", progress=False, host=host, batch_size=4,
                     padding_side="left", metrics=["padded_tokens", "token_dispersion", "prompt_entropy"])
    for addr, values in result.results.items():
        assert values["padded_tokens"]["bad"] == 0.0, addr
        assert values["padded_tokens"]["total"] != 0.0


def test_bin_index_is_bucketize_on_the_edges_themselves():
    from repgeom_eval.functional.condensation import bin_index, histogram_edges

    for bins in (1, 2, 7, 50, 64):
        edges = histogram_edges(bins)
        values = torch.cat([edges, torch.nextafter(edges, torch.full_like(edges, 2.0)),
                            torch.nextafter(edges, torch.full_like(edges, -2.0)), torch.rand(5000, dtype=torch.float64) * 2 - 1])
        values = values.clamp(-1.0, 1.0)
        assert torch.equal(bin_index(values, edges), torch.bucketize(values, edges[1:-1], right=True)), bins


# -- the metric work of a batch spread over threads ------------------------------------------------------------------
LAYERWISE = ["dispersion", "token_dispersion", "prompt_entropy", "dataset_entropy", "effective_rank", "curvature",
             "vendi", "condensation"]


def test_threaded_metric_work_gives_what_one_address_at_a_time_gives(tiny_model_dir, texts, monkeypatch):
    from repgeom_eval.measurement import engine

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        kw = dict(layers="all", metrics=LAYERWISE, progress=False, batch_size=4, per_text=True)
        calls = []
        original = engine.MeasureRun._feed_addresses

        def spy(self, *a):
            calls.append(self._feed_workers)
            return original(self, *a)

        monkeypatch.setattr(engine.MeasureRun, "_feed_addresses", spy)
        threaded = measure(tiny_model_dir("llama", n_layers=3), texts[:13], **kw)
        assert calls and set(calls) == {2}
        monkeypatch.setattr(engine.MeasureRun, "_metric_threads", lambda self, host: 1)
        serial = measure(tiny_model_dir("llama", n_layers=3), texts[:13], **kw)
    finally:
        torch.set_num_threads(threads)
    assert threaded.results.keys() == serial.results.keys() and len(threaded.results) == 4
    for addr in threaded.results:
        for name, value in threaded.results[addr].items():
            other = serial.results[addr][name]
            if isinstance(value, dict):
                for key, v in value.items():
                    if isinstance(v, float):
                        assert v == pytest.approx(other[key], rel=1e-12, abs=1e-12), (addr, name, key)
            else:
                assert value == pytest.approx(other, rel=1e-12, abs=1e-12), (addr, name)
    for a, b in zip(threaded.per_text, serial.per_text, strict=True):
        for addr, scores in a["scores"].items():
            assert scores == pytest.approx(b["scores"][addr], rel=1e-12, abs=1e-12, nan_ok=True)


def test_third_party_metrics_keep_the_sequential_path(tiny_model_dir, texts, monkeypatch):
    from repgeom_eval.measurement import engine

    # sequential: each address fed during the pass, one after another (never the threads of _feed_addresses)
    seen, threaded = [], []
    original, feed = engine.MeasureRun._forward_batch, engine.MeasureRun._feed_addresses
    monkeypatch.setattr(engine.MeasureRun, "_forward_batch",
                        lambda self, *a: (seen.append(self._feed_workers), original(self, *a))[1])
    monkeypatch.setattr(engine.MeasureRun, "_feed_addresses",
                        lambda self, *a: (threaded.append(1), feed(self, *a))[1])

    @rg.hookimpl
    def repgeom_register_metrics(registry):
        registry.add(PaddedTokens)

    module = types.ModuleType("padded_plugin")
    module.repgeom_register_metrics = repgeom_register_metrics
    host = PluginHost(extra_plugins=[("padded_plugin", module)])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        measure(tiny_model_dir("llama"), texts[:5], layers="all", progress=False, host=host,
                metrics=["padded_tokens", "dispersion"])
    finally:
        torch.set_num_threads(threads)
    assert seen and set(seen) == {1} and not threaded


@pytest.mark.parametrize("kind", ["right", "left", "holes"])
def test_the_layout_is_read_from_the_hosts_copy_of_the_mask(kind, monkeypatch):
    """Given the host's copy of its mask (the tokenizer's), a block reads each text's layout from it, waiting for
    no device; without it, the layout is read from the block's own mask, once for all blocks sharing it."""
    import repgeom_eval.functional.tokens as tokens

    waits = []
    real_wait = tokens._wait_for
    monkeypatch.setattr(tokens, "_wait_for", lambda rows: waits.append(1) or real_wait(rows))
    ref = block_of(prompts(), kind)
    host = TokenBlock(ref.hidden, ref.mask, host_mask=ref.mask.clone())
    assert (host.lengths, host.local_spans(), host.span) == (ref.lengths, ref.local_spans(), ref.span)
    assert len(waits) == 1  # ref's own layout; none for the block with the host's copy
    other = TokenBlock(ref.hidden * 2, ref.mask, like=ref)
    assert other.lengths == ref.lengths and len(waits) == 1
    got, expected = prompt_entropies(host, 1.0), prompt_entropies(ref, 1.0)
    assert torch.equal(got.nan_to_num(-1.0), expected.nan_to_num(-1.0))


def test_the_waitless_bin_count_equals_bincount():
    # what a GPU runs (adding into a fixed-size vector: no wait for the largest index) counts as bincount does
    from repgeom_eval.functional.condensation import count_bins

    index = torch.randint(0, 37, (5, 1000), generator=torch.Generator().manual_seed(0))
    for weight in (1.0, 2.0):
        expected = torch.bincount(index.flatten(), minlength=40).to(torch.float64) * weight
        assert torch.equal(count_bins(index, 40, weight, waitless=True), expected)
        assert torch.equal(count_bins(index, 40, weight, waitless=False), expected)
