"""Screening checkpoints by the dispersion gap G of their output projection, without a forward pass (paper A §3.2).

:func:`screen` checks that the models share one tokenizer vocabulary (G compares models only within one tokenizer,
paper A Limitations), then per model opens the output-embedding tensor (:mod:`.checkpoint`), resolves the domain
set T and the reference set T̄ against its vocabulary (:mod:`.vocabulary`), reads only the rows of T ∪ T̄ and
computes G (:mod:`repgeom_eval.functional.gap_distances`; docs/metrics.md#dispersion-gap). The models are ranked by
G, highest first; :class:`GapResult` is what ``repgeom gap`` writes.
"""

from __future__ import annotations

import math
import os
import resource
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...spec.errors import RepgeomError
from ...functional.gap_distances import SIGN, dispersion_gap
from ...modeling.checkpoint_tensors import load_tokenizer, locate_checkpoint, open_output_embeddings
from repgeom_eval.spec.options.analyses import GapConfig
from .vocabulary import (Vocabulary, resolve_token_set,
                         vocabulary_difference)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


@dataclass
class GapResult:
    """The output of :func:`screen`: rows ranked by G (descending), the config used and the vocabulary check."""

    config: dict[str, Any]
    vocabulary: dict[str, Any]
    rows: list[dict[str, Any]]
    timings: dict[str, float]
    spearman: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {"config": self.config, "vocabulary": self.vocabulary, "results": self.rows, "timings": self.timings}
        if self.spearman is not None:
            d["spearman"] = self.spearman
        return d

    def write(self, path: str | os.PathLike) -> None:
        from repgeom_eval.output.files import write_json

        write_json(path, self.to_dict())


def degenerate_rows(model: str, W: Any, T_pos: Sequence[int], Tbar_pos: Sequence[int], values: dict[str, float],
                    distance: str) -> list[str]:
    """Why this model's G says nothing, one line each naming the model (empty when it is sound).

    NaN or inf in the rows read makes G NaN (ranked last); a zero row is at cosine distance 1 from everything
    (docs/metrics.md#conventions), so zero rows pull within(T) and between towards 1 and an all-zero embedding gives
    G = 2 exactly (docs/metrics.md#dispersion-gap); a NaN G or a G of exactly 2 is flagged whatever the cause.
    """
    import torch

    flags = []
    rows = W.double()
    finite = torch.isfinite(rows).all(dim=1)
    zero = (rows == 0).all(dim=1)
    bad_T, bad_R = int((~finite[list(T_pos)]).sum()), int((~finite[list(Tbar_pos)]).sum())
    if bad_T or bad_R:
        flags.append(f"model {model!r}: {bad_T} of {len(T_pos)} domain rows and {bad_R} of {len(Tbar_pos)} reference "
                     "rows of the output embedding hold NaN or inf; its G is NaN (ranked last)")
    zero_T, zero_R = int(zero[list(T_pos)].sum()), int(zero[list(Tbar_pos)].sum())
    if zero_T or zero_R:
        why = ("a zero row is at cosine distance 1 from everything" if distance == "cosine"
               else "a zero row is the origin, not a learned embedding")
        flags.append(f"model {model!r}: {zero_T} of {len(T_pos)} domain rows and {zero_R} of {len(Tbar_pos)} "
                     f"reference rows of the output embedding are all zero; {why}, so G = {values['G']:.4f} reflects "
                     "the zeros, not the geometry (an untrained or pruned checkpoint?)")
    G = values["G"]
    if math.isnan(G) and not (bad_T or bad_R):
        flags.append(f"model {model!r}: G is NaN (within(T) = {values['within_T']}, between = {values['between']})")
    elif distance == "cosine" and G == 2.0 and not (zero_T or zero_R):
        flags.append(f"model {model!r}: G is exactly 2, the value of an all-zero embedding; check the checkpoint")
    return flags


