"""Benchmark: wall time of ``repgeom_hardness_mmlu`` vs lm-eval's stock MMLU tasks on the same documents and model.

Both sides send the model exactly the same requests (tests/test_lmeval_upstream.py checks it): the stock side is
lm-eval's own per-subject ``mmlu_<subject>`` YAMLs (read from the installed lm-eval) over the same local documents,
split by subject; the repgeom side is the one task over all subjects with every geometry metric (fused capture at
the final layer, c_i, AUROC, deciles, the controlled-slice Spearman with its default 100 x 10 slices, shrunk with a
warning when the pool is small). Each timed call is a whole ``simple_evaluate`` (requests, forward passes,
scoring, aggregation) on freshly built task objects; the two sides alternate, and the ratio of medians is printed,
plus the median of the per-round ratios (robust to load from other processes on a shared machine).

Target: ratio <= 1.1.

    .venv/bin/python benchmarks/bench_lmeval.py                # SmolLM2-135M, 300 questions: ~15 min on 2 idle cores
    .venv/bin/python benchmarks/bench_lmeval.py --tiny         # tiny random llama: seconds, checks the script runs
    .venv/bin/python benchmarks/bench_lmeval.py --n 600 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import datasets  # noqa: E402
import lm_eval  # noqa: E402
import torch  # noqa: E402
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.task import ConfigurableTask  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.tasks._yaml_loader import load_yaml  # noqa: E402

from repgeom_eval.spec.errors import RepgeomError  # noqa: E402
from repgeom_eval.lmeval.documents import load_local  # noqa: E402
from repgeom_eval.testing import MMLU_TEST_SUBJECTS, make_tiny_model, write_task_data  # noqa: E402

UPSTREAM_MMLU = Path(lm_eval.__file__).parent / "tasks" / "mmlu" / "default"
TASK = "repgeom_hardness_mmlu"


def load_lm(tiny: bool, tmpdir: str, batch_size: int) -> tuple[HFLM, str]:
    if not tiny:
        try:
            from repgeom_eval.testing.demo import smollm2_path
            from repgeom_eval.modeling.loading import load_model

            loaded = load_model(str(smollm2_path()), device="cpu")
            lm = HFLM(pretrained=loaded.model, tokenizer=loaded.tokenizer, batch_size=batch_size, device="cpu")
            return lm, "SmolLM2-135M-Instruct (GGUF, dequantized to float32)"
        except (RepgeomError, ImportError, OSError) as exc:
            print(f"SmolLM2 unavailable ({exc}); using a tiny random llama")
    path = make_tiny_model("llama", Path(tmpdir) / "tiny-llama", n_layers=4, width=64)
    return HFLM(pretrained=str(path), batch_size=batch_size, device="cpu"), "tiny random llama (4 x 64)"


def stock_tasks(folder: Path) -> dict[str, ConfigurableTask]:
    """lm-eval's own mmlu_<subject> tasks over the local documents of each subject."""
    full = load_local(folder, "mmlu")
    tasks = {}
    for subject in MMLU_TEST_SUBJECTS:
        split = {name: full[name].filter(lambda d: d["subject"] == subject) for name in ("test", "dev")}
        config = load_yaml(UPSTREAM_MMLU / f"mmlu_{subject}.yaml", resolve_func=True)
        config["custom_dataset"] = lambda _split=datasets.DatasetDict(split), **_: _split
        config.pop("tag", None)
        tasks[config["task"]] = ConfigurableTask(config=config)
    return tasks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=300, help="questions (default 300; ~100 tokens each)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per side (default 3)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--tiny", action="store_true", help="tiny random llama instead of SmolLM2-135M")
    args = p.parse_args()
    torch.set_num_threads(2)
    warnings.simplefilter("ignore")  # slice shrinking and lm-eval's notices: not what is measured

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "mmlu"
        write_task_data("mmlu", folder / "test.jsonl", n=args.n, seed=11)
        write_task_data("mmlu", folder / "dev.jsonl", n=15, seed=12)
        lm, model_name = load_lm(args.tiny, tmp, args.batch_size)
        manager = TaskManager(include_defaults=False, metadata={"repgeom_data": str(folder)})

        def run_stock(limit: int | None = None) -> dict:
            tasks = stock_tasks(folder)
            t0, c0 = time.perf_counter(), time.process_time()
            out = simple_evaluate(model=lm, tasks=list(tasks.values()), task_manager=manager, limit=limit)
            return {"s": time.perf_counter() - t0, "cpu": time.process_time() - c0,
                    "acc": sum(out["results"][t]["acc,none"] * out["n-samples"][t]["effective"] for t in tasks)
                    / args.n}

        def run_repgeom(limit: int | None = None) -> dict:
            task = manager.load([TASK])["tasks"][TASK]
            t0, c0 = time.perf_counter(), time.process_time()
            out = simple_evaluate(model=lm, tasks=[task], task_manager=manager, limit=limit)
            res = out["results"][TASK]
            return {"s": time.perf_counter() - t0, "cpu": time.process_time() - c0, "acc": res["acc,none"],
                    "dispersion": res["repgeom_dispersion,none"], "auroc": res["repgeom_auroc,none"],
                    "capture": out["configs"][TASK]["metadata"]["repgeom"]["capture"]}

        run_stock(limit=8)  # warm-up on a few documents: lazy imports (scipy, ...), allocator, caches
        run_repgeom(limit=8)
        stock, ours = [], []
        for _ in range(args.repeats):
            stock.append(run_stock())
            ours.append(run_repgeom())

    med_stock = statistics.median(r["s"] for r in stock)
    med_ours = statistics.median(r["s"] for r in ours)

    def times(rows: list[dict]) -> str:
        return ", ".join(f"{r['s']:.2f}" for r in rows)

    per_round = statistics.median(o["s"] / s["s"] for s, o in zip(stock, ours))
    print(f"model: {model_name}; {args.n} MMLU-format questions (4 choices, {len(MMLU_TEST_SUBJECTS)} subjects), "
          f"batch {args.batch_size}, {args.repeats} alternating rounds after a short warm-up each")
    print(f"stock mmlu_<subject> tasks : median {med_stock:7.2f} s   "
          f"({times(stock)})   acc {stock[-1]['acc']:.4f}")
    print(f"{TASK}      : median {med_ours:7.2f} s   ({times(ours)})   "
          f"acc {ours[-1]['acc']:.4f}   D {ours[-1]['dispersion']:.4f}   AUROC {ours[-1]['auroc']:.4f}   "
          f"capture {ours[-1]['capture']}")
    print(f"ratio of medians {med_ours / med_stock:.3f}x; median per-round ratio {per_round:.3f}x (target <= 1.1x)")
    cpu_stock = statistics.median(r["cpu"] for r in stock)
    cpu_ours = statistics.median(r["cpu"] for r in ours)
    print(f"process CPU time (all threads; less disturbed by other processes): stock {cpu_stock:.2f} s, "
          f"{TASK} {cpu_ours:.2f} s, ratio {cpu_ours / cpu_stock:.3f}x")
    print("load average (1, 5, 15 min): " + ", ".join(f"{x:.1f}" for x in os.getloadavg())
          + f" on {os.cpu_count()} CPUs: timings on a shared machine are noisy")
    print(json.dumps({"stock_s": med_stock, "repgeom_s": med_ours, "ratio": med_ours / med_stock,
                      "ratio_per_round": per_round, "cpu_ratio": cpu_ours / cpu_stock}))


if __name__ == "__main__":
    main()
