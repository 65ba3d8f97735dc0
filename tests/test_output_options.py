"""Every declared output option (``option(..., writes="file"|"folder")``) of every command with a good invocation,
pointed at three things it must never destroy (docs/reference/outputs.md#no-output-replaces-an-input):

* **a device**, through a link to ``/dev/null``: a file output is written through it, the link stays a link and the
  device stays a device; a folder output refuses it in one line;
* **the model folder**: refused in one line, and nothing appears in the folder;
* **an input** of the run (its data file): refused in one line, and the input is unchanged.

The options come from the declarations, so a new output option is covered the day it is declared.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import fields
from pathlib import Path

import pytest

from repgeom_eval.entrypoints.cli import build_parser, command_parser, main
from repgeom_eval.plugin_system.host import get_host
from test_bad_input import COMMANDS, Ctx, good_inputs  # noqa: F401  (good_inputs is a fixture)

# what an output option needs beside it to be written at all
COMPANIONS = {"--save-preprocess-stats": ["--preprocess", "center"]}
# the input file each command reads, under the good inputs (default: its --data file; gap reads a named reference)
INPUT = {"slices": "queries.jsonl", "mteb run": "tasks.yaml", "gap": None}


def declared_outputs(words: list[str]) -> list[tuple[str, str]]:
    parser = command_parser(build_parser(get_host()), words[0])
    for word in words[1:]:
        sub = next(a for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
        parser = sub.configure(word) if hasattr(sub, "configure") else sub.choices[word]
    cls = parser.get_default("_options_class")
    return [(max(f.metadata["flags"], key=len), f.metadata["writes"]) for f in fields(cls)
            if f.metadata.get("writes") and f.metadata.get("flags")]


CASES = [pytest.param(cmd, flag, writes, target, id=f"{cmd.name} {flag} -> {target}")
         for cmd in COMMANDS if cmd.name != "train"  # train's output_dir lives in its YAML: tests/test_train_cmd.py
         for flag, writes in declared_outputs(cmd.name.split())
         for target in ("device", "model folder", "input")
         if (target != "model folder" or "model" in cmd.roles) and (target != "input" or INPUT.get(cmd.name, 1))]


def one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("repgeom: warning:")]
    assert len(lines) == 1 and lines[0].startswith("repgeom: error:"), err
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.fault("refused")
@pytest.mark.parametrize("cmd, flag, writes, target", CASES)
def test_a_declared_output_never_destroys_what_it_is_pointed_at(cmd, flag, writes, target, good_inputs, tmp_path,
                                                                capsys):
    model, data, good = good_inputs
    out = tmp_path / "out" / "result.json"
    out.parent.mkdir()
    args = cmd.build(Ctx(tmp_path, model, data, out, good))
    if target == "device":
        value = tmp_path / ("null-dir" if writes == "folder" else "null.out")
        value.symlink_to(os.devnull)
    elif target == "model folder":
        value = Path(model) / ("sub" if writes == "folder" else "x.out")
    else:
        value = good / INPUT[cmd.name] if cmd.name in INPUT else data
    watched = Path(model), good
    before = [snapshot(Path(w)) for w in watched] + [data.read_bytes()]
    capsys.readouterr()
    rc = main([*args, *COMPANIONS.get(flag, []), flag, str(value)])
    err = capsys.readouterr().err
    assert [snapshot(Path(w)) for w in watched] + [data.read_bytes()] == before, "an input or the model changed"
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode), "the device was replaced"
    if target == "device" and writes == "file":
        assert rc == 0, err  # written through the link, as `>` would
        assert value.is_symlink() and os.readlink(value) == os.devnull
    else:
        assert rc == 2, (rc, err)
        one_line(err)


def test_every_command_that_writes_declares_its_outputs():
    declared = {cmd.name: declared_outputs(cmd.name.split()) for cmd in COMMANDS if cmd.name != "train"}
    assert all(declared.values()), {k: v for k, v in declared.items() if not v}
    n = sum(len(v) for v in declared.values())
    print(f"\n{n} declared output options over {len(declared)} commands, 3 targets each: {3 * n} cases")
    assert n >= 10
    json.dumps(declared)
