"""The public API: the names plugin authors and users import from ``repgeom_eval`` itself, pinned. No moved-name
layer: no release carried the earlier module paths (CHANGELOG.md, 0.2.0)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import repgeom_eval

PUBLIC = {
    "hookimpl", "Metric", "Statistic", "UnitSums", "PooledGram", "LayerBatch", "Consumes", "Command", "ArchitectureSpec",
    "HookPoint", "pre_ln_decoder",
    "post_ln_encoder", "AuxLoss", "build_aux_loss",
    "RepgeomError", "ParameterError", "PluginError", "UnknownNameError", "check_param", "is_real", "is_count",
    "measure", "MeasureResult", "RunConfig", "load_model", "LoadedModel", "ModelInfo", "ModelOptions", "get_host",
    "PluginHost", "load_results",
    "check_metric", "make_tiny_model", "save_tiny",
    "__version__",
}


def test_the_public_names_are_pinned():
    assert set(repgeom_eval.__all__) == PUBLIC, "a public name was added or removed: update PUBLIC and the docs"
    for name in PUBLIC:
        assert getattr(repgeom_eval, name) is not None, name


def test_what_a_plugin_imports_first_is_light():
    code = ("import sys, repgeom_eval\n"
            "from repgeom_eval import hookimpl, Metric, LayerBatch, Consumes, ParameterError, check_param, UnitSums\n"
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("old", ["repgeom_eval.auxloss", "repgeom_eval.models", "repgeom_eval.capture",
                                 "repgeom_eval.moved"])
def test_earlier_module_paths_are_gone_and_nothing_hooks_imports(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
    assert not [f for f in sys.meta_path if type(f).__module__.startswith("repgeom_eval")]


def test_names_moved_to_the_package_root_are_the_same_objects():
    from repgeom_eval.spec.options.model import ModelOptions
    from repgeom_eval.training.auxloss import AuxLoss

    assert repgeom_eval.AuxLoss is AuxLoss and repgeom_eval.ModelOptions is ModelOptions
