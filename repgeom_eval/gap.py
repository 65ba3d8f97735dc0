"""Dispersion gap G on the output projection: screening checkpoints without a forward pass (spec §2.3, §9.2).

For a domain token set T and a general reference set T̄, with ``W`` the rows of the output projection
(``model.get_output_embeddings().weight``, exactly as stored)::

    G = within(T) + between(T, T̄)        (paper A §3.2; sign "+")

within(T) is the mean pairwise distance over i ≠ j inside T, between(T, T̄) the mean distance over all pairs
(i ∈ T, j ∈ T̄). Cosine distance by default, through the O(N·d) sum identities of §1.2–1.3; Euclidean distance as an
option (paper A Tables 9–12). within(T̄) is reported too.

Only the output-embedding tensor is read from the checkpoint (``safetensors`` ``safe_open``, following the shard
index, or the ``gguf`` reader for ``.gguf`` files): the model is never instantiated and no forward pass runs.
:func:`read_output_embeddings` returns the whole V×d matrix; :func:`screen` reads only the |T ∪ T̄| rows it needs.

Token sets
----------
A token-set *spec* is one of

* a registered name (``digits``, ``python_keywords``, ``general`` ship with repgeom-eval; plugins add more through
  ``repgeom_register_token_sets``);
* ``words:a,b,c``: an explicit list of words;
* the path of a UTF-8 text file with one word per line (blank lines skipped).

Tokens are matched on their *stripped text*: the token decoded on its own, stripped of surrounding whitespace and of
the tokenizer's word-boundary markers (``Ġ`` of byte-level BPE, ``▁`` of SentencePiece, WordPiece's ``##``
continuation prefix, a BPE end-of-word suffix such as ``</w>``). A word maps to *every* entry whose stripped text is
exactly the word (``5`` and ``Ġ5`` both count as the word ``5``); a word with no such entry is reported as missing,
never silently dropped. Special tokens never match.

A registered token set is either a collection of strings (a fixed word list, resolved as above) or a callable::

    fn(vocab: Vocabulary, *, exclude: frozenset[int], seed: int, size: int)
        -> (ids: list[int], missing: list[str])      # or (ids, missing, extra_config: dict)

``vocab`` gives the stripped text of every id (``vocab.texts``), the ids of a word (``vocab.ids_for(word)``) and the
tokenizer (``vocab.tokenizer``); the callable must not return ids in ``exclude`` (for the reference set: the ids of
T). ``seed`` and ``size`` are for sampled sets (``general``) and may be ignored by fixed ones.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import RepgeomError, UnknownNameError

DISTANCES = ("cosine", "euclidean")
DEFAULT_DOMAIN = "digits"
DEFAULT_REFERENCE = "general"
DEFAULT_SIZE = 1000
DEFAULT_SEED = 0
WORD_BOUNDARY_MARKERS = ("Ġ", "▁")  # byte-level BPE (GPT-2, Llama-3, SmolLM) and SentencePiece (Llama-2, T5)
SIGN = "G = within(T) + between(T, T̄)"

# Output-embedding tensor names of checkpoints whose keys predate the model class (tried last, shape-checked).
_LEGACY_OUTPUT_NAMES = ("lm_head.weight", "embed_out.weight", "output.weight")
_LEGACY_INPUT_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight", "transformer.wte.weight", "wte.weight",
                       "gpt_neox.embed_in.weight", "embed_in.weight", "transformer.word_embeddings.weight")


# ---------------------------------------------------------------------------------------------------------------
# Reading W
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class EmbeddingInfo:
    """Where the output-embedding matrix came from."""

    model: str  # as given
    path: str  # the directory or .gguf file read
    source: str  # "safetensors" or "gguf"
    tensor: str  # the tensor name inside the checkpoint
    file: str  # the file holding it
    tied: bool | None  # output projection shares the input embedding (None: unknown)
    shape: tuple[int, int]
    dtype: str  # as stored (before any conversion)
    found_by: str  # "parameter name", "checkpoint key renaming", "legacy name" or "gguf name"
    read_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


def _locate_checkpoint(model: str) -> tuple[Path, dict[str, Any], str]:
    """(directory, extra from_pretrained kwargs, source kind) for a directory, a .gguf file or a cached hub id."""
    from repgeom_eval.modeling.loading import _locate

    target, extra, source = _locate(model)
    if source != "hub":
        return Path(target), extra, source
    try:
        from huggingface_hub import snapshot_download

        snapshot = snapshot_download(model, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached (or not a valid id): one message for all cases
        raise RepgeomError(
            f"model {model!r} is not a local directory or .gguf file and is not in the Hugging Face cache; "
            f"download it first (`hf download {model}`) or pass a local model directory"
        ) from None
    return Path(snapshot), {}, "directory"


def _safetensors_layout(directory: Path, model: str) -> dict[str, str]:
    """checkpoint key → safetensors file name, following ``model.safetensors.index.json`` when sharded."""
    from safetensors import safe_open

    indexes = sorted(directory.glob("*.safetensors.index.json"))
    if indexes:
        index = indexes[0]
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise RepgeomError(f"cannot read the shard index {str(index)!r} of model {model!r}: "
                               f"{type(exc).__name__}: {exc}") from None
        return {str(k): str(v) for k, v in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt*"))
        if bins:
            raise RepgeomError(
                f"model {model!r} has no .safetensors weights (only {', '.join(bins[:3])}); the gap reads one "
                "tensor without loading the model, which needs safetensors: convert it once with "
                "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir)` (writes model.safetensors)"
            )
        raise RepgeomError(f"model directory {str(directory)!r} has no .safetensors weights")
    layout: dict[str, str] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    layout.setdefault(key, f.name)
        except Exception as exc:  # noqa: BLE001 - a corrupt file: name it
            raise RepgeomError(f"cannot read {str(f)!r}: {type(exc).__name__}: {exc}") from None
    return layout


def _with_prefix_variants(names: Iterable[str], prefix: str) -> list[str]:
    out: list[str] = []
    for n in names:
        variants = [n]
        if prefix and n.startswith(prefix + "."):
            variants.append(n[len(prefix) + 1:])
        elif prefix:
            variants.append(f"{prefix}.{n}")
        for v in variants:
            if v not in out:
                out.append(v)
    return out


def _skeleton_candidates(config: Any) -> tuple[list[str], list[str], tuple[int, ...], bool, str, Any]:
    """From a meta-device skeleton (no memory, no weights): (output-projection parameter names, names of the input
    embedding it is tied to, expected shape, tied, base-model prefix, the skeleton)."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    out = skeleton.get_output_embeddings()
    weight = getattr(out, "weight", None)
    if weight is None:
        raise RepgeomError(f"{type(skeleton).__name__} has no output embedding (lm_head); the gap needs a causal LM")
    shared = [n for n, p in skeleton.named_parameters(remove_duplicate=False) if p is weight]
    out_module = next((n for n, m in skeleton.named_modules(remove_duplicate=False) if m is out), None)
    own = f"{out_module}.weight" if out_module else None
    output_names = [own] if own in shared else []
    inp = skeleton.get_input_embeddings()
    tied = inp is not None and getattr(inp, "weight", None) is weight
    if not tied and _config_ties(config) and inp is not None:
        # Tying not done on the skeleton, but the config says tied: the stored tensor is the input embedding.
        shared += [n for n, p in skeleton.named_parameters(remove_duplicate=False) if p is inp.weight]
        tied = True
    input_names = [n for n in shared if n not in output_names]
    if not tied:
        output_names, input_names = output_names or shared, []
    prefix = getattr(skeleton, "base_model_prefix", "") or ""
    return output_names, input_names, tuple(weight.shape), tied, prefix, skeleton


