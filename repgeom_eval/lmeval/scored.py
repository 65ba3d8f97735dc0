"""What HFLM scores for one request, and the results that carry what was read from it.

HFLM scores a request ``(context, continuation)`` with one forward pass over ``(context + continuation)[:-1]``,
left-truncated to the model length (lm-eval 0.4.13, ``HFLM._loglikelihood_tokens``): a :class:`ScoredRow`. Its
position ``last`` holds the last context token, whose hidden state predicts the first continuation token: a hardness
query's vector is read there (docs/metrics.md#hardness-slices). Positions ``last … end - 1`` are the ones whose
predictions are scored: the tokens of a rolling-perplexity window. A row is matched to its request by a hash of the
exact tokens a value depends on (:meth:`ScoredRow.context_key`, :meth:`ScoredRow.window_key`), so nothing is assumed
about lm-eval's reordering and batching.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from repgeom_eval.functional.dispersion import DispersionSums, unit
from repgeom_eval.measurement.pooling import pool


def _digest(tokens: Sequence[int] | np.ndarray) -> bytes:
    return hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


@dataclass(frozen=True, eq=False)
class ScoredRow:
    """The tokens of one request as the model reads them; ``last`` is the position of the last context token."""

    tokens: Sequence[int] | np.ndarray
    last: int

    @classmethod
    def of(cls, context: Sequence[int], continuation: Sequence[int], max_length: int) -> "ScoredRow":
        """The row HFLM runs for a request (context and continuation as lm-eval encoded them)."""
        tokens = list((list(context) + list(continuation))[-(max_length + 1):][:-1])
        return cls(tokens, len(tokens) - len(continuation))

    def context(self) -> "ScoredRow":
        """The context alone: all a context vector depends on (causal attention)."""
        return ScoredRow(self.tokens[: self.last + 1], self.last)

    def context_key(self) -> tuple:
        """Key of a value that depends on the context tokens only."""
        return ("ctx", _digest(self.tokens[: self.last + 1]))

    def window_key(self) -> tuple:
        """Key of the values of one scored window (its tokens and how many of them are scored)."""
        return ("win", _digest(self.tokens), len(self.tokens) - self.last)

    def key(self, pooling: str) -> tuple:
        """Key of what ``pooling`` reads: the scored window for ``tokens``, the context otherwise."""
        return self.window_key() if pooling == "tokens" else self.context_key()

    def positions(self, pooling: str, offset: int = 0) -> slice:
        """Where ``pooling`` reads: the scored positions for ``tokens``, the context otherwise."""
        return self.scored_positions(offset) if pooling == "tokens" else self.context_positions(offset)

    def context_positions(self, offset: int = 0) -> slice:
        """Where the context sits in a model sequence that holds ``offset`` tokens before the row (prompt tuning)."""
        return slice(offset, offset + self.last + 1)

    def scored_positions(self, offset: int = 0) -> slice:
        """Where the positions whose predictions are scored sit in such a sequence."""
        return slice(offset + self.last, offset + len(self.tokens))


def positions_mask(length: int, spans: Sequence[slice], device: torch.device | str | None = None) -> torch.Tensor:
    """[len(spans), length] bool, True inside each span."""
    positions = torch.arange(length, device=device)
    return torch.stack([(positions >= s.start) & (positions < s.stop) for s in spans])


def read(hidden: torch.Tensor, span: slice, pooling: str) -> np.ndarray | DispersionSums:
    """What ``pooling`` reads from one sequence's [T, D] hidden states over ``span``, through the project's one
    :func:`~repgeom_eval.measurement.pooling.pool`: a vector, or for ``tokens`` the dispersion sums of the unit token
    vectors (summed where the states are; only S and Q move to the host)."""
    mask = positions_mask(hidden.shape[0], [span], hidden.device)
    if pooling == "tokens":
        u = unit(pool(hidden[None].double(), mask, "tokens")[0])
        return DispersionSums(u.sum(0).cpu().numpy(), float((u * u).sum()), float(u.shape[0]))
    return pool(hidden[None].double(), mask, pooling)[0][0].float().cpu().numpy()


def rolling_windows(lm: Any, text: str) -> list[tuple[list[int], list[int]]]:
    """The (context, continuation) windows ``HFLM.loglikelihood_rolling`` scores for ``text``."""
    from lm_eval import utils

    windows = utils.get_rolling_token_windows(token_list=lm.tok_encode(text), prefix_token=lm.prefix_token_id,
                                              max_seq_len=lm.max_length, context_len=1)
    return [utils.make_disjoint_window(w) for w in windows]


@dataclass(frozen=True)
class PromptScore:
    """How well the model predicts the context (prompt) itself, read from the same forward pass: the summed
    log-probability of the context tokens after the first (each given the ones before it) and how many they are."""

    logprob: float
    n_tokens: int

    def perplexity(self) -> float:
        """exp(−logprob / n_tokens); NaN for a one-token context (nothing of it is predicted)."""
        return math.exp(-self.logprob / self.n_tokens) if self.n_tokens > 0 else float("nan")


def prompt_score(logprobs: torch.Tensor, row: ScoredRow, offset: int = 0) -> PromptScore:
    """The :class:`PromptScore` of ``row``'s context from its log-softmaxed logits [T, V], the row sitting ``offset``
    positions into the model's sequence (position ``offset + p`` predicts token ``p + 1``)."""
    if row.last < 1:
        return PromptScore(0.0, 0)
    positions = torch.arange(offset, offset + row.last, device=logprobs.device)
    targets = torch.as_tensor(np.asarray(row.tokens[1: row.last + 1], dtype=np.int64), device=logprobs.device)
    return PromptScore(float(logprobs[positions, targets].double().sum()), int(row.last))


class Scored(tuple):
    """``(loglikelihood, is_greedy)`` exactly as lm-eval computed it, plus ``geometry`` ({(address, pooling): vector
    or DispersionSums}), ``n_tokens`` (continuation length) and ``prompt`` (the context's :class:`PromptScore`, for
    requests read as contexts; None otherwise). Unpacking, indexing and pickling work as for the tuple."""

    def __new__(cls, result: Iterable[Any], geometry: dict | None = None, n_tokens: int | None = None,
                prompt: PromptScore | None = None):
        obj = super().__new__(cls, result)
        obj.geometry = geometry if geometry is not None else {}
        obj.n_tokens = n_tokens
        obj.prompt = prompt
        return obj


class RollingScore(float):
    """A document's rolling log-likelihood exactly as lm-eval computed it, plus ``geometry`` ({(address, "tokens"):
    DispersionSums} added over its windows) and ``n_tokens`` (tokens scored)."""

    def __new__(cls, value: float, geometry: dict | None = None, n_tokens: int | None = None):
        obj = super().__new__(cls, value)
        obj.geometry = geometry if geometry is not None else {}
        obj.n_tokens = n_tokens
        return obj
