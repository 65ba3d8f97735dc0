"""A third-party plugin, installed for real: examples/repgeom-example-metric through pip and its entry point.

Nothing here registers the example by hand: pip writes the package's metadata (with its ``repgeom_eval`` entry point)
into a target directory, and repgeom-eval has to find it there by itself, in a fresh interpreter.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "repgeom-example-metric"
MODULE = "repgeom_example_metric"
DISTRIBUTION = "repgeom-example-metric"


@pytest.fixture(scope="module")
def site(example_plugin_site) -> Path:
    return example_plugin_site


def _env(site: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]),
                "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"})
    env.pop("REPGEOM_STRICT_PLUGINS", None)
    return env


def _texts() -> list[str]:
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics)[3:15]:
        words = topics[key].split()
        out.append(" ".join(words[: 3 + (len(out) * 2) % 10]))  # 3-12 words, under the 128-token context
    return out


def _mean_last_token_norm(model_dir: str, texts: list[str]) -> float:
    """By hand: final-layer hidden state (hidden_states[-1]) of each text's last non-pad token, mean L2 norm."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    tokenizer.padding_side = "right"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc, output_hidden_states=True).hidden_states[-1]  # [B, T, D], after the final norm
    last = enc["attention_mask"].sum(1) - 1
    assert bool((last < enc["attention_mask"].shape[1] - 1).any()), "the texts should need padding"
    vectors = hidden[torch.arange(len(texts)), last]
    return float(vectors.norm(dim=-1).mean())


@pytest.fixture(scope="module")
def cli_runs(site, tiny_model_dir, tmp_path_factory):
    """``repgeom plugins --json`` and ``repgeom measure ... --metrics mean_norm`` in fresh interpreters (concurrently,
    since each spends seconds importing torch)."""
    work = tmp_path_factory.mktemp("external-plugin")
    model = tiny_model_dir("gpt2")
    texts = _texts()
    with open(work / "texts.jsonl", "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    commands = {
        "plugins": ["plugins", "--json"],
        "measure": ["measure", "--model", model, "--data", "texts.jsonl", "--metrics", "mean_norm", "dispersion",
                    "--dtype", "float64", "--batch-size", "5", "--output", "out.json"],
    }
    procs = {name: subprocess.Popen([sys.executable, "-m", "repgeom_eval", *args], cwd=work, env=_env(site),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, args in commands.items()}
    try:
        done = {"work": work, "texts": texts, "expected": _mean_last_token_norm(model, texts)}  # meanwhile, by hand
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"repgeom {' '.join(commands[name])} failed:\n{stdout}\n{stderr}"
            done[name] = stdout
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return done


def test_listed_through_the_entry_point(cli_runs):
    rows = json.loads(cli_runs["plugins"])
    mine = [r for r in rows if r["name"] == "mean_norm"]
    assert mine == [{"name": "mean_norm", "kind": "metric", "plugin": "example", "distribution": DISTRIBUTION,
                     "version": "0.1.0", "description": "Mean L2 norm of the pooled vectors, one per text."}]
    assert not [r for r in rows if r["kind"] == "plugin"], f"plugins failed to load: {rows}"
    # The built-ins are still there, next to the third-party metric.
    assert {"dispersion", "token_dispersion"} <= {r["name"] for r in rows if r["kind"] == "metric"}


def test_measure_uses_the_installed_metric(cli_runs):
    result = json.loads((cli_runs["work"] / "out.json").read_text(encoding="utf-8"))
    final = result["results"]["final"]
    value = final["mean_norm"]
    assert isinstance(value, float) and math.isfinite(value) and value > 0
    assert 0 <= final["dispersion"] <= 2
    assert result["config"]["metrics"]["mean_norm"] == {"pooling": "last"}  # recorded, though it has no params
    assert result["config"]["plugins"] == {  # where each number comes from
        "mean_norm": {"plugin": "example", "distribution": DISTRIBUTION, "version": "0.1.0"},
        "dispersion": {"plugin": "dispersion", "distribution": "repgeom-eval", "version": result["config"]["versions"]
                       ["repgeom_eval"]}}
    assert result["data"]["n_texts"] == len(cli_runs["texts"])
    expected = cli_runs["expected"]
    assert abs(value - expected) <= 1e-9 * max(1.0, abs(expected)), (value, expected)


def test_installed_module_conforms(site, monkeypatch):
    from repgeom_eval.plugin_system.host import PluginHost
    from repgeom_eval.testing import check_metric

    monkeypatch.syspath_prepend(str(site))
    sys.modules.pop(MODULE, None)
    try:
        module = importlib.import_module(MODULE)
        assert Path(module.__file__).resolve().parent == site.resolve(), "imported from the wrong place"
        check_metric(module.MeanNorm)

        # The same entry point, seen in this process: its distribution, and a fresh host registering it.
        (ep,) = [ep for ep in md.entry_points(group="repgeom_eval") if ep.value == MODULE]
        assert ep.name == "example" and ep.dist.name == DISTRIBUTION
        host = PluginHost(strict=True)
        entry = host.metrics.entry("mean_norm")
        assert (entry.plugin, entry.distribution) == ("example", DISTRIBUTION)
        assert host.metrics.get("mean_norm") is module.MeanNorm
    finally:
        sys.modules.pop(MODULE, None)