def _config_ties(config: Any) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))


def _checkpoint_renames(skeleton: Any) -> Callable[[str], str] | None:
    """Checkpoint key → model key, through transformers' own key-renaming rules (``embed_out`` → ``lm_head`` ...).

    Uses transformers' conversion mapping where this version has one (imported only when the plain names fail:
    it costs seconds); only pure renames are applied (an embedding matrix is never merged or split). None when
    unavailable.
    """
    if skeleton is None:
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        transforms = [t for t in get_model_conversion_mapping(skeleton) if type(t) is WeightRenaming]
    except Exception:  # noqa: BLE001 - private API of transformers; absent or changed in other versions
        return None
    if not transforms:
        return None

    def rename(key: str) -> str:
        for t in transforms:
            try:
                key, _ = t.rename_source_key(key)
            except Exception:  # noqa: BLE001
                continue
        return key

    return rename


def _pick_tensor(layout: dict[str, str], output_names: list[str], input_names: list[str], prefix: str,
                 skeleton: Any, shape_of: Callable[[str], tuple[int, ...]], expected: tuple[int, ...] | None,
                 tied: bool | None) -> tuple[str, str]:
    """(checkpoint key, how it was found) of the output embedding; every candidate is shape-checked."""
    def ok(key: str) -> bool:
        return key in layout and (expected is None or tuple(shape_of(key)) == expected)

    wanted = _with_prefix_variants(output_names + input_names, prefix)
    for name in wanted:
        if ok(name):
            return name, "parameter name"
    renames = _checkpoint_renames(skeleton)
    if renames is not None:
        for key in layout:
            if _renamed(renames, key) in wanted and ok(key):
                return key, "checkpoint key renaming"
    legacy = list(_LEGACY_OUTPUT_NAMES) + (list(_LEGACY_INPUT_NAMES) if tied is not False else [])
    for name in legacy:
        if ok(name):
            return name, "legacy name"
    shown = ", ".join(wanted[:6]) or "(none)"
    raise RepgeomError(
        f"cannot find the output-embedding tensor in the checkpoint (looked for {shown}"
        + (f" with shape {list(expected)}" if expected else "") + f"; it has {len(layout)} tensors)"
    )


