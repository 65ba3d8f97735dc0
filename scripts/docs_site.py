"""MkDocs hooks of the documentation site (mkdocs.yml: ``hooks:``), and the list of its page sources for the tests.

The site is built from ``docs/``, plus a few Markdown files that live elsewhere in the repository and are published
as they are, without a copy (``MOUNTS``): the reproduction gallery (experiments/README.md and each finding's
``results/`` folder) and the benchmarks' notes. Pages are written for two readers at once, someone browsing the
repository and someone reading the site, so their relative links point at repository files. While the site is
built, each link is translated (:func:`translate_links`):

* to a page or image the site publishes: rewritten to where the site puts it;
* to a repository file the site does not publish (``../examples/...``, ``../README.md``): shown as its text;
* to a path that does not exist, or to a heading that such a file does not have: a warning, which fails
  ``mkdocs build --strict`` (tests/test_site.py) as mkdocs' own broken-link warnings do.

Sphinx roles left in docstrings (``:func:`name```) are dropped from the API pages, keeping the code span.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = "docs"
LOG = logging.getLogger("mkdocs.hooks.docs_site")  # under "mkdocs": a warning here fails a --strict build

# (repository path, site path): a file, or a folder whose files matching GLOBS are published under the site path
MOUNTS: tuple[tuple[str, str], ...] = (
    ("experiments/README.md", "gallery/index.md"),
    ("experiments", "gallery"),
    ("benchmarks/README.md", "reference/benchmarks.md"),
)
# results/ of every finding, and results_X/ of a finding's --X run (ppl_vs_dispersion's --paper)
GLOBS = tuple(f"*/{folder}/*.{ext}" for folder in ("results", "results_*") for ext in ("md", "png", "svg"))

FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?:.+?)\1")
LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^()\s]+)((?:\s+\"[^\"]*\")?)\)")
ROLE = re.compile(r":(?:func|meth|class|attr|mod|data|exc|obj|py:\w+):(?=<code>)")


def mounted_files(root: Path = ROOT) -> dict[str, str]:
    """site path → repository path of every file published from outside ``docs/``."""
    out: dict[str, str] = {}
    for source, target in MOUNTS:
        path = root / source
        if path.is_file():
            out[target] = source
        elif path.is_dir():
            for pattern in GLOBS:
                for f in sorted(path.glob(pattern)):
                    rel = f.relative_to(path).as_posix()
                    out[f"{target}/{rel}"] = f"{source}/{rel}"
    return out


def site_sources(root: Path = ROOT) -> list[Path]:
    """Every Markdown file the site is built from: docs/**/*.md and the mounted pages."""
    pages = sorted((root / DOCS).rglob("*.md"))
    pages += [root / source for source in mounted_files(root).values() if source.endswith(".md")]
    return pages


def site_path(repo_path: str, mounted: dict[str, str]) -> str | None:
    """Where the site publishes a repository file (``None``: it does not)."""
    if repo_path.startswith(DOCS + "/"):
        return repo_path[len(DOCS) + 1:]
    for site, source in mounted.items():
        if source == repo_path:
            return site
    return None


def slugs(markdown: str) -> set[str]:
    """The anchors of a Markdown file's headings, as the site's table of contents (and GitHub, mostly) make them,
    plus explicit ``<a id=...>`` anchors."""
    from pymdownx.slugs import slugify

    slug = slugify(case="lower")  # as mkdocs.yml configures the table of contents
    out = set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", markdown))
    in_fence = False
    for line in markdown.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and line.startswith("#"):
            title = line.lstrip("#").strip()
            out.add(slug(re.sub(r"[`*]", "", title), "-"))
    return out


def _outside_code(markdown: str, change) -> str:
    """``change(text)`` applied to the parts of ``markdown`` outside fenced blocks and inline code spans."""
    out, prose, fence = [], [], None

    def flush() -> None:
        if prose:
            text = "".join(prose)
            spans: list[str] = []

            def keep(m: re.Match) -> str:
                spans.append(m.group(0))
                return f"\x00{len(spans) - 1}\x00"

            text = change(CODE_SPAN.sub(keep, text))
            out.append(re.sub(r"\x00(\d+)\x00", lambda m: spans[int(m.group(1))], text))
            prose.clear()

    for line in markdown.splitlines(keepends=True):
        m = FENCE.match(line)
        if fence is None and m:
            flush()
            fence = m.group(1)
            out.append(line)
        elif fence is not None:
            out.append(line)
            if line.strip().startswith(fence[0] * len(fence)) and line.strip().strip(fence[0]) == "":
                fence = None
        else:
            prose.append(line)
    flush()
    return "".join(out)


def translate_links(markdown: str, repo_path: str, page_site_path: str, root: Path = ROOT,
                    mounted: dict[str, str] | None = None, warn=LOG.warning) -> str:
    """The page's relative links, written for the repository, as the site needs them (module docstring)."""
    mounted = mounted_files(root) if mounted is None else mounted
    here = posixpath.dirname(repo_path)
    site_here = posixpath.dirname(page_site_path)

    def one(m: re.Match) -> str:
        bang, text, target, title = m.groups()
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith(("#", "/")):
            return m.group(0)
        path, _, anchor = target.partition("#")
        resolved = posixpath.normpath(posixpath.join(here, path))
        published = site_path(resolved, mounted)
        if published is not None:
            if resolved.startswith(DOCS + "/") and repo_path.startswith(DOCS + "/"):
                return m.group(0)  # docs/ to docs/: mkdocs checks it itself
            new = posixpath.relpath(published, site_here) + (f"#{anchor}" if anchor else "")
            return f"{bang}[{text}]({new}{title})"
        file = root / resolved
        if resolved.startswith("..") or not file.exists():
            warn(f"{repo_path}: link {target!r} points at {resolved!r}, which does not exist")
            return m.group(0)
        if bang:
            warn(f"{repo_path}: image {target!r} is a repository file the site does not publish (scripts/docs_site.py)")
            return m.group(0)
        if anchor and file.suffix == ".md" and anchor not in slugs(file.read_text(encoding="utf-8")):
            warn(f"{repo_path}: link {target!r}: {resolved} has no heading with anchor #{anchor}")
        return text  # a repository file the site does not publish: its text

    return _outside_code(markdown, lambda prose: LINK.sub(one, prose))


# -- the hooks ------------------------------------------------------------------------------------------------------

def on_files(files, config):
    from mkdocs.structure.files import File

    for site, source in mounted_files().items():
        files.append(File.generated(config, site, abs_src_path=str(ROOT / source)))
    return files


def on_page_markdown(markdown, page, config, files):
    mounted = mounted_files()
    src = page.file.src_uri
    repo_path = mounted.get(src, f"{DOCS}/{src}")
    return translate_links(markdown, repo_path, src, mounted=mounted)


def on_page_content(html, page, config, files):
    return ROLE.sub("", html)
