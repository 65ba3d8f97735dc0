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

_TOPICS = ["rivers", "mountains", "numbers", "code", "music", "weather", "stones", "letters", "trees", "ships"]
GOOD_TEXTS = [f"Sentence number {i} talks about {_TOPICS[i % 10]} and then about {_TOPICS[(3 * i) % 10]} again."
              for i in range(40)]


@dataclass
class Ctx:
    """Paths of a good model and good inputs, and the per-case values that replace one role."""

    tmp: Path
    model: str
    data: Path
    output: Path
    good: Path  # folder of the other good inputs (slices' queries and vectors, the MTEB tasks file)
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


def _ppl_bins(c: Ctx) -> list[str]:
    return ["ppl-bins", "-m", c.get("model", c.model), "-d", c.get("data", str(c.data)), "--chunk-len", "8",
            "--group-size", "2", "--bins", "3", "--layers", c.get("address", "final"), "--no-progress",
            "-o", c.get("output", str(c.output))]


def _knn_keys(c: Ctx) -> list[str]:
    return ["knn-keys", "-m", c.get("model", c.model), "-d", c.get("data", str(c.data)), "--chunk-len", "8",
            "--n", "2", "4", "--seeds", "2", "--candidates", c.get("address", "resid_post:-1"), "mlp_in:-1",
            "--no-progress", "-o", c.get("output", str(c.output))]


def _knnlm(c: Ctx) -> list[str]:
    return ["knnlm", "-m", c.get("model", c.model), "--key", c.get("address", "resid_post:-1"),
            "--datastore", c.get("data", str(c.data)), "--eval", str(c.data), "--chunk-len", "8",
            "--neighbors", "4", "--lmbda", "0", "0.25", "--no-progress", "-o", c.get("output", str(c.output))]


def _slices(c: Ctx) -> list[str]:
    return ["slices", c.get("data", str(c.good / "queries.jsonl")), "--vectors", str(c.good / "vectors.npy"),
            "--size", "10", "--seeds", "2", "-o", c.get("output", str(c.output))]


def _mteb(c: Ctx) -> list[str]:
    return ["mteb", "run", "-m", c.get("model", c.model), "--layer", c.get("address", "final"),
            "--tasks-file", c.get("data", str(c.good / "tasks.yaml")), "-t", c.get("name", "TinySTS"),
            "--no-progress", "--no-summary", "--output-folder", c.get("output", str(c.output.with_suffix("")))]


def _train(c: Ctx) -> list[str]:
    config = {"model": c.get("model", c.model),
              "data": {"block_size": 8, "domains": {"text": c.get("data", str(c.data))}},
              "aux_losses": [{"name": c.get("name", "push_away"), "weight": 0.1,
                              "layers": c.get("address", "final")}],
              "training": {"max_steps": 1, "per_device_train_batch_size": 4, "use_cpu": True},
              "output_dir": c.get("output", str(c.output.with_suffix(""))), "save_model": False}
    path = c.tmp / "train.yaml"
    path.write_text(json.dumps(config), encoding="utf-8")  # JSON is YAML
    return ["train", "--config", str(path), "--no-progress"]


COMMANDS = [
    Command("measure", _measure, frozenset({"model", "data", "jsonl", "field", "output", "name", "address"})),
    Command("gap", _gap, frozenset({"model", "data", "output", "name"})),
    Command("ppl-bins", _ppl_bins, frozenset({"model", "data", "jsonl", "field", "output", "address"})),
    Command("knn-keys", _knn_keys, frozenset({"model", "data", "jsonl", "field", "output", "address"})),
    Command("knnlm", _knnlm, frozenset({"model", "data", "jsonl", "field", "output", "address"})),
    Command("slices", _slices, frozenset({"data", "jsonl", "field", "output"})),
    Command("mteb run", _mteb, frozenset({"model", "data", "output", "name", "address"})),
    Command("train", _train, frozenset({"model", "data", "jsonl", "field", "output", "name", "address"})),
]


def _write(tmp: Path, name: str, content: bytes) -> str:
    path = tmp / name
    path.write_bytes(content)
    return str(path)