def _renamed(renames: Callable[[str], str], key: str) -> str:
    try:
        return renames(key)
    except Exception:  # noqa: BLE001
        return key


def _runs(sorted_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive runs [lo, hi) of sorted unique ids."""
    runs: list[tuple[int, int]] = []
    for i in sorted_ids:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


class OutputEmbeddings:
    """An opened output-embedding tensor: shape and provenance known, rows read on demand (never the whole model).

    ``rows(ids)`` reads only the requested rows (in the order given; repeats allowed), so screening needs memory
    for |T ∪ T̄| rows, not V. ``full()`` reads the whole [V, d] matrix.
    """

    def __init__(self, info: EmbeddingInfo, read_rows: Callable[[list[int]], torch.Tensor],
                 read_full: Callable[[], torch.Tensor]):
        self.info = info
        self.shape = info.shape
        self._read_rows, self._read_full = read_rows, read_full

    def rows(self, ids: Sequence[int]) -> torch.Tensor:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.shape[0]]
        if bad:
            raise RepgeomError(f"token id {bad[0]} is out of range for the output embedding of {self.info.model!r} "
                               f"({self.shape[0]} rows)")
        unique = sorted(set(ids))
        if not unique:
            return torch.empty(0, self.shape[1])
        block = self._read_rows(unique)
        pos = {i: k for k, i in enumerate(unique)}
        return block.index_select(0, torch.as_tensor([pos[i] for i in ids], dtype=torch.long))

    def full(self) -> torch.Tensor:
        return self._read_full()


def open_output_embeddings(model: str | os.PathLike) -> OutputEmbeddings:
    """Locate the output-embedding tensor of a checkpoint without loading it (see :func:`read_output_embeddings`)."""
    name = str(model)
    t0 = time.perf_counter()
    directory, extra, source = _locate_checkpoint(name)
    if source == "gguf":
        src = _open_gguf(name, directory / extra["gguf_file"])
    else:
        src = _open_safetensors(name, directory)
    src.info.read_s = time.perf_counter() - t0
    return src


def read_output_embeddings(model: str | os.PathLike) -> tuple[torch.Tensor, EmbeddingInfo]:
    """The output-embedding matrix W [V, d] of a checkpoint, read alone (no model load, no forward pass).

    ``model`` is a local model directory with safetensors weights (single file or sharded), a ``.gguf`` file, or a
    hub id already in the local Hugging Face cache. The tensor keeps its stored dtype (GGUF: de-quantized to
    float32). The tensor name comes from a meta-device skeleton of the architecture (``get_output_embeddings()``
    and every parameter name sharing it when the weights are tied), with and without the base-model prefix, then
    transformers' checkpoint-key renames, then legacy names; the shape must match.
    """
    t0 = time.perf_counter()
    src = open_output_embeddings(model)
    W = src.full()
    src.info.read_s = time.perf_counter() - t0
    return W, src.info


def _open_safetensors(name: str, directory: Path) -> OutputEmbeddings:
    from safetensors import safe_open
    from transformers import AutoConfig

    layout = _safetensors_layout(directory, name)
    try:
        config = AutoConfig.from_pretrained(str(directory))
    except (OSError, ValueError) as exc:
        raise RepgeomError(f"cannot read the model config of {name!r}: {_first_line(exc)}") from None
    try:
        output_names, input_names, expected, tied, prefix, skeleton = _skeleton_candidates(config)
    except RepgeomError:
        raise
    except Exception:  # noqa: BLE001 - an architecture this transformers cannot build: fall back to usual names
        output_names, input_names, expected, tied, prefix, skeleton = [], [], None, None, "", None

    def shape_of(key: str) -> tuple[int, ...]:
        path = directory / layout[key]
        if not path.is_file():
            raise RepgeomError(f"shard {layout[key]!r} of model {name!r}, listed in its index for {key!r}, is "
                               "missing; download the checkpoint again")
        try:
            with safe_open(str(path), framework="pt") as fh:
                return tuple(fh.get_slice(key).get_shape())
        except Exception as exc:  # noqa: BLE001 - a corrupt shard: name it
            raise RepgeomError(f"cannot read {str(path)!r}: {type(exc).__name__}: {exc}") from None

    key, found_by = _pick_tensor(layout, output_names, input_names, prefix, skeleton, shape_of, expected, tied)
    file = directory / layout[key]
    with safe_open(str(file), framework="pt") as fh:
        sl = fh.get_slice(key)
        shape = tuple(int(s) for s in sl.get_shape())
        dtype = str(sl.get_dtype())
    if len(shape) != 2:
        raise RepgeomError(f"tensor {key!r} of model {name!r} has shape {list(shape)}, expected [vocab, hidden]")

    def read_rows(ids: list[int]) -> torch.Tensor:
        with safe_open(str(file), framework="pt") as fh:
            sl = fh.get_slice(key)
            return torch.cat([sl[lo:hi] for lo, hi in _runs(ids)])

    def read_full() -> torch.Tensor:
        with safe_open(str(file), framework="pt") as fh:
            return fh.get_tensor(key)

    info = EmbeddingInfo(model=name, path=str(directory), source="safetensors", tensor=key, file=file.name,
                         tied=tied, shape=(shape[0], shape[1]), dtype=_SAFETENSORS_DTYPES.get(dtype, dtype),
                         found_by=found_by)
    return OutputEmbeddings(info, read_rows, read_full)


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _open_gguf(name: str, path: Path) -> OutputEmbeddings:
    try:
        from gguf import GGUFReader
        from gguf.quants import dequantize
    except ImportError:
        raise RepgeomError(f"model {name!r} is a GGUF file; reading it needs the gguf package: "
                           "pip install 'repgeom-eval[gguf]'") from None
    try:
        reader = GGUFReader(str(path))  # memory-maps the file: only the rows read are paged in
    except Exception as exc:  # noqa: BLE001 - corrupt or unsupported file
        raise RepgeomError(f"cannot read GGUF file {str(path)!r}: {type(exc).__name__}: {exc}") from None
    tensors = {t.name: t for t in reader.tensors}
    for key, tied in (("output.weight", False), ("token_embd.weight", True)):
        if key in tensors:
            break
    else:
        raise RepgeomError(f"GGUF file {str(path)!r} has neither output.weight nor token_embd.weight")
    t = tensors[key]
    shape = tuple(int(s) for s in reversed(list(t.shape)))  # GGUF lists dimensions innermost first
    if len(shape) != 2 or t.data.shape[0] != shape[0]:
        raise RepgeomError(f"GGUF tensor {key!r} of {str(path)!r} has an unexpected layout {list(t.data.shape)}")

    def convert(data: np.ndarray, n: int) -> torch.Tensor:
        try:
            values = dequantize(data, t.tensor_type)
        except NotImplementedError as exc:
            raise RepgeomError(f"GGUF tensor {key!r} of {str(path)!r} uses {t.tensor_type.name}, which this gguf "
                               f"package cannot de-quantize ({exc})") from None
        return torch.from_numpy(np.ascontiguousarray(np.asarray(values, dtype=np.float32).reshape(n, shape[1])))

    def read_rows(ids: list[int]) -> torch.Tensor:
        return torch.cat([convert(np.asarray(t.data[lo:hi]), hi - lo) for lo, hi in _runs(ids)])

    def read_full() -> torch.Tensor:
        return convert(np.asarray(t.data), shape[0])

    info = EmbeddingInfo(model=name, path=str(path), source="gguf", tensor=key, file=path.name, tied=tied,
                         shape=(shape[0], shape[1]), dtype=t.tensor_type.name, found_by="gguf name")
    return OutputEmbeddings(info, read_rows, read_full)


# ---------------------------------------------------------------------------------------------------------------
# Token sets
# ---------------------------------------------------------------------------------------------------------------

def _markers(tokenizer: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(prefix markers, suffix markers) stripped from token text."""
    prefixes, suffixes = list(WORD_BOUNDARY_MARKERS), []
    backend = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
    cont = getattr(backend, "continuing_subword_prefix", None)
    if isinstance(cont, str) and cont:
        prefixes.append(cont)
    eow = getattr(backend, "end_of_word_suffix", None)
    if isinstance(eow, str) and eow:
        suffixes.append(eow)
    return tuple(prefixes), tuple(suffixes)


def strip_token_text(text: str, prefixes: Sequence[str] = WORD_BOUNDARY_MARKERS, suffixes: Sequence[str] = ()) -> str:
    """``text`` without surrounding whitespace and word-boundary markers (``Ġ5`` → ``5``, ``▁for`` → ``for``)."""
    previous = None
    while text != previous:
        previous = text
        text = text.strip()
        for p in prefixes:
            if text.startswith(p):
                text = text[len(p):]
        for s in suffixes:
            if text.endswith(s):
                text = text[: -len(s)]
    return text


class Vocabulary:
    """Every token id of a tokenizer with its raw token and stripped text (what token sets match against).

    ``n_rows``: the number of rows of W; ids at or beyond it (tokens the checkpoint has no row for) never match.
    """

    def __init__(self, tokenizer: Any, n_rows: int | None = None):
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        self.size = len(vocab)
        self.n_rows = n_rows
        self.prefixes, self.suffixes = _markers(tokenizer)
        self.raw: dict[int, str] = {int(i): str(t) for t, i in vocab.items()}
        self.special = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or [] if i is not None}
        ids = sorted(i for i in self.raw if n_rows is None or i < n_rows)
        self.n_beyond_rows = len(self.raw) - len(ids)
        decoded = _decode_each(tokenizer, ids)
        self.texts: dict[int, str] = {
            i: ("" if i in self.special else strip_token_text(d, self.prefixes, self.suffixes))
            for i, d in zip(ids, decoded)
        }
        self._by_text: dict[str, list[int]] | None = None

    def ids_for(self, word: str) -> list[int]:
        """Every id whose stripped text is exactly ``word`` (itself stripped), in id order."""
        if self._by_text is None:
            by: dict[str, list[int]] = {}
            for i, t in self.texts.items():
                if t:
                    by.setdefault(t, []).append(i)
            self._by_text = by
        return list(self._by_text.get(strip_token_text(word, self.prefixes, self.suffixes), []))

    def resolve_words(self, words: Iterable[str], exclude: Iterable[int] = ()) -> tuple[list[int], list[str]]:
        """(ids of every entry of every word, words with no entry) — the word-list rule of §9.2."""
        exclude = set(exclude)
        ids: list[int] = []
        missing: list[str] = []
        seen: set[str] = set()
        for w in words:
            if w in seen:
                continue
            seen.add(w)
            found = [i for i in self.ids_for(w) if i not in exclude]
            if found:
                ids.extend(found)
            else:
                missing.append(w)
        return sorted(set(ids)), missing


