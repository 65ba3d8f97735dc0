"""Each address fed to its metrics as the forward pass reaches it (``Forward.texts(..., consume=...)``, used by
``measure`` wherever the addresses are fed one after another: on a GPU, on one thread, with a third-party metric):
the same numbers as feeding every address after the pass, one address's hidden states held at a time instead of
every address's (docs/how-to/large-models.md#memory-before-it-starts), and the consumer's errors reported as its own.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import pytest
import torch

from repgeom_eval.measurement import engine
from repgeom_eval.measurement.engine import MeasureRun, measure
from repgeom_eval.measurement.forward import Forward
from repgeom_eval.modeling.addresses import resolve_request
from repgeom_eval.modeling.hooks import Capture
from repgeom_eval.modeling.loading import load_model
from repgeom_eval.plugin_system.host import get_host
from repgeom_eval.spec.errors import ModelForwardError, NonFiniteError, RepgeomError
from repgeom_eval.spec.options.model import ModelOptions

METRICS = sorted(get_host().metrics.names())


def _flat(value, path=""):
    if isinstance(value, dict):
        for k in sorted(value):
            yield from _flat(value[k], f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _flat(v, f"{path}[{i}]")
    else:
        yield path, value


def _assert_same(a, b):
    fa, fb = dict(_flat(a)), dict(_flat(b))
    assert fa.keys() == fb.keys()
    compared = 0
    for k, x in fa.items():
        y = fb[k]
        if isinstance(x, float) and isinstance(y, float):
            if math.isnan(x):
                assert math.isnan(y), k
            else:
                assert abs(x - y) <= 1e-10 * max(1.0, abs(x)), (k, x, y)  # the threads' own rounding, no more
            compared += 1
        else:
            assert x == y, (k, x, y)
    return compared


@pytest.mark.parametrize("kind, padding", [("llama", "right"), ("gpt2", "left"), ("gpt_neox", "right"),
                                           ("bert", "right"), ("qwen2", "left"), ("phi3", "right"),
                                           ("olmo", "right"), ("gpt_neox_sequential", "right"),
                                           ("xlm-roberta", "right"), ("t5", "right")])
def test_fed_during_the_pass_equals_fed_after_it(tiny_model_dir, realistic, texts, monkeypatch, kind, padding):
    """Every built-in metric at every address, with per-text values: the numbers of a run whose addresses are fed
    during the pass equal those of a run that feeds them after it, in threads (T5: an encoder whose addresses are
    read from its hidden_states output)."""
    model = realistic(kind) if kind == "t5" else tiny_model_dir(kind)
    streamed = []
    store = Capture._store

    def spy(self, point, tensor):
        streamed.append(self.consume is not None)
        return store(self, point, tensor)

    monkeypatch.setattr(Capture, "_store", spy)

    def run(threads):
        monkeypatch.setattr(MeasureRun, "_metric_threads", lambda self, host: threads)
        streamed.clear()
        result = measure(model, texts[:11], layers="all", metrics=METRICS, batch_size=4, padding_side=padding,
                         per_text=True, progress=False)
        return result, list(streamed)

    after, how_after = run(2)
    during, how_during = run(1)
    assert how_during and all(how_during)  # every address went to its metrics from inside the pass
    assert how_after and not any(how_after)
    assert _assert_same(after.results, during.results) > 12 * 3
    assert _assert_same(after.per_text, during.per_text) > 0
    assert _assert_same(after.diagnostics, during.diagnostics) >= 0


def _load(tiny_model_dir, dtype="bfloat16", n_layers=4):
    return load_model(tiny_model_dir("llama", n_layers=n_layers), options=ModelOptions(dtype=dtype))


def test_the_pass_holds_one_address_at_a_time(tiny_model_dir, texts):
    """A bfloat16 model: each address's float32 copy reaches the consumer while the pass still runs (before the
    last block), and the previous address's copy is gone by then."""
    loaded = _load(tiny_model_dir)
    plan = resolve_request("all", loaded)
    events, alive = [], []
    blocks = loaded.model.model.layers
    hook = blocks[-1].register_forward_hook(lambda *a: events.append("last block ran"))

    def consume(addr, h, mask, host_mask):
        assert h.dtype == torch.float32 and mask.dtype == torch.bool and host_mask is not None
        assert not [ref for ref in alive if ref() is not None], "an earlier address's copy is still held"
        events.append(str(addr))
        alive.append(weakref.ref(h))

    try:
        with Forward(loaded, plan.points) as fwd:
            batch = fwd.texts(texts[:4], 64, consume=consume)
            assert batch.hidden == {}  # handed over, not kept
            assert sorted(e for e in events if e != "last block ran") == sorted(str(a) for a in plan.addresses)
            assert events.index("resid_post:0") < events.index("last block ran")
            # the same Forward without a consumer captures as before
            again = fwd.texts(texts[:4], 64)
            assert sorted(map(str, again.hidden)) == sorted(str(a) for a in plan.addresses)
    finally:
        hook.remove()