def screen(models: Sequence[str], config: GapConfig | None = None, /, *, host: Any = None,
           trust_remote_code: bool = False, **options: Any) -> GapResult:
    """Rank checkpoints by the dispersion gap G of their output projection (highest first).

    Reads each model's tokenizer, refuses models whose vocabularies differ (G compares models only within one
    tokenizer, paper A Limitations) unless ``force``, then per model reads W alone, resolves T (``domain``) and T̄
    (``reference``, excluding T) and computes within(T), within(T̄), between and G. The options: a
    :class:`~repgeom_eval.spec.options.analyses.GapConfig`, or its fields as keywords. ``trust_remote_code`` lets
    transformers read config and tokenizer classes a checkpoint brings.
    """
    cfg = GapConfig.build(config, options)
    t_start = time.perf_counter()
    models = [str(m) for m in models]
    if not models:
        raise RepgeomError("no models given; pass at least one model directory")
    dupes = sorted({m for m in models if models.count(m) > 1})
    if dupes:
        raise RepgeomError(f"model {dupes[0]!r} is given more than once; list each model once")
    if not isinstance(cfg.size, int) or cfg.size < 1:
        raise RepgeomError(f"reference sample size must be a positive integer, got {cfg.size!r}")
    if host is None:
        from repgeom_eval.plugin_system.host import get_host

        host = get_host()
    for m in models:  # every path problem before any work
        locate_checkpoint(m)

    tokenizers: dict[str, Any] = {}
    tok_s: dict[str, float] = {}
    for m in models:
        t0 = time.perf_counter()
        tokenizers[m] = load_tokenizer(m, trust_remote_code)
        tok_s[m] = time.perf_counter() - t0
    first = models[0]
    differences = []
    for m in models[1:]:
        why = vocabulary_difference(tokenizers[first], tokenizers[m])
        if why:
            differences.append({"model": m, "reference_model": first, "difference": why})
    if differences and not cfg.force:
        d = differences[0]
        raise RepgeomError(
            f"models {d['reference_model']!r} and {d['model']!r} have different vocabularies ({d['difference']}); "
            "the gap compares models only within one tokenizer (paper A, Limitations); pass --force "
            "(force=True) to compare them anyway"
        )
    if differences:
        warnings.warn(f"comparing models with different vocabularies ({len(differences)} differ from {first!r}); "
                      "G values are not comparable across tokenizers", stacklevel=2)
    vocabulary = {"shared": not differences, "forced": bool(differences and cfg.force), "size": len(tokenizers[first]),
                  "differences": differences}

    rows: list[dict[str, Any]] = []
    config_sets: dict[str, Any] = {}
    for m in models:
        t0 = time.perf_counter()
        source = open_output_embeddings(m, trust_remote_code)
        info = source.info
        t1 = time.perf_counter()
        vocab = Vocabulary(tokenizers[m], n_rows=info.shape[0])
        T = resolve_token_set(cfg.domain, vocab, host=host, seed=cfg.seed, size=cfg.size)
        if len(T) < 2:
            raise RepgeomError(
                f"domain token set {cfg.domain!r} matches {len(T)} token(s) of model {m!r} (missing: "
                f"{', '.join(repr(w) for w in T.missing[:10]) or 'none'}); within(T) needs at least 2"
            )
        Tbar = resolve_token_set(cfg.reference, vocab, host=host, exclude=T.ids, seed=cfg.seed, size=cfg.size)
        if len(Tbar) < 1:
            raise RepgeomError(f"reference token set {cfg.reference!r} matches no token of model {m!r} outside the "
                               f"domain set; pass another --reference")
        overlap = sorted(set(T.ids) & set(Tbar.ids))
        if overlap:
            warnings.warn(f"{len(overlap)} token(s) are in both the domain and the reference set of {m!r}; their "
                          "self-pairs count in between(T, T̄)", stacklevel=2)
        t2 = time.perf_counter()
        needed = sorted(set(T.ids) | set(Tbar.ids))  # only these rows of W are read
        sub = source.rows(needed)
        t3 = time.perf_counter()
        pos = {i: k for k, i in enumerate(needed)}
        values = dispersion_gap(sub, [pos[i] for i in T.ids], [pos[i] for i in Tbar.ids], distance=cfg.distance)
        t4 = time.perf_counter()
        flags = degenerate_rows(m, sub, [pos[i] for i in T.ids], [pos[i] for i in Tbar.ids], values, cfg.distance)
        for flag in flags:
            warnings.warn(flag, stacklevel=2)
        del sub, source
        config_sets.setdefault("domain", T.config)
        config_sets.setdefault("reference", Tbar.config)
        config_sets.setdefault("stripped_markers", {"prefixes": list(vocab.prefixes), "suffixes": list(vocab.suffixes)})
        rows.append({
            "model": m,
            **values,
            "vocab_size": vocab.size,
            "n_rows": info.shape[0],
            "hidden_size": info.shape[1],
            "n_T": len(T),
            "n_Tbar": len(Tbar),
            "missing_T": T.missing,
            "missing_Tbar": Tbar.missing,
            "n_overlap": len(overlap),
            "embedding": info.to_dict(),
            "T": T.to_dict(with_tokens=True),
            "Tbar": Tbar.to_dict(with_tokens=False),
            "n_rows_read": len(needed),
            "warnings": flags,
            "timings": {"tokenizer_s": tok_s[m], "open_s": t1 - t0, "token_sets_s": t2 - t1, "read_rows_s": t3 - t2,
                        "compute_s": t4 - t3, "total_s": tok_s[m] + (t4 - t0), "peak_rss_mib": _peak_rss_mib()},
        })
    rows.sort(key=lambda r: (math.isnan(r["G"]), -r["G"] if not math.isnan(r["G"]) else 0.0))
    for rank, r in enumerate(rows, 1):
        r["rank"] = rank
    config = {
        "metric": "dispersion_gap",
        "sign": SIGN,
        "models": models,
        "domain": cfg.domain,
        "reference": cfg.reference,
        "distance": cfg.distance,
        "size": cfg.size,
        "seed": cfg.seed,
        "force": cfg.force,
        "token_sets": config_sets,
        "precision": "float64",
        "ranking": "G descending",
    }
    timings = {"total_s": time.perf_counter() - t_start, "peak_rss_mib": _peak_rss_mib()}
    return GapResult(config=config, vocabulary=vocabulary, rows=rows, timings=timings)
