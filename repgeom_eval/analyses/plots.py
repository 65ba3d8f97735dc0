"""Figures of the analyses, drawn from their JSON results (so ``repgeom report`` can redraw them from files).

Every ``figure_*`` function takes a result dict (``AnalysisResult.to_dict()`` or the loaded JSON) and returns a
matplotlib figure; :func:`save_png` writes it atomically, :func:`png_bytes` gives the bytes for embedding.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from repgeom_eval.output.files import atomic_open
from repgeom_eval.output.plotting import pyplot


def save_png(fig: Any, path: str | Path, dpi: int = 110) -> Path:
    plt = pyplot()
    try:
        with atomic_open(path, "wb") as fh:
            fig.savefig(fh, format="png", dpi=dpi, bbox_inches="tight")  # legends outside the axes included
    finally:
        plt.close(fig)
    return Path(path)


def png_bytes(fig: Any, dpi: int = 100) -> bytes:
    plt = pyplot()
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    finally:
        plt.close(fig)
    return buf.getvalue()


def outside_legend(ax: Any, fontsize: int = 7) -> None:
    """The legend right of the axes, where it hides no data (the figure is saved with ``bbox_inches="tight"``); on
    an axes with another panel to its right, where matplotlib finds the least data (``best``)."""
    if not ax.get_legend_handles_labels()[0]:
        return
    spec = ax.get_subplotspec() if hasattr(ax, "get_subplotspec") else None
    rightmost = spec is None or spec.colspan.stop == spec.get_gridspec().ncols
    if rightmost:
        ax.legend(fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)
    else:
        ax.legend(fontsize=fontsize, loc="best", framealpha=0.8)


def finish_axes(ax: Any, xlabel: str | None, ylabel: str, legend_fontsize: int = 7) -> None:
    """How every line and scatter panel ends: its axis labels (no ``xlabel``: the tick labels say it), a light grid
    and the legend outside."""
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    outside_legend(ax, fontsize=legend_fontsize)


def titled(fig: Any, title: str) -> Any:
    """``fig`` under its title, laid out: how every figure with several panels ends."""
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _model_name(result: dict[str, Any]) -> str:
    name = (result.get("model") or {}).get("name", "")
    return Path(str(name)).name


def _nan(v: Any) -> float:
    return float("nan") if v is None else float(v)


# -- ppl-bins ---------------------------------------------------------------------------------------------------

def ppl_plot_layers(result: dict[str, Any], max_panels: int = 3) -> list[str]:
    """The last address, plus the addresses with the strongest positive and negative pooled Spearman."""
    res = result["results"]
    layers = res["layers"]
    corr = res["pooled"]["correlation"]
    chosen = [layers[-1]]
    finite = [a for a in layers if corr[a]["spearman"] is not None and not math.isnan(_nan(corr[a]["spearman"]))]
    if finite:
        for pick in (max(finite, key=lambda a: corr[a]["spearman"]), min(finite, key=lambda a: corr[a]["spearman"])):
            if pick not in chosen:
                chosen.append(pick)
    return chosen[:max_panels]


def figure_ppl_vs_dispersion(result: dict[str, Any], layers: Sequence[str] | None = None) -> Any:
    """Paper A Fig. 3: group mean perplexity vs group mean token dispersion, one panel per address."""
    plt = pyplot()
    res = result["results"]
    layers = list(layers or ppl_plot_layers(result))
    fig, axes = plt.subplots(1, len(layers), figsize=(4.6 * len(layers), 3.8), squeeze=False)
    by_source = {s: r for s, r in (res.get("by_source") or {}).items() if "groups" in r}
    for ax, addr in zip(axes[0], layers):
        pooled = res["pooled"]
        c = pooled["correlation"][addr]
        ax.scatter([g["mean_ppl"] for g in pooled["groups"]], [g["dispersion"][addr] for g in pooled["groups"]],
                   s=14, c="black", marker="x" if by_source else "o", alpha=0.7,
                   label=f"pooled: r={_nan(c['pearson']):.2f}, ρ={_nan(c['spearman']):.2f}")
        for k, (s, r) in enumerate(by_source.items()):
            cs = r["correlation"][addr]
            ax.scatter([g["mean_ppl"] for g in r["groups"]], [g["dispersion"][addr] for g in r["groups"]], s=14,
                       alpha=0.7, color=f"C{k}",
                       label=f"{s}: r={_nan(cs['pearson']):.2f}, ρ={_nan(cs['spearman']):.2f}")
        ax.set_title(addr)
        finish_axes(ax, "group mean perplexity", "group mean token dispersion")
    cfg = result.get("config", {})
    return titled(fig, f"{_model_name(result)}: perplexity vs dispersion "
                       f"(chunks of {cfg.get('chunk_len')} tokens, groups of {cfg.get('group_size')})")


def figure_correlation_vs_depth(result: dict[str, Any]) -> Any:
    """Paper A Fig. 5: Pearson and Spearman correlation of perplexity and dispersion at every address."""
    plt = pyplot()
    res = result["results"]
    layers = res["layers"]
    xs = list(range(len(layers)))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.25 * len(layers) + 3), 3.6))
    corr = res["pooled"]["correlation"]
    pre = "pooled " if res.get("by_source") else ""
    ax.plot(xs, [_nan(corr[a]["pearson"]) for a in layers], color="black", marker="o", ms=3, label=f"{pre}Pearson")
    ax.plot(xs, [_nan(corr[a]["spearman"]) for a in layers], color="dimgrey", ls=":", marker="s", ms=3,
            label=f"{pre}Spearman")
    for k, (s, r) in enumerate((res.get("by_source") or {}).items()):
        if "correlation" in r:
            ax.plot(xs, [_nan(r["correlation"][a]["spearman"]) for a in layers], color=f"C{k}", ls="--", lw=1,
                    label=f"{s} Spearman")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_ylim(-1.05, 1.05)
    ax.set_xticks(xs)
    ax.set_xticklabels(layers, rotation=70, fontsize=7)
    finish_axes(ax, None, "corr(perplexity, dispersion)")
    ax.set_title(f"{_model_name(result)}: correlation by depth", fontsize=10)
    fig.tight_layout()
    return fig


# -- knn-keys ---------------------------------------------------------------------------------------------------

def figure_knn_keys(result: dict[str, Any]) -> Any:
    """Mean ± std (over seeds) dispersion of last-token vectors per candidate key, against the sample size N."""
    plt = pyplot()
    res = result["results"]
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    for k, name in enumerate(res["candidates"]):
        rows = [r for r in res["table"] if r["address"] == name]
        ax.errorbar([r["N"] for r in rows], [_nan(r["mean"]) for r in rows], yerr=[_nan(r["std"]) for r in rows],
                    marker="o", ms=4, capsize=3, color=f"C{k}",
                    label=name + (" (recommended)" if name == res["recommended"] else ""))
    ax.set_xscale("log")
    ax.set_xticks(sorted({r["N"] for r in res["table"]}))
    ax.get_xaxis().set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    finish_axes(ax, "chunks per sample (N)", "dispersion of last-token keys", legend_fontsize=8)
    ax.set_title(f"{_model_name(result)}: kNN-LM key candidates "
                 f"({result.get('config', {}).get('n_seeds')} seeds)", fontsize=10)
    fig.tight_layout()
    return fig


# -- condensation -----------------------------------------------------------------------------------------------

def figure_condensation(result: dict[str, Any]) -> Any:
    """Paper C Fig. 2: per model a layer × cosine heatmap of the cosine histograms (log density), and below, the
    mean cosine against relative depth for every model, with Spearman ρ and Kendall τ in the legend."""
    import numpy as np

    plt = pyplot()
    res = result["results"]
    models = res["models"]
    edges = res["edges"]
    n = len(models)
    fig = plt.figure(figsize=(max(6.0, 3.6 * n), 6.8))
    grid = fig.add_gridspec(2, n, height_ratios=[1.4, 1.0])
    for k, (label, m) in enumerate(models.items()):
        ax = fig.add_subplot(grid[0, k])
        dens = np.asarray([[_nan(v) for v in row] for row in m["density"]], dtype=float)
        img = ax.imshow(np.log10(dens + 1e-3), aspect="auto", origin="lower", cmap="viridis",
                        extent=(edges[0], edges[-1], -0.5, len(m["layers"]) - 0.5))
        step = max(1, len(m["layers"]) // 8)
        ax.set_yticks(range(0, len(m["layers"]), step))
        ax.set_yticklabels(m["layers"][::step], fontsize=7)
        ax.set_xlabel("cosine similarity")
        ax.set_title(label, fontsize=9)
        fig.colorbar(img, ax=ax, fraction=0.05, pad=0.02).set_label("log10 density", fontsize=7)
    ax = fig.add_subplot(grid[1, :])
    for k, (label, m) in enumerate(models.items()):
        ax.plot(m["relative_depth"], [_nan(v) for v in m["mean_cosine"]], marker="o", ms=3, color=f"C{k}",
                label=f"{label}: ρ={_nan(m['spearman']):.2f}, τ={_nan(m['kendall']):.2f}")
    finish_axes(ax, "relative depth (layer index / L)", "mean token cosine")
    return titled(fig, f"embedding condensation by depth ({result.get('data', {}).get('n_texts')} texts, "
                       f"≤ {result.get('config', {}).get('max_length')} tokens each)")


# -- clusters ---------------------------------------------------------------------------------------------------

def figure_clusters(result: dict[str, Any]) -> Any:
    """Within- and between-cluster cosine distance against relative depth, one line per model; with several models
    (a checkpoint series) a third panel shows both at the last address against the checkpoint."""
    plt = pyplot()
    models = result["results"]["models"]
    series = len(models) > 1
    fig, axes = plt.subplots(1, 3 if series else 2, figsize=(13.5 if series else 9.5, 3.6), squeeze=False)
    for k, (label, m) in enumerate(models.items()):
        for ax, key in zip(axes[0], ("within", "between")):
            ax.plot(m["relative_depth"], [_nan(v) for v in m[key]], marker="o", ms=3, color=f"C{k}", label=label)
    for ax, key in zip(axes[0], ("within-cluster", "between-cluster")):
        finish_axes(ax, "relative depth (layer index / L)", f"{key} cosine distance")
    if series:
        ax = axes[0, 2]
        xs = list(range(len(models)))
        ax.plot(xs, [_nan(m["within"][-1]) for m in models.values()], marker="o", label="within")
        ax.plot(xs, [_nan(m["between"][-1]) for m in models.values()], marker="s", label="between")
        ax.set_xticks(xs)
        ax.set_xticklabels(list(models), rotation=30, fontsize=7)
        finish_axes(ax, None, f"distance at {next(iter(models.values()))['layers'][-1]}")
    cfg = result.get("config", {})
    return titled(fig, f"{len(result['results']['clusters'])} clusters of contexts sharing a {cfg.get('ngram')}-gram "
                       f"continuation ({cfg.get('context_len')}-token contexts)")


# -- perturb ----------------------------------------------------------------------------------------------------

def figure_perturb(result: dict[str, Any]) -> Any:
    """Paper B §5: prompt entropy (top) and token dispersion (bottom) against depth, one panel per sweep, one line
    per perturbation strength (darker = stronger)."""
    plt = pyplot()
    res = result["results"]
    layers = res["layers"]
    sweeps = res["sweeps"]
    xs = [i / max(1, len(layers) - 1) for i in range(len(layers))]
    fig, axes = plt.subplots(2, len(sweeps), figsize=(4.4 * len(sweeps), 6.4), squeeze=False, sharex=True)
    for col, (sweep, r) in enumerate(sweeps.items()):
        n = len(r["values"])
        for j, v in enumerate(r["values"]):
            color = plt.cm.viridis(0.85 * (1 - j / max(1, n - 1)))
            label = f"L={v:g}" if sweep == "length" else f"p={v:g}"
            for row, key in enumerate(("prompt_entropy", "token_dispersion")):
                axes[row, col].plot(xs, [_nan(y) for y in r[key][j]], color=color, marker="o", ms=2.5, label=label)
        axes[0, col].set_title(sweep, fontsize=10)
        axes[1, col].set_xlabel("relative depth")
        outside_legend(axes[0, col], fontsize=7)
    axes[0, 0].set_ylabel("prompt entropy (normalized)")
    axes[1, 0].set_ylabel("token dispersion")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    return titled(fig, f"{_model_name(result)}: prompt perturbations ({result.get('data', {}).get('n_prompts')} "
                       "prompts)")


def label_points(ax: Any, xs: Sequence[float], ys: Sequence[float], labels: Sequence[str], fontsize: int = 7) -> int:
    """Label scatter points without overlapping labels: each label tries a few offsets around its point and takes
    the first whose box touches no label already placed; a label with no free place is left out. Returns how many
    were placed. Call after the axes' limits and scales are final."""
    fig = ax.figure
    fig.canvas.draw()  # the transforms (log scales, limits) are final only once drawn
    renderer = fig.canvas.get_renderer()
    offsets = [(4, 4), (4, -11), (-4, 4), (-4, -11), (4, 14), (-4, -21)]
    placed: list[Any] = []
    count = 0
    for x, y, text in sorted(zip(xs, ys, map(str, labels)), key=lambda p: (p[0], p[1])):
        for dx, dy in offsets:
            ann = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=fontsize,
                              ha="left" if dx > 0 else "right")
            box = ann.get_window_extent(renderer).expanded(1.05, 1.1)
            if not any(box.overlaps(other) for other in placed):
                placed.append(box)
                count += 1
                break
            ann.remove()
    return count
