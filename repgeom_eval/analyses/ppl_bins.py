"""Perplexity vs token dispersion (paper A §2.1–2.2, Fig. 3 and Fig. 5; docs/metrics.md#perplexity-groups).

Per chunk of ``chunk_len`` tokens, ONE forward pass gives both the loss and every requested layer's token
vectors:

* perplexity = exp(mean next-token cross-entropy over the chunk's ``chunk_len − 1`` predicted positions), as HF's
  ``outputs.loss`` with ``labels = inputs``;
* token dispersion at each address = D over the chunk's token vectors (docs/metrics.md#token_dispersion, by the
  O(T·d) identity).

Algorithm 1 (paper A's ``step2_group_and_sample.py``): sort the chunks by perplexity, cut consecutive groups of
``group_size`` (dropping the incomplete tail), and if there are more than ``n_bins`` groups keep the groups nearest
to ``n_bins`` perplexity targets spaced evenly from the lowest to the highest group mean (bisect, ties go to the
right-hand neighbour, duplicates dropped). A group's value is the mean of its chunks' perplexities and the mean of
their dispersions. Pearson and Spearman correlations between group perplexity and group dispersion are reported
for every address.

Sampling: every chunk by default; ``n_chunks`` draws that many uniformly (paper A), so a source that gives few
chunks gets few; ``per_source`` draws the same number from every source instead (an error names the sources that
have fewer).

Group size: ``"auto"`` (the default) makes groups of (chunks of the smallest source) // ``PPL_BINS_GROUPS_PER_SOURCE``
chunks, between 1 and ``PPL_BINS_GROUP_SIZE_MAX`` (paper A's 100), so every source gets about that many groups
(the whole sample counts as one source when there is a single one); a number is used as given.

Sources: records may carry a ``source`` field. Correlations are then computed per source (each its own grouping)
and pooled; sources whose median perplexities differ by ``confound_ratio`` or more are flagged, because a pooled
correlation then mostly compares domains and can have the opposite sign of every per-source one (paper A analyses
one domain at a time).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from repgeom_eval.spec.options.model import ModelOptions
from repgeom_eval.output.progress import progress_bar

from ..spec.errors import RepgeomError
from ..functional.dispersion import token_dispersion
from repgeom_eval.functional.stats import complete_pairs, pearson, spearman
from repgeom_eval.output.files import write_jsonl
from repgeom_eval.modeling.loading import LoadedModel, load_model
from .corpus import (Chunk, Texts, check_context, corpus_chunks, describe, load_documents,
                     sample_chunks, sample_per_source)
from repgeom_eval.analyses.chunk_log import ChunkLog, chunks_digest
from repgeom_eval.measurement.checkpoint import model_identity
from repgeom_eval.measurement.distributed import Distributed
from repgeom_eval.measurement.forward import Forward, next_token_logprobs
from repgeom_eval.analyses.envelope import AnalysisResult
from repgeom_eval.modeling.addresses import resolve_request

KIND = "ppl-bins"
from repgeom_eval.spec.options.analyses import GROUP_SIZE_MAX, GROUPS_PER_SOURCE, PplBinsConfig
from repgeom_eval.spec.option_fields import takes_options

# The defaults under their earlier names (declared once, in PplBinsConfig)
DEFAULT_CHUNK_LEN, DEFAULT_GROUP_SIZE, DEFAULT_BINS, DEFAULT_SEED, DEFAULT_CONFOUND_RATIO = (
    PplBinsConfig().chunk_len, PplBinsConfig().group_size, PplBinsConfig().n_bins, PplBinsConfig().seed,
    PplBinsConfig().confound_ratio)
MIN_GROUPS = 3  # fewer points make a correlation meaningless


def uniform_ppl_groups(ppl: Sequence[float], group_size: int, n_bins: int = DEFAULT_BINS
                       ) -> tuple[list[list[int]], int]:
    """Algorithm 1 of paper A. Returns (selected groups as lists of chunk indices, in increasing perplexity;
    the number of complete groups before selection).

    Groups are consecutive runs of ``group_size`` chunks in perplexity order (stable sort; incomplete tail dropped).
    With more than ``n_bins`` groups, for each target of ``linspace(min, max, n_bins)`` over the group means the
    nearest group is kept (bisect_left; ties prefer the right neighbour), without duplicates.
    """
    if group_size < 1:
        raise RepgeomError(f"group size must be positive, got {group_size}")
    if n_bins < 1:
        raise RepgeomError(f"number of bins must be positive, got {n_bins}")
    order = sorted(range(len(ppl)), key=lambda i: ppl[i])
    groups = [order[lo:lo + group_size] for lo in range(0, len(order) - group_size + 1, group_size)]
    if len(groups) <= n_bins:
        return groups, len(groups)
    means = [float(np.mean([ppl[i] for i in g])) for g in groups]
    selected: set[int] = set()
    for target in np.linspace(means[0], means[-1], n_bins):
        pos = bisect.bisect_left(means, target)
        if pos == len(means):
            pos -= 1
        if pos > 0 and abs(means[pos - 1] - target) < abs(means[pos] - target):
            pos -= 1
        selected.add(pos)
    return [groups[i] for i in sorted(selected)], len(groups)


def auto_group_size(chunks_per_source: dict[str, int], groups: int = GROUPS_PER_SOURCE,
                    cap: int = GROUP_SIZE_MAX) -> tuple[int, str]:
    """The ``"auto"`` group size and the sentence that explains it: the smallest source's chunk count // ``groups``,
    clamped to [1, ``cap``], so that every source gets about ``groups`` groups (at least ``groups`` when the group
    size is not capped or floored)."""
    if not chunks_per_source:
        raise RepgeomError("no chunks to group")
    source, n = min(chunks_per_source.items(), key=lambda kv: (kv[1], kv[0]))
    size = max(1, min(cap, n // groups))
    whose = f"source {source!r}, the smallest," if len(chunks_per_source) > 1 else "the sample"
    clamp = " (capped)" if n // groups > cap else (" (at least 1)" if n // groups < 1 else "")
    return size, (f"auto: {whose} has {n} chunks, // {groups} groups per source = {size}{clamp}, "
                  f"between 1 and {cap}")


def check_group_size(group_size: int | str) -> None:
    ok = (group_size == "auto" if isinstance(group_size, str) else
          not isinstance(group_size, bool) and isinstance(group_size, (int, np.integer)) and group_size >= 1)
    if not ok:
        raise RepgeomError(f"group size must be a positive number of chunks or 'auto', got {group_size!r}")


def resolve_group_size(group_size: int | str, chunks_per_source: dict[str, int]) -> tuple[int, str]:
    """(group size, how it was chosen) for an explicit number (used as given) or ``"auto"``."""
    check_group_size(group_size)
    if group_size == "auto":
        return auto_group_size(chunks_per_source)
    return int(group_size), "given"


def chunk_statistics(loaded: LoadedModel, chunks: Sequence[Chunk], addresses: Sequence[Any], batch_size: int = 4,
                     progress: bool = True, dist: Distributed | None = None,
                     log: ChunkLog | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(perplexity [N], token dispersion [N, n_addresses]) of every chunk; one forward pass per batch.

    Under ``torch.distributed`` (``dist``), batch ``b`` runs on rank ``b % world`` — the same batches as one
    process, so the same numbers — and the per-chunk rows are gathered on rank 0; other ranks get empty arrays.
    With a ``log`` (``--run-dir``), batches whose chunks it holds are read back instead of run, and every batch
    run is appended to it (analyses/chunk_log.py).
    """
    dist = dist or Distributed()
    ppl = np.full(len(chunks), np.nan, dtype=np.float64)
    disp = np.full((len(chunks), len(addresses)), np.nan, dtype=np.float64)
    mine = [(b, lo) for b, lo in enumerate(range(0, len(chunks), batch_size)) if dist.owns(b)]
    if log is not None:
        for i, (p, d) in log.done.items():
            if i < len(chunks):
                ppl[i], disp[i] = p, d
        mine = [(b, lo) for b, lo in mine
                if not all(i in log.done for i in range(lo, min(lo + batch_size, len(chunks))))]
    with Forward.at(loaded, addresses, logits=True) as runner, progress_bar(
            total=sum(min(batch_size, len(chunks) - lo) for _, lo in mine), unit="chunk", desc="ppl-bins",
            progress=progress, disable=not dist.is_main) as bar:
        for _, lo in mine:
            batch = chunks[lo:lo + batch_size]
            out = runner.token_ids([c.ids for c in batch])
            logprob, valid = next_token_logprobs(out.logits, out.ids, out.mask)
            nll = -(logprob.sum(1) / valid.sum(1).clamp(min=1))
            ppl[lo:lo + len(batch)] = torch.exp(nll).numpy()
            for j, addr in enumerate(addresses):
                values, _ = token_dispersion(out.hidden[addr], out.mask.to(out.hidden[addr].device))
                disp[lo:lo + len(batch), j] = values.cpu().numpy()
            if log is not None:
                rows = range(lo, lo + len(batch))
                log.append(rows, ppl[rows.start:rows.stop], disp[rows.start:rows.stop])
            bar.update(len(batch))
    if not dist.active:
        return ppl, disp
    rows = [lo + i for _, lo in mine for i in range(min(batch_size, len(chunks) - lo))]
    parts = dist.gather((rows, ppl[rows], disp[rows]))
    if parts is None:
        return np.empty(0), np.empty((0, len(addresses)))
    for rows, p, d in parts:
        ppl[rows], disp[rows] = p, d
    return ppl, disp


