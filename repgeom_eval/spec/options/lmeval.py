"""The ``repgeom_*`` keys of lm-eval's ``--metadata`` (and of ``--model_args`` with ``--model repgeom-hf``), declared
once as the fields of :class:`Settings` (docs/lmeval.md#settings---metadata).

From the declaration come: the keys a task accepts (:func:`key`; an unknown ``repgeom_*`` key is an error naming
it), the conversion of a given value (``from_cli``), every check (:meth:`Settings.from_metadata`), the keys
``repgeom-hf`` takes out of its model arguments (:func:`settings_in`), and the block each task writes into the
results' task config under ``metadata.repgeom`` (:meth:`Settings.record`: the fields declared with ``config=True``
that the task's kind reads). lm-eval merges ``--model_args`` into the metadata every task receives, so both routes
reach the same fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import Field, dataclass, fields
from types import MappingProxyType
from typing import Any

from repgeom_eval.spec.options.analyses import SlicesConfig
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.spec.poolings import check_pooling
from repgeom_eval.spec.option_fields import Must, check_options, integer_at_least, option, plain

PREFIX = "repgeom_"
# Not a setting: the shipped YAMLs' dataset_kwargs key, which lm-eval passes to the dataset loader beside the metadata.
SCHEMA_KEY = "repgeom_schema"
CAPTURES = ("fused", "extra")
# A hardness task reads one vector per query: its last context token or the mean over its context (the `first` token
# of the one pooling vocabulary, repgeom_eval.measurement.pooling, is the same for every query of a prompt format).
# A rolling-perplexity task reads every scored token (`tokens`).
HARDNESS_POOLINGS = ("last", "mean")
HARDNESS_ONLY = "hardness_only"  # field metadata: read (and recorded) by hardness tasks only


def _pooling_problem(pooling: Any) -> str | None:
    """``repgeom_pooling``: one pooling name, or a mapping of metric names to pooling names."""
    if pooling is None:
        return None
    if isinstance(pooling, Mapping) and all(isinstance(k, str) for k in pooling):
        named = list(pooling.items())
    elif isinstance(pooling, str):
        named = [(None, pooling)]
    else:
        return f'must be a pooling name (last, mean, first, tokens) or {{"METRIC": pooling}}, got {pooling!r}'
    for metric, value in named:
        try:
            check_pooling(value)
        except RepgeomError as exc:
            return str(exc) if metric is None else f"[{metric!r}]: {exc}"
    return None


def _hardness_only(spec: Field) -> Field:
    """Mark an :func:`option` that only hardness tasks read: a perplexity task accepts the key (one ``--metadata``
    serves every task of a run) but does not record it."""
    spec.metadata = MappingProxyType({**spec.metadata, HARDNESS_ONLY: True})
    return spec


@dataclass(frozen=True)
class Settings:
    """The settings of one repgeom task: field ``name`` is the ``--metadata`` key ``repgeom_<name>``."""

    data: str | None = option(None, help="local file or folder in the upstream schema (docs/lmeval.md#local-data); "
                                         "default: the Hugging Face Hub dataset")
    layer: str = option("final", from_cli=str,
                        help="one layer address: final, resid_post:-1, mlp_in:12, a hidden-state index")
    # One name for pooling on every surface (docs/lmeval.md#settings---metadata): a string is the pooling of every
    # vector the run reads (a hardness task's own geometry and every POOLED registered metric, as `repgeom measure
    # --pooling`); a mapping {METRIC: pooling} sets single metrics' (as `--metric-param METRIC.pooling`). None: the
    # defaults (`last` for a hardness task's own geometry, each registered metric's own).
    pooling: Any = option(None, config=False, check=_pooling_problem,
                          help="pooling of every vector read, or {METRIC: pooling}; default: last for the task's own "
                               "geometry, each metric's own")
    correct: str = _hardness_only(option("acc", help="the 0/1 metric that defines a correct query (acc or acc_norm)"))
    capture: str = option("fused", check=Must(" or ".join(CAPTURES), lambda v: v in CAPTURES), help="fused: read lm-eval's own forward pass; extra: one more pass (fallback)")
    slice_size: int = _hardness_only(option(SlicesConfig.size, check=integer_at_least(1),
                                            help="queries per controlled slice"))
    slice_seeds: int = _hardness_only(option(SlicesConfig.seeds, check=integer_at_least(1),
                                             help="slices per fraction"))
    # The registered metrics (docs/lmeval.md#any-registered-metric), None: not requested. Recorded as the metric
    # request normalises them (MetricRequest.record), and only when metrics are requested.
    metrics: Any = option(None, config=False, help="registered metrics to add, at repgeom_layers")
    metric_params: Any = option(None, config=False, help='their parameters: {"METRIC": {"PARAM": VALUE}}')
    layers: Any = option(None, config=False, help="their addresses or selectors (default: repgeom_layer)")
    seed: int = option(0, config=False, help="seed of the augmented views of VIEWS metrics")

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], kind: str) -> "Settings":
        """The settings of a task of ``kind`` (``hardness``, ``perplexity``, or ``any`` for any other task and for
        ``repgeom-hf``'s model arguments) from the metadata lm-eval hands it.
        Every check of a setting is here (those of the metric request in
        :meth:`~repgeom_eval.lmeval.registered.MetricRequest.from_settings`).

        Parsed once per process: lm-eval hands the same metadata to the model, the start-up check and every task,
        so the checked (frozen) object of the first parse is returned for the same keys and kind again."""
        given = settings_in(metadata)
        memo = (repr(sorted((k, _canonical(v)) for k, v in given.items())), kind)
        if memo not in _PARSED:
            _PARSED[memo] = cls._parse(given, kind)
        return _PARSED[memo]

    @classmethod
    def _parse(cls, given: Mapping[str, Any], kind: str) -> "Settings":
        out = cls(**given)
        if kind == "hardness" and isinstance(out.pooling, str) and out.pooling not in HARDNESS_POOLINGS:
            # a rule of the task kind, not of the value: the perplexity task reads every token whatever is given
            raise RepgeomError(f"repgeom_pooling must be {' or '.join(HARDNESS_POOLINGS)}, got {out.pooling!r}")
        check_options(out, name=lambda f: key(f.name))  # the one check mechanism: each field's declared check
        return out

    def read_pooling(self, kind: str) -> str:
        """The pooling of a task's own geometry: every scored token for a rolling-perplexity task, else the one
        ``repgeom_pooling`` names (a mapping sets registered metrics only), ``last`` by default."""
        if kind == "perplexity":
            return "tokens"
        return self.pooling if isinstance(self.pooling, str) else "last"

    def record(self, kind: str) -> dict[str, Any]:
        """What a task of ``kind`` writes under ``metadata.repgeom`` of its config: the recorded settings it reads
        (``pooling``: what its own geometry reads)."""
        out = {}
        for f in fields(self):
            if f.name == "pooling":
                out["pooling"] = self.read_pooling(kind)
            elif f.metadata["config"] and (kind == "hardness" or not f.metadata.get(HARDNESS_ONLY)):
                out[f.name] = plain(getattr(self, f.name))
        return out


_PARSED: dict[tuple[str, str], Settings] = {}


def _canonical(value: Any) -> Any:
    """A value as a comparable, order-independent key (mappings sorted; lists kept in order)."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _canonical(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_canonical(v) for v in value)
    return (type(value).__name__, value)


def key(name: str) -> str:
    """The metadata key of the setting ``name``."""
    return f"{PREFIX}{name}"


KEYS = tuple(key(f.name) for f in fields(Settings))


def rejoin_brackets(args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` with the pieces of a ``repgeom_*`` value that a naive comma split cut apart put back together.

    lm-eval's command line splits ``--model_args`` at the commas outside brackets (``repgeom_layers=resid_post:[0,1]``
    arrives whole), but a model-argument *string* given to its Python API (``simple_evaluate(model_args="...")``)
    goes through ``simple_parse_args_string``, which splits at every comma: ``{"repgeom_layers": "resid_post:[0",
    "1]": ""}``. Each piece follows its key, without an ``=`` (so its value is ``""``); they are joined back here
    (docs/lmeval.md#settings---metadata)."""
    out: dict[str, Any] = {}
    open_key = None
    for name, value in args.items():
        if open_key is not None and value == "" and "=" not in name:
            out[open_key] += "," + name
        else:
            out[name] = value
            open_key = name if name.startswith(PREFIX) and isinstance(value, str) else None
        if open_key is not None and out[open_key].count("[") <= out[open_key].count("]"):
            open_key = None
    return out


def settings_in(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The settings given in ``metadata`` (lm-eval's ``--metadata`` or model arguments), by field name and
    converted; an unknown ``repgeom_*`` key is an error."""
    metadata = rejoin_brackets(metadata)
    unknown = sorted(k for k in metadata if k.startswith(PREFIX) and k not in KEYS and k != SCHEMA_KEY)
    if unknown:
        raise RepgeomError(f"unknown metadata key {unknown[0]!r} for repgeom tasks (valid: {', '.join(sorted(KEYS))})")
    given = {}
    for f in fields(Settings):
        if key(f.name) in metadata:
            convert = f.metadata["from_cli"]
            value = metadata[key(f.name)]
            given[f.name] = convert(value) if convert else value
    return given
