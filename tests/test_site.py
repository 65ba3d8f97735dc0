"""The documentation site (mkdocs.yml, docs/, scripts/docs_site.py, scripts/gen_reference.py) and the README.

* ``mkdocs build --strict`` succeeds without a single warning: a broken link or anchor, a page missing from the
  navigation, a stale API entry all fail here. mkdocs comes with the ``dev`` extra, so a missing mkdocs is a failure,
  never a skip.
* The generated reference pages (command line, Python API) equal a fresh generation.
* The README stays a first page: at most 200 lines, the two commands CI and newcomers run, links that resolve.

The examples of every page run in tests/test_docs.py.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


docs_site = _load("repgeom_docs_site_hooks", ROOT / "scripts" / "docs_site.py")


# -- the build ------------------------------------------------------------------------------------------------------

def test_site_builds_strict_without_warnings(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.fail("mkdocs is not installed; the dev extra installs it (`make test` does: scripts/bootstrap.sh dev)")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=600)
    log = proc.stdout + proc.stderr
    warnings = [line for line in log.splitlines() if re.match(r"\S*(WARNING|ERROR)", line)]
    assert proc.returncode == 0 and not warnings, f"mkdocs build --strict failed:\n{log}"
    for page in ("index.html", "getting-started/index.html", "how-to/own-model/index.html",
                 "how-to/large-models/index.html", "how-to/papers/index.html", "lmeval/index.html",
                 "mteb/index.html", "plugins/index.html", "reference/cli/index.html", "reference/api/index.html",
                 "metrics/index.html", "gallery/index.html", "reference/benchmarks/index.html"):
        assert (site / page).is_file(), f"the site has no {page}"
    api = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert "Base class of every metric" in api, "the Python API page shows no docstring (mkdocstrings)"
    gallery = (site / "gallery" / "index.html").read_text(encoding="utf-8")
    for image in re.findall(r'<img[^>]+src="([^"]+)"', gallery):
        assert (site / "gallery" / image).is_file(), f"the gallery shows a missing image {image}"


def test_generated_reference_pages_are_current():
    gen = _load("repgeom_gen_reference", ROOT / "scripts" / "gen_reference.py")
    for path, text in gen.pages().items():
        assert path.read_text(encoding="utf-8") == text, \
            f"{path.relative_to(ROOT)} is stale: run `.venv/bin/python scripts/gen_reference.py`"


def test_every_public_name_is_on_the_api_page():
    import repgeom_eval

    page = (ROOT / "docs" / "reference" / "api.md").read_text(encoding="utf-8")
    headings = set(re.findall(r"heading: (\w+)", page)) | set(re.findall(r"^### `(\w+)`", page, re.M))
    assert {n for n in repgeom_eval.__all__ if not n.startswith("__")} <= headings


# -- how repository links become site links --------------------------------------------------------------------------

def test_links_to_published_files_are_rewritten_and_the_rest_checked():
    mounted = {"gallery/index.md": "experiments/README.md", "gallery/a/results/result.md": "experiments/a/results/"
               "result.md", "reference/benchmarks.md": "benchmarks/README.md"}
    warned: list[str] = []
    page = ("See [the gallery](../../experiments/README.md), [bench](../../benchmarks/README.md#x), "
            "[metrics](../metrics.md#dispersion), [the example](../../examples/repgeom-example-metric), "
            "[gone](../../no/such/file.md) and [web](https://example.org).\n"
            "`[code](../../no/such/file.md)`\n\n```\n[fenced](../../no/such/file.md)\n```\n")
    out = docs_site.translate_links(page, "docs/how-to/x.md", "how-to/x.md", root=ROOT, mounted=mounted,
                                    warn=warned.append)
    assert "[the gallery](../gallery/index.md)" in out
    assert "[bench](../reference/benchmarks.md#x)" in out
    assert "[metrics](../metrics.md#dispersion)" in out  # docs/ to docs/: left to mkdocs' own checks
    assert "the example," in out and "repgeom-example-metric)" not in out  # not published: its text
    assert "[web](https://example.org)" in out
    assert "`[code](../../no/such/file.md)`" in out and "[fenced](../../no/such/file.md)" in out
    assert len(warned) == 1 and "no/such/file.md" in warned[0]

    gallery = docs_site.translate_links("![fig](a/results/fig.png) [finding](a/results/result.md)",
                                        "experiments/README.md", "gallery/index.md", root=ROOT,
                                        mounted={**mounted, "gallery/a/results/fig.png": "experiments/a/results/"
                                                 "fig.png"}, warn=warned.append)
    assert gallery == "![fig](a/results/fig.png) [finding](a/results/result.md)" and len(warned) == 1


def test_a_missing_heading_of_an_unpublished_file_is_a_warning():
    warned: list[str] = []
    docs_site.translate_links("[r](../README.md#no-such-heading) [ok](../README.md#plugins)", "docs/x.md", "x.md",
                              root=ROOT, mounted={}, warn=warned.append)
    assert len(warned) == 1 and "#no-such-heading" in warned[0]


def test_the_gallery_and_the_benchmarks_are_published():
    mounted = docs_site.mounted_files(ROOT)
    assert mounted["gallery/index.md"] == "experiments/README.md"
    assert mounted["reference/benchmarks.md"] == "benchmarks/README.md"
    findings = sorted(p.parent.parent.name for p in (ROOT / "experiments").glob("*/results/result.md"))
    assert findings and all(f"gallery/{f}/results/result.md" in mounted for f in findings)


# -- the README -------------------------------------------------------------------------------------------------------

def test_readme_is_at_most_200_lines():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move the detail to a page " \
                                  "of docs/ and link to it"


def test_readme_shows_the_two_commands_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    assert [line.split()[:2] for line in block.strip().splitlines()] == [["make", "demo"], ["make", "test"]]
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^test:", makefile, re.M) and re.search(r"^demo:", makefile, re.M)


def test_readme_has_an_example_per_surface_and_links_into_the_site():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for heading in ("## Measure", "## lm-eval", "## MTEB", "## Plugins", "## Documentation"):
        assert heading in readme, f"README.md lost its {heading!r} section"
    for command in ("repgeom measure", "lm_eval ", "repgeom mteb run", "class MaxNorm(rg.Metric)"):
        assert command in readme
    for page in ("docs/getting-started.md", "docs/reference/cli.md", "docs/reference/api.md", "experiments/README.md"):
        assert f"]({page})" in readme, f"README.md does not link to {page}"


def test_readme_links_resolve():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", readme):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path if path else ROOT / "README.md"
        assert file.exists(), f"README.md links to {target}, which does not exist"
        if anchor and file.suffix == ".md":
            assert anchor in docs_site.slugs(file.read_text(encoding="utf-8")), f"README.md: no heading #{anchor}"
