"""Sections of ``repgeom report`` for what other tools and commands write beside repgeom's results files: lm-eval's
``results_*.json`` (``lm_eval --output_path``), the per-layer folders of ``repgeom mteb run`` and the ``slices.json``
of ``repgeom slices``. lm-eval and MTEB outputs are read by the loader of ``repgeom compare``
(repgeom_eval/output/results_table.py), so a page and a comparison table show the same numbers."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from repgeom_eval.output.results_table import lmeval_rows, model_label

from .report_html import bullets, esc, figure, fmt, generic, para, png_file, table

MTEB_KIND = "mteb-layers"


def _profiles(rows: list[dict[str, Any]], title: str) -> list[str]:
    """Overlaid depth profiles (one panel per metric and task: each main-score type on its own axis)."""
    from repgeom_eval.output.plotting import depth_profiles_figure

    drawable = [r for r in rows if r.get("relative_depth") is not None or r.get("depth") is not None]
    by_panel: dict[tuple, set] = {}
    for r in drawable:
        by_panel.setdefault((r["metric"], r["task"], r.get("split")), set()).add(r.get("address"))
    if not any(len(addresses) > 1 for addresses in by_panel.values()):
        return []  # single points: the table says it all
    x = "relative" if all(r.get("relative_depth") is not None for r in drawable) else "layer"
    return [figure(depth_profiles_figure(drawable, x=x, title=title), title)]


def render_lmeval(doc: dict[str, Any]) -> list[str]:
    rows = lmeval_rows(doc, "")
    config = doc.get("config") or {}
    blocks = [para(f"lm-eval {esc(doc.get('lm_eval_version') or '')} · model arguments "
                   f"`{config.get('model_args', '')}` · {len(doc['results'])} task(s)")]
    shown = [[r["task"], r["metric"], r["address"] or "", r["value"], r["stderr"]] for r in rows]
    blocks.append(table(["task", "metric", "address", "value", "± s.e."], shown))
    geometry = [r for r in rows if r["kind"] == "geometry" and r["depth"] is not None]
    return blocks + _profiles(geometry, "lm-eval geometry by layer")


def render_mteb(doc: dict[str, Any]) -> list[str]:
    rows = doc["rows"]
    models = sorted({model_label(r) for r in rows})
    blocks = [para(f"`repgeom mteb run` results in {esc(doc.get('folder', ''))}: {len(models)} model(s) "
                   f"({', '.join(models)}), {len({r['task'] for r in rows})} task(s), "
                   f"{len({r['address'] for r in rows})} layer(s).")]
    scores = [r for r in rows if r["kind"] == "score"]
    geometry = sorted({r["metric"] for r in rows if r["kind"] == "geometry"})
    by_key = {(model_label(r), r["recipe"], r["task"], r["split"], r["subset"], r["address"], r["metric"]): r["value"]
              for r in rows}
    shown = []
    for r in scores:
        k = (model_label(r), r["recipe"], r["task"], r["split"], r["subset"], r["address"])
        shown.append([k[0], r["task"], r["split"], r["address"], r["metric"], r["value"],
                      *[by_key.get((*k, g)) for g in geometry]])
    blocks.append(table(["model", "task", "split", "layer", "main score", "value", *geometry], shown))
    best = _best_vs_last(scores)
    if best:
        blocks.append(bullets(best))
    return blocks + _profiles(rows, "MTEB main scores and geometry by depth")


def _best_vs_last(scores: list[dict[str, Any]]) -> list[str]:
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in scores:
        if r["depth"] is not None:
            groups.setdefault((model_label(r), r["recipe"], r["task"], r["split"], r["subset"]), []).append(r)
    lines = []
    for (model, _, task, split, _), rs in groups.items():
        if len(rs) < 2:
            continue
        last = max(rs, key=lambda r: r["depth"])
        best = max(rs, key=lambda r: r["value"])
        verdict = (f"an earlier layer, `{best['address']}`, beats the last (`{last['address']}`): "
                   f"{fmt(best['value'])} against {fmt(last['value'])}" if best is not last and
                   best["value"] > last["value"] else f"the last layer `{last['address']}` scores best "
                   f"({fmt(last['value'])})")
        lines.append(f"{model} · {task} ({split}), {best['metric']}: {verdict}")
    return lines


def render_slices(doc: dict[str, Any]) -> list[str]:
    """``repgeom slices --output``: the curve of slice dispersion against the fraction of correct queries."""
    curve = doc.get("slices")
    if not isinstance(curve, dict) or "fractions" not in curve:
        return generic(doc)
    from repgeom_eval.output.plotting import plot_slices

    blocks = [para(f"{doc.get('n_queries')} queries ({doc.get('n_correct')} correct) from "
                   f"`{doc.get('source')}`; slices of {curve['size']} queries, {curve['seeds']} seeds per "
                   f"fraction; Spearman ρ (fraction correct, mean slice dispersion) = {fmt(curve.get('spearman'))}, "
                   f"over all slices {fmt(curve.get('spearman_all_slices'))}.")]
    columns = [("dispersion", "slice dispersion"), ("perplexity", "answer perplexity"),
               ("prompt_perplexity", "prompt perplexity")]
    columns = [(k, label) for k, label in columns if curve.get(f"{k}_mean")]
    rows = [[f"{100 * f:.0f}%", *[f"{fmt(curve[f'{k}_mean'][i])} ± {fmt(curve[f'{k}_se'][i])}" for k, _ in columns]]
            for i, f in enumerate(curve["fractions"])]
    blocks.append(table(["correct", *[label for _, label in columns]], rows))
    cal = doc.get("calibration")
    if isinstance(cal, dict) and cal.get("mae_mean") is not None:
        blocks.append(para(f"Calibration: test MAE of slice accuracy predicted from slice dispersion "
                           f"{fmt(cal['mae_mean'])} ± {fmt(cal.get('mae_se'))} over {cal.get('seeds')} seeds "
                           f"(regressors chosen on validation: {', '.join(map(str, cal.get('chosen') or []))})."))
    if doc.get("notes"):
        blocks.append(bullets([str(n) for n in doc["notes"]]))
    with tempfile.TemporaryDirectory() as tmp:
        path = plot_slices(curve, Path(tmp) / "slices.png")
        blocks.append(png_file(path, "controlled slices"))
    return blocks


def is_slices(doc: Any) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("slices"), dict) and "fractions" in doc["slices"]


RENDERERS = {"lm-eval": render_lmeval, MTEB_KIND: render_mteb, "slices": render_slices}
