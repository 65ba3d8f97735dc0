"""One declaration per option (docs/configuration.md): flags, help, ``--config FILE`` (YAML, flags win), the Python
API, checks and the ``config`` block all come from the configuration's fields (repgeom_eval/spec/option_fields.py)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import pytest

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.spec.option_fields import Options, option, option_like, positive
from repgeom_eval.spec.options.groups import LayersGroup, ModelGroup, RunGroup


@dataclass(frozen=True, kw_only=True)
class Probe(ModelGroup, LayersGroup, RunGroup):
    size: int = option(3, "--size", type=int, check=positive, help="items (default: {default})")
    mode: str = option("a", "--mode", choices=["a", "b"], config=False, help="a or b")
    seed: int = option_like(RunGroup, "seed", 7)


def parse(argv: list[str]) -> Probe:
    parser = argparse.ArgumentParser(prog="probe")
    Probe.add_arguments(parser)
    return Probe.from_args(parser.parse_args(argv))


def test_flags_yaml_and_precedence(tmp_path):
    # --progress auto: bars on a terminal, plain lines elsewhere (repgeom_eval/output/progress.py)
    assert parse(["-m", "x"]) == Probe(model="x", layers=("all",), progress="auto")
    assert parse(["-m", "x", "--no-progress"]).progress == "never"
    assert parse(["-m", "x", "--progress", "always"]).progress == "always"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: from-file\nsize: 5\nbatch-size: 9\nlayers: [embed, final]\n")
    got = parse(["--config", str(cfg), "--size", "6"])
    assert (got.model, got.size, got.batch_size, got.layers, got.seed) == ("from-file", 6, 9, ("embed", "final"), 7)


def test_yaml_errors_name_the_key_and_the_fix(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: x\nbatch_sise: 3\n")
    with pytest.raises(RepgeomError, match=r"unknown option 'batch_sise'.*did you mean 'batch_size'\?"):
        parse(["--config", str(cfg)])
    cfg.write_text("- a list\n")
    with pytest.raises(RepgeomError, match="must hold a mapping"):
        parse(["--config", str(cfg)])
    with pytest.raises(RepgeomError, match="does not exist"):
        parse(["--config", str(tmp_path / "missing.yaml")])
    with pytest.raises(RepgeomError, match=r"--model is required: give it on the command line, or as model:"):
        parse([])


def test_checks_live_in_the_configuration():
    with pytest.raises(RepgeomError, match=r"--size: expected a positive integer, got 0"):
        Probe(model="x", size=0)
    with pytest.raises(RepgeomError, match=r"--mode: unknown value 'c' \(valid: a, b\)"):
        Probe(model="x", mode="c")  # the flag's choices, checked for the Python API and YAML files too
    with pytest.raises(RepgeomError, match="--batch-size: expected a positive integer"):
        Probe(model="x", batch_size=0)


def test_one_check_mechanism_serves_the_cli_the_train_yaml_and_lm_eval_settings():
    """Issue 34, item 4: every door declares a field's condition as its ``check`` (a function of the value, or a
    :class:`Must` with the condition in words) and raises through the same ``field_problem``: the same condition
    reads the same in every door, only the field's name is the door's own."""
    import dataclasses
    import pathlib

    from repgeom_eval.spec.options.lmeval import Settings
    from repgeom_eval.spec.option_fields import Must, field_problem, integer_at_least
    from repgeom_eval.spec.options.train import GeometryProbe
    from repgeom_eval.spec.options.settings import ConfigError, from_mapping

    for cls in (Probe, Settings, GeometryProbe):
        checked = [f for f in dataclasses.fields(cls) if f.metadata.get("check") is not None]
        assert checked, cls
        assert all("must" not in f.metadata for f in dataclasses.fields(cls))
    said = "must be a positive integer, got 0"
    assert integer_at_least(1)(0) == said
    with pytest.raises(RepgeomError, match=f"^repgeom_slice_size {said}$"):
        Settings._parse({"slice_size": 0}, "hardness")
    with pytest.raises(ConfigError, match=f"^batch_size {said}$"):
        from_mapping(GeometryProbe, {"texts": ["a b", "c d"], "batch_size": 0})
    batch = next(f for f in dataclasses.fields(GeometryProbe) if f.name == "batch_size")
    assert field_problem(batch, 0) == said
    # Must is declared once, on the torch-free floor
    root = pathlib.Path(__file__).resolve().parents[1]
    declared = [p for folder in ("repgeom_eval", "entrypoints", "plugins") for p in (root / folder).rglob("*.py")
                if "class Must" in p.read_text(encoding="utf-8")]
    assert [p.relative_to(root).as_posix() for p in declared] == ["repgeom_eval/spec/option_fields.py"]
    assert isinstance(integer_at_least(1), Must)


def test_every_analysis_takes_a_config_or_its_fields_as_keywords():
    """``takes_options``: one declaration of the analyses' calling convention (issue 34, item 6)."""
    import inspect

    from repgeom_eval.spec.options.analyses import KnnlmConfig, PerturbConfig
    from repgeom_eval.analyses.knnlm import knnlm
    from repgeom_eval.analyses.perturb import perturb
    from repgeom_eval.spec.option_fields import takes_options

    shown = inspect.signature(perturb)
    assert list(shown.parameters) == ["model", "data", "config", "model_options", "options"]
    assert str(shown).startswith("(model: 'str | LoadedModel', data: 'Any', config: 'PerturbConfig | None' = None, /, *,")
    assert list(inspect.signature(knnlm).parameters)[:4] == ["model", "datastore", "eval_data", "config"]
    assert "PerturbConfig`, or its fields as keywords" in perturb.__doc__
    assert KnnlmConfig.__name__ in knnlm.__doc__

    seen = []

    @takes_options(PerturbConfig)
    def probe(model, data, cfg, /, *, model_options=None):
        seen.append((model, data, cfg, model_options))
        return cfg

    assert probe("m", "d", n_prompts=3).n_prompts == 3
    whole = PerturbConfig(n_prompts=5)
    assert probe("m", "d", whole, model_options="o") is whole and seen[-1] == ("m", "d", whole, "o")
    with pytest.raises(RepgeomError, match="either as a PerturbConfig or as keywords, not both"):
        probe("m", "d", whole, n_prompts=3)
    with pytest.raises(RepgeomError, match="expected a positive integer, got 0"):
        probe("m", "d", n_prompts=0)  # checked before the function runs
    assert len(seen) == 2
    with pytest.raises(TypeError, match=r"probe\(\) takes 2 positional input\(s\)"):
        probe("m")


