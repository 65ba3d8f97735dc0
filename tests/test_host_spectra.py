"""prompt_entropy's ``spectra: host`` (plugins/host_spectra.py): the per-text spectra solved on the host's cores while
the model goes on. The same float64 solver on the same Grams, so on the CPU the values equal the default route's
within 1e-12 (LAPACK's blocked kernels may round a solve on another thread a few ulps apart); the states are folded
in order before anything reads them (a result, a checkpoint, a merge)."""

import pytest
import torch

from repgeom_eval import LayerBatch
from repgeom_eval.measurement.engine import measure
from repgeom_eval.spec.errors import RepgeomError

from repgeom_eval.plugins import host_spectra
from repgeom_eval.plugins.layerwise import PromptEntropy

LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)  # more tokens than the tiny width


def _batches(seed: int, n: int, width: int = 24):
    """``n`` LayerBatches of 3 texts with 1 to 40 real tokens (a 1-token text has no value), right-padded."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(n):
        lengths = [1 + int(torch.randint(0, 40, (1,), generator=g)) for _ in range(3)]
        mask = torch.zeros(3, max(lengths), dtype=torch.bool)
        for i, k in enumerate(lengths):
            mask[i, :k] = True
        hidden = torch.randn(3, max(lengths), width, generator=g, dtype=torch.float64) * mask.unsqueeze(2)
        out.append(LayerBatch("x", torch.arange(3 * b, 3 * b + 3), hidden=hidden, mask=mask))
    return out


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gpt_neox", "bert"])
@pytest.mark.parametrize("params", [{}, {"alpha": 0.5}, {"alpha": 3.0, "variant": "information_flow"}])
def test_host_route_equals_the_device_route(tiny_model_dir, texts, model_type, params):
    data = texts[:9] + ["a", LONG]

    def run(spectra, batch_size, padding_side):
        return measure(tiny_model_dir(model_type), data, layers="all", metrics=["prompt_entropy"], per_text=True,
                       batch_size=batch_size, padding_side=padding_side, max_length=100, progress=False,
                       metric_params={"prompt_entropy": {**params, "spectra": spectra}})

    for batch_size, side in ((4, "right"), (1, "left")):  # the same batches for both routes: the same Grams
        device, host = run("device", batch_size, side), run("host", batch_size, side)
        for addr, metrics in device.results.items():
            for key, value in metrics["prompt_entropy"].items():
                assert host.results[addr]["prompt_entropy"][key] == pytest.approx(value, abs=1e-12), (addr, key)
        assert host.diagnostics == device.diagnostics
        worst = 0.0
        for a, b in zip(device.per_text, host.per_text):
            assert a["index"] == b["index"]
            for addr, scores in a["scores"].items():
                for key, value in scores.items():
                    other = b["scores"][addr][key]
                    assert (value != value) == (other != other)  # the same texts without a value
                    worst = max(worst, abs(value - other) if value == value else 0.0)
        assert worst <= 1e-12  # one LAPACK on the CPU; its blocked kernels may round a thread's solve apart


def test_states_are_folded_before_they_are_read():
    batches = _batches(0, 6)
    whole = PromptEntropy(per_text=True)
    for b in batches:
        whole.update(b)
    reference = PromptEntropy(per_text=True, spectra="host")
    for b in batches:
        reference.update(b)
    assert reference.compute() == pytest.approx(whole.compute(), abs=1e-12)

    # a checkpoint part-way, loaded into a new metric that goes on
    first = PromptEntropy(per_text=True, spectra="host")
    for b in batches[:3]:
        first.update(b)
    saved = first.state_dict()
    resumed = PromptEntropy(per_text=True, spectra="host")
    resumed.load_state_dict(saved)
    for b in batches[3:]:
        resumed.update(b)
    assert resumed.compute() == pytest.approx(whole.compute(), abs=1e-12)
    assert resumed.diagnostics() == whole.diagnostics()

    # two shards, merged before either has folded its batches
    left, right = PromptEntropy(per_text=True, spectra="host"), PromptEntropy(per_text=True, spectra="host")
    for b in batches[:4]:
        left.update(b)
    for b in batches[4:]:
        right.update(b)
    merged = left.merge(right)
    assert merged.compute() == pytest.approx(whole.compute(), abs=1e-12)
    idx, values = merged.per_text_results()["prompt_entropy"]
    ref_idx, ref_values = whole.per_text_results()["prompt_entropy"]
    assert torch.equal(idx, ref_idx) and torch.allclose(values, ref_values, atol=1e-12, equal_nan=True)

    # a reset leaves nothing running that could land in the fresh states
    reference.update(batches[0])
    reference.reset()
    assert reference.diagnostics() == {"n_texts": 0, "n_skipped": 0}


def test_grams_waiting_on_the_host_are_bounded(monkeypatch):
    """Two batches of Grams per worker in host memory at once, over every address's metric together: past that,
    the next batch waits for a solve to finish."""
    import threading

    monkeypatch.setattr(host_spectra, "_POOL", None)
    monkeypatch.setattr(host_spectra, "_SLOTS", None)
    monkeypatch.setattr(host_spectra, "workers", lambda: 1)
    release = threading.Event()
    solve = host_spectra._solve
    monkeypatch.setattr(host_spectra, "_solve", lambda *a: (release.wait(10), solve(*a))[1])  # a slow host
    metrics = [PromptEntropy(spectra="host") for _ in range(2)]  # two addresses
    batches = _batches(1, 2)
    for metric in metrics:
        metric.update(batches[0])
    assert host_spectra.in_flight() == 2
    third = threading.Thread(target=metrics[0].update, args=(batches[1],))
    third.start()
    third.join(0.5)
    assert third.is_alive() and host_spectra.in_flight() == 2  # the third batch waits for a slot
    release.set()
    third.join(10)
    assert not third.is_alive()
    assert metrics[0].diagnostics()["n_texts"] + metrics[0].diagnostics()["n_skipped"] == 6
    assert host_spectra.in_flight() == 0
    host_spectra.pool().shutdown()


def test_alpha_2_needs_no_spectra_and_a_bad_route_is_named():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert not PromptEntropy(alpha=2.0, spectra="host")._on_host(gpu)  # two traces (collision_entropy)
    assert PromptEntropy(alpha=2.0, variant="information_flow", spectra="host")._on_host(cpu)
    with pytest.raises(RepgeomError, match=r"spectra must be one of 'auto', 'device', 'host', got 'gpu'"):
        PromptEntropy(spectra="gpu")


def test_auto_solves_on_the_host_for_a_gpu_and_in_place_on_the_cpu():
    """The default route (benchmarks/results/gpu_profile.json: on an H200 at 512 tokens, the 8B layer-wise suite
    added 10.8× the forward per batch with the spectra on the GPU, 1.9× on the host's 16 cores): the host's cores
    for hidden states on a GPU, in place on the CPU."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    auto = PromptEntropy()
    assert auto.spectra == "auto" and auto._on_host(gpu) and not auto._on_host(cpu)
    assert not PromptEntropy(spectra="device")._on_host(gpu) and PromptEntropy(spectra="host")._on_host(cpu)
    assert not PromptEntropy(alpha=2.0)._on_host(gpu)
    assert "when the hidden states are on a GPU" in auto.work_note(512, 4096)
    assert "host" not in PromptEntropy(spectra="device").work_note(512, 4096)


def test_a_batch_that_fails_before_its_solve_gives_its_slot_back(monkeypatch):
    from repgeom_eval.functional import entropy

    def out_of_memory(block, max_elements=1 << 22):
        raise RuntimeError("CUDA out of memory (a stand-in)")

    monkeypatch.setattr(entropy, "prompt_grams", out_of_memory)
    before = host_spectra.in_flight()
    with pytest.raises(RuntimeError, match="stand-in"):
        PromptEntropy(spectra="host").update(_batches(2, 1)[0])
    assert host_spectra.in_flight() == before


def test_a_nan_is_named_as_on_the_device_route(tiny_model_dir, texts, monkeypatch):
    """A NaN hidden state checked later (as on a GPU) is still the run's error, naming its text and address, and
    not a failed solve on the host's cores (whose batches are read only after the check)."""
    from repgeom_eval.measurement.forward import Forward
    from repgeom_eval.modeling.loading import load_model
    from repgeom_eval.spec.errors import NonFiniteError

    monkeypatch.setattr(Forward, "check_each_batch", False)
    loaded = load_model(tiny_model_dir("llama"))
    messages = []
    for spectra in ("device", "host"):
        calls: list[int] = []

        def poison_second_batch(module, args, output):
            calls.append(1)
            if len(calls) == 2:
                output = output.clone()
                output[2, 0] = float("nan")
            return output

        handle = loaded.model.model.layers[1].register_forward_hook(poison_second_batch)
        try:
            with pytest.raises(NonFiniteError) as caught:
                measure(loaded, texts[:12], layers="resid_post:[0,1]", metrics=["prompt_entropy"], batch_size=4,
                        progress=False, metric_params={"prompt_entropy": {"spectra": spectra}})
        finally:
            handle.remove()
        messages.append(str(caught.value))
    assert "at address resid_post:1 for text id" in messages[0] and messages[1] == messages[0]
