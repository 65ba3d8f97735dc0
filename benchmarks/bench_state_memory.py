"""Benchmark: the metric states' peak memory against the ``--dry-run`` estimate, with more texts than the width.

Question (issue 32): does a run hold what ``repgeom measure --dry-run`` says its states need, and do three Gram
metrics cost what the shared-statistics design says (``vendi``, ``dataset_entropy centering=none`` and
``effective_rank`` one packed (D+1)×D array holding the Grams of the unit and of the raw vectors, so three cost what
one costs; ``dataset_entropy``'s default global centring the vectors themselves)? Goal: the Gram metrics together
≤ 1.2 × one D×D Gram per address.

Method: a random-init Llama built from transformers' own config class (``LlamaConfig``, the test tokenizer of
``repgeom_eval.testing.make_tokenizer``), width D = 2048 by default and 2 blocks (3 hidden states, ``--layers all``), over N = D + 256 short texts (N > D,
so every Gram is folded into its D×D form), 16 texts a batch: wide enough that the states stand well above the
noise of the forward pass's own memory. Each case runs in a fresh subprocess that imports everything first and
loads the model, touches every weight (pages of a mapped weight file count in the resident memory once read, which
would otherwise happen during the measured run), returns the memory loading freed to the system (``malloc_trim``), resets the process's peak RSS (``/proc/self/clear_refs``), and reports how far the peak
(``VmHWM``) rose above the resident memory during ``measure`` (one glibc arena, so that memory freed is memory
reused). The state part of a case is that rise minus the rise of ``dispersion`` alone (whose
states are a few D-vectors), set against the estimate's difference for the same N (``estimate().for_texts(N)``).
The estimate counts (D+1)·D per address for the packed Grams (the rows held before the first fold are no more),
and once for the run the largest temporary of one address (the fold's rows beside the sum, compute's arrays:
``compute_temporaries``, e.g. dataset_entropy's vectors gathered in text order with a Gram and eigvalsh's copy).
Printed per case: the measured peak over one D×D float64 Gram per address.

The run's rise above the baseline cannot show a temporary smaller than the memory the run freed before it (the
forward passes' scratch is reused), so the measured state part lies between the states alone and the estimate with
its temporary. Each case's compute temporaries are therefore also measured apart, in another fresh process: its
metrics at one address, fed N random vectors of width D, the rise of the peak while they compute, against the
estimate's ``transient_for(N)``.

    .venv/bin/python benchmarks/bench_state_memory.py              # about 6 minutes on 2 cores
    .venv/bin/python benchmarks/bench_state_memory.py --write      # also benchmarks/results/bench_state_memory.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {
    "dispersion (baseline)": ["dispersion"],
    "one Gram: vendi": ["dispersion", "vendi"],
    "three Gram metrics, shared (vendi, effective_rank, dataset_entropy centering=none)":
        ["dispersion", "vendi", "effective_rank", "dataset_entropy"],
    "three Gram metrics, defaults (dataset_entropy keeps the centred vectors)":
        ["dispersion", "vendi", "effective_rank", "dataset_entropy"],
}
# vendi pools the last token by default, dataset_entropy the mean: at one pooling they read one unit Gram
PARAMS = {"one Gram: vendi": {"vendi": {"pooling": "mean"}},
          "three Gram metrics, shared (vendi, effective_rank, dataset_entropy centering=none)":
          {"dataset_entropy": {"centering": "none"}, "vendi": {"pooling": "mean"}},
          "three Gram metrics, defaults (dataset_entropy keeps the centred vectors)": {"vendi": {"pooling": "mean"}}}


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def texts(n: int) -> list[str]:
    from pydoc_data.topics import topics

    words = " ".join(topics.values()).split()
    return [" ".join(words[(i * 7) % (len(words) - 12):][: 4 + i % 8]) for i in range(n)]


def child(model: str, case: str, n: int, batch: int) -> None:
    import torch
    import transformers  # noqa: F401  - imported first: the baseline holds them

    from repgeom_eval.spec.options.measure import RunConfig
    from repgeom_eval.measurement.engine import measure
    from repgeom_eval.measurement.estimate import estimate

    torch.set_num_threads(2)
    from repgeom_eval.modeling.loading import load_model

    config = RunConfig(layers="all", metrics=CASES[case], metric_params=PARAMS.get(case, {}), batch_size=batch,
                       progress=False)
    est = estimate(model, config)
    data = texts(n)
    loaded = load_model(model)
    with torch.inference_mode():  # weights read from a mapped file are resident only once touched: touch them now,
        for tensor in [*loaded.model.parameters(), *loaded.model.buffers()]:  # not during the measured run
            tensor.sum()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what loading freed goes back to the system: a base that is the model
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM: the peak below is the run's, not the load's
    base = _kib("VmRSS")
    t0 = time.perf_counter()
    result = measure(loaded, data, config)
    print(json.dumps({"base_kib": base, "peak_kib": _kib("VmHWM"), "seconds": time.perf_counter() - t0,
                      "estimate_bytes": est.for_texts(n), "estimate_temporary_bytes": est.transient_for(n),
                      "state_bytes_at_end": result.timings["state_bytes"], "addresses": len(result.results)}))


def temporary_child(case: str, n: int, width: int, batch: int) -> None:
    """The case's metrics at one address, fed ``n`` random vectors of ``width``: how far the peak rises while they
    compute (their temporaries, for one address at a time), against the estimate's ``transient_for(n)``."""
    import torch

    from repgeom_eval.measurement.bank import MetricBank
    from repgeom_eval.modeling.addresses import Address

    torch.set_num_threads(2)
    addr = Address("final")
    bank = MetricBank(CASES[case], [addr], params=PARAMS.get(case, {}), pooling="mean")
    gen = torch.Generator().manual_seed(0)
    for start in range(0, n, batch):
        rows = min(batch, n - start)
        bank.update(addr, torch.randn(rows, 1, width, generator=gen), torch.ones(rows, 1, dtype=torch.bool),
                    list(range(start, start + rows)))
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    base = _kib("VmRSS")
    bank.compute()
    print(json.dumps({"compute_rise_bytes": (_kib("VmHWM") - base) * 1024}))


