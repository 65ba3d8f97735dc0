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


# Registered metrics (docs/lmeval.md#any-registered-metric) of the second run: a sum state with per-text c_i, a
# "cat" state (dataset_entropy keeps every pooled vector), a token metric, and on MMLU a VIEWS metric (each rank
# runs the views of its own documents; augmenting long documents would only make the test slower).
_LAYERS = ["resid_post:0", "final"]
REGISTERED = {
    MMLU: {"repgeom_metrics": ["dispersion", "dataset_entropy", "token_dispersion", "infonce"],
           "repgeom_layers": _LAYERS},
    WIKI: {"repgeom_metrics": ["dispersion", "dataset_entropy", "token_dispersion"], "repgeom_layers": _LAYERS},
}


def one_process(model_dir, mmlu, wikitext, metadata=None):
    metadata = metadata or {}
    lm = HFLM(pretrained=model_dir, batch_size=4, device="cpu")
    tasks = [load_task(MMLU, str(mmlu), **metadata.get(MMLU, {})),
             load_task(WIKI, str(wikitext), **metadata.get(WIKI, {}))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return simple_evaluate(model=lm, tasks=tasks, log_samples=True, bootstrap_iters=0)


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory):
    """One torchrun launch, two evaluations: the tasks as they are, then with REGISTERED metrics."""
    tmp_path = tmp_path_factory.mktemp("lmeval-ranks")
    model_dir = tiny_model_dir("llama")
    mmlu = write_task_data("mmlu", tmp_path / "mmlu.jsonl", n=25, seed=7)  # odd: ranks get 13 and 12 documents
    wikitext = write_task_data("wikitext", tmp_path / "wiki.jsonl", n=7, seed=8)
    out, out_registered = tmp_path / "rank0.json", tmp_path / "rank0-registered.json"
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(HERE / "lmeval_rank_worker.py"), model_dir, str(mmlu), str(wikitext), str(out),
           json.dumps(REGISTERED), str(out_registered)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1")
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {"model_dir": model_dir, "mmlu": mmlu, "wikitext": wikitext, "plain": json.loads(out.read_text()),
            "registered": json.loads(out_registered.read_text())}


def test_two_ranks_equal_one_process(two_ranks):
    model_dir, mmlu, wikitext = two_ranks["model_dir"], two_ranks["mmlu"], two_ranks["wikitext"]
    two = two_ranks["plain"]
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


def test_two_ranks_registered_metrics_equal_one_process(two_ranks):
    """The metric states of both ranks are merged before anything is computed: every registered value and every
    per-text score of rank 0 equals a one-process run."""
    two = two_ranks["registered"]
    one = one_process(two_ranks["model_dir"], two_ranks["mmlu"], two_ranks["wikitext"], REGISTERED)
    for task, n in ((MMLU, 25), (WIKI, 7)):
        names = sorted(k for k in one["results"][task] if k.startswith("repgeom:") and "_stderr," not in k)
        assert len(names) >= 2 * len(REGISTERED[task]["repgeom_metrics"]), names
        assert sorted(k for k in two["results"][task] if k.startswith("repgeom:") and "_stderr," not in k) == names
        for name in names:
            assert two["results"][task][name] == pytest.approx(one["results"][task][name], rel=1e-5, abs=1e-6), \
                (task, name)
        per_text = {s["doc_id"]: s["repgeom:dispersion@final"] for s in two["samples"][task]}
        assert sorted(per_text) == list(range(n))
        for sample in one["samples"][task]:
            assert per_text[sample["doc_id"]] == pytest.approx(sample["repgeom:dispersion@final"], rel=1e-5, abs=1e-6)
        # the task's own geometry is unchanged by the registered metrics
        for name in ("repgeom_dispersion,none", "repgeom_token_dispersion,none"):
            if name in two_ranks["plain"]["results"][task]:
                assert two["results"][task][name] == pytest.approx(two_ranks["plain"]["results"][task][name],
                                                                   rel=1e-5, abs=1e-6)