def correlations(x: Sequence[float], y: Sequence[float]) -> dict[str, float]:
    """Pearson and Spearman over the complete pairs, and ``n``, the number of those pairs."""
    pairs = complete_pairs(x, y)
    return {"pearson": pearson(pairs.x, pairs.y), "spearman": spearman(pairs.x, pairs.y), "n": pairs.n}


def bin_and_correlate(ppl: np.ndarray, disp: np.ndarray, layers: Sequence[str], group_size: int, n_bins: int,
                      max_ppl: float | None = None) -> dict[str, Any]:
    """Algorithm 1 on one population of chunks, group means, and the correlations per layer.

    Raises :class:`RepgeomError` if fewer than 3 groups remain (the message says how to get more)."""
    groups, n_groups = uniform_ppl_groups(ppl.tolist(), group_size, n_bins)
    rows = []
    for g in groups:
        rows.append({"mean_ppl": float(ppl[g].mean()), "n_chunks": len(g),
                     "dispersion": {a: float(disp[g, j].mean()) for j, a in enumerate(layers)}})
    n_dropped = 0
    if max_ppl is not None:
        kept = [r for r in rows if r["mean_ppl"] < max_ppl]
        n_dropped, rows = len(rows) - len(kept), kept
    if len(rows) < MIN_GROUPS:
        have = (f"{len(ppl)} chunks make {n_groups} complete group(s) of {group_size}"
                + (f", {n_dropped} of the selected dropped by --max-ppl {max_ppl}" if n_dropped else ""))
        raise RepgeomError(f"corpus too small for perplexity bins: {have}, but at least {MIN_GROUPS} groups are "
                           f"needed for a correlation; give more text (or --n-chunks), or lower --group-size "
                           f"(at most {max(1, len(ppl) // MIN_GROUPS)} here) or --chunk-len")
    xs = [r["mean_ppl"] for r in rows]
    corr = {a: correlations(xs, [r["dispersion"][a] for r in rows]) for a in layers}
    return {"n_chunks": int(len(ppl)), "n_groups": n_groups, "n_selected": len(rows),
            "n_dropped_max_ppl": n_dropped, "median_chunk_ppl": float(np.median(ppl)),
            "groups": rows, "correlation": corr}


