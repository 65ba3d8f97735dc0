"""A real kNN-LM (Khandelwal et al. 2020) to check a key choice (paper A §3.3; docs/metrics.md#knn-lm-keys).

Datastore: for every position t of every chunk of the datastore text, key = the hidden state at the key address,
value = token t+1. Keys go to disk chunk by chunk (a ``.npy`` memmap, float32 or float16), never all in memory,
and into a faiss index: exact (``IndexFlatL2``) for small stores, IVF (``IndexIVFFlat``, ``nlist`` cells, ``nprobe``
probed) from ``ivf_threshold`` keys on; ``fp16`` stores keys and index codes in half precision (faiss's fp16 scalar
quantizer).

Evaluation: one forward pass per batch of evaluation chunks gives the LM's next-token log-probabilities and the
queries at every key address. For each query the k nearest keys (negative squared L2 distance d, the default) give

    p_kNN(w) = Σ_{neighbours j with value w} exp(−d_j/T) / Σ_j exp(−d_j/T)
    p(w) = λ·p_kNN(w) + (1 − λ)·p_LM(w)            (computed in log space with logaddexp)

and perplexity = exp(−mean log p(target)) over every predicted position of the evaluation chunks. Khandelwal's
defaults: k = 1024, λ = 0.25, T = 1. λ = 0 gives the LM's perplexity exactly (log 0 = −inf drops the kNN term).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from repgeom_eval.spec.options.model import ModelOptions
from repgeom_eval.output.progress import progress_bar

from ..spec.errors import RepgeomError
from repgeom_eval.modeling.loading import LoadedModel, load_model
from .corpus import Chunk, check_context, corpus_chunks, load_documents
from repgeom_eval.measurement.forward import Forward, batches, next_token_logprobs
from repgeom_eval.spec.options.analyses import INDEX_KINDS, KnnlmConfig
from repgeom_eval.spec.option_fields import takes_options
from repgeom_eval.analyses.envelope import AnalysisResult
from repgeom_eval.modeling.addresses import resolve_request

KIND = "knnlm"
_DEFAULTS = KnnlmConfig()  # the defaults under their earlier names (declared once, in the configuration)
DEFAULT_K = _DEFAULTS.k
DEFAULT_LAMBDA = _DEFAULTS.lambdas[0]
DEFAULT_TEMPERATURE = _DEFAULTS.temperature
DEFAULT_CHUNK_LEN = _DEFAULTS.chunk_len
IVF_THRESHOLD = _DEFAULTS.ivf_threshold
_ADD_BLOCK = 65536
_SEARCH_BLOCK = 2048


def _faiss():
    try:
        import faiss
    except ImportError:
        raise RepgeomError("the kNN-LM needs faiss: pip install 'repgeom-eval[knn]' (faiss-cpu)") from None
    return faiss


def _file_name(address: str) -> str:
    return address.replace(":", "_")


class Datastore:
    """Keys of one address on disk (``keys``, a memmap), their next-token ``values`` and the faiss ``index``."""

    def __init__(self, address: str, keys: np.ndarray, values: np.ndarray, index: Any, index_kind: str,
                 params: dict[str, Any]):
        self.address, self.keys, self.values, self.index = address, keys, values, index
        self.index_kind, self.params = index_kind, params

    @property
    def size(self) -> int:
        return int(self.values.shape[0])

    def describe(self) -> dict[str, Any]:
        return {"n_keys": self.size, "dim": int(self.keys.shape[1]), "key_dtype": str(self.keys.dtype),
                "index": self.index_kind, **self.params}


def build_index(keys: np.ndarray, kind: str = "auto", fp16: bool = False, nlist: int | None = None,
                nprobe: int = 32, ivf_threshold: int = IVF_THRESHOLD, seed: int = 0) -> tuple[Any, str, dict]:
    """A faiss L2 index over ``keys`` [n, d] (read in blocks, so a memmap stays on disk); returns
    (index, kind used, parameters)."""
    faiss = _faiss()
    n, d = keys.shape
    if kind not in INDEX_KINDS:
        raise RepgeomError(f"unknown index {kind!r} (valid: {', '.join(INDEX_KINDS)})")
    if kind == "auto":
        kind = "ivf" if n >= ivf_threshold else "flat"
    params: dict[str, Any] = {"metric": "squared L2", "fp16": fp16}
    if kind == "flat":
        index = (faiss.IndexScalarQuantizer(d, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_L2) if fp16
                 else faiss.IndexFlatL2(d))
    else:
        nlist = nlist or int(min(max(1, 4 * math.sqrt(n)), max(1, n // 39)))
        if nlist > n:
            raise RepgeomError(f"IVF index with {nlist} cells needs at least as many keys, the store has {n}")
        quantizer = faiss.IndexFlatL2(d)
        index = (faiss.IndexIVFScalarQuantizer(quantizer, d, nlist, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_L2)
                 if fp16 else faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_L2))
        train_rows = np.sort(np.random.default_rng(seed).choice(n, size=min(n, 256 * nlist), replace=False))
        index.train(np.ascontiguousarray(keys[train_rows], dtype=np.float32))
        index.nprobe = min(nprobe, nlist)
        params |= {"nlist": nlist, "nprobe": int(index.nprobe), "n_train": int(len(train_rows))}
    for lo in range(0, n, _ADD_BLOCK):
        index.add(np.ascontiguousarray(keys[lo:lo + _ADD_BLOCK], dtype=np.float32))
    return index, kind, params


def build_datastores(loaded: LoadedModel, chunks: Sequence[Chunk], addresses: Sequence[Any], directory: Path, *,
                     fp16: bool = False, index: str = "auto", nlist: int | None = None, nprobe: int = 32,
                     ivf_threshold: int = IVF_THRESHOLD, batch_size: int = 8, seed: int = 0,
                     progress: bool = True) -> dict[str, Datastore]:
    """One datastore per address from one forward pass per batch of ``chunks`` (stopping after the deepest key)."""
    total = sum(len(c) - 1 for c in chunks)
    if total < 1:
        raise RepgeomError("the datastore text gives no (context, next token) pair")
    dim = loaded.info.hidden_size
    dtype = np.float16 if fp16 else np.float32
    keys = {str(a): np.lib.format.open_memmap(directory / f"keys_{_file_name(str(a))}.npy", mode="w+", dtype=dtype,
                                              shape=(total, dim)) for a in addresses}
    values = np.empty(total, dtype=np.int64)
    row = 0
    with Forward.at(loaded, addresses) as runner, progress_bar(total=len(chunks), unit="chunk", desc="datastore",
                                                                 progress=progress) as bar:
        for batch in batches(chunks, batch_size):
            out = runner.token_ids([c.ids for c in batch])
            for i, c in enumerate(batch):
                n = len(c) - 1
                values[row:row + n] = np.asarray(c.ids[1:], dtype=np.int64)
                for a in addresses:
                    keys[str(a)][row:row + n] = out.hidden[a][i, :n].float().cpu().numpy().astype(dtype)
                row += n
            bar.update(len(batch))
    np.save(directory / "values.npy", values)
    stores = {}
    for a in addresses:
        k = keys[str(a)]
        k.flush()
        idx, kind, params = build_index(k, index, fp16, nlist, nprobe, ivf_threshold, seed)
        stores[str(a)] = Datastore(str(a), k, values, idx, kind, params)
    return stores


STORE_FILES = ("manifest.json", "values.npy")


def check_store_dir(directory: Path, overwrite: bool) -> None:
    """``--store-dir`` must be new or empty unless ``--overwrite``: a store there may be another model's, and other
    files are not this command's to replace."""
    if overwrite or not directory.is_dir():
        return
    present = sorted(p.name for p in directory.iterdir())
    if present:
        what = "an earlier kNN store" if "manifest.json" in present else f"{len(present)} file(s)"
        raise RepgeomError(f"--store-dir {str(directory)!r} already holds {what} ({', '.join(present[:4])}"
                           f"{' ...' if len(present) > 4 else ''}); pass an empty or new folder, or add --overwrite "
                           "to replace it")