@pytest.mark.filterwarnings("ignore:.*changes its hidden states")
@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("rows_alone", [False, True], ids=["one-pass", "each-text-alone"])
def test_what_the_consumer_gets_is_the_batch(tiny_model_dir, texts, padding, rows_alone, monkeypatch):
    """The consumer receives exactly the tensors and masks the batch would hold, in one pass or, for a model whose
    load check refused the padding side, after the texts ran one at a time."""
    loaded = _load(tiny_model_dir)
    if rows_alone:
        monkeypatch.setattr(loaded.layout, "padding_sides", ("right",) if padding == "left" else ("left",))
    plan = resolve_request("all", loaded)
    got = {}
    with Forward(loaded, plan.points) as fwd:
        want = fwd.texts(texts[3:8], 64, padding)
        fwd.texts(texts[3:8], 64, padding, consume=lambda a, h, m, hm: got.setdefault(a, (h, m, hm)))
    assert set(got) == set(want.hidden)
    for addr, (h, mask, host_mask) in got.items():
        assert torch.equal(h, want.hidden[addr])
        assert torch.equal(mask, want.mask) and torch.equal(host_mask, want.host_mask)


def test_the_consumers_errors_stay_its_own(tiny_model_dir, texts):
    """An error of the consumer's own code inside the pass comes out as it was raised, not as a failure of the
    model's forward pass; a RepgeomError too; the hooks are clean afterwards."""
    loaded = _load(tiny_model_dir)
    plan = resolve_request("all", loaded)

    def broken(addr, h, mask, host_mask):
        try:
            {}["missing"]
        except KeyError as exc:
            raise ValueError(f"consumer broke at {addr}") from exc

    def refuses(addr, h, mask, host_mask):
        raise RepgeomError("refused")

    with Forward(loaded, plan.points) as fwd:
        with pytest.raises(ValueError, match="consumer broke at") as caught:
            fwd.texts(texts[:3], 64, consume=broken)
        assert not isinstance(caught.value, ModelForwardError)
        assert isinstance(caught.value.__cause__, KeyError)  # its own cause, not the carrier through the pass
        with pytest.raises(RepgeomError, match="^refused$"):
            fwd.texts(texts[:3], 64, consume=refuses)
        assert fwd._capture.consume is None
        assert len(fwd.texts(texts[:3], 64).hidden) == len(plan.addresses)


