"""The precision matrix of tests/test_precision_matrix.py on the two other surfaces: the MTEB sweep (what
``repgeom mteb run`` runs) and lm-eval's ``repgeom-hf``. Each realistic tiny model (norm gains, a massive dimension)
runs in float32, bfloat16 and float16; every layer a surface reports in half precision is the one it reports in
float32, under the same name, and its geometry is within docs/metrics.md's tolerance of float32's. (``repgeom-hf``
runs the causal types: lm-eval's HF backend does not run encoders.)"""

from __future__ import annotations

import warnings

import pytest

import lm_eval  # noqa: F401  (dev extra: missing must fail, not skip)
import mteb  # noqa: F401

from test_precision_matrix import DTYPES, LM_PAIRS, ORACLE, TOLERANCE, TYPES

CAUSAL = [t for t in TYPES if ORACLE[t][0] == "causal"]


@pytest.fixture(scope="module")
def sts_task():
    from repgeom_eval.mteb_layers import make_task
    from repgeom_eval.mteb_layers.examples import build_tasks, pydoc_documents

    spec = build_tasks(pydoc_documents(), "pydoc", size="small", seed=0)["PydocSTS"]
    return lambda: make_task({"name": "PydocSTS", **spec})  # a fresh instance per run


@pytest.mark.parametrize("model_type", TYPES)
def test_mteb_sweep_in_every_precision(realistic, sts_task, model_type):
    from repgeom_eval.mteb_layers import run_layers

    rows = {}
    for dtype in DTYPES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = run_layers(realistic(model_type), [sts_task()], "all", pooling="mean", output_folder=None,
                                progress=False, metrics=["dispersion"], dtype=dtype, batch_size=8)
        rows[dtype] = {row["layer"]: row["repgeom.dispersion"] for row in result.rows}
    assert len(rows["float32"]) >= 3
    for dtype in DTYPES:
        assert list(rows[dtype]) == list(rows["float32"]), dtype
        for layer, value in rows[dtype].items():
            assert abs(value - rows["float32"][layer]) <= TOLERANCE[dtype], (dtype, layer, value)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    from repgeom_eval.testing import write_lm_eval_task

    return write_lm_eval_task(tmp_path_factory.mktemp("precision-task"), "rg_precision", LM_PAIRS)


@pytest.mark.parametrize("model_type", CAUSAL)
def test_repgeom_hf_in_every_precision(realistic, task_dir, model_type):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from repgeom_eval.lmeval.model import RepgeomHFLM

    values = {}
    for dtype in DTYPES:
        lm = RepgeomHFLM(pretrained=realistic(model_type), batch_size=3, device="cpu", dtype=dtype,
                         repgeom_metrics="dispersion", repgeom_layers="all", repgeom_pooling="mean")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = simple_evaluate(model=lm, tasks=["rg_precision"], bootstrap_iters=0,
                                  task_manager=TaskManager(include_defaults=False, include_path=str(task_dir)))
        values[dtype] = {k: v for k, v in out["results"]["rg_precision"].items()
                         if k.startswith("repgeom:dispersion@") and isinstance(v, float)}
    assert len(values["float32"]) >= 3
    for dtype in DTYPES:
        assert list(values[dtype]) == list(values["float32"]), dtype
        for key, value in values[dtype].items():
            assert abs(value - values["float32"][key]) <= TOLERANCE[dtype], (dtype, key, value)
