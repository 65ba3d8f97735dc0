"""User-facing errors: each names the culprit and, where possible, the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class RepgeomError(Exception):
    """An error caused by the user's input or environment (not a bug in repgeom-eval).

    The CLI prints these as one line and exits with status 2; everything else is a bug and keeps its traceback.
    """


class UnknownNameError(RepgeomError, KeyError):
    """A name (metric, address site, plugin, token set ...) that is not registered."""

    def __init__(self, kind: str, name: str, choices: Iterable[str], hint: str = ""):
        self.kind, self.name, self.choices = kind, name, sorted(set(choices))
        msg = f"unknown {kind} {name!r}"
        close = difflib.get_close_matches(name, self.choices, n=3, cutoff=0.5)
        if close:
            msg += f"; did you mean {' or '.join(repr(c) for c in close)}?"
        if self.choices:
            shown = ", ".join(self.choices[:30]) + (" ..." if len(self.choices) > 30 else "")
            msg += f" (valid: {shown})"
        if hint:
            msg += f". {hint}"
        super().__init__(msg)

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class PluginError(RepgeomError):
    """A plugin failed to load or registered something invalid."""


class NonFiniteError(RepgeomError):
    """NaN or inf in hidden states or inputs."""


def check_param(metric: str, name: str, value: object, ok: bool, expected: str) -> None:
    """Raise a RepgeomError naming the metric, the parameter, its value and what it must be, unless ``ok``."""
    if not ok:
        raise RepgeomError(f"{metric}: parameter {name}={value!r} is invalid; it must be {expected} "
                           f"(set it with --metric-param {metric}.{name}=VALUE)")


def is_real(value: object) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) != float("inf")


def is_count(value: object, minimum: int = 1) -> bool:
    """An int (not a bool) ≥ ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