def test_config_block_and_build():
    probe = Probe(model="x", layers=["final"])
    block = probe.config_block({"dtype": "float32"})
    assert block["layer_request"] == ["final"] and block["dtype"] == "float32" and block["size"] == 3
    assert "mode" not in block and "model" not in block and "progress" not in block
    assert Probe.build(None, {"model": "y", "size": 4}).size == 4
    assert Probe.build(probe) is probe
    with pytest.raises(RepgeomError, match="either as a Probe or as keywords"):
        Probe.build(probe, {"size": 4})


def test_help_is_grouped_and_shows_defaults():
    parser = argparse.ArgumentParser(prog="probe")
    Probe.add_arguments(parser)
    text = parser.format_help()
    for heading in ("model options:", "layers:", "run:"):
        assert heading in text
    assert "items (default: 3)" in text and "--config FILE.yaml" in text


def test_every_command_takes_a_config_file(tmp_path, capsys):
    from repgeom_eval.entrypoints.cli import build_parser, command_parser, main
    from repgeom_eval.plugin_system.host import get_host

    host = get_host()
    parser = build_parser(host)
    for name in host.commands:
        if name in ("train", "lm-eval"):
            continue
        text = command_parser(parser, name).format_help()
        if name == "mteb":
            text = command_parser(parser, name)._subparsers._group_actions[0].choices["run"].format_help()
        assert "--config" in text, name
    cfg = tmp_path / "plugins.yaml"
    cfg.write_text("kind: metric\njson: true\n")
    assert main(["plugins", "--config", str(cfg)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and {r["kind"] for r in rows} == {"metric"}
    cfg.write_text("knid: metric\n")
    assert main(["plugins", "--config", str(cfg)]) == 2
    assert "unknown option 'knid' of repgeom plugins; did you mean 'kind'?" in capsys.readouterr().err
