"""``repgeom report``: the JSON outputs of every command as one self-contained HTML page.

Each input file becomes a section: a summary table and its figures, redrawn from the JSON by :mod:`.plots` and
embedded as base64 PNG ``data:`` URIs. The page has inline CSS, no script and no external link, so it reads offline
and can be mailed as one file. Files are recognised by their ``kind`` field (every analysis writes one); outputs of
``measure`` and ``gap``, which predate it, are recognised by their shape. A file of another kind still gets a
section: its config and results as pretty-printed JSON.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .. import __version__
from ..spec.errors import RepgeomError
from repgeom_eval.output.files import atomic_open
from repgeom_eval.output.progress import duration
from repgeom_eval.output.results_table import is_lmeval, mteb_rows, warning_lines
from . import plots, report_sources
from .report_html import bullets, esc, figure, fmt, generic, md, para, png_file, table  # noqa: F401 (API)

Section = tuple[str, list[str]]  # (title, HTML blocks)
RENDERERS: dict[str, Callable[[dict[str, Any]], list[str]]] = dict(report_sources.RENDERERS)

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#222;line-height:1.45}
h1{font-size:1.6em;border-bottom:2px solid #444}h2{font-size:1.25em;margin-top:2em;border-bottom:1px solid #bbb}
table{border-collapse:collapse;margin:.8em 0;font-size:.88em}td,th{border:1px solid #ccc;padding:.25em .6em;
text-align:right}th{background:#f0f0f0}td:first-child,th:first-child{text-align:left}
img{max-width:100%;display:block;margin:.8em 0}.meta{color:#666;font-size:.85em}
.warn{background:#fff4d6;border-left:4px solid #e0a800;padding:.4em .8em;margin:.5em 0}
pre{background:#f6f6f6;padding:.6em;overflow-x:auto;font-size:.8em;max-height:30em}
nav ul{columns:2;font-size:.9em}
code{background:#f0f0f0;padding:0 .25em;border-radius:3px;font-size:.92em}
"""


def renderer(kind: str):
    def register(fn):
        RENDERERS[kind] = fn
        return fn

    return register


# -- reading ----------------------------------------------------------------------------------------------------

def classify(doc: Any) -> str:
    """The command that wrote ``doc``: its ``kind``, or ``measure``/``gap`` recognised by shape."""
    if not isinstance(doc, dict):
        return "unknown"
    if isinstance(doc.get("kind"), str):
        return doc["kind"]
    if is_lmeval(doc):
        return "lm-eval"
    if report_sources.is_slices(doc):
        return "slices"
    if (doc.get("config") or {}).get("metric") == "dispersion_gap" and isinstance(doc.get("results"), list):
        return "gap"
    if isinstance(doc.get("results"), dict) and "layers" in (doc.get("config") or {}) and "summary" in doc:
        return "measure"
    return "unknown"