def clear_store_dir(directory: Path) -> None:
    """With ``--overwrite``: remove an earlier store's files (keys, values, indexes, manifest), so that no stale
    file of another model stays beside the new store."""
    if not directory.is_dir():
        return
    for p in directory.iterdir():
        if p.is_file() and (p.name in STORE_FILES or p.name.startswith(("keys_", "index_"))):
            p.unlink()


def knn_logprob(store: Datastore, queries: np.ndarray, targets: np.ndarray, k: int = DEFAULT_K,
                temperature: float = DEFAULT_TEMPERATURE) -> tuple[np.ndarray, np.ndarray]:
    """(log p_kNN(target) [M], whether the target is among the neighbours [M]) for float32 ``queries`` [M, d]."""
    k = min(k, store.size)
    out = np.empty(len(queries), dtype=np.float64)
    hit = np.empty(len(queries), dtype=bool)
    for lo in range(0, len(queries), _SEARCH_BLOCK):
        dist, ids = store.index.search(np.ascontiguousarray(queries[lo:lo + _SEARCH_BLOCK], dtype=np.float32), k)
        valid = ids >= 0
        scores = np.where(valid, -dist.astype(np.float64) / temperature, -np.inf)
        match = valid & (store.values[np.where(valid, ids, 0)] == targets[lo:lo + _SEARCH_BLOCK, None])
        with np.errstate(divide="ignore", invalid="ignore"):
            norm = _logsumexp(scores)
            out[lo:lo + _SEARCH_BLOCK] = _logsumexp(np.where(match, scores, -np.inf)) - norm
        hit[lo:lo + _SEARCH_BLOCK] = match.any(1)
    return out, hit


