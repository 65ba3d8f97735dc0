"""``repgeom measure --dry-run``: the memory a run will hold, from the model's config alone (no weights read), and
the run's own record of what it held (``timings.state_bytes``, ``peak_rss_bytes``)."""

from __future__ import annotations

import json
import warnings

import pytest

import repgeom_eval as rg
from repgeom_eval.entrypoints.cli import main
from repgeom_eval.spec.options.measure import RunConfig
from repgeom_eval.measurement.estimate import estimate

METRICS = ["dispersion", "dataset_entropy", "effective_rank", "vendi", "token_dispersion"]


def texts(n: int) -> list[str]:
    words = "rivers hills numbers code music weather stones letters trees ships".split()
    return [" ".join(words[(i * 7 + k) % 10] for k in range(3 + i % 5)) + f" {i}" for i in range(n)]


@pytest.mark.parametrize("n_texts", [12, 80])  # fewer and more texts than the tiny model's width (32)
def test_the_estimate_bounds_what_the_run_holds(tiny_model_dir, n_texts):
    model = tiny_model_dir("llama")
    run = RunConfig(layers="all", metrics=METRICS, progress=False)
    est = estimate(model, run)
    assert est.width == 32 and est.n_addresses == 3 and est.weights_bytes > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = rg.measure(model, texts(n_texts), config=run)
    held = result.timings["state_bytes"]
    metric_states = sum(s.fixed_bytes + s.per_1000_texts_bytes * n_texts // 1000
                        for states in est.per_address.values() for s in states if not s.metric.startswith("("))
    # an upper bound: a Gram metric holds its rows until there are more than D, then a D×D sum and a buffer of 0 to
    # D rows; with more texts than the width the estimate is within a factor 2 (half of it is the buffer)
    assert held <= metric_states, (held, metric_states)
    if n_texts > est.width:
        assert held >= 0.5 * metric_states, (held, metric_states)
    assert result.timings["peak_rss_bytes"] > held


