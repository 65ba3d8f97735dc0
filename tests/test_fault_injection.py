"""Fault injection, side by side: the model, the data, the outputs and a resumed run, each broken on purpose.

Every case asserts the same four things (docs/reference/outputs.md#no-output-replaces-an-input):

* a non-zero exit;
* exactly one line on stderr (warnings aside), the CLI's error line, naming the culprit (a regex per case);
* every input byte-identical afterwards: the model folder, the data, the run directory, hashed before and after,
  and no file added to them;
* no partial output: the run's output folder is as empty afterwards as before (no temporary file either).

Runs in-process (``main``) on the 2-block tiny GPT-2 of tests/conftest.py; only the file-size limit needs a child
process (``resource.setrlimit`` would limit pytest itself).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from repgeom_eval.entrypoints.cli import main

TEXTS = [f"Line {i} of the corpus speaks of {w} and, later, of {v} in the same breath."
         for i, (w, v) in enumerate(zip(["rivers", "stones", "ships", "trees", "songs"] * 8,
                                        ["clouds", "roads", "birds", "coins", "lamps", "doors", "maps", "bells"] * 5))]


# -- the checks every case makes ------------------------------------------------------------------------------------

def snapshot(*paths: Path) -> dict[str, str]:
    """sha256 of every file under ``paths`` (files or folders), keyed by path: a changed, removed or added file
    changes the snapshot."""
    out = {}
    for root in paths:
        root = Path(root)
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for f in files:
            out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def error_line(err: str) -> str:
    """The one error line of a failed run (warnings aside): anything else on stderr fails the case."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("repgeom: warning:")]
    assert len(lines) == 1 and lines[0].startswith("repgeom: error:"), err
    return lines[0]


def run_refused(args: list[str], capsys, pattern: str, inputs: list[Path], out_dir: Path) -> str:
    before = snapshot(*inputs)
    already = sorted(p.name for p in out_dir.iterdir())
    capsys.readouterr()
    rc = main([str(a) for a in args])
    err = capsys.readouterr().err
    assert rc not in (0, None), f"accepted: {args}"
    line = error_line(err)
    assert re.search(pattern, line), f"{line!r} does not match {pattern!r}"
    assert snapshot(*inputs) == before, "an input file was changed"
    assert sorted(p.name for p in out_dir.iterdir()) == already, "a failed run left output behind"
    return line


# -- a good setup, copied per case ----------------------------------------------------------------------------------

@dataclass
class Setup:
    tmp: Path
    model: Path  # a private copy of the tiny model, free to break
    data: Path
    out: Path  # the output folder: must stay empty

    @property
    def result(self) -> Path:
        return self.out / "result.json"


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("fault-base")
    data = root / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS), encoding="utf-8")
    return Path(tiny_model_dir("gpt2")), data


@pytest.fixture
def setup(base, tmp_path) -> Setup:
    model, data = base
    shutil.copytree(model, tmp_path / "model")
    shutil.copy(data, tmp_path / "texts.jsonl")
    (tmp_path / "out").mkdir()
    return Setup(tmp_path, tmp_path / "model", tmp_path / "texts.jsonl", tmp_path / "out")


def _train_config(s: Setup, model: Path | str, data: Path | str, output_dir: Path | str) -> Path:
    config = {"model": str(model), "data": {"block_size": 8, "domains": {"text": str(data)}},
              "aux_losses": [{"name": "push_away", "weight": 0.1}],
              "training": {"max_steps": 1, "per_device_train_batch_size": 4, "use_cpu": True},
              "output_dir": str(output_dir), "save_model": False}
    path = s.tmp / "train.yaml"
    path.write_text(json.dumps(config), encoding="utf-8")  # JSON is YAML
    return path


