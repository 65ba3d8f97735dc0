"""A checkpoint is measured as saved, or refused; a model's own code runs only on request (never a prompt)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from repgeom_eval.entrypoints.cli import main
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.modeling.loading import load_model
from repgeom_eval.spec.options.model import ModelOptions


def _variant(src: Path, dst: Path, tensors=None, config=None) -> Path:
    shutil.copytree(src, dst)
    if tensors is not None:
        t = tensors(load_file(dst / "model.safetensors"))
        save_file(t, dst / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        c = json.loads((dst / "config.json").read_text())
        config(c)
        (dst / "config.json").write_text(json.dumps(c))
    return dst


BROKEN = {
    "renamed keys": (lambda t: {k.replace("model.layers.", "model.blocks."): v for k, v in t.items()}, None,
                     "missing .*unexpected \\(model.blocks.0"),
    "missing block": (lambda t: {k: v for k, v in t.items() if not k.startswith("model.layers.1.")}, None,
                      "tensor\\(s\\) missing \\(model.layers.1."),
    "config claims more layers": (None, lambda c: c.update(num_hidden_layers=c["num_hidden_layers"] + 1),
                                  "missing \\(model.layers.2."),
    "wrong shape": (None, lambda c: c.update(intermediate_size=c["intermediate_size"] * 2), "of the wrong shape"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_checkpoint_that_does_not_fill_its_architecture_is_refused(tiny_model_dir, tmp_path, texts, case, capsys):
    tensors, config, match = BROKEN[case]
    bad = _variant(Path(tiny_model_dir("llama")), tmp_path / "bad", tensors, config)
    before = {p.name: p.read_bytes() for p in bad.iterdir() if p.is_file()}
    with pytest.raises(RepgeomError, match=match):
        load_model(str(bad))
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(texts[:4]) + "\n")
    out = tmp_path / "out.json"
    assert main(["measure", "-m", str(bad), "-d", str(data), "--no-progress", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--allow-random-init" in err[0] and not out.exists()
    assert {p.name: p.read_bytes() for p in bad.iterdir() if p.is_file()} == before  # the model folder untouched


def test_random_initialisation_only_on_request_and_recorded(tiny_model_dir, tmp_path, texts):
    tensors, config, _ = BROKEN["missing block"]
    bad = _variant(Path(tiny_model_dir("llama")), tmp_path / "bad", tensors, config)
    with pytest.warns(UserWarning, match="keep their random initialisation"):
        loaded = load_model(str(bad), options=ModelOptions(allow_random_init=True))
    assert "model.layers.1.mlp.up_proj.weight" in loaded.info.to_dict()["random_init_tensors"]
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(texts[:4]) + "\n")
    out = tmp_path / "out.json"
    assert main(["measure", "-m", str(bad), "-d", str(data), "--no-progress", "-o", str(out),
                 "--allow-random-init"]) == 0
    assert json.loads(out.read_text())["model"]["random_init_tensors"]
    good = load_model(tiny_model_dir("llama"))
    assert "random_init_tensors" not in good.info.to_dict()  # a sound checkpoint: nothing to say


def _custom_code_model(src: Path, dst: Path, marker: Path) -> Path:
    """A model folder whose config needs its own Python code; running that code writes ``marker``."""
    model = _variant(src, dst, config=lambda c: c.update(
        model_type="repgeom_custom", auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                                               "AutoModelForCausalLM": "configuration_custom.CustomModel"}))
    (model / "configuration_custom.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class CustomConfig(LlamaConfig):\n    model_type = 'repgeom_custom'\n"
        "class CustomModel(LlamaForCausalLM):\n    config_class = CustomConfig\n")
    return model


def test_remote_code_is_refused_without_the_flag_and_never_prompts(tiny_model_dir, tmp_path, texts):
    marker = tmp_path / "code-ran"
    model = _custom_code_model(Path(tiny_model_dir("llama")), tmp_path / "custom", marker)
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(texts[:4]) + "\n")
    # "y" on stdin answers transformers' interactive question if one were asked: it must not be
    proc = subprocess.run([sys.executable, "-m", "repgeom_eval", "measure", "-m", str(model), "-d", str(data),
                           "--no-progress"], input="y\ny\n", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "--trust-remote-code" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not marker.exists()


def test_remote_code_runs_with_the_flag(tiny_model_dir, tmp_path, texts):
    marker = tmp_path / "code-ran"
    model = _custom_code_model(Path(tiny_model_dir("llama")), tmp_path / "custom", marker)
    with pytest.raises(RepgeomError, match="--trust-remote-code"):
        load_model(str(model))
    assert not marker.exists()
    # with the flag the model's code runs, and its layers are found by reading its modules (no table needed)
    loaded = load_model(str(model), options=ModelOptions(trust_remote_code=True))
    assert marker.exists()
    assert loaded.info.model_type == "repgeom_custom" and loaded.layout.table is None
    assert loaded.layout.blocks == "model.layers" and loaded.layout.final.point.module_name == "model.norm"
    assert all(site.ok for block in loaded.layout.sites for site in block.values())