def test_dry_run_reads_the_config_alone_at_a_real_shape(tmp_path, capsys):
    """A Llama-3-8B-shaped config with no weight file at all: the estimate says what three Gram metrics at every
    hidden state hold (one packed (D+1)×D Gram per address, 128 MiB, read by effective_rank and vendi; the vectors
    per 1,000 texts for dataset_entropy's global centring; 33 addresses) and what the weights need in bfloat16."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256).save_pretrained(tmp_path / "llama-8b")
    assert main(["measure", "-m", str(tmp_path / "llama-8b"), "-d", "unread.txt", "--layers", "all", "--metrics",
                 "effective_rank", "vendi", "dataset_entropy", "--dtype", "bfloat16", "--pooling", "mean", "--dry-run",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["width"] == 4096 and len(doc["addresses"]) == 33 and doc["dtype"] == "bfloat16"
    # the packed Grams (raw below, unit above: (D+1)×D) and three counts, in float64; the fold buffer (up to D rows)
    # never holds data beside them at two addresses, so it counts once for the run, as do compute's two D×D copies
    assert doc["metrics"]["effective_rank"]["fixed_bytes_per_address"] == 4097 * 4096 * 8 + 3 * 8
    assert doc["metrics"]["vendi"]["fixed_bytes_per_address"] == 0  # at the same pooling it reads effective_rank's
    # the largest compute temporary, dataset_entropy's with global centring (its Gram, eigvalsh's copy, workspace),
    # above the shared Gram's (the Gram rebuilt whole, eigvalsh's copy, LAPACK's workspace of 512 columns)
    assert doc["transient_bytes"] == 3 * 4096 * 4096 * 8
    assert main(["measure", "-m", str(tmp_path / "llama-8b"), "-d", "unread.txt", "--layers", "all", "--metrics",
                 "vendi", "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["transient_bytes"] == (2 * 4096 + 512) * 4096 * 8
    # dataset_entropy's compute gathers its vectors in text order: one more row per text, for one address at a time
    assert doc["transient_per_1000_texts_bytes"] == 1000 * 4096 * 8
    per_address = sum(m["fixed_bytes_per_address"] for m in doc["metrics"].values() if m["addresses"] == 33)
    assert doc["state_bytes"] == 33 * per_address + doc["transient_bytes"]
    assert doc["metrics"]["dataset_entropy"]["per_1000_texts_bytes_per_address"] == 1000 * (4096 + 1) * 8
    assert 14e9 < doc["weights_bytes"] < 18e9  # about 8 billion parameters in bfloat16
    assert not list(tmp_path.glob("llama-8b/*.safetensors"))


def test_dry_run_table_and_errors(tiny_model_dir, capsys):
    assert main(["measure", "-m", tiny_model_dir("gpt2"), "-d", "unread.txt", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "dispersion" in out and "per 1,000 texts" in out and "weights" in out
    assert main(["measure", "-m", "./no-such-model", "-d", "x.txt", "--dry-run"]) == 2
    assert "no-such-model" in capsys.readouterr().err


def test_a_state_memory_budget_refuses_before_loading(tiny_model_dir, tmp_path, capsys):
    """--state-memory: an estimate above the budget is one line naming what to drop, before any weight is read;
    within the budget the run goes on."""
    model = tiny_model_dir("llama")
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(texts(20)) + "\n")
    out = tmp_path / "out.json"
    args = ["measure", "-m", model, "-d", str(data), "--layers", "all", "--metrics", "dispersion", "effective_rank",
            "vendi", "-o", str(out)]
    assert main(args + ["--state-memory", "10KB"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "--state-memory 9.8 KiB" in err and "effective_rank" in err and "--layers final" in err
    assert not out.exists()
    assert main(args + ["--state-memory", "1GB"]) == 0 and out.exists()


@pytest.mark.parametrize("text, expected", [("8GB", 8 * 10 ** 9), ("512MiB", 512 * 2 ** 20), ("2.5g", 25 * 10 ** 8),
                                            ("1000", 1000)])
def test_sizes_parse(text, expected):
    from repgeom_eval.spec.options.measure import parse_size

    assert parse_size(text) == expected


def test_mteb_run_dry_run_states_the_sweep_memory_from_the_config_alone(tmp_path, capsys):
    """``repgeom mteb run --dry-run`` (issue 32, item 1): no tasks resolved, no weights read; every layer's --metrics
    states and the embeddings a task keeps at each layer (float32, host memory, per 1,000 texts) at 8B's shape."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256).save_pretrained(tmp_path / "llama-8b")
    model = str(tmp_path / "llama-8b")
    assert main(["mteb", "run", "-m", model, "--layer", "auto", "--metrics", "effective_rank", "--dry-run"]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "33 address(es)" in out  # auto reads every hidden state
    assert "(task embeddings, float32) cpu 0 B 15.6 MiB 33" in out  # 1000 × 4096 × 4 bytes at each address
    assert "effective_rank" in out and "128.0 MiB" in out  # its packed Gram per address
    # the sweep pools each address as the pass reaches it, on the CPU too (it has no threaded path)
    assert "× 4096 in float32, one address at a time" in out and "× 33 addresses in float32" not in out
    assert main(["mteb", "run", "-m", model, "--layer", "resid_post:[0,1]", "--dry-run"]) == 0
    assert "2 address(es)" in capsys.readouterr().out
    assert not list(tmp_path.glob("llama-8b/*.safetensors")) and not (tmp_path / "results").exists()


def test_dry_run_states_work_that_outgrows_the_forward_with_the_length(tmp_path, capsys):
    """prompt_entropy's per-text eigendecomposition (min(T, D)³) is named at the run's length and address count;
    at alpha 2 it reads two traces and says nothing; a plugin's work_note that raises costs its line only."""
    from test_plugin_runs import plugin_host
    from transformers import LlamaConfig

    from repgeom_eval import Consumes, Metric

    LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256).save_pretrained(tmp_path / "llama-8b")
    model = str(tmp_path / "llama-8b")
    argv = ["measure", "-m", model, "-d", "unread.txt", "--layers", "all", "--max-length", "2048", "--dry-run",
            "--json", "--metrics", "dispersion", "prompt_entropy"]
    assert main(argv) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    work = [n for n in notes if n.startswith("prompt_entropy at 2048 tokens × 33 addresses: ")]
    assert len(work) == 1 and "up to 2048×2048 per text and address" in work[0] and "min(T, D)³" in work[0], notes
    assert not [n for n in notes if n.startswith("dispersion")]
    assert main(argv + ["--metric-param", "prompt_entropy.alpha=2"]) == 0
    assert not [n for n in json.loads(capsys.readouterr().out)["notes"] if n.startswith("prompt_entropy")]

    class BrokenNote(Metric):
        name, consumes = "broken_note", Consumes.POOLED

        def __init__(self):
            super().__init__()
            self.add_state("total", __import__("torch").zeros(()), "sum")

        def work_note(self, tokens, width):
            raise ZeroDivisionError("no note")

    host = plugin_host(BrokenNote, name="broken_note_plugin")
    est = estimate(model, RunConfig(layers="final", metrics=("broken_note", "prompt_entropy"), max_length=64),
                   host=host)
    assert "broken_note at 64 tokens × 1 address: work_note raised ZeroDivisionError: no note" in est.notes
    assert any(n.startswith("prompt_entropy at 64 tokens × 1 address: ") and "64×64" in n for n in est.notes)

    class TwoLineNote(BrokenNote):
        name = "two_line_note"

        def work_note(self, tokens, width):
            return "first line\n  second line"

    est = estimate(model, RunConfig(layers="final", metrics=("two_line_note",), max_length=64),
                   host=plugin_host(TwoLineNote, name="two_line_plugin"))
    assert "two_line_note at 64 tokens × 1 address: first line second line" in est.notes  # folded into one