# Each command as a function of (setup, model, data) → argv; the output always goes to setup.out.
COMMANDS: dict[str, Callable[[Setup, Path, Path], list]] = {
    "measure": lambda s, m, d: ["measure", "-m", m, "-d", d, "--layers", "final", "--no-progress", "-o", s.result],
    "ppl-bins": lambda s, m, d: ["ppl-bins", "-m", m, "-d", d, "--chunk-len", "8", "--group-size", "2", "--bins", "3",
                                 "--layers", "final", "--no-progress", "-o", s.result],
    "knn-keys": lambda s, m, d: ["knn-keys", "-m", m, "-d", d, "--chunk-len", "8", "--n", "2", "4", "--seeds", "2",
                                 "--no-progress", "-o", s.result],
    "knnlm": lambda s, m, d: ["knnlm", "-m", m, "--datastore", d, "--eval", d, "--chunk-len", "8", "--neighbors", "4",
                              "--no-progress", "-o", s.result],
    "condensation": lambda s, m, d: ["condensation", "-m", m, "-d", d, "--max-length", "16", "--no-progress",
                                     "-o", s.result],
    "clusters": lambda s, m, d: ["clusters", "-m", m, "-d", d, "--ngram", "2", "--min-count", "3", "--contexts", "3",
                                 "--context-len", "4", "--clusters", "5", "--no-progress", "-o", s.result],
    "perturb": lambda s, m, d: ["perturb", "-m", m, "-d", d, "--lengths", "4", "8", "--n-prompts", "4",
                                "--no-progress", "-o", s.result],
    "train": lambda s, m, d: ["train", "--config", _train_config(s, m, d, s.out / "run"), "--no-progress"],
    "gap": lambda s, m, d: ["gap", "-m", m, "--domain", "digits", "--reference", "general", "-o", s.result],
}


@pytest.mark.fault("clean")
def test_every_command_succeeds_on_the_good_setup(setup, capsys):
    """The baseline the cases break (one command per loader: measure's and the analyses' are the same)."""
    for name in ("measure", "ppl-bins", "gap"):
        out = setup.out / name
        out.mkdir()
        s = Setup(setup.tmp, setup.model, setup.data, out)
        assert main([str(a) for a in COMMANDS[name](s, setup.model, setup.data)]) == 0, capsys.readouterr().err
        assert (out / "result.json").is_file()


# == the model side ================================================================================================

