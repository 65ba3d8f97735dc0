"""One declaration per option (docs/configuration.md): flags, help, ``--config FILE`` (YAML, flags win), the Python
API, checks and the ``config`` block all come from the configuration's fields (repgeom_eval/spec/option_fields.py)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import pytest

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.spec.option_fields import Options, option, option_like, positive
from repgeom_eval.modeling.option_groups import LayersGroup, ModelGroup, RunGroup


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
