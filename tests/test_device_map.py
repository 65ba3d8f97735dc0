"""Models larger than one device (docs/how-to/large-models.md): with ``--device-map auto`` accelerate places the
blocks where they fit, here on the CPU with part of the weights offloaded to disk (parameters on the meta device,
loaded block by block). Each hook reads its block where it runs; the numbers equal the single-device run's."""

from __future__ import annotations

import json
import warnings

import pytest

import repgeom_eval as rg
from repgeom_eval.entrypoints.cli import main
from repgeom_eval.modeling.loading import load_model
from repgeom_eval.spec.options.model import ModelOptions

TEXTS = ["one short text", "and another one, longer than the first", "a third", "four is here, with a comma",
         "five"]
METRICS = ["dispersion", "token_dispersion", "vendi", "prompt_entropy"]


def offloaded(tmp_path) -> ModelOptions:
    # a CPU budget smaller than the weights: accelerate sends the rest of the blocks to disk
    return ModelOptions(device_map="auto", model_args={"max_memory": {"cpu": 30000},
                                                       "offload_folder": str(tmp_path / "offload")})


def flat(results):
    out = {}
    for addr, metrics in results.items():
        for name, value in metrics.items():
            for k, v in (value.items() if isinstance(value, dict) else [("", value)]):
                out[f"{addr}/{name}{'.' + k if k else ''}"] = v
    return out


def close(a, b, tol=1e-6):
    assert a.keys() == b.keys()
    worst = max(abs(a[k] - b[k]) for k in a)
    assert worst <= tol, worst


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_measure_with_disk_offload_equals_one_device(realistic, tmp_path, model_type):
    path = realistic(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = load_model(path, options=offloaded(tmp_path))
        assert "disk" in set(loaded.model.hf_device_map.values())  # really offloaded
        base = rg.measure(path, TEXTS, layers="all", metrics=METRICS, progress=False)
        split = rg.measure(loaded, TEXTS, layers="all", metrics=METRICS, progress=False)
    close(flat(base.results), flat(split.results))
    assert split.model["layers"]["hidden_states"] == base.model["layers"]["hidden_states"]


def test_measure_cli_with_disk_offload(realistic, tmp_path):
    path = realistic("llama")
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(TEXTS) + "\n")
    args = ["measure", "-m", path, "-d", str(data), "--layers", "all", "--metrics", "dispersion"]
    assert main(args + ["-o", str(tmp_path / "one.json")]) == 0
    assert main(args + ["-o", str(tmp_path / "split.json"), "--device-map", "auto", "--model-arg",
                        'max_memory={"cpu": 30000}', "--model-arg", f"offload_folder={tmp_path / 'off'}"]) == 0
    one = json.loads((tmp_path / "one.json").read_text())["results"]
    split = json.loads((tmp_path / "split.json").read_text())["results"]
    close(flat(one), flat(split))


def test_mteb_sweep_with_disk_offload_equals_one_device(realistic, tmp_path):
    from repgeom_eval.mteb_layers import make_task, run_layers
    from repgeom_eval.mteb_layers.examples import build_tasks, pydoc_documents

    spec = build_tasks(pydoc_documents(), "pydoc", size="small", seed=0)["PydocSTS"]
    rows = []
    for options in (ModelOptions(), offloaded(tmp_path)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = run_layers(realistic("llama"), [make_task({"name": "PydocSTS", **spec})], "all",
                                pooling="mean", output_folder=None, progress=False, metrics=["dispersion"],
                                batch_size=4, model_options=options)
        rows.append({(row["layer"], k): v for row in result.rows for k, v in row.items()
                     if isinstance(v, float) and k != "layer"})
    assert rows[0].keys() == rows[1].keys() and rows[0]
    close(rows[0], rows[1])