def _sign(x: float) -> int:
    return 0 if x is None or math.isnan(x) or x == 0 else (1 if x > 0 else -1)


def confound_check(pooled: dict[str, Any], by_source: dict[str, dict[str, Any]], layers: Sequence[str],
                   ratio_threshold: float) -> dict[str, Any]:
    """Median-perplexity spread of the sources and the layers where the pooled Spearman sign is opposite to every
    source's (a domain-confound reversal)."""
    medians = {s: r["median_chunk_ppl"] for s, r in by_source.items() if "median_chunk_ppl" in r}
    ratio = max(medians.values()) / min(medians.values()) if len(medians) >= 2 and min(medians.values()) > 0 \
        else float("nan")
    reversed_layers = []
    complete = [r for r in by_source.values() if "correlation" in r]
    if len(complete) >= 2:
        for a in layers:
            pooled_sign = _sign(pooled["correlation"][a]["spearman"])
            signs = {_sign(r["correlation"][a]["spearman"]) for r in complete}
            if pooled_sign and len(signs) == 1 and -pooled_sign in signs:
                reversed_layers.append(a)
    flagged = bool(not math.isnan(ratio) and ratio >= ratio_threshold)
    return {"median_ppl": medians, "ratio": ratio, "threshold": ratio_threshold, "flagged": flagged,
            "sign_reversal_layers": reversed_layers}