def test_a_nan_stops_a_streamed_run_naming_the_address(tiny_model_dir, texts, monkeypatch):
    """A NaN hidden state reached during the pass: the run stops with the check's error (address and text), not
    the model's."""
    monkeypatch.setattr(MeasureRun, "_metric_threads", lambda self, host: 1)
    loaded = _load(tiny_model_dir, dtype="float32", n_layers=2)
    block = loaded.model.model.layers[0]

    def poison(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        out[0, 0, 0] = float("nan")

    hook = block.register_forward_hook(poison)
    try:
        with pytest.raises(NonFiniteError, match="at address resid_post:0 for text id"):
            measure(loaded, texts[:4], layers="all", metrics=["dispersion", "prompt_entropy"], batch_size=2,
                    progress=False)
    finally:
        hook.remove()


def test_the_dry_run_counts_what_the_pass_holds(tiny_model_dir, tmp_path):
    """--dry-run: a GPU run holds one address's hidden states at a time; the CPU's threads hold every address's."""
    from repgeom_eval.measurement.estimate import estimate
    from repgeom_eval.spec.options.measure import RunConfig

    model = tiny_model_dir("llama")
    run = RunConfig(layers="all", metrics=["dispersion"], max_length=64, batch_size=4)
    gpu = estimate(model, RunConfig(layers="all", metrics=["dispersion"], max_length=64, batch_size=4, device="cuda"))
    one = 4 * 64 * 32 * 4
    assert gpu.batch_hidden_bytes == one
    assert any("one address at a time" in n for n in gpu.notes)
    torch_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cpu = estimate(model, run)
        assert cpu.batch_hidden_bytes == one * len(cpu.addresses) and len(cpu.addresses) == 3
        torch.set_num_threads(1)
        assert estimate(model, run).batch_hidden_bytes == one
    finally:
        torch.set_num_threads(torch_threads)


def test_engine_feeds_during_the_pass_where_it_feeds_one_address_after_another():
    from repgeom_eval.measurement.feed import THREADED_CAPTURE_BYTES

    assert engine.streams_addresses(1, 30) and engine.streams_addresses(8, 2)
    assert not engine.streams_addresses(2, 3) and not engine.streams_addresses(2, 4, THREADED_CAPTURE_BYTES // 4)
    assert engine.streams_addresses(2, 4, THREADED_CAPTURE_BYTES // 4 + 1)  # too large a batch to hold whole


def test_a_large_batch_on_the_cpus_threads_is_fed_during_the_pass(tiny_model_dir, texts, monkeypatch):
    """On the CPU's threads, a batch whose addresses together would pass THREADED_CAPTURE_BYTES is fed during the
    pass instead (memory before speed), with the same values; the dry run says the same."""
    from repgeom_eval.measurement import feed
    from repgeom_eval.measurement.estimate import estimate
    from repgeom_eval.spec.options.measure import RunConfig

    model = tiny_model_dir("llama")
    monkeypatch.setattr(MeasureRun, "_metric_threads", lambda self, host: 2)
    streamed = []
    store = Capture._store
    monkeypatch.setattr(Capture, "_store", lambda self, p, t: (streamed.append(self.consume is not None),
                                                              store(self, p, t))[1])

    def run():
        streamed.clear()
        out = measure(model, texts[:8], layers="all", metrics=["dispersion", "prompt_entropy"], batch_size=4,
                      max_length=64, progress=False)
        return out, set(streamed)

    held, how_held = run()
    est_held = estimate(model, RunConfig(layers="all", metrics=["dispersion"], max_length=64, batch_size=4))
    monkeypatch.setattr(feed, "THREADED_CAPTURE_BYTES", 3 * 32 * 4)  # below 3 addresses of any batch here
    fed, how_fed = run()
    est_fed = estimate(model, RunConfig(layers="all", metrics=["dispersion"], max_length=64, batch_size=4))
    assert how_held == {False} and how_fed == {True}
    assert _assert_same(held.results, fed.results) > 0
    assert est_held.batch_hidden_bytes == 3 * est_fed.batch_hidden_bytes == 3 * 4 * 64 * 32 * 4


def test_a_measure_run_holds_one_address_at_a_time(tiny_model_dir, texts, monkeypatch):
    """The engine streams a bfloat16 model's addresses one at a time: when an address reaches the metrics, nothing
    keeps any earlier address's float32 copy alive (neither the pass nor the per-batch layout the addresses share,
    which keeps the first address's mask and layout but not its values)."""
    monkeypatch.setattr(MeasureRun, "_metric_threads", lambda self, host: 1)
    loaded = _load(tiny_model_dir)
    fed = engine._MeasureSink.batch
    alive, calls = [], []

    def watch(self, addr, h, *rest, **kw):
        assert not [ref for ref in alive if ref() is not None], f"an earlier address is still held at {addr}"
        calls.append(addr)
        fed(self, addr, h, *rest, **kw)
        alive.append(weakref.ref(h))

    monkeypatch.setattr(engine._MeasureSink, "batch", watch)
    result = measure(loaded, texts[:8], layers="all", metrics=["dispersion", "prompt_entropy", "token_dispersion",
                                                              "curvature", "vendi"], batch_size=4, progress=False)
    assert len(calls) == 2 * len(result.results) == 2 * 5


def test_a_caller_that_holds_every_address_says_so_in_the_dry_run(tiny_model_dir):
    """estimate(streams=False): a caller that keeps every address of a batch (the lm-eval wrapper's passes) gets a
    dry run that counts them all, on a GPU too."""
    from repgeom_eval.measurement.estimate import estimate
    from repgeom_eval.spec.options.measure import RunConfig

    run = RunConfig(layers="all", metrics=["dispersion"], max_length=64, batch_size=4, device="cuda")
    est = estimate(tiny_model_dir("llama"), run, energy=False, streams=False)
    assert est.batch_hidden_bytes == 4 * 64 * 32 * 4 * 3
    assert any("every address of a batch is held" in n for n in est.notes)


def test_the_dry_run_reads_the_tokenizers_context_limit(tiny_model_dir, tmp_path):
    """The run's context is the smaller of the config's positions and the tokenizer's model_max_length
    (context_length); the dry run reads the latter from tokenizer_config.json, without loading the tokenizer."""
    import json
    import shutil

    from repgeom_eval.measurement.estimate import estimate
    from repgeom_eval.spec.options.measure import RunConfig

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir("llama"), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["model_max_length"] = 48
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    run = RunConfig(layers="all", metrics=["dispersion"], batch_size=2, device="cuda")
    assert estimate(str(model), run).batch_hidden_bytes == 2 * 48 * 32 * 4
    config["model_max_length"] = 10**30  # transformers' "no limit"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    positions = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    assert estimate(str(model), run).batch_hidden_bytes == 2 * positions * 32 * 4


def test_the_mteb_sweep_pools_each_address_during_the_pass(tiny_model_dir, texts, monkeypatch):
    """LayerEmbedder.embed (the MTEB sweep's forward) pools each address as the pass reaches it: every capture is
    handed over, none kept, and the embeddings are the pooled hidden states of an ordinary pass."""
    from repgeom_eval.measurement.pooling import pool
    from repgeom_eval.mteb_layers.embedder import LayerEmbedder

    loaded = _load(tiny_model_dir)
    embedder = LayerEmbedder(loaded, pooling="mean", normalize=False)
    addresses = embedder.addresses("all")
    streamed = []
    store = Capture._store
    monkeypatch.setattr(Capture, "_store", lambda self, p, t: (streamed.append(self.consume is not None),
                                                              store(self, p, t))[1])
    got = embedder.embed(texts[:6], addresses, batch_size=3, dtype=np.float64, raw=True)
    assert streamed and all(streamed)
    with Forward(loaded, embedder.points(addresses)) as fwd:
        for start in (0, 3):
            rows = sorted(range(6), key=lambda i: -len(loaded.tokenizer(texts[i])["input_ids"]))[start:start + 3]
            batch = fwd.texts([texts[i] for i in rows], embedder.recipe.max_length, "right")
            for addr in addresses:
                want = pool(batch.hidden[addr].double(), batch.mask, "mean")[0].numpy()
                np.testing.assert_allclose(got[addr][rows], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("padding", ["right", "left"])
def test_one_block_per_address_equals_many_small_ones(tiny_model_dir, texts, monkeypatch, padding):
    """Off the CPU a batch is fed as one float64 block per address (functional/tokens.py's ``block_limit``: 512 MB,
    so that a GPU launches each operation once per address, not once per slice of rows); the numbers equal those of
    a run cut into blocks of one text each."""
    from repgeom_eval.functional import tokens
    from repgeom_eval.measurement import feed

    assert tokens.block_limit(torch.device("cuda")) == tokens.DEVICE_BLOCK_ELEMENTS > tokens.BLOCK_ELEMENTS
    assert tokens.block_limit(torch.device("cpu")) == tokens.BLOCK_ELEMENTS
    model = tiny_model_dir("llama")
    seen = []
    chunks = feed.row_chunks

    def spy(n_rows, row_elements, limit=tokens.BLOCK_ELEMENTS):
        out = list(chunks(n_rows, row_elements, limit))
        seen.append(len(out))
        return iter(out)

    monkeypatch.setattr(feed, "row_chunks", spy)

    def run(limit):
        monkeypatch.setattr(feed, "block_limit", lambda device: limit)
        seen.clear()
        result = measure(model, texts[:11], layers="all", metrics=METRICS, batch_size=4, padding_side=padding,
                         per_text=True, progress=False)
        return result, set(seen)

    (whole, whole_blocks), (cut, cut_blocks) = run(1 << 26), run(1)
    assert whole_blocks == {1} and max(cut_blocks) == 4  # a batch of 4 texts: 1 block, or one block per text
    assert _assert_same(whole.results, cut.results) > 12 * 3
    assert _assert_same(whole.per_text, cut.per_text) > 0