def _weights(transform: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def apply(model: Path) -> None:
        f = model / "model.safetensors"
        f.write_bytes(transform(f.read_bytes()))
    return apply


def _config(change: Callable[[dict], None] | str) -> Callable[[Path], None]:
    def apply(model: Path) -> None:
        f = model / "config.json"
        if isinstance(change, str):
            f.write_text(change)
            return
        config = json.loads(f.read_text())
        change(config)
        f.write_text(json.dumps(config))
    return apply


def _no_special_tokens(model: Path) -> None:
    f = model / "tokenizer_config.json"
    config = json.loads(f.read_text())
    for key in ("pad_token", "eos_token", "unk_token", "bos_token"):
        config.pop(key, None)
    f.write_text(json.dumps(config))


def _no_tokenizer_files(model: Path) -> None:
    for f in model.iterdir():
        if f.name.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
            f.unlink()


def _rename_tensors(model: Path) -> None:
    from safetensors.torch import load_file, save_file

    f = model / "model.safetensors"
    save_file({k.replace(".h.", ".blocks."): v for k, v in load_file(f).items()}, f, metadata={"format": "pt"})


WEIGHTS = r"model\.safetensors"
MODEL_CASES: dict[str, tuple[Callable[[Path], None], str, tuple[str, ...]]] = {
    # case → (how to break the model folder, what the error line must say, commands)
    "truncated weights": (_weights(lambda b: b[: len(b) // 2]), WEIGHTS, ("measure", "ppl-bins", "knnlm", "train",
                                                                          "gap")),
    "garbage weights": (_weights(lambda b: bytes(range(256)) * (len(b) // 256)), WEIGHTS, ("measure", "train", "gap")),
    "empty weights": (_weights(lambda b: b""), WEIGHTS, ("measure", "condensation", "gap")),
    "config of the wrong type": (_config(lambda c: c.update(n_embd="32")), r"config\.json.*'n_embd' expected int",
                                 ("measure", "ppl-bins", "knn-keys", "train")),
    "config of a float depth": (_config(lambda c: c.update(n_layer=2.0)), r"config\.json.*'n_layer'",
                                ("measure", "clusters")),
    "config of the wrong shape": (_config(lambda c: c.update(n_inner=256)), r"of the wrong shape.*--allow-random-init",
                                  ("measure", "perturb")),
    "config not JSON": (_config("{not json"), r"config", ("measure", "train")),
    "renamed tensors": (_rename_tensors, r"missing .*unexpected", ("measure", "train")),
    "tokenizer without pad/eos/unk/bos": (_no_special_tokens, r"no pad, eos, unk or bos", ("measure", "ppl-bins",
                                                                                             "train")),
    "no tokenizer files": (_no_tokenizer_files, r"tokenizer is missing or unusable.*in its folder",
                           ("measure", "ppl-bins", "knnlm", "train")),
}


@pytest.mark.fault("refused")
@pytest.mark.parametrize("case, command", [pytest.param(case, cmd, id=f"{case} · {cmd}")
                                           for case, (_, _, cmds) in MODEL_CASES.items() for cmd in cmds])
def test_model_side(case, command, setup, capsys):
    breakage, pattern, _ = MODEL_CASES[case]
    breakage(setup.model)
    args = COMMANDS[command](setup, setup.model, setup.data)
    run_refused(args, capsys, pattern, [setup.model, setup.data], setup.out)


# == the data side =================================================================================================

DEEP = "[" * 100_000 + "]" * 100_000
DATA_CASES: dict[str, tuple[str, bytes, str]] = {
    # case → (file name, content, what the error line must say)
    "lone surrogate in the text": ("sur.jsonl", b'{"text": "a \\ud800 b"}\n' * 4, r"sur\.jsonl:1: .*surrogate"),
    "lone surrogate in another field": ("sur2.jsonl", b'{"text": "fine text"}\n{"text": "x", "id": "\\udfff"}\n' * 3,
                                        r"sur2\.jsonl:2: .*surrogate"),
    "deeply nested JSON": ("deep.jsonl", b'{"text": "a"}\n{"text": "b", "meta": ' + DEEP.encode() + b"}\n",
                           r"deep\.jsonl:2: .*nested too deeply"),
    "a CSV file": ("texts.csv", b"text\nfirst text\nsecond text\nthird text\n", r"texts\.csv.*'\.csv'.*\.jsonl"),
    "a gzip file": ("texts.txt.gz", b"\x1f\x8b\x08\x00" + bytes(40), r"texts\.txt\.gz.*gzip"),
    "no extension": ("corpus", b"first text\nsecond text\n", r"'[^']*corpus' has no extension"),
}
DATA_COMMANDS = ("measure", "ppl-bins", "knn-keys", "knnlm", "condensation", "clusters", "perturb", "train")


@pytest.mark.fault("refused")
@pytest.mark.parametrize("case, command", [pytest.param(case, cmd, id=f"{case} · {cmd}")
                                           for case in DATA_CASES for cmd in DATA_COMMANDS])
def test_data_side(case, command, setup, capsys):
    name, content, pattern = DATA_CASES[case]
    bad = setup.tmp / name
    bad.write_bytes(content)
    args = COMMANDS[command](setup, setup.model, bad)
    run_refused(args, capsys, pattern, [setup.model, bad], setup.out)


PARAM_CASES = {
    "boolean given a number": ("dispersion", "dispersion.per_text=3", r"'dispersion'.*per_text must be true or false"),
    "pooling given a number": ("dispersion", "dispersion.pooling=3", r"pooling must be one of .*got 3"),
    "integer given text": ("condensation", 'condensation.bins="many"', r"'condensation'.*bins must be an integer"),
    "number given text": ("prompt_entropy", 'prompt_entropy.alpha="x"', r"'prompt_entropy'.*alpha must be a number"),
    "text given a list": ("prompt_entropy", "prompt_entropy.variant=[1]", r"variant must be a string"),
}


@pytest.mark.fault("refused")
@pytest.mark.parametrize("case", sorted(PARAM_CASES))
def test_metric_parameter_of_the_wrong_type(case, setup, capsys):
    metric, param, pattern = PARAM_CASES[case]
    args = COMMANDS["measure"](setup, setup.model, setup.data) + ["--metrics", metric, "--metric-param", param]
    run_refused(args, capsys, pattern, [setup.model, setup.data], setup.out)


@pytest.mark.fault("refused")
@pytest.mark.parametrize("command", ["measure", "ppl-bins", "knnlm", "clusters", "perturb"])
def test_a_device_without_values_is_refused_before_the_model_loads(command, setup, capsys):
    args = COMMANDS[command](setup, setup.model, setup.data) + ["--device", "meta"]
    run_refused(args, capsys, r"--device: 'meta' holds tensor shapes but no values.*use cpu", [setup.model, setup.data],
                setup.out)


@pytest.mark.fault("clean")
@pytest.mark.parametrize("command, flag, value, recorded", [
    ("knnlm", "--neighbors", "100000", "k_used"), ("clusters", "--clusters", "100000", "n_clusters_used")])
def test_a_parameter_beyond_the_data_is_said_and_the_used_value_recorded(command, flag, value, recorded, setup,
                                                                          capsys):
    args = [str(a) for a in COMMANDS[command](setup, setup.model, setup.data)]
    at = args.index(flag)
    args[at + 1] = value
    with pytest.warns(UserWarning, match=f"{flag} {value}"):
        assert main(args) == 0
    out = json.loads(setup.result.read_text())
    assert out["config"][recorded] < int(value) and f"{flag} {value}" in " ".join(out["warnings"])


@pytest.mark.fault("refused")
def test_report_and_scores_with_absurdly_deep_json(setup, capsys):
    bad = setup.tmp / "deep.json"
    bad.write_text(DEEP)
    run_refused(["report", bad, "-o", setup.out / "report.html"], capsys, r"deep\.json .*nested too deeply",
                [bad], setup.out)
    run_refused(["gap", "-m", setup.model, setup.model.parent / "model2", "--scores", bad, "-o", setup.result],
                capsys, r"deep\.json.*nested too deeply", [bad, setup.model], setup.out)


# == the output side ===============================================================================================

def _link(kind: str) -> Callable[[Path, Path], Path]:
    def make(target: Path, where: Path) -> Path:
        link = where / f"{kind}-link.json"
        (os.symlink if kind == "symbolic" else os.link)(target, link)
        return link
    return make


@dataclass
class OutputCase:
    build: Callable[[Setup], list]  # the argv, with one output pointed at an input
    pattern: str
    inputs: Callable[[Setup], list[Path]] = lambda s: [s.model, s.data]


def _measure(s: Setup, *extra) -> list:
    return ["measure", "-m", s.model, "-d", s.data, "--layers", "final", "--no-progress", *extra]


def _stats(s: Setup) -> Path:
    path = s.tmp / "stats.safetensors"
    if not path.exists():
        path.write_bytes(b"reference statistics written by an earlier run")
    return path


def _queries(s: Setup) -> tuple[Path, Path]:
    import numpy as np

    q, v = s.tmp / "queries.jsonl", s.tmp / "vectors.npy"
    if not q.exists():
        q.write_text("".join(json.dumps({"correct": i % 3 != 0}) + "\n" for i in range(40)))
        np.save(v, np.random.default_rng(0).normal(size=(40, 8)))
    return q, v


def _scores(s: Setup) -> Path:
    path = s.tmp / "scores.csv"
    path.write_text("model,0.5\nmodel2,0.7\n")
    return path


def _earlier_run(s: Setup) -> Path:
    run = s.tmp / "runs" / "a"
    run.mkdir(parents=True)
    (run / "results.json").write_text('{"config": {}, "evaluations": []}\n')
    return run


OUTPUT_CASES: dict[str, OutputCase] = {
    "measure --output is the data": OutputCase(lambda s: _measure(s, "-o", s.data),
                                               r"--output '.*texts\.jsonl'.*--data input"),
    "measure --output is a symbolic link to the data": OutputCase(
        lambda s: _measure(s, "-o", _link("symbolic")(s.data, s.tmp)), r"--output .*symbolic-link.*--data input"),
    "measure --output is a hard link to the data": OutputCase(
        lambda s: _measure(s, "-o", _link("hard")(s.data, s.tmp)), r"--output .*hard-link.*--data input"),
    "measure --per-text is the data": OutputCase(lambda s: _measure(s, "-o", s.result, "--per-text", s.data),
                                                 r"--per-text .*--data input"),
    "measure --per-text is --output": OutputCase(lambda s: _measure(s, "-o", s.result, "--per-text", s.result),
                                                 r"--output and --per-text are the same"),
    "measure --output inside the model folder": OutputCase(lambda s: _measure(s, "-o", s.model / "out.json"),
                                                           r"--output .*inside the --model folder"),
    "measure --output replaces the weights": OutputCase(lambda s: _measure(s, "-o", s.model / "model.safetensors"),
                                                        r"model\.safetensors.*inside the --model folder"),
    "measure --save-preprocess-stats is --preprocess-stats": OutputCase(
        lambda s: _measure(s, "--preprocess", "center", "--preprocess-stats", _stats(s), "--save-preprocess-stats",
                           _stats(s), "-o", s.result),
        r"--save-preprocess-stats .*--preprocess-stats input", lambda s: [s.model, s.data, _stats(s)]),
    "measure --run-dir is the model folder": OutputCase(lambda s: _measure(s, "--run-dir", s.model, "-o", s.result),
                                                        r"--run-dir .*run\.json.*inside the --model folder"),
    "measure --run-dir is a file": OutputCase(lambda s: _measure(s, "--run-dir", s.data, "-o", s.result),
                                              r"--run-dir '.*texts\.jsonl' is a file"),
    "ppl-bins --plot-dir is a file": OutputCase(
        lambda s: COMMANDS["ppl-bins"](s, s.model, s.data) + ["--plot-dir", s.data],
        r"--plot-dir '.*texts\.jsonl' is a file"),
    "demo --output-dir is the model folder": OutputCase(
        lambda s: ["demo", "--model", s.model, "--output-dir", s.model, "--profile-only"],
        r"--output-dir .*results\.json.*inside the --model folder"),
    "ppl-bins --per-chunk is the data": OutputCase(
        lambda s: COMMANDS["ppl-bins"](s, s.model, s.data) + ["--per-chunk", s.data], r"--per-chunk .*--data input"),
    "ppl-bins --plot-dir is the model folder": OutputCase(
        lambda s: COMMANDS["ppl-bins"](s, s.model, s.data) + ["--plot-dir", s.model],
        r"--plot-dir .*result_scatter\.png.*inside the --model folder"),
    "knn-keys --output is the data": OutputCase(
        lambda s: COMMANDS["knn-keys"](s, s.model, s.data)[:-1] + [s.data], r"--output .*--data input"),
    "knnlm --output is the --eval text": OutputCase(
        lambda s: COMMANDS["knnlm"](s, s.model, s.data)[:-1] + [s.data], r"--output .*--datastore input"),
    "knnlm --store-dir is the model folder": OutputCase(
        lambda s: COMMANDS["knnlm"](s, s.model, s.data) + ["--store-dir", s.model],
        r"--store-dir .*manifest\.json.*inside the --model folder"),
    "knnlm --store-dir is a file": OutputCase(
        lambda s: COMMANDS["knnlm"](s, s.model, s.data) + ["--store-dir", s.data], r"--store-dir.*is a file"),
    "condensation --output inside the model folder": OutputCase(
        lambda s: COMMANDS["condensation"](s, s.model, s.data)[:-1] + [s.model / "c.json"],
        r"inside the --model folder"),
    "clusters --output is the data": OutputCase(
        lambda s: COMMANDS["clusters"](s, s.model, s.data)[:-1] + [s.data], r"--output .*--data input"),
    "perturb --plot-dir is the model folder": OutputCase(
        lambda s: COMMANDS["perturb"](s, s.model, s.data) + ["--plot-dir", s.model],
        r"--plot-dir .*result\.png.*inside the --model folder"),
    "report --output is one of its inputs": OutputCase(
        lambda s: ["report", s.data.with_suffix(".json"), "-o", s.data.with_suffix(".json")]
        if shutil.copy(s.data, s.data.with_suffix(".json")) else [],
        r"--output .*RESULT input", lambda s: [s.data.with_suffix(".json")]),
    "slices --output is the vectors": OutputCase(
        lambda s: ["slices", _queries(s)[0], "--vectors", _queries(s)[1], "--size", "10", "--seeds", "2",
                   "-o", _queries(s)[1]], r"--output .*vectors\.npy.*--vectors input", lambda s: list(_queries(s))),
    "slices --plot is the queries": OutputCase(
        lambda s: ["slices", _queries(s)[0], "--vectors", _queries(s)[1], "--plot", _queries(s)[0]],
        r"--plot .*queries\.jsonl.*SAMPLES input", lambda s: list(_queries(s))),
    "gap --output is the --scores file": OutputCase(
        lambda s: ["gap", "-m", s.model, s.model, "--scores", _scores(s), "-o", _scores(s)],
        r"--output .*scores\.csv.*--scores input", lambda s: [s.model, _scores(s)]),
    "gap --output inside the model folder": OutputCase(
        lambda s: ["gap", "-m", s.model, "-o", s.model / "gap.json"], r"inside the --models folder"),
    "train output_dir is the model folder": OutputCase(
        lambda s: ["train", "--config", _train_config(s, s.model, s.data, s.model), "--no-progress"],
        r"output_dir .*inside the model folder"),
    "train results.json replaces a data file": OutputCase(
        lambda s: ["train", "--config", _train_config(s, s.model, s.out.parent / "runs" / "results.json",
                                                      s.out.parent / "runs"), "--no-progress"]
        if (s.tmp / "runs").mkdir() or shutil.copy(s.data, s.tmp / "runs" / "results.json") else [],
        r"output_dir .*results\.json.*data\.domains\.text\.train input",
        lambda s: [s.model, s.tmp / "runs"]),
    "train over an earlier run": OutputCase(
        lambda s: ["train", "--config", _train_config(s, s.model, s.data, _earlier_run(s)), "--no-progress"],
        r"already holds a run \(results\.json\).*--overwrite", lambda s: [s.model, s.data, s.tmp / "runs"]),
}


def _earlier_store(s: Setup) -> Path:
    store = s.tmp / "store"
    store.mkdir(exist_ok=True)
    (store / "manifest.json").write_text('{"model": "another model"}')
    (store / "keys_final.npy").write_bytes(b"not this run's keys")
    return store


OUTPUT_CASES["knnlm --store-dir over an earlier store"] = OutputCase(
    lambda s: COMMANDS["knnlm"](s, s.model, s.data) + ["--store-dir", _earlier_store(s)],
    r"--store-dir .* already holds an earlier kNN store .*--overwrite", lambda s: [s.model, s.data, s.tmp / "store"])


@pytest.mark.fault("refused")
@pytest.mark.parametrize("case", list(OUTPUT_CASES))
def test_output_side(case, setup, capsys):
    c = OUTPUT_CASES[case]
    args = c.build(setup)
    run_refused(args, capsys, c.pattern, c.inputs(setup), setup.out)


@pytest.mark.fault("refused")
def test_train_overwrites_an_earlier_run_only_when_asked(setup, capsys):
    run = _earlier_run(setup)
    config = _train_config(setup, setup.model, setup.data, run)
    before = snapshot(run)
    assert main(["train", "--config", str(config), "--no-progress"]) == 2
    assert snapshot(run) == before
    assert main(["train", "--config", str(config), "--no-progress", "--overwrite"]) == 0, capsys.readouterr().err
    assert json.loads((run / "results.json").read_text())["evaluations"] is not None
    assert snapshot(run) != before


@pytest.mark.fault("refused")
def test_disk_full_leaves_no_output(setup, capsys, monkeypatch):
    """ENOSPC while the outputs are written: one line, and neither --output nor --per-text is left."""
    import repgeom_eval.output.files as files

    real = files.os.fsync
    calls = []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 2:  # the first output made it; the second hits a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(files.os, "fsync", fsync)
    args = _measure(setup, "-o", setup.result, "--per-text", setup.out / "per_text.jsonl")
    run_refused(args, capsys, r"cannot write .*per_text\.jsonl.*no space left", [setup.model, setup.data], setup.out)
    assert len(calls) == 2


FSIZE_CHILD = """
import resource, sys
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
from repgeom_eval.entrypoints.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.fault("refused")
def test_file_size_limit_leaves_no_output(setup):
    """RLIMIT_FSIZE (``ulimit -f``) below the size of the per-text file, in a child process."""
    args = _measure(setup, "--layers", "all", "--metrics", "dispersion", "token_dispersion", "-o", setup.result,
                    "--per-text", setup.out / "per_text.jsonl")[len(["measure"]):]
    before = snapshot(setup.model, setup.data)
    proc = subprocess.run([sys.executable, "-c", FSIZE_CHILD, "measure", *map(str, args)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2, proc.stderr
    assert re.search(r"cannot write .*file-size limit", error_line(proc.stderr))
    assert snapshot(setup.model, setup.data) == before
    assert list(setup.out.iterdir()) == []


# == the resume side ===============================================================================================

def _resume_args(s: Setup, run_dir: Path, metrics=("dispersion",)) -> list:
    return _measure(s, "--metrics", *metrics, "--shard-size", "10", "--batch-size", "5", "--run-dir", run_dir)


@pytest.fixture(scope="module")
def checkpoints(base, tmp_path_factory):
    """Two finished checkpointed runs of the same model and data: one measuring dispersion, one token dispersion."""
    model, data = base
    root = tmp_path_factory.mktemp("fault-runs")
    s = Setup(root, model, data, root)
    for name, metrics in (("run", ("dispersion",)), ("other", ("token_dispersion",))):
        args = [str(a) for a in _resume_args(s, root / name, metrics)]
        assert main(args + ["-o", str(root / f"{name}-result.json")]) == 0
        assert (root / name / "state.rank0-of-1.pt").is_file()
    return root


def _state(transform: Callable[[bytes], bytes]) -> Callable[[Path, Path], None]:
    def apply(run: Path, other: Path) -> None:
        f = run / "state.rank0-of-1.pt"
        f.write_bytes(transform(f.read_bytes()))
    return apply


def _foreign_state(run: Path, other: Path) -> None:
    import torch

    torch.save({"weights": torch.zeros(3)}, run / "state.rank0-of-1.pt")


def _state_of_another_run(run: Path, other: Path) -> None:
    shutil.copy(other / "state.rank0-of-1.pt", run / "state.rank0-of-1.pt")


def _run_json(change: Callable[[dict], None] | str) -> Callable[[Path, Path], None]:
    def apply(run: Path, other: Path) -> None:
        f = run / "run.json"
        if isinstance(change, str):
            f.write_text(change)
            return
        key = json.loads(f.read_text())
        change(key)
        f.write_text(json.dumps(key))
    return apply


STATE = r"state\.rank0-of-1\.pt"
RESUME_CASES: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "state file truncated": (_state(lambda b: b[: len(b) // 2]), STATE + r" is corrupt"),
    "state file garbage": (_state(lambda b: bytes(reversed(b))), STATE + r" is corrupt"),
    "state file empty": (_state(lambda b: b""), STATE + r" is corrupt"),
    "state file of a foreign format": (_foreign_state, STATE + r" has an unknown format"),
    "state file of another run": (_state_of_another_run, STATE + r" was written for another run"),
    "run.json edited": (_run_json(lambda k: k.update(batch_size=7)), r"run directory .*belongs to a different run"),
    "run.json garbage": (_run_json("\x00\x01 not json"), r"run\.json: unreadable run key"),
    "run.json absurdly deep": (_run_json(DEEP), r"run\.json: unreadable run key"),
    "run.json a list": (_run_json("[1, 2, 3]"), r"run\.json: the run key is a JSON list, not an object"),
}


@pytest.mark.fault("refused")
@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_side(case, checkpoints, base, tmp_path, capsys):
    breakage, pattern = RESUME_CASES[case]
    model, data = base  # the model and data the checkpoints were made from
    s = Setup(tmp_path, model, data, tmp_path / "out")
    s.out.mkdir()
    run = tmp_path / "run"
    shutil.copytree(checkpoints / "run", run)
    breakage(run, checkpoints / "other")
    args = _resume_args(s, run) + ["--resume", "-o", s.result]
    run_refused(args, capsys, pattern, [model, data, run], s.out)


@pytest.mark.fault("exact")
def test_an_intact_checkpoint_resumes(checkpoints, base, tmp_path, capsys):
    """The baseline the resume cases break: the same copy, unbroken, resumes to the uninterrupted numbers."""
    model, data = base
    s = Setup(tmp_path, model, data, tmp_path)
    shutil.copytree(checkpoints / "run", tmp_path / "run")
    assert main([str(a) for a in _resume_args(s, tmp_path / "run")] + ["--resume", "-o", str(s.result)]) == 0
    fresh = json.loads((checkpoints / "run-result.json").read_text())
    assert json.loads(s.result.read_text())["results"] == fresh["results"]


# -- every field of a saved state, changed (docs/…: a resumed run is refused or exact) ----------------------------------

def _leaves(state, path=""):
    """(path, value) of every field of a checkpoint's state, as RunDir.save digests them."""
    if isinstance(state, dict) and state:
        for k in sorted(state, key=str):
            yield from _leaves(state[k], f"{path}.{k}" if path else str(k))
    else:
        yield path, state


def _changed(value):
    import torch

    if isinstance(value, torch.Tensor):
        if value.numel() == 0:
            return torch.ones(1, dtype=value.dtype)
        out = value.clone().reshape(-1)
        out[0] = out[0] + 1
        return out.reshape(value.shape)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, list):
        return value[:-1] if value else [0]
    if isinstance(value, dict):  # an empty mapping
        return {"0": 0}
    return 0 if value is None else f"{value}x"


def _set(state, path, value):
    keys = path.split(".")
    d = state
    for k in keys[:-1]:
        d = d[k] if k in d else d[int(k)]
    last = keys[-1] if keys[-1] in d else int(keys[-1])
    d[last] = value


@pytest.mark.fault("refused")
def test_every_field_of_a_saved_state_changed_is_refused_naming_it(checkpoints, base, tmp_path, capsys, request):
    import torch

    model, data = base
    src = checkpoints / "run" / "state.rank0-of-1.pt"
    saved = torch.load(src, map_location="cpu", weights_only=True)
    body = {k: v for k, v in saved.items() if k not in ("version", "key", "digests")}
    fields = [p for p, _ in _leaves(body)]
    assert len(fields) >= 10, fields
    request.node.user_properties.append(("fault_cases", len(fields)))  # one case per field (tests/conftest.py)
    for i, field in enumerate(fields):
        run = tmp_path / f"run{i}"
        shutil.copytree(checkpoints / "run", run)
        state = torch.load(run / "state.rank0-of-1.pt", map_location="cpu", weights_only=True)
        _set(state, field, _changed(dict(_leaves(body))[field]))
        torch.save(state, run / "state.rank0-of-1.pt")
        s = Setup(tmp_path, model, data, tmp_path / f"out{i}")
        s.out.mkdir()
        args = _resume_args(s, run) + ["--resume", "-o", s.result]
        run_refused(args, capsys, rf"field {re.escape(field)} was changed after it was written", [model, data, run],
                    s.out)


def _rewrite(change):
    """A consistent rewrite: the state changed and its digests recomputed, as a buggy writer would leave it."""
    def apply(run: Path, other: Path) -> None:
        import torch

        from repgeom_eval.measurement.checkpoint import field_digests

        f = run / "state.rank0-of-1.pt"
        state = torch.load(f, map_location="cpu", weights_only=True)
        body = {k: v for k, v in state.items() if k not in ("version", "key", "digests")}
        change(body)
        torch.save({**state, **body, "digests": field_digests(body)}, f)
    return apply


def _metric(body):
    return body["metrics"]["final"]["dispersion"]


REWRITE_CASES = {
    "a state shortened (48 → 7)": (lambda b: _metric(b).update(sum_u=_metric(b)["sum_u"][:7]),
                                   r"metrics\.final\.dispersion: sum_u has D = 7 where .* has D = "),
    "n set to 0": (lambda b: _metric(b).update(n=_metric(b)["n"] * 0),
                   r"metrics\.final\.dispersion: sum_sq = .* but n − n_zero = 0"),
    "a negative count": (lambda b: _metric(b).update(n_zero=_metric(b)["n_zero"] - 1),
                         r"metrics\.final\.dispersion: counts .* are not whole numbers with n_zero ≤ n"),
    "a sum doubled": (lambda b: _metric(b).update(sum_sq=_metric(b)["sum_sq"] * 2),
                      r"metrics\.final\.dispersion: sum_sq = "),
    "one shard fewer said done": (lambda b: b.update(next_shard=b["next_shard"] - 1, complete=False),
                                  r"counts\.n_tokens is \d+, but the \d+ shard\(s\) it says are done hold \d+"),
    "a count edited": (lambda b: b["counts"].__setitem__(3, b["counts"][3] + 1),
                       r"counts\.n_sequences is \d+, but the \d+ shard\(s\)"),
    # every sum and count of every state doubled, consistently: each metric's invariants hold, but the vectors the
    # states claim are twice the texts of the shards said done
    "every state doubled": (lambda b: [state.update({k: v * 2 for k, v in state.items()})
                                       for group in (*b["metrics"].values(), {"energy": b["energy"]})
                                       for states in group.values() for state in
                                       (states.values() if "n" not in states else [states])],
                            r"energy\.\S+\.n is \d+ vectors, but the \d+ shard\(s\) it says are done hold \d+ "
                            r"text\(s\)"),
}


@pytest.mark.fault("refused")
@pytest.mark.parametrize("case", list(REWRITE_CASES))
def test_a_consistently_rewritten_state_is_checked_against_the_run(case, checkpoints, base, tmp_path, capsys):
    change, pattern = REWRITE_CASES[case]
    model, data = base
    s = Setup(tmp_path, model, data, tmp_path / "out")
    s.out.mkdir()
    run = tmp_path / "run"
    shutil.copytree(checkpoints / "run", run)
    _rewrite(change)(run, checkpoints / "other")
    run_refused(_resume_args(s, run) + ["--resume", "-o", s.result], capsys, pattern, [model, data, run], s.out)
