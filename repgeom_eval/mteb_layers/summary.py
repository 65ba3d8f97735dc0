"""Per-layer tables and plots built from mteb's cache folder.

Each layer is its own mteb model name, so mteb's ``BenchmarkResults.to_dataframe()`` shows one column per layer;
this module reads the cache files itself to put the layers of one model side by side: every folder whose
``model_meta.json`` has a ``layer`` in its ``loader_kwargs`` (the name is then ``org/model@layer=...``), or in its
``experiment_kwargs`` (results written before each layer had its own name, in ``experiments/<name>/`` folders), is
one layer of one model, and each ``<Task>.json`` in it holds the scores, the ``repgeom_*`` geometry and the
``repgeom.*`` values of requested metrics of that layer. Outputs: a long CSV (one
row per model, recipe, layer, task, split and subset), a Markdown report (one table per task: layers × main score,
geometry and metrics, with the best layer against the last one), and one plot per model and recipe (score, geometry
and metrics against depth).

The name of the main score is not in mteb's result file (only its value is): it is read from the
``repgeom_main_score_name`` key that ``repgeom mteb run`` writes beside it, else from mteb's task registry (which
knows only mteb's own tasks, not the local tasks of a ``--tasks-file``).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.output.files import atomic_open

from .geometry import GEOMETRY_KEYS, MAIN_SCORE_NAME_KEY
from .metrics import RESULT_PREFIX, metric_keys

COLUMNS = ("model", "revision", "pooling", "normalize", "max_length", "preprocess", "preprocess_stats", "layer",
           "depth", "task", "split", "subset", "main_score_name", "main_score", *GEOMETRY_KEYS, "repgeom_n_texts")
PLOTTED = ("main_score", "repgeom_dataset_entropy", "repgeom_dispersion", "repgeom_effective_rank")
_LABELS = {"main_score": "main score", "repgeom_dataset_entropy": "dataset entropy (normalised)",
           "repgeom_dispersion": "dispersion", "repgeom_effective_rank": "effective rank (RankMe)"}


def _main_score_name(task: str, cache: dict[str, str | None]) -> str | None:
    if task not in cache:
        try:
            import mteb

            cache[task] = mteb.get_task(task).metadata.main_score
        except Exception:  # noqa: BLE001 - a local task mteb does not know
            cache[task] = None
    return cache[task]


def summarize(folder: str | Path) -> list[dict[str, Any]]:
    """One row per (model, recipe, layer, task, split, subset) found under ``folder`` (an mteb cache or output
    folder), sorted by model, recipe, task and depth."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise RepgeomError(f"results folder {str(root)!r} not found")
    rows: list[dict[str, Any]] = []
    names: dict[str, str | None] = {}
    for meta_file in sorted(root.rglob("model_meta.json")):
        try:
            meta = json.loads(meta_file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        exp, model = meta.get("experiment_kwargs") or {}, meta.get("name")
        if "layer" not in exp:  # today's layout: the layer and recipe are in the name and in loader_kwargs
            exp = {k: v for k, v in (meta.get("loader_kwargs") or {}).items() if k != "model"}
            model = str(model).split("@", 1)[0]
        if "layer" not in exp:
            continue  # not a layer result (e.g. an ordinary mteb run)
        for result_file in sorted(meta_file.parent.glob("*.json")):
            if result_file.name == "model_meta.json":
                continue
            try:
                result = json.loads(result_file.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                continue
            task = result.get("task_name", result_file.stem)
            for split, subsets in (result.get("scores") or {}).items():
                for scores in subsets:
                    declared = scores.get(MAIN_SCORE_NAME_KEY) or _main_score_name(task, names)
                    row = {"model": model, "revision": meta.get("revision"),
                           "pooling": exp.get("pooling"), "normalize": exp.get("normalize"),
                           "max_length": exp.get("max_length", meta.get("max_tokens")),
                           "preprocess": exp.get("preprocess", "none"),
                           "preprocess_stats": exp.get("preprocess_stats"), "layer": exp["layer"],
                           "depth": scores.get("repgeom_depth"), "task": task, "split": split,
                           "subset": scores.get("hf_subset"), "main_score_name": declared,
                           "main_score": scores.get("main_score")}
                    row.update({k: scores.get(k) for k in (*GEOMETRY_KEYS, "repgeom_n_texts")})
                    row.update({k: scores[k] for k in metric_keys(scores)})
                    rows.append(row)
    if not rows:
        raise RepgeomError(f"no layer results under {str(root)!r} (expected mteb cache folders written by "
                           "`repgeom mteb run`)")
    rows.sort(key=lambda r: (str(r["model"]), str(r["revision"]), _family(r), r["task"], r["split"],
                             str(r["subset"]), _num(r["depth"]), r["layer"]))
    return rows


def metric_columns(rows: Iterable[dict[str, Any]]) -> list[str]:
    """The ``repgeom.*`` metric keys found in ``rows``, sorted."""
    return sorted({k for r in rows for k in r if k.startswith(RESULT_PREFIX)})


def metric_label(key: str) -> str:
    """``repgeom.dataset_entropy.normalized`` → ``dataset_entropy.normalized`` (table headers)."""
    return key[len(RESULT_PREFIX):]


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and x is not None and not math.isnan(float(x)) else math.inf


def _family(row: dict[str, Any]) -> str:
    out = f"pooling {row['pooling']}, normalize {row['normalize']}"
    out += f", max_length {row['max_length']}" if row.get("max_length") is not None else ""
    if row.get("preprocess", "none") != "none":
        out += f", preprocess {row['preprocess']} ({row.get('preprocess_stats')} statistics)"
    return out


def fmt_number(x: Any) -> str:
    """A score or geometry value in the summary tables: missing and NaN as a dash."""
    from repgeom_eval.output.console import fmt_number as fmt

    return fmt(x, missing="—", nan="—")


def rows_by_group(rows: Iterable[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, list[dict[str, Any]]]]:
    """(model, revision, recipe) → task label → rows in depth order."""
    out: dict[tuple[str, str, str], dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        label = r["task"] if (r["split"], r["subset"]) in (("test", "default"), ("test", None)) else \
            f"{r['task']} ({r['split']}, {r['subset']})"
        out[(str(r["model"]), str(r["revision"]), _family(r))][label].append(r)
    return out


def best_vs_last(task_rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The best-scoring layer against the deepest one (the usual embedding) of one task's rows."""
    scored = [r for r in task_rows if isinstance(r["main_score"], (int, float)) and not math.isnan(r["main_score"])]
    if len(scored) < 2:
        return None
    last = max(scored, key=lambda r: _num(r["depth"]) if _num(r["depth"]) != math.inf else -1)
    best = max(scored, key=lambda r: r["main_score"])
    return {"best_layer": best["layer"], "best_score": best["main_score"], "last_layer": last["layer"],
            "last_score": last["main_score"], "gain": best["main_score"] - last["main_score"],
            "intermediate_wins": best["layer"] != last["layer"] and best["main_score"] > last["main_score"]}


def to_csv(rows: list[dict[str, Any]]) -> str:
    """The long table: fixed columns, then one column per metric key found (``repgeom.<metric>[.<sub>]``)."""
    columns = [*COLUMNS, *metric_columns(rows)]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in columns})
    return buf.getvalue()


def to_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["# MTEB scores and embedding geometry by layer", "",
             "Geometry is computed on the embeddings each task scored: dataset entropy = von Neumann entropy of the "
             "centred, unit embeddings / log min(N, D); dispersion = mean pairwise cosine distance; effective rank "
             "= RankMe; other columns are the requested metrics (`repgeom.<metric>` keys of the result files). "
             "The best layer is in bold.", ""]
    for (model, revision, family), tasks in rows_by_group(rows).items():
        lines += [f"## {model} @ {revision} ({family})", ""]
        wins = []
        for label, task_rows in tasks.items():
            name = task_rows[0]["main_score_name"] or "main score"
            verdict = best_vs_last(task_rows)
            extra = metric_columns(task_rows)
            lines += [f"### {label}", "",
                      f"| layer | depth | {name} | dataset entropy | dispersion | effective rank | texts |"
                      + "".join(f" {metric_label(k)} |" for k in extra),
                      "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(extra)]
            for r in task_rows:
                score = fmt_number(r["main_score"])
                if verdict and r["layer"] == verdict["best_layer"]:
                    score = f"**{score}**"
                cells = [r["layer"], fmt_number(r["depth"]), score, fmt_number(r["repgeom_dataset_entropy"]),
                         fmt_number(r["repgeom_dispersion"]), fmt_number(r["repgeom_effective_rank"]),
                         fmt_number(r["repgeom_n_texts"]), *(fmt_number(r.get(k)) for k in extra)]
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
            if verdict:
                if verdict["intermediate_wins"]:
                    text = (f"Best layer {verdict['best_layer']} ({verdict['best_score']:.4f}) beats the last layer "
                            f"{verdict['last_layer']} ({verdict['last_score']:.4f}) by {verdict['gain']:+.4f}.")
                    wins.append(label)
                else:
                    text = f"The last layer {verdict['last_layer']} ({verdict['last_score']:.4f}) is the best layer."
                lines += [text, ""]
        if len(tasks) > 1:
            lines += [f"An intermediate layer beats the last one on {len(wins)} of {len(tasks)} tasks"
                      + (f": {', '.join(wins)}." if wins else "."), ""]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str | Path, title: str | None = None) -> Path:
    """Main score, the three geometry values and every metric key against depth, one line per task (rows of ONE
    model/recipe)."""
    from repgeom_eval.output.plotting import pyplot

    plt = pyplot()
    tasks = next(iter(rows_by_group(rows).values()))
    keys = [*PLOTTED, *metric_columns(rows)]
    fig, axes = plt.subplots(len(keys), 1, figsize=(7.0, 2.4 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        for label, task_rows in tasks.items():
            pts = [(r["depth"], r[key]) for r in task_rows if r["depth"] is not None and r.get(key) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label)
        ax.set_ylabel(_LABELS.get(key) or metric_label(key), fontsize=8)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7, loc="best")
    axes[-1, 0].set_xlabel("depth (hidden-state index: 0 = embeddings, L = last layer)")
    first = rows[0]
    fig.suptitle(title or f"{first['model']} ({_family(first)})", fontsize=10)
    fig.tight_layout()
    with atomic_open(path, "wb") as fh:
        fig.savefig(fh, format="png", dpi=120)
    plt.close(fig)
    return Path(path)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")


def write_summary(folder: str | Path, out_dir: str | Path | None = None, prefix: str = "repgeom_summary",
                  plots: bool = True) -> dict[str, Any]:
    """Write ``<prefix>.csv``, ``<prefix>.md`` and one ``<prefix>-<model>-<recipe>.png`` per model and recipe into
    ``out_dir`` (default: ``folder``). Returns the rows and the paths written."""
    rows = summarize(folder)
    out = Path(out_dir).expanduser() if out_dir is not None else Path(folder).expanduser()
    if out.exists() and not out.is_dir():
        raise RepgeomError(f"output folder {str(out)!r} is a file; pass a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file where a parent folder should be, no permission ...
        raise RepgeomError(f"cannot create output folder {str(out)!r}: {exc.strerror or exc}") from None
    paths = {"csv": out / f"{prefix}.csv", "markdown": out / f"{prefix}.md", "plots": []}
    with atomic_open(paths["csv"]) as fh:
        fh.write(to_csv(rows))
    with atomic_open(paths["markdown"]) as fh:
        fh.write(to_markdown(rows))
    if plots:
        for (model, revision, family), tasks in rows_by_group(rows).items():
            group_rows = [r for task_rows in tasks.values() for r in task_rows]
            png = out / f"{prefix}-{_slug(model)}-{_slug(revision)[:8]}-{_slug(family)}.png"
            paths["plots"].append(plot(group_rows, png))
    return {"rows": rows, "paths": paths}
