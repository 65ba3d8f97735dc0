"""Plots (matplotlib, headless). Imported only when a plot is requested."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.output.files import atomic_open


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RepgeomError("plots need matplotlib: pip install 'repgeom-eval[plot]'") from None
    return plt


def plot_profile(result: dict[str, Any], path: str | Path, metrics: Sequence[str] | None = None,
                 title: str | None = None) -> Path:
    """Each scalar metric against depth (addresses in the result's order), one panel per metric."""
    plt = pyplot()
    results = result["results"]
    addresses = list(results)
    if metrics is None:
        metrics = [m for m, v in next(iter(results.values())).items() if isinstance(v, (int, float))]
    fig, axes = plt.subplots(len(metrics), 1, figsize=(max(6.0, 0.28 * len(addresses) + 2), 2.8 * len(metrics)),
                             sharex=True, squeeze=False)
    xs = list(range(len(addresses)))
    for ax, metric in zip(axes[:, 0], metrics):
        ys = [results[a].get(metric) for a in addresses]
        ys = [float("nan") if y is None else y for y in ys]
        ax.plot(xs, ys, marker="o", ms=3)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xticks(xs)
    axes[-1, 0].set_xticklabels(addresses, rotation=70, fontsize=7)
    axes[-1, 0].set_xlabel("layer address (depth order)")
    model = result.get("model", {}).get("name", "")
    pooling = {m: c.get("pooling") for m, c in result.get("config", {}).get("metrics", {}).items() if c.get("pooling")}
    shown = ", ".join(f"{m}: {p}" for m, p in pooling.items())
    fig.suptitle(title or f"{Path(str(model)).name}: geometry by depth" + (f" (pooling {shown})" if shown else ""))
    fig.tight_layout()
    with atomic_open(path, "wb") as fh:
        fig.savefig(fh, format="png", dpi=120)
    plt.close(fig)
    return Path(path)


def plot_slices(curve: dict[str, Any], path: str | Path, title: str | None = None) -> Path:
    """Controlled slices (``repgeom slices``): slice dispersion, and the slice's mean perplexities where known (the
    gold answers' given the prompts, the prompts' own), against the fraction of correct queries, mean ± s.e. over
    seeds."""
    plt = pyplot()
    xs = [100 * f for f in curve["fractions"]]
    panels = [("dispersion", "slice dispersion D")]
    if curve.get("perplexity_mean"):
        panels.append(("perplexity", "slice mean answer perplexity"))
    if curve.get("prompt_perplexity_mean"):
        panels.append(("prompt_perplexity", "slice mean prompt perplexity"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        ax.errorbar(xs, curve[f"{key}_mean"], yerr=curve[f"{key}_se"], marker="o", ms=4, capsize=3)
        ax.set_xlabel("correct queries in the slice (%)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    rho = curve.get("spearman")
    rho_text = "nan" if rho is None or rho != rho else f"{rho:.3f}"
    fig.suptitle(title or f"{curve['size']} queries per slice, {curve['seeds']} seeds; Spearman ρ = {rho_text}")
    fig.tight_layout()
    with atomic_open(path, "wb") as fh:
        fig.savefig(fh, format="png", dpi=120)
    plt.close(fig)
    return Path(path)


def plot_depth_profiles(rows: Sequence[dict[str, Any]], path: str | Path, x: str = "relative",
                        title: str | None = None) -> Path:
    """:func:`depth_profiles_figure` written to ``path`` (PNG)."""
    plt = pyplot()
    fig = depth_profiles_figure(rows, x, title)
    with atomic_open(path, "wb") as fh:
        fig.savefig(fh, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def depth_profiles_figure(rows: Sequence[dict[str, Any]], x: str = "relative", title: str | None = None) -> Any:
    """Depth profiles of several models overlaid: one panel per metric (and task, when several tasks give it), one
    line per model (and source, when several sources give the panel), a shared x axis: ``relative`` depth (0 =
    embeddings, 1 = the deepest position) or the ``layer`` index (depth). Rows without a depth are left out.
    Legends sit outside the axes, so that no line is hidden."""
    from repgeom_eval.output.results_table import column_labels, identity

    key = "relative_depth" if x == "relative" else "depth"
    names = column_labels(rows)  # one line per model and recipe, as the table has one column each
    panels: dict[tuple[str, str], dict[str, list[tuple[float, float]]]] = {}
    for r in rows:
        if r.get(key) is None or r.get("value") is None:
            continue
        split = f" {r['split']}" if r.get("split") else ""
        panel = panels.setdefault((r["metric"], f"{r['task']}{split}"), {})
        line = names[identity(r)]
        panel.setdefault(f"{line} [{r['source']}]", []).append((float(r[key]), float(r["value"])))
    if not panels:
        raise RepgeomError("nothing to plot: no result has a layer depth (lm-eval values at an unknown layer, or "
                           "single numbers only)")
    plt = pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(8.5, 2.6 * len(panels) + 0.6), sharex=True, squeeze=False)
    for ax, ((metric, task), lines) in zip(axes[:, 0], sorted(panels.items())):
        sources = {name.rsplit(" [", 1)[1] for name in lines}
        for name, points in sorted(lines.items()):
            points.sort()
            shown = name if len(sources) > 1 else name.rsplit(" [", 1)[0]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3, label=shown)
        ax.set_ylabel(metric, fontsize=8)
        ax.set_title(f"{metric} · {task}", fontsize=9, loc="left")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)
    axes[-1, 0].set_xlabel("relative depth (0 = embeddings, 1 = last layer)" if x == "relative"
                           else "layer (0 = embeddings)")
    fig.suptitle(title or "depth profiles")
    fig.tight_layout()
    return fig