def _logsumexp(x: np.ndarray) -> np.ndarray:
    m = x.max(1)
    safe = np.where(np.isfinite(m), m, 0.0)
    return np.log(np.exp(x - safe[:, None]).sum(1)) + safe


def interpolate(lm_logprob: np.ndarray, knn_logprob: np.ndarray, lam: float) -> np.ndarray:
    """log(λ·p_kNN + (1−λ)·p_LM), elementwise, in log space. λ = 0 returns the LM's log-probabilities exactly."""
    if not 0.0 <= lam <= 1.0:
        raise RepgeomError(f"λ must lie in [0, 1], got {lam}")
    with np.errstate(divide="ignore"):
        return np.logaddexp(np.log(lam) + knn_logprob, np.log1p(-lam) + lm_logprob)


def perplexity(logprob: np.ndarray) -> float:
    return float(np.exp(-np.mean(logprob)))


@takes_options(KnnlmConfig)
def knnlm(model: str | LoadedModel, datastore: Any, eval_data: Any, cfg: KnnlmConfig, /, *,
          model_options: ModelOptions | None = None) -> AnalysisResult:
    """Build a datastore per key address from ``datastore`` text, evaluate perplexity on ``eval_data`` with and
    without retrieval; returns the ``knnlm`` result. ``store_dir`` keeps the keys, values and indexes on disk
    (default: a temporary directory, removed afterwards)."""
    t_start = time.perf_counter()
    if not cfg.temperature > 0:
        raise RepgeomError(f"temperature must be positive, got {cfg.temperature}")
    lambdas = [float(x) for x in cfg.lambdas]  # the λ values as numbers, in the given order
    for lam in lambdas:
        interpolate(np.zeros(0), np.zeros(0), lam)  # validates λ before any work
    _faiss()
    if cfg.store_dir is not None:
        from repgeom_eval.output.files import check_creatable_dir

        check_creatable_dir(cfg.store_dir, "kNN store folder (--store-dir)")  # before the model is loaded
        check_store_dir(Path(cfg.store_dir), cfg.overwrite)
    store_docs, store_path = load_documents(datastore, cfg.text_field)
    eval_docs, eval_path = load_documents(eval_data, cfg.text_field)
    t0 = time.perf_counter()
    loaded = model if isinstance(model, LoadedModel) else load_model(
        model, dtype=cfg.dtype, device=cfg.device, options=model_options)
    t_load = time.perf_counter() - t0
    if not loaded.layout.causal:
        raise RepgeomError(f"a kNN-LM needs a causal language model; {loaded.info.name} is a "
                           f"{loaded.info.model_type} model without causal attention")
    loaded.check_logits("a kNN-LM")
    check_context(cfg.chunk_len, loaded.info.max_positions)
    addrs = []
    for key in cfg.keys:
        for a in list(resolve_request(key, loaded).addresses):
            if a not in addrs:
                addrs.append(a)
    names = [str(a) for a in addrs]
    store_chunks = corpus_chunks(loaded.tokenizer, store_docs, cfg.chunk_len, cfg.packing)
    eval_chunks = corpus_chunks(loaded.tokenizer, eval_docs, cfg.chunk_len, cfg.packing)
    for what, got, path in (("datastore", store_chunks, store_path), ("evaluation", eval_chunks, eval_path)):
        if not got:
            raise RepgeomError(f"the {what} text ({path}) gives no chunk of {cfg.chunk_len} tokens; give more "
                               f"text or lower --chunk-len")

    result = AnalysisResult(KIND, config={}, results={}, model=loaded.info.to_dict())
    if store_path != "<memory>" and os.path.realpath(store_path) == os.path.realpath(eval_path):
        result.warn("the datastore is built from the evaluation text itself: retrieval finds the very contexts it "
                    "scores, so the perplexity gain is an upper bound, not an estimate of generalisation")
    tmp = tempfile.TemporaryDirectory(prefix="repgeom-knnlm-") if cfg.store_dir is None else None
    directory = Path(tmp.name if tmp else cfg.store_dir)  # type: ignore[arg-type]
    directory.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        if cfg.store_dir is not None and cfg.overwrite:
            clear_store_dir(directory)
        stores = build_datastores(loaded, store_chunks, addrs, directory, fp16=cfg.fp16, index=cfg.index,
                                  nlist=cfg.nlist, nprobe=cfg.nprobe, ivf_threshold=cfg.ivf_threshold,
                                  batch_size=cfg.batch_size, seed=cfg.seed, progress=cfg.progress)
        t_build = time.perf_counter() - t0
        if cfg.store_dir is not None:
            faiss = _faiss()
            for name, st in stores.items():
                faiss.write_index(st.index, str(directory / f"index_{_file_name(name)}.faiss"))
            (directory / "manifest.json").write_text(json.dumps(
                {"model": loaded.info.name, "datastore": store_path, "chunk_len": cfg.chunk_len,
                 "packing": cfg.packing,
                 "keys": {n: st.describe() for n, st in stores.items()}}, indent=2) + "\n")

        t0 = time.perf_counter()
        lm_parts: list[np.ndarray] = []
        knn_parts: dict[str, list[np.ndarray]] = {n: [] for n in names}
        hit_parts: dict[str, list[np.ndarray]] = {n: [] for n in names}
        with Forward.at(loaded, addrs, logits=True) as runner, progress_bar(
                total=len(eval_chunks), unit="chunk", desc="evaluate", progress=cfg.progress) as bar:
            for batch in batches(eval_chunks, cfg.batch_size):
                out = runner.token_ids([c.ids for c in batch])
                logprob, valid = next_token_logprobs(out.logits, out.ids, out.mask)
                lm_parts.append(logprob[valid].numpy())
                targets = out.ids[:, 1:][valid].numpy()
                for a, name in zip(addrs, names):
                    queries = out.hidden[a][:, :-1][valid.to(out.hidden[a].device)].float().cpu().numpy()
                    lp, hit = knn_logprob(stores[name], queries, targets, cfg.k, cfg.temperature)
                    knn_parts[name].append(lp)
                    hit_parts[name].append(hit)
                bar.update(len(batch))
        t_eval = time.perf_counter() - t0
    except OSError as exc:  # the keys are written to disk chunk by chunk: a full disk or a file-size limit
        from repgeom_eval.output.files import write_error

        clean = write_error(getattr(exc, "filename", None) or directory, exc)
        if clean is None:
            raise
        raise clean from None
    finally:
        if tmp is not None:
            tmp.cleanup()

    size = min(st.size for st in stores.values())
    k_used = min(cfg.k, size)
    if k_used < cfg.k:
        result.warn(f"--neighbors {cfg.k} is more than the {size} keys of the datastore: every key was used (k = "
                    f"{k_used}, recorded as k_used)")
    lm = np.concatenate(lm_parts)
    base = perplexity(lm)
    per_key = {}
    for name in names:
        knn = np.concatenate(knn_parts[name])
        hits = np.concatenate(hit_parts[name])
        ppl = {str(lam): perplexity(interpolate(lm, knn, lam)) for lam in lambdas}
        per_key[name] = {"ppl": ppl, "hit_rate": float(hits.mean()),
                         "mean_p_knn_target": float(np.mean(np.exp(knn))), "datastore": stores[name].describe()}
    best = {str(lam): min(names, key=lambda n: per_key[n]["ppl"][str(lam)]) for lam in lambdas}
    result.results = {"base_ppl": base, "n_eval_tokens": int(lm.size), "keys": per_key, "best_key": best}
    result.data = {"datastore": store_path, "eval": eval_path, "packing": cfg.packing,
                   "n_datastore_chunks": len(store_chunks), "n_eval_chunks": len(eval_chunks)}
    result.config = cfg.config_block({
        "keys": names, "k_used": k_used, "lambdas": lambdas, "distance": "negative squared L2", "dtype": loaded.info.dtype,
        "device": str(loaded.device),
        "defaults": "Khandelwal et al. 2020: k=1024, λ=0.25, negative squared L2 (assumed by paper A)"})
    result.timings = {"load_model_s": t_load, "build_datastore_s": t_build, "evaluate_s": t_eval,
                      "total_s": time.perf_counter() - t_start}
    return result
