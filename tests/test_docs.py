"""Docs that are tested: every ```bash and ```python block of README.md and of every page of the documentation site
(docs/**/*.md and the pages it publishes from elsewhere: scripts/docs_site.py) runs here.

Plain ``` blocks (make, pip, sample output) and other languages are not run. A block of any language whose info
string names a file (```` ```yaml file=my_tasks/quiz.yaml ````) is written to that path, relative to the working
directory, before the next runnable block of the same page runs: how a page shows the files a command reads. Each block runs in a fresh working
directory holding ``my-model/`` (a tiny GPT-2) and ``texts.jsonl`` (real sentences from Python's own docs):

* ``bash``: every command line must be a ``repgeom ...`` or ``lm_eval ...`` command (optionally preceded by
  ``NAME=value`` environment assignments); each runs as ``python -m repgeom_eval ...`` / ``python -m lm_eval ...``
  in a subprocess and must exit 0. Any other line fails the test, so that nothing in a ``bash`` block is silently
  skipped.
* ``python``: executed in a fresh namespace with the working directory as cwd; any ``test_*`` functions it defines
  are then called (a ``tmp_path`` argument gets a fresh directory).

Blocks of docs/plugins.md, and any block that mentions the example plugin, run with
examples/repgeom-example-metric installed (``pip install --target``) and on the path.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import types
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "repgeom-example-metric"
EXAMPLE_MODULE = "repgeom_example_metric"


def _site_sources() -> list[Path]:
    """The Markdown files the documentation site is built from (scripts/docs_site.py, which mkdocs.yml hooks in)."""
    spec = importlib.util.spec_from_file_location("repgeom_docs_site", ROOT / "scripts" / "docs_site.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.site_sources(ROOT)


DOC_FILES = [p for p in [ROOT / "README.md", *_site_sources()] if p.is_file()]
RUN_LANGUAGES = ("bash", "python")
DOCS_MODULE = "repgeom_docs_block"  # the module a python block runs as
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*", re.S)
PROGRAMS = {"repgeom": "repgeom_eval", "lm_eval": "lm_eval"}  # command -> the module `python -m` runs
FILE_INFO = re.compile(r"(?:^|\s)file=(\S+)")


@dataclass
class Block:
    path: Path
    number: int  # 1-based among the runnable blocks of its file
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    files: tuple[tuple[str, str], ...] = ()  # (relative path, text) written before the block runs

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}#{self.number}-{self.language}-L{self.line}"

    @property
    def needs_plugin(self) -> bool:
        return self.path.name == "plugins.md" or "mean_norm" in self.code or EXAMPLE_MODULE in self.code


def fenced_blocks(path: Path) -> list[tuple[int, str, str]]:
    """(line, language, code) of every fenced block of a Markdown file, runnable or not."""
    return [(line, language, code) for line, language, _, code in fenced_blocks_with_info(path)]


def fenced_blocks_with_info(path: Path) -> list[tuple[int, str, str, str]]:
    """(line, language, rest of the info string, code) of every fenced block of a Markdown file."""
    out: list[tuple[int, str, str, str]] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)(.*)$", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, language, info = m.groups()
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[i]):
            line = lines[i]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            i += 1
        assert i < len(lines), f"{path.relative_to(ROOT)}:{start}: unclosed code fence"
        out.append((start, language.lower(), info.strip(), "\n".join(body) + "\n"))
        i += 1
    return out


def runnable_blocks(paths: list[Path] = DOC_FILES) -> list[Block]:
    blocks = []
    for path in paths:
        number = 0
        files: list[tuple[str, str]] = []  # file blocks waiting for the next runnable block
        for line, language, info, code in fenced_blocks_with_info(path):
            named = FILE_INFO.search(info)
            if named:
                target = Path(named.group(1))
                assert not target.is_absolute() and ".." not in target.parts, \
                    f"{path.name}:{line}: file={target} must be a path inside the working directory"
                files.append((target.as_posix(), code))
            elif language in RUN_LANGUAGES:
                number += 1
                blocks.append(Block(path, number, line, language, code, tuple(files)))
                files = []
        assert not files, f"{path.name}: file blocks {[f for f, _ in files]} come after the last " \
                          "runnable block; nothing would read them"
    return blocks


def write_files(block: Block, cwd: Path) -> None:
    for name, text in block.files:
        target = cwd / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")


BLOCKS = runnable_blocks()


def bash_commands(code: str) -> list[tuple[dict[str, str], list[str]]]:
    """(environment, command words) for each ``repgeom`` / ``lm_eval`` line of a bash block; anything else is an
    error."""
    commands = []
    for raw in code.replace("\\\n", " ").splitlines():
        words = shlex.split(raw, comments=True)
        if not words:
            continue
        env = {}
        while words and ENV_ASSIGNMENT.fullmatch(words[0]):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        if not words or words[0] not in PROGRAMS:
            raise AssertionError(
                f"bash block line {raw!r} is not a `repgeom` or `lm_eval` command; docs tests run only those, so put "
                "other commands (pip, make, cd ...) in a plain ``` fence"
            )
        commands.append((env, words))
    return commands


# -- fixtures ----------------------------------------------------------------------------------------------------

def _texts() -> list[str]:
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics)[:20]:
        words = topics[key].split()
        out.append(" ".join(words[: 6 + (len(out) * 5) % 9]))  # 6-14 words: well inside the tiny context
    return out


@pytest.fixture(scope="session")
def docs_workdir_template(tiny_model_dir, tmp_path_factory) -> Path:
    template = tmp_path_factory.mktemp("docs-template")
    shutil.copytree(tiny_model_dir("gpt2"), template / "my-model")
    with open(template / "texts.jsonl", "w", encoding="utf-8") as f:
        for text in _texts():
            f.write(json.dumps({"text": text}) + "\n")
    return template


@pytest.fixture(scope="session")
def example_target(example_plugin_site) -> Path:
    """examples/repgeom-example-metric, really installed (metadata and entry point included) into a target dir."""
    return example_plugin_site


@pytest.fixture
def workdir(docs_workdir_template, tmp_path) -> Path:
    wd = tmp_path / "work"
    shutil.copytree(docs_workdir_template, wd)
    return wd


def _subprocess_env(extra_path: Path | None, env: dict[str, str]) -> dict[str, str]:
    out = dict(os.environ)
    out.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
                "COLUMNS": "120"})
    out.pop("REPGEOM_STRICT_PLUGINS", None)
    if extra_path is not None:
        out["PYTHONPATH"] = os.pathsep.join([str(extra_path), *filter(None, [os.environ.get("PYTHONPATH")])])
    out.update(env)
    return out


def _run_commands(block: Block, cwd: Path, extra_path: Path | None) -> list[tuple[str, subprocess.CompletedProcess]]:
    """Run a bash block's commands one after the other; stop at the first failure."""
    done = []
    write_files(block, cwd)
    for env, (program, *args) in bash_commands(block.code):
        proc = subprocess.run([sys.executable, "-m", PROGRAMS[program], *args], cwd=cwd, capture_output=True,
                              text=True, env=_subprocess_env(extra_path, env), timeout=300)
        done.append((" ".join([*(f"{k}={v}" for k, v in env.items()), program, *map(shlex.quote, args)]), proc))
        if proc.returncode != 0:
            break
    return done