def _decode_each(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each id decoded on its own (one batched call on fast tokenizers)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        try:
            return list(backend.decode_batch([[i] for i in ids], skip_special_tokens=False))
        except Exception:  # noqa: BLE001 - fall back to the Python path
            pass
    return list(tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                       clean_up_tokenization_spaces=False))


@dataclass
class TokenSet:
    """A resolved token set: the ids (sorted), their raw tokens, the words not found, and how it was built."""

    name: str
    ids: list[int]
    tokens: list[str]
    missing: list[str]
    config: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)

    def to_dict(self, with_tokens: bool = True) -> dict[str, Any]:
        d = {"name": self.name, "n": len(self.ids), "ids": list(self.ids), "missing": list(self.missing),
             "config": dict(self.config)}
        if with_tokens:
            d["tokens"] = list(self.tokens)
        return d


def _read_word_file(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RepgeomError(f"token set file {str(path)!r} is not valid UTF-8 (byte {exc.start}); save it as UTF-8"
                           ) from None
    except OSError as exc:
        raise RepgeomError(f"cannot read token set file {str(path)!r}: {exc.strerror or exc}") from None
    return [line.strip() for line in text.splitlines() if line.strip()]


def resolve_token_set(spec: str, tokenizer: Any, host: Any = None, exclude: Iterable[int] = (),
                      seed: int = DEFAULT_SEED, size: int = DEFAULT_SIZE) -> TokenSet:
    """Resolve a token-set spec (registered name, ``words:a,b,c`` or a file path) against a tokenizer.

    ``tokenizer`` may be a :class:`Vocabulary` (re-used, cheaper) or a tokenizer. ``exclude``: ids that must not be
    in the result (the domain set, when resolving the reference set).
    """
    vocab = tokenizer if isinstance(tokenizer, Vocabulary) else Vocabulary(tokenizer)
    exclude = frozenset(int(i) for i in exclude)
    if not isinstance(spec, str) or not spec.strip():
        raise RepgeomError("empty token set; pass a name (see `repgeom plugins`), words:a,b,c or a file path")
    spec = spec.strip()
    config: dict[str, Any] = {"spec": spec}
    if spec.startswith("words:"):
        words = [w.strip() for w in spec[len("words:"):].split(",") if w.strip()]
        if not words:
            raise RepgeomError(f"token set {spec!r} lists no words; give at least one, e.g. words:alpha,beta")
        ids, missing = vocab.resolve_words(words, exclude)
        config.update(kind="words", n_words=len(dict.fromkeys(words)))
        return _token_set(spec, vocab, ids, missing, config)

    if host is None:
        from repgeom_eval.plugin_system.host import get_host

        host = get_host()
    if spec in host.token_sets:
        entry = host.token_sets.entry(spec)
        obj = host.token_sets.get(spec)
        config.update(kind="registered", plugin=entry.plugin)
        if callable(obj):
            out = obj(vocab, exclude=exclude, seed=seed, size=size)
            if not isinstance(out, tuple) or len(out) not in (2, 3):
                raise RepgeomError(f"token set {spec!r} of plugin {entry.plugin!r} returned {type(out).__name__}; "
                                   "expected (ids, missing) or (ids, missing, config)")
            ids, missing = sorted({int(i) for i in out[0]}), [str(m) for m in out[1]]
            bad = [i for i in ids if i in exclude or i not in vocab.texts]
            if bad:
                raise RepgeomError(f"token set {spec!r} of plugin {entry.plugin!r} returned ids that are excluded or "
                                   f"not in the vocabulary: {bad[:5]}")
            if len(out) == 3 and isinstance(out[2], dict):
                config.update(out[2])
            return _token_set(spec, vocab, ids, missing, config)
        words = [str(w) for w in obj]
        ids, missing = vocab.resolve_words(words, exclude)
        config.update(n_words=len(dict.fromkeys(words)))
        return _token_set(spec, vocab, ids, missing, config)

    path = Path(os.path.expanduser(spec))
    if path.is_file():
        words = _read_word_file(path)
        if not words:
            raise RepgeomError(f"token set file {spec!r} has no words; write one word per line")
        ids, missing = vocab.resolve_words(words, exclude)
        config.update(kind="file", path=str(path.resolve()), n_words=len(dict.fromkeys(words)))
        return _token_set(spec, vocab, ids, missing, config)
    if path.is_dir():
        raise RepgeomError(f"token set {spec!r} is a directory; pass a text file with one word per line")
    if os.sep in spec or spec.endswith((".txt", ".lst", ".list")):
        raise RepgeomError(f"token set file {spec!r} does not exist")
    raise UnknownNameError("token set", spec, host.token_sets.names(),
                           "Or pass words:a,b,c, or a file with one word per line")


def _token_set(name: str, vocab: Vocabulary, ids: list[int], missing: list[str], config: dict[str, Any]) -> TokenSet:
    return TokenSet(name=name, ids=list(ids), tokens=[vocab.raw.get(i, "") for i in ids], missing=list(missing),
                    config=config)


# ---------------------------------------------------------------------------------------------------------------
# The gap
# ---------------------------------------------------------------------------------------------------------------

def _chunk_rows(n_cols: int, budget: int = 1 << 22) -> int:
    return max(1, budget // max(1, n_cols))


def mean_pairwise_euclidean(x: torch.Tensor) -> float:
    """Mean Euclidean distance over the N(N−1) ordered pairs i ≠ j (NaN if N < 2); O(chunk·N) memory."""
    x = x.double()
    n = x.shape[0]
    if n < 2:
        return float("nan")
    total = torch.zeros((), dtype=torch.float64)
    step = _chunk_rows(n)
    for lo in range(0, n, step):
        block = torch.cdist(x[lo:lo + step], x)
        rows = torch.arange(block.shape[0])
        block[rows, rows + lo] = 0.0  # the self-distance (exactly 0; the matmul form may leave rounding)
        total += block.sum()
    return float(total / (n * (n - 1)))


def mean_cross_euclidean(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean Euclidean distance over all pairs (i ∈ A, j ∈ B)."""
    a, b = a.double(), b.double()
    if a.shape[0] == 0 or b.shape[0] == 0:
        return float("nan")
    total = torch.zeros((), dtype=torch.float64)
    step = _chunk_rows(b.shape[0])
    for lo in range(0, a.shape[0], step):
        total += torch.cdist(a[lo:lo + step], b).sum()
    return float(total / (a.shape[0] * b.shape[0]))


def _rows(W: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    idx = torch.as_tensor(list(ids), dtype=torch.long)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= W.shape[0]):
        raise RepgeomError(f"token id {int(idx.max()) if int(idx.max()) >= W.shape[0] else int(idx.min())} is out "
                           f"of range for an output embedding with {W.shape[0]} rows")
    return W.index_select(0, idx).double()


def dispersion_gap(W: torch.Tensor, T_ids: Sequence[int], Tbar_ids: Sequence[int],
                   distance: str = "cosine") -> dict[str, float]:
    """within(T), within(T̄), between(T, T̄) and G = within(T) + between(T, T̄) over the rows of ``W`` (float64).

    Cosine: the O(N·d) identities (spec §1.2–1.3; zero rows have cosine 0 to everything). Euclidean: mean pairwise
    distance over i ≠ j and mean cross distance, by row chunks. within is NaN for a set of fewer than 2 tokens.
    """
    from .functional.dispersion import cross_dispersion, dispersion

    if distance not in DISTANCES:
        raise RepgeomError(f"unknown distance {distance!r} (valid: {', '.join(DISTANCES)})")
    if len(T_ids) == 0 or len(Tbar_ids) == 0:
        raise RepgeomError("the dispersion gap needs a non-empty domain set T and reference set T̄")
    A, B = _rows(W, T_ids), _rows(W, Tbar_ids)
    if distance == "cosine":
        within_T, within_Tbar, between = float(dispersion(A)), float(dispersion(B)), float(cross_dispersion(A, B))
    else:
        within_T, within_Tbar = mean_pairwise_euclidean(A), mean_pairwise_euclidean(B)
        between = mean_cross_euclidean(A, B)
    return {"within_T": within_T, "within_Tbar": within_Tbar, "between": between, "G": within_T + between}


# ---------------------------------------------------------------------------------------------------------------
# Screening several checkpoints
# ---------------------------------------------------------------------------------------------------------------

def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def load_tokenizer(model: str) -> Any:
    """The tokenizer of a model directory, .gguf file or cached hub id (no weights are read)."""
    import transformers
    from transformers import AutoTokenizer

    directory, extra, _ = _locate_checkpoint(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            transformers.logging.set_verbosity_error()
            return AutoTokenizer.from_pretrained(str(directory), **extra)
    except (OSError, ValueError, ImportError, TypeError) as exc:
        raise RepgeomError(f"cannot load the tokenizer of model {model!r}: {_first_line(exc)}") from None
    finally:
        transformers.logging.set_verbosity_warning()


def vocabulary_difference(a: Any, b: Any) -> str | None:
    """Why two tokenizers' vocabularies differ (None if identical): sizes, or the first differing id."""
    va, vb = a.get_vocab(), b.get_vocab()
    if va == vb:
        return None
    if len(va) != len(vb):
        return f"{len(va)} vs {len(vb)} entries"
    ia = {i: t for t, i in va.items()}
    ib = {i: t for t, i in vb.items()}
    for i in sorted(set(ia) | set(ib)):
        if ia.get(i) != ib.get(i):
            return f"token id {i} is {ia.get(i)!r} vs {ib.get(i)!r}"
    return "the vocabularies differ"  # pragma: no cover - equal sizes and equal id maps imply equal dicts


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


def screen(models: Sequence[str], domain: str = DEFAULT_DOMAIN, reference: str = DEFAULT_REFERENCE,
           distance: str = "cosine", seed: int = DEFAULT_SEED, size: int = DEFAULT_SIZE, force: bool = False,
           host: Any = None) -> GapResult:
    """Rank checkpoints by the dispersion gap G of their output projection (highest first).

    Reads each model's tokenizer, refuses models whose vocabularies differ (G compares models only within one
    tokenizer, paper A Limitations) unless ``force``, then per model reads W alone, resolves T (``domain``) and T̄
    (``reference``, excluding T) and computes within(T), within(T̄), between and G.
    """
    t_start = time.perf_counter()
    models = [str(m) for m in models]
    if not models:
        raise RepgeomError("no models given; pass at least one model directory")
    dupes = sorted({m for m in models if models.count(m) > 1})
    if dupes:
        raise RepgeomError(f"model {dupes[0]!r} is given more than once; list each model once")
    if distance not in DISTANCES:
        raise RepgeomError(f"unknown distance {distance!r} (valid: {', '.join(DISTANCES)})")
    if not isinstance(size, int) or size < 1:
        raise RepgeomError(f"reference sample size must be a positive integer, got {size!r}")
    if host is None:
        from repgeom_eval.plugin_system.host import get_host

        host = get_host()
    for m in models:  # every path problem before any work
        _locate_checkpoint(m)

    tokenizers: dict[str, Any] = {}
    tok_s: dict[str, float] = {}
    for m in models:
        t0 = time.perf_counter()
        tokenizers[m] = load_tokenizer(m)
        tok_s[m] = time.perf_counter() - t0
    first = models[0]
    differences = []
    for m in models[1:]:
        why = vocabulary_difference(tokenizers[first], tokenizers[m])
        if why:
            differences.append({"model": m, "reference_model": first, "difference": why})
    if differences and not force:
        d = differences[0]
        raise RepgeomError(
            f"models {d['reference_model']!r} and {d['model']!r} have different vocabularies ({d['difference']}); "
            "the gap compares models only within one tokenizer (paper A, Limitations); pass --force "
            "(force=True) to compare them anyway"
        )
    if differences:
        warnings.warn(f"comparing models with different vocabularies ({len(differences)} differ from {first!r}); "
                      "G values are not comparable across tokenizers", stacklevel=2)
    vocabulary = {"shared": not differences, "forced": bool(differences and force), "size": len(tokenizers[first]),
                  "differences": differences}

    rows: list[dict[str, Any]] = []
    config_sets: dict[str, Any] = {}
    for m in models:
        t0 = time.perf_counter()
        source = open_output_embeddings(m)
        info = source.info
        t1 = time.perf_counter()
        vocab = Vocabulary(tokenizers[m], n_rows=info.shape[0])
        T = resolve_token_set(domain, vocab, host=host, seed=seed, size=size)
        if len(T) < 2:
            raise RepgeomError(
                f"domain token set {domain!r} matches {len(T)} token(s) of model {m!r} (missing: "
                f"{', '.join(repr(w) for w in T.missing[:10]) or 'none'}); within(T) needs at least 2"
            )
        Tbar = resolve_token_set(reference, vocab, host=host, exclude=T.ids, seed=seed, size=size)
        if len(Tbar) < 1:
            raise RepgeomError(f"reference token set {reference!r} matches no token of model {m!r} outside the "
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
        values = dispersion_gap(sub, [pos[i] for i in T.ids], [pos[i] for i in Tbar.ids], distance=distance)
        t4 = time.perf_counter()
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
        "domain": domain,
        "reference": reference,
        "distance": distance,
        "size": size,
        "seed": seed,
        "force": force,
        "token_sets": config_sets,
        "precision": "float64",
        "ranking": "G descending",
    }
    timings = {"total_s": time.perf_counter() - t_start, "peak_rss_mib": _peak_rss_mib()}
    return GapResult(config=config, vocabulary=vocabulary, rows=rows, timings=timings)


# ---------------------------------------------------------------------------------------------------------------
# Spearman correlation (scipy is not a core dependency)
# ---------------------------------------------------------------------------------------------------------------

def average_ranks(x: Sequence[float]) -> np.ndarray:
    """1-based ranks, ties sharing the mean of the ranks they span."""
    a = np.asarray(x, dtype=np.float64)
    order = np.argsort(a, kind="mergesort")
    ranks = np.empty(len(a), dtype=np.float64)
    sorted_a = a[order]
    i = 0
    while i < len(a):
        j = i
        while j + 1 < len(a) and sorted_a[j + 1] == sorted_a[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's ρ: Pearson correlation of the average ranks (NaN if fewer than 2 points or a constant side)."""
    if len(x) != len(y):
        raise ValueError(f"spearman: {len(x)} vs {len(y)} values")
    if len(x) < 2 or any(math.isnan(float(v)) for v in list(x) + list(y)):
        return float("nan")
    rx, ry = average_ranks(x), average_ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = math.sqrt(float((rx * rx).sum()) * float((ry * ry).sum()))
    return float((rx * ry).sum() / denom) if denom > 0 else float("nan")

