"""With two data-parallel ranks (CPU processes, gloo) every rank scores its shard of the documents, and the
geometry is computed over the whole population: rank 0's table and per-query c_i equal a one-process run.

The ranks are started by ``torchrun`` with ``ACCELERATE_USE_CPU=1``, so that accelerate's ``Accelerator`` (which
HFLM uses for its gathers and barriers) sets up the same multi-process state as under ``accelerate launch``:
``accelerate launch --cpu --num_processes 2`` on one machine starts a single process (accelerate's multi-CPU route
needs MPI), and ``--multi_gpu`` needs GPUs. tests/lmeval_rank_worker.py explains why each rank is handed its rank
and world size (HFLM's data-parallel branch is GPU-only).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import lm_eval  # noqa: E402,F401  (dev extra: missing must fail, not skip)
import accelerate  # noqa: E402,F401  (dev extra: missing must fail, not skip)

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from repgeom_eval.testing import write_task_data  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from lmeval_rank_worker import load_task  # noqa: E402
MMLU, WIKI = "repgeom_hardness_mmlu", "repgeom_ppl_wikitext"
HARDNESS = ("acc", "repgeom_dispersion", "repgeom_dispersion_correct", "repgeom_dispersion_incorrect",
            "repgeom_auroc", "repgeom_acc_low_c", "repgeom_acc_high_c", "repgeom_slice_spearman")
PERPLEXITY = ("word_perplexity", "repgeom_token_dispersion", "repgeom_ppl_pearson", "repgeom_ppl_spearman")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_process(model_dir, mmlu, wikitext):
    lm = HFLM(pretrained=model_dir, batch_size=4, device="cpu")
    tasks = [load_task(MMLU, str(mmlu)), load_task(WIKI, str(wikitext))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return simple_evaluate(model=lm, tasks=tasks, log_samples=True, bootstrap_iters=0)


def test_two_ranks_equal_one_process(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    mmlu = write_task_data("mmlu", tmp_path / "mmlu.jsonl", n=25, seed=7)  # odd: ranks get 13 and 12 documents
    wikitext = write_task_data("wikitext", tmp_path / "wiki.jsonl", n=7, seed=8)
    out = tmp_path / "rank0.json"
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(HERE / "lmeval_rank_worker.py"), model_dir, str(mmlu), str(wikitext), str(out)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1")
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    two = json.loads(out.read_text())
    one = one_process(model_dir, mmlu, wikitext)

    for task, names, n in ((MMLU, HARDNESS, 25), (WIKI, PERPLEXITY, 7)):
        assert len(two["samples"][task]) == n  # every rank's documents reached rank 0, none twice
        for name in names:
            assert two["results"][task][f"{name},none"] == pytest.approx(one["results"][task][f"{name},none"],
                                                                         rel=1e-5, abs=1e-6), (task, name)
    # c_i are computed against all 25 queries, not against the rank's own shard
    c_two = {s["doc_id"]: s["repgeom_dispersion"] for s in two["samples"][MMLU]}
    c_one = {s["doc_id"]: s["repgeom_dispersion"] for s in one["samples"][MMLU]}
    assert sorted(c_two) == list(range(25))
    for doc_id, c in c_one.items():
        assert c_two[doc_id] == pytest.approx(c, rel=1e-5, abs=1e-6)
