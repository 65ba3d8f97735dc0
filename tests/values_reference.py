"""Independent reference computations for the value tests (tests/test_values_*.py).

Nothing here imports repgeom_eval: hidden states come from ``transformers`` directly (one text per forward pass, no
padding, float64 weights), and every statistic is written out in numpy. A value test compares what repgeom reports
with these, so a change in repgeom's pooling, addressing, preprocessing or metric code shows up as a mismatch
instead of being reproduced by the reference.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

MAX_LENGTH = 128  # the tiny test models' context (repgeom_eval.testing.tiny_config)


def corpus(first: int, count: int, skip_words: int = 0, max_words: int = 18) -> list[str]:
    """``count`` short texts read from Python's own documentation (pydoc_data), starting at topic ``first``.

    Lengths vary between 3 and ``max_words`` words; ``skip_words`` starts each text further into its topic, so two
    calls with different arguments give genuinely different corpora.
    """
    from pydoc_data.topics import topics

    keys = sorted(topics)
    out = []
    for i in range(count):
        words = topics[keys[(first + i) % len(keys)]].split()
        n = 3 + (i * 5) % (max_words - 2)
        start = min(skip_words, max(0, len(words) - n))
        out.append(" ".join(words[start:start + n]))
    return out


@lru_cache(maxsize=8)
def _load(model_dir: str, dtype: torch.dtype):
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(model_dir, torch_dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def hidden_states(model_dir: str, texts: list[str], dtype: torch.dtype = torch.float64) -> list[list[np.ndarray]]:
    """``out[i][k]`` = ``hidden_states[k]`` [T_i, D] of text i, from ``model(..., output_hidden_states=True)``.

    Index 0 is the embedding output, k the output of block k-1, and -1 the last hidden state (after the final
    norm on models that have one).
    """
    model, tok = _load(str(model_dir), dtype)
    out = []
    for text in texts:
        enc = tok(text, return_tensors="pt", truncation=True, max_length=MAX_LENGTH)
        with torch.no_grad():
            hs = model(**enc, output_hidden_states=True).hidden_states
        out.append([h[0].double().numpy() for h in hs])
    return out


def token_id_states(model_dir: str, ids: list[list[int]], dtype: torch.dtype = torch.float64) -> list[list[np.ndarray]]:
    """Like :func:`hidden_states` for sequences of token ids (fed as they are, no special tokens added)."""
    model, _ = _load(str(model_dir), dtype)
    out = []
    for seq in ids:
        with torch.no_grad():
            hs = model(input_ids=torch.tensor([list(seq)]), output_hidden_states=True).hidden_states
        out.append([h[0].double().numpy() for h in hs])
    return out


def pool(tokens: np.ndarray, how: str) -> np.ndarray:
    if how == "mean":
        return tokens.mean(0)
    if how == "last":
        return tokens[-1]
    if how == "first":
        return tokens[0]
    raise ValueError(how)


def pooled(states: list[list[np.ndarray]], layer: int, how: str) -> np.ndarray:
    """[N, D]: every text's hidden state at ``layer`` pooled ``how``."""
    return np.stack([pool(s[layer], how) for s in states])


def units(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.where(norms > 0, norms, 1.0)


def mean_cosine_distance(x: np.ndarray) -> float:
    """Mean of 1 − cos(x_i, x_j) over the ordered pairs i ≠ j (brute force, N×N)."""
    u = units(x)
    cos = u @ u.T
    n = len(x)
    return float((n * n - cos.sum() - (n - np.trace(cos))) / (n * (n - 1)))


def energy_shares(x: np.ndarray) -> np.ndarray:
    """Share of Σ_i ‖x_i‖² carried by each dimension."""
    e = (x * x).sum(0)
    return e / e.sum()


def von_neumann_entropy_normalized(tokens: np.ndarray) -> float:
    """Prompt entropy as documented in repgeom (paper B): centre the rows, scale them to unit length, take the
    eigenvalues of the Gram matrix, keep the positive ones above round-off, S = −Σ p log p with p = λ / Σλ, and
    divide by log min(N, D)."""
    z = units(tokens - tokens.mean(0, keepdims=True))
    n, d = z.shape
    gram = z @ z.T
    lam = np.linalg.eigvalsh(gram)
    lam = lam[lam > n * np.finfo(np.float64).eps * lam.max()]
    p = lam / lam.sum()
    return float(-(p * np.log(p)).sum() / np.log(min(n, d)))
