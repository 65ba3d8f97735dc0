"""Prompt entropy and token dispersion under controlled prompt perturbations (paper B §5), per layer.

Three seeded sweeps over the same prompts (the first ``n_prompts`` texts with at least ``max(lengths)`` tokens):

* ``repetition`` p: every token after the first is, independently with probability p, replaced by one token of the
  prompt drawn once per prompt — p = 1 repeats a single token;
* ``random`` p: every token is, independently with probability p, replaced by a token drawn uniformly from the
  vocabulary (special tokens excluded);
* ``length`` L: the prompt cut to its first L tokens.

Perturbations act on token ids (no re-tokenization). The repetition and random sweeps use prompts of ``max_length``
tokens. Each condition is one forward pass per batch; at every address, per prompt, prompt entropy
(docs/metrics.md#prompt_entropy, ``normalized`` = B's maxEntropy) and token dispersion
(docs/metrics.md#token_dispersion) are averaged over prompts. Paper B's finding: repetition lowers prompt
entropy, random tokens raise it, and it grows with length; this module reports what the model does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from repgeom_eval.spec.options.model import ModelOptions
from repgeom_eval.output.progress import progress_bar

from ..spec.errors import RepgeomError
from ..functional.dispersion import dispersion
from ..functional.entropy import prompt_entropy
from repgeom_eval.modeling.loading import LoadedModel, load_model
from .corpus import load_documents, tokenize_documents
from repgeom_eval.measurement.forward import Forward, batches
from repgeom_eval.measurement.pooling import pool
from repgeom_eval.spec.options.analyses import PerturbConfig
from repgeom_eval.spec.option_fields import takes_options
from repgeom_eval.analyses.envelope import AnalysisResult
from repgeom_eval.modeling.addresses import resolve_request

KIND = "perturb"
_DEFAULTS = PerturbConfig()  # the defaults under their earlier names (declared once, in the configuration)
SWEEPS = _DEFAULTS.sweeps
DEFAULT_PS = _DEFAULTS.ps
DEFAULT_LENGTHS = _DEFAULTS.lengths
DEFAULT_PROMPTS = _DEFAULTS.n_prompts


def repeat_tokens(ids: Sequence[int], p: float, rng: np.random.Generator) -> list[int]:
    """Each token after the first replaced, with probability p, by one token of the prompt (drawn once)."""
    token = ids[int(rng.integers(len(ids)))]
    hit = rng.random(len(ids)) < p
    hit[0] = False
    return [token if h else t for t, h in zip(ids, hit)]


def random_tokens(ids: Sequence[int], p: float, rng: np.random.Generator, vocab: np.ndarray) -> list[int]:
    """Each token replaced, with probability p, by a uniform draw from ``vocab``."""
    hit = rng.random(len(ids)) < p
    draws = vocab[rng.integers(len(vocab), size=len(ids))]
    return [int(d) if h else t for t, h, d in zip(ids, hit, draws)]


def _measure(runner: Forward, addrs: Sequence[Any], prompts: Sequence[Sequence[int]],
             batch_size: int) -> dict[str, list[float]]:
    """Mean over prompts of prompt entropy (normalized) and token dispersion at every address."""
    ent = {a: [] for a in addrs}
    disp = {a: [] for a in addrs}
    for batch in batches(prompts, batch_size):
        out = runner.token_ids(batch)
        for a in addrs:
            vecs, owner = pool(out.hidden[a].double(), out.mask.to(out.hidden[a].device), "tokens")
            vecs, owner = vecs.cpu(), owner.cpu()
            for i in range(len(batch)):
                tokens = vecs[owner == i]
                ent[a].append(prompt_entropy(tokens)["normalized"])
                disp[a].append(float(dispersion(tokens)))
    return {"prompt_entropy": [_nanmean(ent[a]) for a in addrs], "token_dispersion": [_nanmean(disp[a]) for a in addrs]}


def _nanmean(values: list[float]) -> float:
    """The mean of the defined values; NaN, silently, when none is (the table shows nan; an all-zero model is
    reported once by the forward passes, not here once per cell)."""
    finite = [v for v in values if not np.isnan(v)]
    return float(np.mean(finite)) if finite else float("nan")


@takes_options(PerturbConfig)
def perturb(model: str | LoadedModel, data: Any, cfg: PerturbConfig, /, *,
            model_options: ModelOptions | None = None) -> AnalysisResult:
    """Run the requested ``sweeps`` and return the ``perturb`` result (per sweep: values × addresses tables)."""
    t_start = time.perf_counter()
    unknown = [s for s in cfg.sweeps if s not in SWEEPS]
    if unknown or not cfg.sweeps:
        raise RepgeomError(f"unknown sweep(s) {', '.join(unknown) or '(none given)'} (valid: {', '.join(SWEEPS)})")
    probabilities = [float(p) for p in cfg.ps]
    if any(not 0.0 <= p <= 1.0 for p in probabilities):
        raise RepgeomError(f"probabilities must lie in [0, 1], got {probabilities}")
    prompt_lengths = sorted({int(n) for n in cfg.lengths})
    if prompt_lengths[0] < 2:
        raise RepgeomError(
            f"prompt lengths must be at least 2 tokens (prompt entropy needs 2), got {prompt_lengths[0]}")
    if cfg.n_prompts < 1:
        raise RepgeomError(f"number of prompts must be positive, got {cfg.n_prompts}")
    docs, data_path = load_documents(data, cfg.text_field)
    loaded = model if isinstance(model, LoadedModel) else load_model(
        model, dtype=cfg.dtype, device=cfg.device, options=model_options)
    max_len = prompt_lengths[-1]
    if loaded.info.max_positions and max_len > loaded.info.max_positions:
        raise RepgeomError(f"prompt length {max_len} exceeds the model context of {loaded.info.max_positions} tokens; "
                           "pass shorter --lengths")
    addrs = list(resolve_request(cfg.layers, loaded).addresses)
    names = [str(a) for a in addrs]
    prompts = [ids[:max_len] for ids in tokenize_documents(loaded.tokenizer, docs) if len(ids) >= max_len]
    if not prompts:
        raise RepgeomError(f"no text has {max_len} tokens; give longer texts or pass shorter --lengths")
    prompts = prompts[:cfg.n_prompts]
    special = set(loaded.tokenizer.all_special_ids)
    vocab = np.array([i for i in range(len(loaded.tokenizer)) if i not in special], dtype=np.int64)

    conditions: list[tuple[str, float, list[list[int]]]] = []
    for sweep in (s for s in SWEEPS if s in cfg.sweeps):
        k = SWEEPS.index(sweep)  # a sweep's draws do not depend on which other sweeps run
        values: Sequence[float] = prompt_lengths if sweep == "length" else probabilities
        for j, v in enumerate(values):
            rng = np.random.default_rng([cfg.seed, k, j])
            if sweep == "repetition":
                got = [repeat_tokens(ids, v, rng) for ids in prompts]
            elif sweep == "random":
                got = [random_tokens(ids, v, rng, vocab) for ids in prompts]
            else:
                got = [list(ids[:int(v)]) for ids in prompts]
            conditions.append((sweep, v, got))
    results: dict[str, Any] = {}
    with torch.no_grad(), Forward.at(loaded, addrs) as runner, progress_bar(
            total=len(conditions), unit="condition", desc="perturb", progress=cfg.progress) as bar:
        for sweep, v, got in conditions:
            r = results.setdefault(sweep, {"values": [], "prompt_entropy": [], "token_dispersion": []})
            m = _measure(runner, addrs, got, cfg.batch_size)
            r["values"].append(v)
            r["prompt_entropy"].append(m["prompt_entropy"])
            r["token_dispersion"].append(m["token_dispersion"])
            bar.update(1)
    result = AnalysisResult(KIND, config={}, results={"layers": names, "sweeps": results},
                            model=loaded.info.to_dict())
    result.data = {"path": data_path, "n_documents": len(docs), "n_prompts": len(prompts),
                   "prompt_tokens": max_len}
    result.config = cfg.config_block({
        "layers": names, "sweeps": [s for s in SWEEPS if s in cfg.sweeps], "dtype": loaded.info.dtype,
        "device": str(loaded.device),
        "prompt_entropy": "normalized (S_1 / log min(N, D), paper B's maxEntropy), mean over prompts",
        "token_dispersion": "mean pairwise cosine distance of a prompt's tokens, mean over prompts",
        "repetition": "tokens after the first replaced w.p. p by one token of the prompt",
        "random": "tokens replaced w.p. p by uniform non-special vocabulary tokens",
        "rng": "numpy default_rng([seed, sweep index, value index])"})
    result.timings = {"total_s": time.perf_counter() - t_start}
    return result