@takes_options(PplBinsConfig)
def ppl_bins(model: str | LoadedModel, data: Texts, cfg: PplBinsConfig, /, *,
             model_options: ModelOptions | None = None) -> AnalysisResult:
    """Run the perplexity-vs-dispersion analysis (see the module docstring); returns the ``ppl-bins`` result."""
    t_start = time.perf_counter()
    docs, data_path = load_documents(data, cfg.text_field, cfg.source_field)
    dist = Distributed.from_env(cfg.device)  # torchrun / accelerate launch: chunks spread over ranks, rows merged on 0
    t0 = time.perf_counter()
    loaded = model if isinstance(model, LoadedModel) else load_model(
        model, options=model_options, dtype=cfg.dtype, device=dist.device(cfg.device))
    t_load = time.perf_counter() - t0
    check_context(cfg.chunk_len, loaded.info.max_positions)
    addrs = list(resolve_request(cfg.layers, loaded).addresses)
    names = [str(a) for a in addrs]

    t0 = time.perf_counter()
    chunks = corpus_chunks(loaded.tokenizer, docs, cfg.chunk_len, cfg.packing)
    if cfg.per_source is not None:
        doc_sources = list(dict.fromkeys(d.source for d in docs))
        picked = sample_per_source(chunks, cfg.per_source, cfg.seed, doc_sources)
    else:
        picked = sample_chunks(chunks, cfg.n_chunks, cfg.seed)
    sampled = [chunks[i] for i in picked]
    t_tok = time.perf_counter() - t0
    if not sampled:
        raise RepgeomError(f"corpus too small for perplexity bins: no chunk of {cfg.chunk_len} tokens "
                           f"({len(docs)} documents, packing {cfg.packing!r}); give more "
                           f"text, or lower --chunk-len")
    sampled_per_source: dict[str, int] = {}
    for c in sampled:
        sampled_per_source[c.source] = sampled_per_source.get(c.source, 0) + 1
    group_size, group_rule = resolve_group_size(cfg.group_size, sampled_per_source)
    if len(sampled) < group_size * MIN_GROUPS:
        raise RepgeomError(
            f"corpus too small for perplexity bins: {len(sampled)} chunk(s) of {cfg.chunk_len} tokens "
            f"({len(docs)} documents, packing {cfg.packing!r}), but {MIN_GROUPS} groups of {group_size} need "
            f"{group_size * MIN_GROUPS}; give more text, or lower --group-size or --chunk-len")

    log = None
    if cfg.run_dir is not None:
        if dist.active:
            raise RepgeomError("--run-dir with several processes is not supported by ppl-bins yet; run it in one "
                               "process, or drop --run-dir")
        log = ChunkLog.open(cfg.run_dir, {
            "kind": KIND, "model": model_identity(loaded), "chunks": chunks_digest(sampled), "n_chunks": len(sampled),
            "addresses": names, "chunk_len": cfg.chunk_len, "batch_size": cfg.batch_size,
            "dtype": loaded.info.dtype},
            cfg.resume)
    resumed = len(log.done) if log is not None else 0
    t0 = time.perf_counter()
    try:
        ppl, disp = chunk_statistics(loaded, sampled, addrs, cfg.batch_size, cfg.progress, dist, log)
    finally:
        if log is not None:
            log.close()
    t_forward = time.perf_counter() - t0

    result = AnalysisResult(KIND, config={}, results={}, model=loaded.info.to_dict())
    if not dist.is_main:  # rank 0 bins, correlates and writes
        result.is_main = False
        dist.close()
        return result
    pooled = bin_and_correlate(ppl, disp, names, group_size, cfg.n_bins, cfg.max_ppl)
    sources = sorted({c.source for c in sampled})
    by_source: dict[str, dict[str, Any]] = {}
    if len(sources) > 1:
        for s in sources:
            rows = np.array([i for i, c in enumerate(sampled) if c.source == s])
            try:
                by_source[s] = bin_and_correlate(ppl[rows], disp[rows], names, group_size, cfg.n_bins, cfg.max_ppl)
            except RepgeomError as exc:
                by_source[s] = {"n_chunks": int(len(rows)), "median_chunk_ppl": float(np.median(ppl[rows])),
                                "error": str(exc)}
                result.warn(f"source {s!r}: no per-source correlation ({exc})")
        confound = confound_check(pooled, by_source, names, cfg.confound_ratio)
        if confound["flagged"]:
            med = ", ".join(f"{s} {v:.3g}" for s, v in confound["median_ppl"].items())
            result.warn(f"domain confound: the sources' median chunk perplexities differ {confound['ratio']:.1f}-fold "
                        f"({med}); the pooled correlation then mostly compares domains — read the per-source "
                        "correlations (paper A analyses one domain at a time)")
        flipped = confound["sign_reversal_layers"]
        if flipped:
            shown = ", ".join(flipped[:6]) + (" ..." if len(flipped) > 6 else "")
            result.warn(f"the pooled Spearman correlation has the opposite sign of every source's at "
                        f"{len(flipped)} of {len(names)} addresses ({shown})")
        result.results["confound"] = confound
    result.results["pooled"] = pooled
    if by_source:
        result.results["by_source"] = by_source
    result.results["layers"] = names
    result.data = {"path": data_path, "packing": cfg.packing, **describe(chunks, docs),
                   "n_chunks_used": len(sampled),
                   "chunks_used_per_source": sampled_per_source,
                   "n_tokens_used": int(sum(len(c) for c in sampled)), "sources": sources}
    result.config = cfg.config_block({
        "layers": names,
        "sampling": (f"{cfg.per_source} chunks from every source" if cfg.per_source is not None else
                     "every chunk" if len(picked) == len(chunks) else f"{cfg.n_chunks} chunks, uniform"),
        "group_size": group_size, "group_size_rule": group_rule, "dtype": loaded.info.dtype,
        "device": str(loaded.device), "distributed": dist.config(),
        "perplexity": "exp(mean next-token cross-entropy over the chunk's chunk_len-1 positions)",
        "dispersion": "token dispersion: mean pairwise cosine distance of the chunk's token vectors",
        "group_value": "mean over the group's chunks (paper A)",
        "special_tokens": "none added (paper A: no BOS on chunks after the first)"})
    if cfg.per_chunk_path is not None:
        write_jsonl(cfg.per_chunk_path, ({"source": c.source, "doc": c.doc, "start": c.start, "ppl": float(ppl[i]),
                                      "dispersion": dict(zip(names, disp[i].tolist()))}
                                     for i, c in enumerate(sampled)))
    if cfg.run_dir is not None:
        result.data["run_dir"] = {"path": str(cfg.run_dir), "chunks_read_back": resumed,
                                  "chunks_computed": len(sampled) - resumed}
    result.timings = {"load_model_s": t_load, "tokenize_s": t_tok, "forward_s": t_forward,
                      "total_s": time.perf_counter() - t_start,
                      "tokens_per_s": result.data["n_tokens_used"] / max(t_forward, 1e-9)}
    dist.close()
    return result