def result_files(paths: Sequence[str | Path]) -> list[Path]:
    """The files a report reads: each file given, and the ``*.json`` files of each directory in name order."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            # a folder of results, the gallery's layout (experiments/NAME/results/result.json), an lm-eval
            # --output_path folder (MODEL/results_*.json) or a `repgeom mteb run` folder (every file under it)
            found = (sorted(p.rglob("*.json")) if _is_mteb(p) else sorted(p.glob("*.json"))
                     or sorted(p.glob("*/results/result.json")) or sorted(p.rglob("results_*.json")))
            if not found:
                raise RepgeomError(f"directory {str(p)!r} holds no .json file (nor */results/result.json, "
                                   "lm-eval results_*.json or MTEB layer results)")
            files.extend(found)
        elif p.exists():
            files.append(p)
        else:
            raise RepgeomError(f"result file {str(p)!r} does not exist")
    if not files:
        raise RepgeomError("give at least one result file (.json) or directory")
    return files


def _is_mteb(folder: Path) -> bool:
    return any(folder.rglob("model_meta.json"))


def collect(paths: Sequence[str | Path]) -> list[tuple[Path, dict[str, Any]]]:
    """(path, parsed JSON) for every file; a directory contributes its ``*.json`` files in name order, an MTEB
    result folder one document of all its layers (``kind`` mteb-layers, ``rows`` as ``repgeom compare`` reads
    them)."""
    out = []
    for p in map(Path, paths):
        if p.is_dir() and _is_mteb(p):
            rows = mteb_rows(p)
            if not rows:
                raise RepgeomError(f"{p}: MTEB folder without layer results (written by `repgeom mteb run`?)")
            out.append((p, {"kind": report_sources.MTEB_KIND, "folder": str(p), "rows": rows}))
        else:
            out += _collect_files([p])
    return out


def _collect_files(paths: Sequence[Path]) -> list[tuple[Path, dict[str, Any]]]:
    from repgeom_eval.measurement.texts import parse_json

    out = []
    for f in result_files(paths):
        try:
            doc = parse_json(f.read_text(encoding="utf-8"), str(f))
        except UnicodeDecodeError as exc:
            reason = f"not UTF-8: {exc.reason} at byte {exc.start}"
        except RepgeomError as exc:
            reason = str(exc).removeprefix(f"{f}: ")
        else:
            reason = None
        if reason is not None:
            raise RepgeomError(f"{f} is not a JSON results file ({reason}); pass the .json a repgeom command wrote "
                               "with --output")
        if not isinstance(doc, dict):
            raise RepgeomError(f"{f} holds a JSON {type(doc).__name__}, not a repgeom results object")
        out.append((f, doc))
    return out


# -- HTML pieces: repgeom_eval/analyses/report_html.py --------------------------------------------------------------

def _model_name(doc: dict[str, Any]) -> str:
    kind = classify(doc)
    if kind == "lm-eval":
        return str(doc.get("model_name") or (doc.get("config") or {}).get("model_args", "?"))
    if kind == report_sources.MTEB_KIND:
        return Path(doc["folder"]).name
    if kind == "slices":
        return Path(str(doc.get("source", "?"))).name
    if kind == "gap":
        return ", ".join(Path(str(m)).name for m in (doc.get("config") or {}).get("models", []))
    if doc.get("models"):
        return ", ".join(Path(str(m.get("name", "?"))).name for m in doc["models"])
    return Path(str((doc.get("model") or {}).get("name", "?"))).name


# -- one renderer per kind --------------------------------------------------------------------------------------

def _scalars(per_metric: dict[str, Any]) -> dict[str, float]:
    """A measure row's scalar values; a metric returning a dict contributes its scalar entries as metric.key."""
    out: dict[str, float] = {}
    for m, v in per_metric.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[m] = v
        elif isinstance(v, dict):
            out.update({f"{m}.{k}": x for k, x in v.items() if isinstance(x, (int, float)) and not isinstance(x, bool)})
    return out


@renderer("measure")
def _measure(doc: dict[str, Any]) -> list[str]:
    from repgeom_eval.output.plotting import plot_profile

    results = {a: _scalars(per) for a, per in doc["results"].items()}
    metrics: list[str] = []
    for per in results.values():
        metrics += [m for m in per if m not in metrics]
    blocks = [table(["address", *metrics], [[a, *[results[a].get(m) for m in metrics]] for a in results])]
    if metrics and len(results) > 1:
        with tempfile.TemporaryDirectory() as tmp:
            path = plot_profile(doc | {"results": results}, Path(tmp) / "profile.png", metrics=metrics)
            blocks.append(png_file(path, "metrics by depth"))
    for name, s in (doc.get("summary") or {}).items():
        if isinstance(s, dict):
            scalars = _scalars(s)
            if scalars:
                shown = ", ".join(f"{k} = {fmt(v)}" for k, v in scalars.items())
                blocks.append(para(f"{name} across layers: {shown}"))
    return blocks


@renderer("gap")
def _gap(doc: dict[str, Any]) -> list[str]:
    rows = doc["results"]
    cfg = doc.get("config", {})
    blocks = [para(f"G = within(T) + between(T, T̄); T = {cfg.get('domain')}, T̄ = {cfg.get('reference')}, "
                   f"{cfg.get('distance')} distance, ranked by G (descending)."),
              table(["rank", "model", "G", "within(T)", "between", "accuracy"],
                    [[r.get("rank"), r.get("model"), r.get("G"), r.get("within_T"), r.get("between"),
                      r.get("accuracy")] for r in rows])]
    if doc.get("spearman"):
        blocks.append(para(f"Spearman ρ(G, accuracy) = {fmt(doc['spearman'].get('rho'))} over "
                           f"{doc['spearman'].get('n')} models."))
    return blocks


