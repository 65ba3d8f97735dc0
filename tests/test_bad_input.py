"""Bad input, every command: a non-zero exit, one line naming the problem, no traceback, no output left behind.

Each command declares how to build a good invocation from a few *roles* (model, data, output, name, address);
each case replaces one role with something broken. A case runs only for the commands that have its role, so the
table below is the whole sweep: a new command adds one ``Command`` entry.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from repgeom_eval.entrypoints.cli import main

GOOD_TEXTS = [f"Sentence number {i} talks about {w} and a few other things." for i, w in
              enumerate(["rivers", "mountains", "numbers", "code", "music", "weather", "stones", "letters"])]


@dataclass
class Ctx:
    """Paths of a good model and good inputs, and the per-case values that replace one role."""

    tmp: Path
    model: str
    data: Path
    output: Path
    roles: dict[str, str] = field(default_factory=dict)

    def get(self, role: str, default: str) -> str:
        return self.roles.get(role, default)


@dataclass
class Command:
    name: str
    build: Callable[[Ctx], list[str]]
    roles: frozenset[str]  # the roles this command's invocation has (cases for other roles do not apply)


def _measure(c: Ctx) -> list[str]:
    return ["measure", "-m", c.get("model", c.model), "-d", c.get("data", str(c.data)),
            "--layers", c.get("address", "final"), "--metrics", c.get("name", "dispersion"),
            "-o", c.get("output", str(c.output))]


def _gap(c: Ctx) -> list[str]:
    return ["gap", "-m", c.get("model", c.model), "--domain", c.get("name", "digits"),
            "--reference", c.get("data", "general"), "-o", c.get("output", str(c.output))]


COMMANDS = [
    Command("measure", _measure, frozenset({"model", "data", "jsonl", "field", "output", "name", "address"})),
    Command("gap", _gap, frozenset({"model", "data", "output", "name"})),
]


def _write(tmp: Path, name: str, content: bytes) -> str:
    path = tmp / name
    path.write_bytes(content)
    return str(path)


# case id → (role, how to make the broken value from the test's tmp dir, regex the one-line message must match)
CASES: dict[str, tuple[str, Callable[[Path], str], str]] = {
    "empty file": ("data", lambda t: _write(t, "empty.txt", b""), r"empty\.txt.*(empty|no text|no word)"),
    "blank lines only": ("data", lambda t: _write(t, "blank.txt", b"\n  \n\t\n"), r"blank\.txt"),
    "wrong JSON": ("jsonl", lambda t: _write(t, "bad.jsonl", b'{"text": "fine"}\n{"text": oops\n'),
                   r"bad\.jsonl(:| line )2.*JSON"),
    "wrong field": ("field", lambda t: _write(t, "field.jsonl", b'{"body": "a text"}\n{"body": "another"}\n'),
                    r"field\.jsonl.*'text'"),
    "non-UTF-8 bytes": ("data", lambda t: _write(t, "latin.txt", "caf\u00e9 au lait\nna\u00efve\n".encode("latin-1")),
                        r"latin\.txt.*UTF-8"),
    "directory for a file": ("data", lambda t: str(t), r"director"),
    "missing model": ("model", lambda t: str(t / "no-such-model"), r"no-such-model"),
    "unknown address": ("address", lambda t: "resid_psot:0", r"resid_psot.*did you mean 'resid_post'"),
    "unknown name": ("name", lambda t: "dispersoin_xyz", r"unknown .*'dispersoin_xyz'"),
    "unwritable output": ("output", lambda t: str(Path(_write(t, "a-file", b"x")) / "out.json"),
                          r"a-file/out\.json"),
}

SLOT = {"jsonl": "data", "field": "data"}  # roles that break the data file in a JSONL-specific way

SWEEP = [pytest.param(cmd, case, id=f"{cmd.name}: {case}") for cmd in COMMANDS for case, (role, _, _) in
         CASES.items() if role in cmd.roles]


@pytest.fixture(scope="module")
def good_inputs(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("good")
    data = tmp / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in GOOD_TEXTS), encoding="utf-8")
    return tiny_model_dir("gpt2"), data


def test_every_command_has_a_good_invocation(good_inputs, tmp_path, capsys):
    """The baseline the cases break: each invocation, unbroken, succeeds and writes its output."""
    model, data = good_inputs
    for cmd in COMMANDS:
        out = tmp_path / f"{cmd.name}.json"
        assert main(cmd.build(Ctx(tmp_path, model, data, out))) == 0, cmd.name
        assert out.exists(), cmd.name
    capsys.readouterr()


@pytest.mark.parametrize("cmd, case", SWEEP)
def test_bad_input_fails_cleanly(cmd: Command, case: str, good_inputs, tmp_path, capsys):
    model, data = good_inputs
    role, make, pattern = CASES[case]
    work = tmp_path / "work"
    work.mkdir()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    ctx = Ctx(work, model, data, out_dir / "result.json")
    ctx.roles = {SLOT.get(role, role): make(work)}
    rc = main(cmd.build(ctx))
    err = capsys.readouterr().err
    assert rc not in (0, None), f"{cmd.name} accepted {case}"
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("repgeom: error:")]
    assert len(errors) == 1, err  # one line, the CLI's error line
    assert re.search(pattern, errors[0]), f"message {errors[0]!r} does not match {pattern!r}"
    assert list(out_dir.iterdir()) == [], "a failed run left output behind"