# case id → (role, how to make the broken value from the test's tmp dir, regex the one-line message must match)
CASES: dict[str, tuple[str, Callable[[Path], str], str]] = {
    "empty file": ("data", lambda t: _write(t, "empty.txt", b""), r"empty\.txt.*(empty|no text|no word|no record|must hold)"),
    "blank lines only": ("data", lambda t: _write(t, "blank.txt", b"\n  \n\t\n"), r"blank\.txt"),
    "wrong JSON": ("jsonl", lambda t: _write(t, "bad.jsonl", b'{"text": "fine"}\n{"text": oops\n'),
                   r"bad\.jsonl(:| line )2.*JSON"),
    "wrong field": ("field", lambda t: _write(t, "field.jsonl", b'{"body": "a text"}\n' * 40),
                    r"field\.jsonl.*('text'|'correct'|field)"),
    "non-UTF-8 bytes": ("data", lambda t: _write(t, "latin.txt", "caf\u00e9 au lait\nna\u00efve\n".encode("latin-1")),
                        r"latin\.txt.*UTF-8"),
    "directory for a file": ("data", lambda t: str(t), r"director"),
    "missing model": ("model", lambda t: str(t / "no-such-model"), r"no-such-model"),
    "unknown address": ("address", lambda t: "resid_psot:0", r"resid_psot.*did you mean 'resid_post'"),
    "unknown name": ("name", lambda t: "dispersoin_xyz", r"'dispersoin_xyz'"),
    "unwritable output": ("output", lambda t: str(Path(_write(t, "a-file", b"x")) / "out.json"),
                          r"a-file/out\.json"),
}

SLOT = {"jsonl": "data", "field": "data"}  # roles that break the data file in a JSONL-specific way

SWEEP = [pytest.param(cmd, case, id=f"{cmd.name}: {case}") for cmd in COMMANDS for case, (role, _, _) in
         CASES.items() if role in cmd.roles]


@pytest.fixture(scope="module")
def good_inputs(tmp_path_factory, tiny_model_dir):
    import numpy as np

    tmp = tmp_path_factory.mktemp("good")
    data = tmp / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in GOOD_TEXTS), encoding="utf-8")
    rng = np.random.default_rng(0)  # slices: 40 queries with a correctness flag and a vector each
    (tmp / "queries.jsonl").write_text("".join(json.dumps({"id": i, "correct": i % 3 != 0, "ppl": 2.0 + i % 5}) + "\n"
                                               for i in range(40)))
    np.save(tmp / "vectors.npy", rng.normal(size=(40, 8)))
    pairs = [{"sentence1": GOOD_TEXTS[i], "sentence2": GOOD_TEXTS[(i + k) % 40], "score": float(5 - k)}
             for i in range(0, 40, 4) for k in (0, 2, 5)]
    (tmp / "sts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (tmp / "tasks.yaml").write_text("tasks:\n  - {name: TinySTS, type: STS, data: sts.jsonl}\n")
    return tiny_model_dir("gpt2"), data, tmp


def test_every_command_has_a_good_invocation(good_inputs, tmp_path, capsys):
    """The baseline the cases break: each invocation, unbroken, succeeds and writes its output."""
    model, data, good = good_inputs
    for cmd in COMMANDS:
        out = tmp_path / cmd.name.replace(" ", "-") / "result.json"
        out.parent.mkdir()
        assert main(cmd.build(Ctx(tmp_path, model, data, out, good))) == 0, (cmd.name, capsys.readouterr().err)
        assert list(out.parent.iterdir()), cmd.name
    capsys.readouterr()


@pytest.mark.parametrize("cmd, case", SWEEP)
def test_bad_input_fails_cleanly(cmd: Command, case: str, good_inputs, tmp_path, capsys):
    model, data, good = good_inputs
    role, make, pattern = CASES[case]
    work = tmp_path / "work"
    work.mkdir()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    ctx = Ctx(work, model, data, out_dir / "result.json", good)
    ctx.roles = {SLOT.get(role, role): make(work)}
    rc = main(cmd.build(ctx))
    err = capsys.readouterr().err
    assert rc not in (0, None), f"{cmd.name} accepted {case}"
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("repgeom: error:")]
    assert len(errors) == 1, err  # one line, the CLI's error line
    assert re.search(pattern, errors[0]), f"message {errors[0]!r} does not match {pattern!r}"
    assert list(out_dir.iterdir()) == [], "a failed run left output behind"