@renderer("ppl-bins")
def _ppl_bins(doc: dict[str, Any]) -> list[str]:
    res = doc["results"]
    pooled = res["pooled"]
    sources = [s for s, r in (res.get("by_source") or {}).items() if "correlation" in r]
    rows = [[a, pooled["correlation"][a]["pearson"], pooled["correlation"][a]["spearman"],
             *[res["by_source"][s]["correlation"][a][k] for s in sources for k in ("pearson", "spearman")]]
            for a in res["layers"]]
    cfg = doc["config"]
    rule = cfg.get("group_size_rule")
    return [para(f"{pooled.get('n_chunks')} chunks of {cfg.get('chunk_len')} tokens"
                 + (f" ({cfg['sampling']})" if cfg.get("sampling") else "")
                 + f", groups of {cfg.get('group_size')}" + (f" ({rule})" if rule and rule != "given" else "")
                 + f", {pooled.get('n_selected')} of {pooled.get('n_groups')} perplexity groups selected "
                 "(Algorithm 1); correlation between group perplexity and group token dispersion "
                 "(r: Pearson, ρ: Spearman)."),
            table(["address", "Pearson r", "Spearman ρ", *[f"{s} {k}" for s in sources for k in ("r", "ρ")]],
                  rows),
            figure(plots.figure_ppl_vs_dispersion(doc), "perplexity vs dispersion"),
            figure(plots.figure_correlation_vs_depth(doc), "correlation by depth")]


@renderer("knn-keys")
def _knn_keys(doc: dict[str, Any]) -> list[str]:
    res = doc["results"]
    ns = doc["config"]["ns"]
    rows = []
    for name in res["candidates"]:
        cells = []
        for n in ns:
            r = next(r for r in res["table"] if r["address"] == name and r["N"] == n)
            cells.append(f"{fmt(r['mean'])} ± {fmt(r['std'])}")
        rows.append([name + (" (recommended)" if name == res["recommended"] else ""), *cells])
    return [para(f"Dispersion of last-token vectors, mean ± std over {doc['config'].get('n_seeds')} seeds; "
                 f"recommended key: {res['recommended']}."),
            table(["candidate", *[f"N={n}" for n in ns]], rows),
            figure(plots.figure_knn_keys(doc), "kNN-LM key candidates")]


@renderer("knnlm")
def _knnlm(doc: dict[str, Any]) -> list[str]:
    res = doc["results"]
    lambdas = doc["config"]["lambdas"]
    rows = [["(LM alone)", "", *[res["base_ppl"]] * len(lambdas), ""]]
    for name, r in res["keys"].items():
        rows.append([name, r["datastore"]["n_keys"], *[r["ppl"][str(lam)] for lam in lambdas], r["hit_rate"]])
    return [para(f"Perplexity on {res['n_eval_tokens']} tokens with k = {doc['config'].get('k')}, "
                 f"T = {doc['config'].get('temperature')} ({doc['config'].get('distance')})."),
            table(["key", "datastore keys", *[f"ppl λ={lam:g}" for lam in lambdas], "target among neighbours"],
                  rows)]


@renderer("condensation")
def _condensation(doc: dict[str, Any]) -> list[str]:
    rows = [[label, m["mean_cosine"][0], m["mean_cosine"][-1], m["spearman"], m["kendall"]]
            for label, m in doc["results"]["models"].items()]
    return [table(["model", "mean cosine (first)", "mean cosine (last)", "Spearman ρ", "Kendall τ"], rows),
            figure(plots.figure_condensation(doc), "condensation by depth")]


