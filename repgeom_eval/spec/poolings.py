"""The pooling names (docs/metrics.md#pooling): how a text's token vectors become the vectors a metric reads.
Standard library only, so that every option that names a pooling is checked before torch loads;
repgeom_eval/measurement/pooling.py pools.
"""

from __future__ import annotations

from repgeom_eval.spec.errors import RepgeomError, UnknownNameError

POOLINGS = ("last", "mean", "first", "tokens")
POOLING_ALIASES = {"cls": "first"}


def check_pooling(name: str) -> str:
    if not isinstance(name, str):
        raise RepgeomError(f"pooling must be one of {', '.join(POOLINGS + tuple(POOLING_ALIASES))}, got {name!r}")
    name = POOLING_ALIASES.get(name, name)
    if name not in POOLINGS:
        raise UnknownNameError("pooling", name, POOLINGS + tuple(POOLING_ALIASES))
    return name