def test_a_run_records_the_gpu_peak_of_every_gpu_it_used(monkeypatch):
    # a --device-map model split over GPUs: its peak is the sum over the GPUs that allocated, and each is named
    import torch

    from repgeom_eval.measurement.engine import memory_used

    class _State:
        states: dict = {}

    peaks = {0: 5 * 2**30, 1: 3 * 2**30, 2: 0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda i: peaks[i])
    out = memory_used(_State(), torch.device("cuda", 0))
    assert out["cuda_max_memory_allocated_bytes"] == 8 * 2**30
    assert out["cuda_max_memory_allocated_bytes_per_device"] == {"cuda:0": 5 * 2**30, "cuda:1": 3 * 2**30}
    peaks[1] = 0  # one GPU: its peak alone, no per-device breakdown
    out = memory_used(_State(), torch.device("cuda", 0))
    assert out["cuda_max_memory_allocated_bytes"] == 5 * 2**30
    assert "cuda_max_memory_allocated_bytes_per_device" not in out
    assert "cuda_max_memory_allocated_bytes" not in memory_used(_State(), torch.device("cpu"))


def test_dry_run_reads_the_decoder_of_a_config_with_two_text_configs(tmp_path, capsys):
    # transformers cannot say which of musicgen's text configs (encoder, decoder) is "the" text config: the dry run
    # reads the decoder's (before, the ambiguity escaped as a traceback)
    from transformers import MusicgenConfig

    config = MusicgenConfig()
    config.save_pretrained(tmp_path / "mg")
    assert main(["measure", "-m", str(tmp_path / "mg"), "-d", "unread.txt", "--layers", "all", "--metrics",
                 "dispersion", "--dry-run", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["width"] == config.decoder.hidden_size
    assert len(doc["addresses"]) == config.decoder.num_hidden_layers + 1


def test_a_gpu_run_is_planned_on_a_machine_without_one(tmp_path, capsys, monkeypatch):
    # a login node without a GPU plans the GPU job: the states are said to live on cuda and the weights take auto's
    # GPU dtype (bfloat16); the run itself still refuses a missing GPU
    import torch
    from transformers import LlamaConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=1000).save_pretrained(tmp_path / "m")
    argv = ["measure", "-m", str(tmp_path / "m"), "-d", str(tmp_path / "t.txt"), "--metrics", "dispersion",
            "--device", "cuda"]
    assert main(argv + ["--dry-run", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["device"] == "cuda" and doc["dtype"] == "bfloat16"
    assert {m["device"] for m in doc["metrics"].values()} == {"cuda"}
    (tmp_path / "t.txt").write_text("a text\nanother\n")
    assert main(argv) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_with_token_pooling_the_estimate_counts_every_token(tiny_model_dir):
    # --pooling tokens makes every real token a row of a per-text state: the estimate counts the context length's
    # worth a text (an upper bound), not one row (before: 60× under)
    model = tiny_model_dir("llama")
    run = RunConfig(layers="all", metrics=("dataset_entropy",), pooling="tokens", max_length=48, progress=False)
    est = estimate(model, run)
    assert any("--pooling tokens" in note for note in est.notes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = rg.measure(model, texts(12), config=run)
    held = result.timings["state_bytes"]
    assert 0.25 * est.for_texts(12) <= held <= est.for_texts(12), (held, est.for_texts(12))
    # one row a text, as the estimate counted before, is far below what the run holds
    plain = estimate(model, RunConfig(layers="all", metrics=("dataset_entropy",), max_length=48, progress=False))
    assert held > 5 * plain.for_texts(12), (held, plain.for_texts(12))


def test_the_dry_run_says_when_poolings_alone_keep_grams_apart(tmp_path):
    # vendi (last) and effective_rank (mean) keep one Gram each by default; the note says one pooling keeps one
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=100).save_pretrained(tmp_path / "m")
    apart = estimate(str(tmp_path / "m"), RunConfig(layers="all", metrics=("effective_rank", "vendi")))
    (note,) = [n for n in apart.notes if "each keep a pooled_gram" in n]
    assert note.startswith("vendi (last pooling) and effective_rank (mean pooling) each keep a pooled_gram")
    one = estimate(str(tmp_path / "m"), RunConfig(layers="all", metrics=("effective_rank", "vendi"), pooling="mean"))
    assert not [n for n in one.notes if "each keep" in n] and one.state_bytes < apart.state_bytes


def test_the_dry_run_states_the_float64_working_copies_of_one_block(tmp_path, capsys, monkeypatch):
    """A batch is fed through float64 copies of one block of rows (functional/tokens.py): one copy for pooled
    metrics, four with token metrics (the copy, the centred tokens, curvature's differences and their products),
    one block at most the device's limit (512 MB of float64 on a GPU, 32 MB on the CPU)."""
    import torch
    from transformers import LlamaConfig

    from repgeom_eval.functional.tokens import BLOCK_ELEMENTS, DEVICE_BLOCK_ELEMENTS

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=1000, max_position_embeddings=512).save_pretrained(tmp_path / "m")

    def working(metrics, device):
        argv = ["measure", "-m", str(tmp_path / "m"), "-d", str(tmp_path / "t.txt"), "--metrics", metrics,
                "--device", device, "--batch-size", "64", "--max-length", "512", "--dry-run", "--json"]
        assert main(argv) == 0
        return json.loads(capsys.readouterr().out)["working_bytes"]

    row = 512 * 256  # one text's float64 elements
    assert working("dispersion", "cuda") == 8 * 64 * row  # 64 rows fit the GPU's block
    assert working("dispersion,curvature", "cuda") == 4 * 8 * 64 * row
    assert working("dispersion", "cpu") == 8 * (BLOCK_ELEMENTS // row) * row  # 32 rows a block on the CPU
    assert DEVICE_BLOCK_ELEMENTS // row >= 64
