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
    """A plugin failed to load, registered something invalid, or raised while it ran."""


class PluginUnavailableError(UnknownNameError, PluginError):
    """A name that is not registered because the plugin that would register it failed to load or is switched off."""

    def __init__(self, kind: str, name: str, message: str, choices: Iterable[str] = ()):
        self.kind, self.name, self.choices = kind, name, sorted(set(choices))
        RepgeomError.__init__(self, message)


class ParameterError(RepgeomError, ValueError):
    """A parameter value a metric (or another plugin) cannot use: raise it from ``__init__`` to reject it in one line.

    ``ParameterError("threshold", -1.0, "a number > 0")`` reads, once the pipeline has filled in the metric's name,
    ``long_vectors: parameter threshold=-1.0 is invalid; it must be a number > 0 (set it with --metric-param
    long_vectors.threshold=VALUE)`` (docs/plugins.md#rejecting-a-bad-parameter-value). It is also a ``ValueError``.
    """

    def __init__(self, name: str, value: object, expected: str, metric: str | None = None):
        super().__init__(name, value, expected, metric)
        self.param, self.value, self.expected, self.metric = name, value, expected, metric

    def __str__(self) -> str:
        text = f"parameter {self.param}={self.value!r} is invalid; it must be {self.expected}"
        if self.metric:
            text = f"{self.metric}: {text} (set it with --metric-param {self.metric}.{self.param}=VALUE)"
        return text


class NonFiniteError(RepgeomError):
    """NaN or inf in hidden states or inputs."""


class ModelForwardError(RepgeomError):
    """The model's own forward pass raised on an input (a limit of that model, or of transformers' code for it)."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name if it has none): how one-line errors quote a cause."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def check_param(metric: str, name: str, value: object, ok: bool, expected: str) -> None:
    """Raise a :class:`ParameterError` naming the metric, the parameter, its value and what it must be, unless
    ``ok``."""
    if not ok:
        raise ParameterError(name, value, expected, metric=metric)


def is_real(value: object) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) != float("inf")


def is_count(value: object, minimum: int = 1) -> bool:
    """An int (not a bool) ≥ ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