def build(path: Path, width: int, blocks: int, positions: int = 128, dtype: str = "float32") -> str:
    """A random-init Llama (transformers' own config class) and the test tokenizer, saved to ``path``; the
    tokenizer's limit follows ``positions`` (the test tokenizer's own 128 would cap a longer run's context)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from repgeom_eval.testing import make_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.model_max_length = positions
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=blocks,
                         num_attention_heads=8, num_key_value_heads=8, vocab_size=len(tokenizer) + 16,
                         max_position_embeddings=positions, torch_dtype=dtype)
    LlamaForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--write", action="store_true")
    p.add_argument("--child", nargs=3, metavar=("MODEL", "CASE", "N"), help=argparse.SUPPRESS)
    p.add_argument("--temporary-child", nargs=2, metavar=("CASE", "N"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]), args.batch)
        return 0
    if args.temporary_child:
        temporary_child(args.temporary_child[0], int(args.temporary_child[1]), args.width, args.batch)
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    n = args.width + 256  # more texts than the width: every Gram is folded
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp) / "m", args.width, args.blocks)
        env = {**os.environ, "MALLOC_ARENA_MAX": "1"}  # glibc: one arena, so freed memory is reused, not kept
        # a first, discarded run: the load check of a new model runs forward passes once and caches its result, so
        # without it the first case alone would load differently (and start from a higher resident memory)
        for case in ["(warm-up, discarded)", *CASES]:
            out = subprocess.run([sys.executable, __file__, "--batch", str(args.batch), "--child", model,
                                  case if case in CASES else next(iter(CASES)), str(n if case in CASES else 32)],
                                 capture_output=True, text=True, check=True, env=env)
            if case in CASES:
                rows[case] = json.loads(out.stdout.strip().splitlines()[-1])
                tmp_out = subprocess.run([sys.executable, __file__, "--width", str(args.width), "--batch",
                                          str(args.batch), "--temporary-child", case, str(n)],
                                         capture_output=True, text=True, check=True, env=env)
                rows[case].update(json.loads(tmp_out.stdout.strip().splitlines()[-1]))
                print(case, rows[case], flush=True)
    base = rows["dispersion (baseline)"]
    table = {}
    for case, row in rows.items():
        if row is base:
            continue
        measured = ((row["peak_kib"] - row["base_kib"]) - (base["peak_kib"] - base["base_kib"])) * 1024
        estimated = row["estimate_bytes"] - base["estimate_bytes"]
        states_only = estimated - (row["estimate_temporary_bytes"] - base["estimate_temporary_bytes"])
        temporary = row["compute_rise_bytes"] - base["compute_rise_bytes"]
        temporary_est = row["estimate_temporary_bytes"] - base["estimate_temporary_bytes"]
        table[case] = {"state_peak_bytes_measured": measured, "state_bytes_estimated": estimated,
                       "measured_over_estimate": round(measured / estimated, 3),
                       "within_25_percent": abs(measured / estimated - 1) <= 0.25,
                       "states_alone_estimated": states_only,
                       "measured_over_states_alone": round(measured / states_only, 3),
                       "between_states_alone_and_estimate": states_only * 0.95 <= measured <= estimated * 1.05,
                       "compute_temporary_measured": temporary, "compute_temporary_estimated": temporary_est,
                       "temporary_measured_over_estimate": round(temporary / temporary_est, 3) if temporary_est
                       else None,
                       "state_bytes_at_end": row["state_bytes_at_end"] - base["state_bytes_at_end"],
                       "peak_over_one_gram_per_address": round(measured / (8 * args.width ** 2 * row["addresses"]),
                                                               3)}
        print(f"{case}: peak {measured / 2**20:.1f} MiB, estimate {estimated / 2**20:.1f} MiB "
              f"(states alone {states_only / 2**20:.1f} MiB), ratio {measured / estimated:.2f}; compute's temporary "
              f"{temporary / 2**20:.1f} MiB, estimate {temporary_est / 2**20:.1f} MiB; "
              f"{table[case]['peak_over_one_gram_per_address']:.2f} × one D×D Gram per address", flush=True)
    one, three = (table.get(k, {}).get("state_peak_bytes_measured") for k in list(CASES)[1:3])
    shared_over_one = round(three / one, 3) if one and three else None
    print(f"three Gram metrics (shared) over one: {shared_over_one}")
    doc = {"benchmark": "bench_state_memory", "machine": {"platform": platform.platform(), "python":
           platform.python_version()}, "width": args.width, "blocks": args.blocks, "addresses": base["addresses"],
           "n_texts": n, "batch": args.batch, "runs": rows, "state_part": table,
           "one_gram_bytes_per_address": 8 * args.width ** 2, "three_shared_over_one_gram_metric": shared_over_one,
           "method": "rise of peak RSS during measure (model loaded before, VmHWM reset), minus the rise with dispersion alone; fresh process per case"}
    if args.write:
        out = Path(__file__).resolve().parent / "results" / "bench_state_memory.json"
        out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
