"""Named token sets for the dispersion gap (docs/metrics.md#token-sets): ``digits``, ``python_keywords`` and
``general``.

A token set is a callable ``fn(vocab, *, exclude, seed, size) -> (ids, missing[, config])`` or a collection of
words; ``vocab`` is a :class:`repgeom_eval.analyses.gap.vocabulary.Vocabulary` (stripped text of every id,
``vocab.ids_for(word)``, ``vocab.resolve_words(words, exclude)``). See the module docstring of
:mod:`repgeom_eval.analyses.gap.vocabulary` for the matching rule.
"""

from __future__ import annotations

import keyword
import random

from repgeom_eval import hookimpl

DIGITS = tuple("0123456789")
GENERAL_MIN_LENGTH = 3


def digits(vocab, *, exclude=frozenset(), seed=0, size=0):
    """Entries whose stripped text is one digit 0-9, every variant kept (5 and Ġ5); missing digits reported."""
    return vocab.resolve_words(DIGITS, exclude)


def python_keywords(vocab, *, exclude=frozenset(), seed=0, size=0):
    """Entries whose stripped text is a Python keyword (keyword.kwlist); keywords with no entry reported missing."""
    ids, missing = vocab.resolve_words(keyword.kwlist, exclude)
    return ids, missing, {"n_words": len(keyword.kwlist)}


def general(vocab, *, exclude=frozenset(), seed=0, size=1000):
    """Reference set: a seeded sample (default 1000, seed 0) of alphabetic entries of length >= 3, not in T."""
    candidates = sorted(i for i, text in vocab.texts.items()
                        if len(text) >= GENERAL_MIN_LENGTH and text.isalpha() and i not in exclude)
    if len(candidates) <= size:
        chosen = candidates
    else:
        chosen = sorted(random.Random(seed).sample(candidates, size))
    return chosen, [], {"size": size, "seed": seed, "n_candidates": len(candidates),
                        "rule": f"str.isalpha() and length >= {GENERAL_MIN_LENGTH} after stripping; T excluded",
                        "sampler": "random.Random(seed).sample over candidate ids in ascending order"}


@hookimpl
def repgeom_register_token_sets(registry):
    registry.add(digits, name="digits")
    registry.add(python_keywords, name="python_keywords")
    registry.add(general, name="general")
