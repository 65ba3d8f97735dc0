"""kNN-LM key selection by dispersion (paper A §3.3, Table 1; docs/metrics.md#knn-lm-keys).

Candidates are layer addresses (default: the last block's ``resid_mid`` = h_att, the paper's choice;
``resid_post`` = h_ffn, the raw block output; ``mlp_in`` = the post-norm FFN input, Khandelwal et al.'s key). One
vector per chunk: the **last-token** hidden state at the candidate. For each N in {10, 50, 100} and each of 10
seeds, N non-overlapping chunks are drawn and D (docs/metrics.md#cosine-dispersion) is computed over their N
vectors; the table reports mean ± std over the seeds. The same chunks feed every candidate: one forward pass per
chunk captures all of them (stopping after the deepest one), and seed s's sample of size N is the first N chunks of
one seeded permutation, so the samples of one seed are nested across N. The recommended key is the most dispersed
candidate at the largest N.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from repgeom_eval.spec.options.model import ModelOptions
from repgeom_eval.output.progress import progress_bar

from ..spec.errors import RepgeomError
from ..functional.dispersion import dispersion
from repgeom_eval.modeling.loading import LoadedModel, load_model
from .corpus import Chunk, Texts, check_context, corpus_chunks, describe, load_documents
from repgeom_eval.measurement.forward import Forward, batches
from repgeom_eval.measurement.pooling import pool
from repgeom_eval.spec.options.analyses import KnnKeysConfig
from repgeom_eval.spec.option_fields import takes_options
from repgeom_eval.analyses.envelope import AnalysisResult
from repgeom_eval.modeling.addresses import resolve_request

KIND = "knn-keys"
_DEFAULTS = KnnKeysConfig()  # the defaults under their earlier names (declared once, in the configuration)
DEFAULT_CANDIDATES = _DEFAULTS.candidates
DEFAULT_NS = _DEFAULTS.ns
DEFAULT_SEEDS = _DEFAULTS.n_seeds
DEFAULT_CHUNK_LEN = _DEFAULTS.chunk_len
PAPER_EXPECTATION = "resid_mid (h_att) more dispersed than resid_post (h_ffn) on every GPT-2 size (paper A Table 1)"


def seeded_samples(n_pool: int, ns: Sequence[int], n_seeds: int, seed: int = 0) -> dict[tuple[int, int], list[int]]:
    """``{(N, s): chunk indices}``: seed s's sample of size N is the first N of a permutation drawn with
    ``random.Random(seed + s)``."""
    largest = max(ns)
    out = {}
    for s in range(n_seeds):
        perm = random.Random(seed + s).sample(range(n_pool), largest)
        for n in ns:
            out[(n, s)] = perm[:n]
    return out


def last_token_vectors(loaded: LoadedModel, chunks: Sequence[Chunk], addresses: Sequence[Any], batch_size: int = 8,
                       progress: bool = True) -> dict[Any, torch.Tensor]:
    """{address: [len(chunks), D] float64}: the hidden state at each chunk's last token."""
    parts: dict[Any, list[torch.Tensor]] = {a: [] for a in addresses}
    with Forward.at(loaded, addresses) as runner, progress_bar(total=len(chunks), unit="chunk", desc="knn-keys",
                                                                 progress=progress) as bar:
        for batch in batches(chunks, batch_size):
            out = runner.token_ids([c.ids for c in batch])
            for a in addresses:
                h = out.hidden[a]
                parts[a].append(pool(h.double(), out.mask.to(h.device), "last")[0].cpu())
            bar.update(len(batch))
    return {a: torch.cat(v) for a, v in parts.items()}


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and population standard deviation (ddof = 0, numpy's default) of one candidate's values over seeds."""
    v = np.asarray(values, dtype=np.float64)
    return float(v.mean()), float(v.std())


@takes_options(KnnKeysConfig)
def knn_keys(model: str | LoadedModel, data: Texts, cfg: KnnKeysConfig, /, *,
             model_options: ModelOptions | None = None) -> AnalysisResult:
    """Dispersion of last-token vectors at each candidate address; returns the ``knn-keys`` result."""
    t_start = time.perf_counter()
    sample_sizes = sorted({int(n) for n in cfg.ns})
    if not sample_sizes or sample_sizes[0] < 2:
        raise RepgeomError(
            f"sample sizes must be at least 2 (dispersion is a mean over pairs), got {list(sample_sizes)}")
    docs, data_path = load_documents(data, cfg.text_field, source_field="source")
    t0 = time.perf_counter()
    loaded = model if isinstance(model, LoadedModel) else load_model(
        model, dtype=cfg.dtype, device=cfg.device, options=model_options)
    t_load = time.perf_counter() - t0
    check_context(cfg.chunk_len, loaded.info.max_positions)
    addrs = []
    for c in cfg.candidates:  # keep the user's order; each must exist on this model
        for a in list(resolve_request(c, loaded).addresses):
            if a not in addrs:
                addrs.append(a)
    names = [str(a) for a in addrs]
    if len(addrs) < 1:
        raise RepgeomError("no candidate address given")

    chunks = corpus_chunks(loaded.tokenizer, docs, cfg.chunk_len, cfg.packing)
    if len(chunks) < sample_sizes[-1]:
        raise RepgeomError(f"corpus too small: {len(chunks)} chunk(s) of {cfg.chunk_len} tokens, but "
                           f"N = {sample_sizes[-1]} needs at least {sample_sizes[-1]} distinct chunks; give more "
                           f"text, lower --chunk-len, or pass smaller --n values")
    samples = seeded_samples(len(chunks), sample_sizes, cfg.n_seeds, cfg.seed)
    needed = sorted({i for idx in samples.values() for i in idx})
    position = {i: k for k, i in enumerate(needed)}
    t0 = time.perf_counter()
    vectors = last_token_vectors(loaded, [chunks[i] for i in needed], addrs, cfg.batch_size, cfg.progress)
    t_forward = time.perf_counter() - t0

    table, means = [], {}
    for a, name in zip(addrs, names):
        for n in sample_sizes:
            values = [float(dispersion(vectors[a][[position[i] for i in samples[(n, s)]]]))
                      for s in range(cfg.n_seeds)]
            mean, std = mean_std(values)
            means[(name, n)] = mean
            table.append({"address": name, "N": n, "mean": mean, "std": std, "values": values})
    ranking = {str(n): sorted(names, key=lambda a: -means[(a, n)]) for n in sample_sizes}
    recommended = ranking[str(sample_sizes[-1])][0]
    consistent = len({r[0] for r in ranking.values()}) == 1
    result = AnalysisResult(KIND, config={}, results={}, model=loaded.info.to_dict())
    result.results = {"candidates": names, "table": table, "ranking": ranking, "recommended": recommended,
                      "consistent_across_N": consistent, "paper_expectation": PAPER_EXPECTATION}
    last = loaded.info.n_layers - 1
    mid, post = f"resid_mid:{last}", f"resid_post:{last}"
    if mid in names and post in names:
        result.results["resid_mid_more_dispersed"] = {str(n): means[(mid, n)] > means[(post, n)] for n in sample_sizes}
    if not consistent:
        result.warn("the most dispersed candidate changes with N: " +
                    ", ".join(f"N={n}: {r[0]}" for n, r in ranking.items()))
    result.data = {"path": data_path, "packing": cfg.packing, **describe(chunks, docs),
                   "n_chunks_forwarded": len(needed)}
    result.config = cfg.config_block({
        "candidates": names, "ns": sample_sizes, "vector": "last token of each chunk",
        "std": "population (ddof=0) over seeds",
        "sampling": "seed s: first N of a permutation drawn with random.Random(seed + s)", "dtype": loaded.info.dtype,
        "device": str(loaded.device)})
    result.timings = {"load_model_s": t_load, "forward_s": t_forward, "total_s": time.perf_counter() - t_start}
    return result