@pytest.fixture(scope="module")
def bash_runs(request, docs_workdir_template, tmp_path_factory):
    """``bash_runs(block)`` → a future of the block's finished commands.

    Every command loads torch (and most a model) in a fresh interpreter, seconds each, so the selected bash blocks
    all start at once in the background, a few at a time, and overlap with the python blocks. Under pytest-xdist
    the workers already run in parallel and a worker does not know which blocks it will get: each block then starts
    when its test asks for it.
    """
    selected = [item.callspec.params["block"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_doc_block" and hasattr(item, "callspec")]
    selected = [b for b in selected if b.language == "bash"]
    target = request.getfixturevalue("example_target") if any(b.needs_plugin for b in selected) else None
    futures: dict[str, Future] = {}
    pool = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1), thread_name_prefix="docs-bash")

    def submit(block: Block) -> Future:
        if block.id not in futures:
            cwd = tmp_path_factory.mktemp("docs-bash") / "work"
            shutil.copytree(docs_workdir_template, cwd)
            futures[block.id] = pool.submit(_run_commands, block, cwd, target if block.needs_plugin else None)
        return futures[block.id]

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        for block in selected:
            submit(block)
    yield submit
    pool.shutdown(wait=True, cancel_futures=True)


def _run_python(block: Block, tmp_path: Path) -> None:
    # A real (temporary) module, so that what the block defines can be pickled like anything in a user's module.
    module = types.ModuleType(DOCS_MODULE)
    module.__file__ = str(block.path)
    sys.modules[DOCS_MODULE] = module
    namespace = module.__dict__
    with warnings.catch_warnings():
        exec(compile(block.code, block.id, "exec"), namespace)
        tests = [(name, f) for name, f in namespace.items()
                 if name.startswith("test_") and inspect.isfunction(f) and f.__module__ == DOCS_MODULE]
        for name, function in tests:
            kwargs = {}
            for param in inspect.signature(function).parameters:
                assert param == "tmp_path", f"{block.id}: {name}() asks for fixture {param!r}; only tmp_path exists"
                kwargs[param] = tmp_path / f"{name}-tmp"
                kwargs[param].mkdir()
            function(**kwargs)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_doc_block(block: Block, request, monkeypatch, tmp_path):
    from repgeom_eval.plugin_system.host import reset_host

    if block.language == "bash":
        commands = bash_commands(block.code)
        assert commands, f"{block.id}: bash block without any repgeom or lm_eval command"
        done = request.getfixturevalue("bash_runs")(block).result()
        for shown, proc in done:
            assert proc.returncode == 0, (f"{block.id}: `{shown}` exited with {proc.returncode}\n"
                                          f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
        assert len(done) == len(commands)
        return
    extra_path = request.getfixturevalue("example_target") if block.needs_plugin else None
    workdir = request.getfixturevalue("workdir")
    write_files(block, workdir)
    monkeypatch.chdir(workdir)
    monkeypatch.delenv("REPGEOM_STRICT_PLUGINS", raising=False)
    if extra_path is not None:
        monkeypatch.syspath_prepend(str(extra_path))
    reset_host()  # the plugin host re-reads the entry points of the path this block runs with
    try:
        _run_python(block, tmp_path)
    finally:
        sys.modules.pop(EXAMPLE_MODULE, None)
        sys.modules.pop(DOCS_MODULE, None)
        reset_host()
        importlib.invalidate_caches()


# -- the docs and the example package agree ----------------------------------------------------------------------

def test_docs_found():
    names = {b.path.name for b in BLOCKS}
    assert "README.md" in names and "plugins.md" in names, f"runnable blocks found only in {sorted(names)}"
    pages = {p.relative_to(ROOT).as_posix() for p in DOC_FILES}
    assert {"docs/index.md", "docs/getting-started.md", "docs/how-to/own-model.md", "docs/reference/cli.md",
            "experiments/README.md"} <= pages, f"site pages missing from the docs tests: {sorted(pages)}"


def test_tutorial_module_is_the_example():
    """The tutorial shows the example plugin's module verbatim."""
    module = (EXAMPLE / f"{EXAMPLE_MODULE}.py").read_text(encoding="utf-8")
    doc = ROOT / "docs" / "plugins.md"
    shown = [code for _, language, code in fenced_blocks(doc) if language == "python"]
    assert module in shown, "docs/plugins.md must show examples/repgeom-example-metric/repgeom_example_metric.py " \
                            "verbatim in a ```python block"


def test_tutorial_pyproject_is_the_example():
    """Every ```toml block of the tutorial is a verbatim excerpt of the example's pyproject.toml."""
    pyproject = (EXAMPLE / "pyproject.toml").read_text(encoding="utf-8")
    doc = ROOT / "docs" / "plugins.md"
    toml_blocks = [code for _, language, code in fenced_blocks(doc) if language == "toml"]
    assert toml_blocks, "docs/plugins.md shows no pyproject.toml"
    assert toml_blocks[0] == pyproject, "the first ```toml block must be the example's whole pyproject.toml"
    for code in toml_blocks:
        assert code in pyproject, f"not in the example's pyproject.toml:\n{code}"


def test_bash_command_parser():
    assert bash_commands("repgeom plugins --json\n# a comment\n\n") == [({}, ["repgeom", "plugins", "--json"])]
    assert bash_commands("REPGEOM_STRICT_PLUGINS=1 repgeom measure \\\n  --model './my model'\n") == [
        ({"REPGEOM_STRICT_PLUGINS": "1"}, ["repgeom", "measure", "--model", "./my model"])]
    assert bash_commands("lm_eval --tasks quiz --include_path my_tasks\n") == [
        ({}, ["lm_eval", "--tasks", "quiz", "--include_path", "my_tasks"])]
    with pytest.raises(AssertionError, match="plain ``` fence"):
        bash_commands("pip install -e .\n")


def test_file_blocks_go_to_the_next_runnable_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```yaml file=my_tasks/quiz.yaml\ntask: quiz\n```\n\n```jsonl file=quiz.jsonl\n{}\n```\n\n"
                    "```bash\nrepgeom plugins\n```\n\n```bash\nrepgeom plugins --json\n```\n", encoding="utf-8")
    first, second = runnable_blocks([page])
    assert first.files == (("my_tasks/quiz.yaml", "task: quiz\n"), ("quiz.jsonl", "{}\n")) and second.files == ()
    write_files(first, tmp_path / "work")
    assert (tmp_path / "work" / "my_tasks" / "quiz.yaml").read_text() == "task: quiz\n"
    assert any(b.files for b in BLOCKS if b.path.name == "lmeval.md"), "docs/lmeval.md shows its custom task's files"
