"""Benchmark: the discovered path against the tabled path, on the same model.

SmolLM2-135M-Instruct (``llama`` type, which has a built-in table) is loaded twice: with the architectures plugin
(table on top of discovery) and with it switched off (discovery alone). The script checks that both resolve every
address to the same hook point, then reports:

* the load check itself (``discover`` on the loaded model: one recorded probe pass with every module hooked, plus the
  position, causality and padding checks: six forward passes of 7 tokens), median of 5, against the whole load;
* ``measure`` over the same texts at every hidden state (dispersion + token_dispersion), tabled and discovered runs
  interleaved, ``--repeats`` times: the median ratio of their wall times (target ≈ 1.00: the hooks are the same
  modules) and the largest difference between their numbers (target 0).

    .venv/bin/python benchmarks/bench_discovery.py            # SmolLM2-135M (about a minute on 2 cores)
    .venv/bin/python benchmarks/bench_discovery.py --tiny     # tiny random llama, seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

from repgeom_eval.testing.demo import python_doc_paragraphs, smollm2_path  # noqa: E402
from repgeom_eval.measurement.engine import measure  # noqa: E402
from repgeom_eval.modeling.addresses import available_addresses, resolve  # noqa: E402
from repgeom_eval.modeling.discovery import discover  # noqa: E402
from repgeom_eval.modeling.loading import load_model  # noqa: E402
from repgeom_eval.plugin_system.host import PluginHost  # noqa: E402
from repgeom_eval.testing import make_tiny_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--n-texts", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            path, label = str(make_tiny_model("llama", tmp, n_layers=4, width=64)), "tiny llama (4 blocks, d=64)"
        else:
            path, label = str(smollm2_path()), "SmolLM2-135M-Instruct (30 blocks, d=576)"
        tabled_host, bare_host = PluginHost(), PluginHost(disable=["architectures"])
        t0 = time.perf_counter()
        tabled = load_model(path, host=tabled_host)
        t_load_tabled = time.perf_counter() - t0
        t0 = time.perf_counter()
        found = load_model(path, host=bare_host)
        t_load_found = time.perf_counter() - t0
        assert tabled.layout.table and found.layout.table is None
        addrs = available_addresses(tabled)
        assert available_addresses(found) == addrs and resolve(addrs, found) == resolve(addrs, tabled), \
            "discovery and the table disagree"
        checks = []
        for _ in range(5):
            t0 = time.perf_counter()
            discover(found.model, cache=False)
            checks.append(time.perf_counter() - t0)
        texts = python_doc_paragraphs(args.n_texts)
        kw = dict(layers="all", metrics=["dispersion", "token_dispersion"], batch_size=8, max_length=args.max_length,
                  progress=False)
        times: dict[str, list[float]] = {"tabled": [], "discovered": []}
        results = {}
        for _ in range(args.repeats):
            for name, loaded in (("tabled", tabled), ("discovered", found)):
                t0 = time.perf_counter()
                results[name] = measure(loaded, texts, **kw).results
                times[name].append(time.perf_counter() - t0)
        diff = max(abs(results["tabled"][a][m] - results["discovered"][a][m])
                   for a in results["tabled"] for m in results["tabled"][a])
        ratios = [d / t for d, t in zip(times["discovered"], times["tabled"])]
    check = statistics.median(checks)
    print(f"model: {label}; {len(addrs)} addresses resolve to the same hook points with and without the table")
    print(f"load check (discover): {check:.3f} s median of 5 = {100 * check / t_load_found:.1f} % of the "
          f"discovered load ({t_load_found:.2f} s; tabled load {t_load_tabled:.2f} s, it runs the same check)")
    print(f"measure, {args.n_texts} texts at every hidden state: tabled {statistics.median(times['tabled']):.2f} s, "
          f"discovered {statistics.median(times['discovered']):.2f} s; discovered/tabled = "
          f"{statistics.median(ratios):.3f} (median of {args.repeats}); largest difference in the numbers {diff:.1e}")


if __name__ == "__main__":
    main()