@renderer("clusters")
def _clusters(doc: dict[str, Any]) -> list[str]:
    res = doc["results"]
    cfg = doc.get("config", {})
    rows = [[label, a, m["within"][i], m["between"][i], m["ratio"][i]]
            for label, m in res["models"].items() for i, a in enumerate(m["layers"])]
    top = ", ".join(f"{c['ngram']!r} ×{c['count']}" for c in res["clusters"][:5])
    return [para(f"{len(res['clusters'])} clusters of {cfg.get('context_len')}-token contexts sharing a "
                 f"{cfg.get('ngram')}-gram continuation; most frequent: {top}."),
            table(["model", "address", "within", "between", "between / within"], rows),
            figure(plots.figure_clusters(doc), "within- and between-cluster distance")]


@renderer("perturb")
def _perturb(doc: dict[str, Any]) -> list[str]:
    res = doc["results"]
    last = res["layers"][-1]
    rows = [[sweep, v, r["prompt_entropy"][j][-1], r["token_dispersion"][j][-1]]
            for sweep, r in res["sweeps"].items() for j, v in enumerate(r["values"])]
    return [para(f"{doc.get('data', {}).get('n_prompts')} prompts; values at {last} (every address in the figure)."),
            table(["sweep", "value", "prompt entropy", "token dispersion"], rows),
            figure(plots.figure_perturb(doc), "prompt perturbations")]


def _experiment(doc: dict[str, Any], folder: Path) -> list[str]:
    """A finding of the reproduction gallery (experiments/*/results/result.json): its summary, figures (read from
    the result's folder) and tables."""
    blocks = [para(f"Mirrors {doc['mirrors']}." + (" Smoke run (tiny size)." if doc.get("smoke") else ""))]
    blocks.append(bullets(doc["summary"]))
    for fig in doc.get("figures") or []:
        png = folder / fig["file"]
        blocks.append(png_file(png, fig["caption"]) if png.is_file() else para(f"(figure {png} is missing)"))
        blocks.append(f'<p class="meta">{md(fig["caption"])}</p>')
    for t in doc.get("tables") or []:
        blocks += [f"<h3>{md(t['title'])}</h3>", table(t["header"], t["rows"])]
    for note in doc.get("notes") or []:
        blocks.append(para(note))
    blocks.append(f'<p class="meta"><code>{esc(doc["command"])}</code> · {esc(duration(float(doc["seconds"])))}</p>')
    return blocks


# -- the page ---------------------------------------------------------------------------------------------------

def section(path: Path, doc: dict[str, Any]) -> Section:
    kind = classify(doc)
    title = f"{kind}: {_model_name(doc)}" if kind != "unknown" else path.name
    versions = (doc.get("config") or {}).get("versions") or doc.get("versions") or {}
    version = doc.get("repgeom_version") or versions.get("repgeom_eval", "?")
    blocks = [f'<p class="meta">{esc(path.name)} · written by repgeom-eval {esc(version)}</p>']
    for w in warning_lines(doc.get("warnings")):
        blocks.append(f'<div class="warn">{md(w)}</div>')
    if kind == "experiment":
        title = f"{doc.get('title', path.parent.parent.name)} (experiment)"
    try:
        blocks += _experiment(doc, path.parent) if kind == "experiment" else RENDERERS.get(kind, generic)(doc)
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise RepgeomError(f"{path} looks like a {kind} result but lacks what its section needs ({exc!r}); was it "
                           "written by another repgeom version?") from None
    return title, blocks


def build_report(paths: Sequence[str | Path], title: str = "repgeom-eval report") -> str:
    """The HTML page for the result files (or directories of them) in ``paths``."""
    docs = collect(paths)
    sections = [section(p, d) for p, d in docs]
    nav = "".join(f'<li><a href="#s{i}">{esc(t)}</a></li>' for i, (t, _) in enumerate(sections))
    body = "".join(f'<section id="s{i}"><h2>{esc(t)}</h2>{"".join(b)}</section>' for i, (t, b) in enumerate(sections))
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f"<style>{_CSS}</style></head><body><h1>{esc(title)}</h1>"
            f'<p class="meta">{len(sections)} result file(s) · repgeom-eval {esc(__version__)} · {when}</p>'
            f"<nav><ul>{nav}</ul></nav>{body}</body></html>\n")


def write_report(paths: Sequence[str | Path], output: str | Path, title: str = "repgeom-eval report") -> Path:
    page = build_report(paths, title)
    with atomic_open(output, "w") as fh:
        fh.write(page)
    return Path(output)
