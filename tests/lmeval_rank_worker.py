"""One rank of tests/test_lmeval_distributed.py, started by ``torchrun --nproc_per_node 2`` with
``ACCELERATE_USE_CPU=1`` (accelerate's multi-CPU state over gloo).

HFLM shards documents across ranks only in its multi-GPU branch; on CPU it keeps every rank at world size 1. So
each rank builds the HFLM as usual and is then given the launch's rank, world size and accelerator (exactly the
three attributes that branch sets), which sends lm-eval down its data-parallel path: documents sharded by rank,
padding requests, ``all_gather`` of request counts, ``gather_object`` of the samples and metric items to rank 0,
and repgeom's own ``all_gather_object`` of the unit-vector sums in ``apply_filters``.

    python lmeval_rank_worker.py MODEL_DIR MMLU_FILE WIKITEXT_FILE OUT_JSON [METADATA_JSON OUT2_JSON]

With the two optional arguments the ranks evaluate the tasks a second time, each with the extra ``--metadata`` that
METADATA_JSON gives for it (``{task: metadata}``; registered metrics, whose states are merged across ranks), and
rank 0 writes that run to OUT2_JSON.
"""

import json
import sys
import warnings

from accelerate import Accelerator
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

TASKS = ["repgeom_hardness_mmlu", "repgeom_ppl_wikitext"]


def load_task(name: str, data: str, **metadata):
    """The task built with its own data file (each task gets its own ``repgeom_data``)."""
    tm = TaskManager(include_defaults=False, metadata={"repgeom_data": data, "repgeom_slice_size": 6,
                                                       "repgeom_slice_seeds": 3, **metadata})
    return tm.load([name])["tasks"][name]


def evaluate(lm, mmlu: str, wikitext: str, out_path: str, metadata: dict | None = None) -> None:
    metadata = metadata or {}
    tasks = [load_task(TASKS[0], mmlu, **metadata.get(TASKS[0], {})),
             load_task(TASKS[1], wikitext, **metadata.get(TASKS[1], {}))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = simple_evaluate(model=lm, tasks=tasks, log_samples=True, bootstrap_iters=0)
    if lm.rank == 0:
        with open(out_path, "w", encoding="utf-8") as fh:
            json.dump({"results": {t: out["results"][t] for t in TASKS},
                       "samples": {t: out["samples"][t] for t in TASKS}}, fh, default=str)


def main() -> None:
    model_dir, mmlu, wikitext, out_path = sys.argv[1:5]
    lm = HFLM(pretrained=model_dir, batch_size=4, device="cpu")
    accelerator = Accelerator()
    assert accelerator.num_processes == 2, accelerator.state
    lm.accelerator, lm._rank, lm._world_size = accelerator, accelerator.process_index, accelerator.num_processes
    evaluate(lm, mmlu, wikitext, out_path)
    if len(sys.argv) > 6:
        evaluate(lm, mmlu, wikitext, sys.argv[6], json.loads(sys.argv[5]))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
