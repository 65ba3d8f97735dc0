"""The option groups the commands share, each option declared once (machinery: repgeom_eval/spec/option_fields.py).

A command's configuration inherits the groups it needs and adds its own fields; a group field with another default
for one command is declared again with :func:`~repgeom_eval.spec.option_fields.option_like`. The model group is
:class:`~repgeom_eval.spec.options.model.ModelOptions` plus ``--model``. Torch-free (``--help`` stays instant).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass
from typing import Any

from repgeom_eval.spec.options.model import ModelOptions
from repgeom_eval.spec.option_fields import Options, option, positive

PACKINGS = ("concat", "document")  # how documents become chunks: repgeom_eval/analyses/corpus.py


def models_given(value: Any) -> str | tuple[str, ...]:
    """``--model`` given once: that model; given several times (``-m A -m B``): all of them, in order (a command
    that takes one model refuses several in one line: :func:`one_model`, never keeping only the last)."""
    if isinstance(value, (list, tuple)):
        return value[0] if len(value) == 1 else tuple(value)
    return value


def one_model(value: Any) -> str | None:
    if isinstance(value, (list, tuple)) and len(value) > 1:
        return (f"given {len(value)} times ({', '.join(map(str, value))}); this command takes one model: run it "
                "once per model (`repgeom measure` takes several)")
    return None


@dataclass(frozen=True, kw_only=True)
class ModelGroup(ModelOptions):
    """One model and how to load it."""

    group_title = "model options"
    model: str = option(MISSING, "--model", "-m", key=False, config=False, action="append", from_cli=models_given,
                        check=one_model, metavar="MODEL",
                        help="hub id, local model directory, or .gguf file (loaded through transformers)")


@dataclass(frozen=True, kw_only=True)
class ModelsGroup(ModelOptions):
    """One model or several (measured alike, side by side)."""

    group_title = "model options"
    model: tuple[str, ...] = option(MISSING, "--model", "-m", nargs="+", action="extend", key=False, config=False,
                                    help="one or more models (hub ids, directories, .gguf files), shown side by side")


@dataclass(frozen=True, kw_only=True)
class TextsGroup(Options):
    """Which field of a .jsonl record holds the text."""

    group_title = "data"
    text_field: str = option("text", "--text-field", help="field of each .jsonl record to read (default: {default})")


@dataclass(frozen=True, kw_only=True)
class DataGroup(TextsGroup):
    """The texts: a file (and its text field)."""

    group_title = "data"

    data: str = option(MISSING, "--data", "-d", key=False, config=False,
                       help=".jsonl with a text field per line, or .txt, one text a line")


@dataclass(frozen=True, kw_only=True)
class ChunksGroup(Options):
    """How a corpus becomes chunks of tokens (repgeom_eval/analyses/corpus.py)."""

    group_title = "data"
    chunk_len: int = option(512, "--chunk-len", type=int, check=positive, help="tokens per chunk (default: {default})")
    packing: str = option("concat", "--packing", choices=list(PACKINGS),
                          help="concat: join each source's documents into one token stream and cut it (paper A's "
                               "Wikitext protocol, default); document: cut each document on its own")


def request_problem(value: Any, auto: bool = False) -> str | None:
    """What the one layer grammar (repgeom_eval.modeling.addresses.layer_request, docs/metrics.md#layer-addresses)
    finds wrong with a layer request before any model loads; ``auto`` (the layer pick) only where ``auto`` is true."""
    from repgeom_eval.spec.errors import RepgeomError
    from repgeom_eval.spec.layer_request import AUTO_ELSEWHERE, layer_request

    if value is None:
        return None
    try:
        request = layer_request(value)
    except RepgeomError as exc:
        return str(exc)
    return AUTO_ELSEWHERE if request.auto and not auto else None


@dataclass(frozen=True, kw_only=True)
class LayersGroup(Options):
    """Where in the model to measure (docs/addresses.md)."""

    group_title = "layers"
    layers: str | tuple[str, ...] = option("all", "--layers", "-l", nargs="+", config_name="layer_request",
                                           cli_default=["all"], check=request_problem,
                                           help="layer addresses (default: {default} = every hidden state)")

    def __post_init__(self) -> None:
        if self.layers is not None and not isinstance(self.layers, str):
            self._set("layers", tuple(str(x) for x in self.layers))
        super().__post_init__()

    def config_block(self, resolved: Any = None) -> dict[str, Any]:
        """The request is recorded as its items, split by the one grammar, under ``layer_request`` (the name every
        output gives it; ``layer_spec`` before, as given)."""
        from repgeom_eval.spec.layer_request import REQUEST_KEY, layer_request

        block = super().config_block(resolved)
        if REQUEST_KEY in block and REQUEST_KEY not in (resolved or {}) and self.layers is not None:
            block[REQUEST_KEY] = layer_request(self.layers).record()
        return block

    @property
    def layer_request(self) -> str | list[str]:
        """The request as the analyses take it: one address as a string, several as a list."""
        if isinstance(self.layers, str):
            return self.layers
        return self.layers[0] if len(self.layers) == 1 else list(self.layers)


@dataclass(frozen=True, kw_only=True)
class RunGroup(Options):
    """How the forward passes run: batch size, seed, the device the model is given (its flags are the model
    group's), progress bar."""

    group_title = "run"
    batch_size: int = option(4, "--batch-size", "-b", type=int, check=positive, help="texts per forward pass")
    seed: int = option(0, "--seed", type=int, help="random seed (default: {default})")
    dtype: str | None = option("auto")  # flags: the model group's --dtype
    device: str | None = option("cpu", key=False)  # flags: the model group's --device
    progress: str | bool = option("auto", "--progress", choices=["auto", "always", "never"], key=False,
                                  config=False, help="auto (default): a bar on a terminal, plain lines in logs and "
                                                     "pipes (every 30 s or 10%%); always: a bar; never: nothing")
    no_progress: bool = option(False, "--no-progress", action="store_true", key=False, config=False,
                               help="the same as --progress never")

    def __post_init__(self) -> None:
        # the Python API's switch: True = auto (bars on a terminal, lines elsewhere), False = never
        if self.no_progress or self.progress is False or self.progress is None:
            self._set("progress", "never")
        elif self.progress is True:
            self._set("progress", "auto")
        self._set("no_progress", False)  # said by progress from here on: one configuration, however it was given
        super().__post_init__()


@dataclass(frozen=True, kw_only=True)
class OutputGroup(Options):
    """Where the results go."""

    group_title = "output"
    output: str | None = option(None, "--output", "-o", writes="file", key=False, config=False,
                                help="results JSON (written atomically)")


@dataclass(frozen=True, kw_only=True)
class PlotsGroup(OutputGroup):
    """Results and figures."""

    group_title = "output"

    plot_dir: str | None = option(None, "--plot-dir", writes="folder", key=False, config=False,
                                  help="write the figures (PNG) here; default: next to --output, none without it")


@dataclass(frozen=True, kw_only=True)
class JsonGroup(Options):
    """The results on stdout as JSON instead of a table."""

    group_title = "output"
    json: bool = option(False, "--json", action="store_true", key=False, config=False,
                        help="print the results JSON to stdout instead of a table")
