"""Reading pieces of a checkpoint without loading the model: its output-embedding tensor and its tokenizer.

Only the output-embedding tensor W [V, d] (``model.get_output_embeddings().weight``, exactly as stored) is read:
with ``safetensors`` ``safe_open``, following the shard index of a sharded checkpoint, or with the ``gguf`` reader for
``.gguf`` files. The model is never instantiated and no forward pass runs. :func:`open_output_embeddings` locates
the tensor and reads rows on demand (the dispersion gap needs only the |T ∪ T̄| rows of its token sets);
:func:`read_output_embeddings` returns the whole matrix; :func:`load_tokenizer` reads the tokenizer alone.

Top to bottom, each piece is built from the ones above it: locating a checkpoint and reading its tokenizer; finding
the tensor in safetensors files (its name from a meta-device skeleton of the architecture, then transformers' key
renames, then legacy names); reading it from a GGUF file; the two entry points that choose between the formats.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from repgeom_eval.spec.errors import RepgeomError, first_line
from repgeom_eval.modeling.layout import text_config
from repgeom_eval.modeling.loading import locate_model

# Output-embedding tensor names of checkpoints whose keys predate the model class (tried last, shape-checked).
_LEGACY_OUTPUT_NAMES = ("lm_head.weight", "embed_out.weight", "output.weight")
_LEGACY_INPUT_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight", "transformer.wte.weight", "wte.weight",
                       "gpt_neox.embed_in.weight", "embed_in.weight", "transformer.word_embeddings.weight")
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


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


def locate_checkpoint(model: str) -> tuple[Path, dict[str, Any], str]:
    """(directory, extra from_pretrained kwargs, source kind) for a directory, a .gguf file or a cached hub id."""
    target, extra, source = locate_model(model)
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


def load_tokenizer(model: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer of a model directory, .gguf file or cached hub id (no weights are read)."""
    import transformers
    from transformers import AutoTokenizer

    directory, extra, _ = locate_checkpoint(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            transformers.logging.set_verbosity_error()
            return AutoTokenizer.from_pretrained(str(directory), **extra,
                                                 trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError, TypeError) as exc:
        raise RepgeomError(f"cannot load the tokenizer of model {model!r}: {first_line(exc)}") from None
    finally:
        transformers.logging.set_verbosity_warning()


# -- safetensors -------------------------------------------------------------------------------------------------------

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


def _config_ties(config: Any) -> bool:
    text = text_config(config)
    return bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))


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


def _renamed(renames: Callable[[str], str], key: str) -> str:
    try:
        return renames(key)
    except Exception:  # noqa: BLE001
        return key


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


def _runs(sorted_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive runs [lo, hi) of sorted unique ids."""
    runs: list[tuple[int, int]] = []
    for i in sorted_ids:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _open_safetensors(name: str, directory: Path, trust_remote_code: bool = False) -> OutputEmbeddings:
    from safetensors import safe_open
    from transformers import AutoConfig

    layout = _safetensors_layout(directory, name)
    try:
        config = AutoConfig.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise RepgeomError(f"cannot read the model config of {name!r}: {first_line(exc)}") from None
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


# -- GGUF --------------------------------------------------------------------------------------------------------------


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


# -- the entry points --------------------------------------------------------------------------------------------------


def open_output_embeddings(model: str | os.PathLike, trust_remote_code: bool = False) -> OutputEmbeddings:
    """Locate the output-embedding tensor of a checkpoint without loading it (see :func:`read_output_embeddings`);
    ``trust_remote_code`` lets transformers read a config class the checkpoint brings (its code is not run)."""
    name = str(model)
    t0 = time.perf_counter()
    directory, extra, source = locate_checkpoint(name)
    if source == "gguf":
        src = _open_gguf(name, directory / extra["gguf_file"])
    else:
        src = _open_safetensors(name, directory, trust_remote_code)
    src.info.read_s = time.perf_counter() - t0
    return src


def read_output_embeddings(model: str | os.PathLike, trust_remote_code: bool = False) -> tuple[torch.Tensor, EmbeddingInfo]:
    """The output-embedding matrix W [V, d] of a checkpoint, read alone (no model load, no forward pass).

    ``model`` is a local model directory with safetensors weights (single file or sharded), a ``.gguf`` file, or a
    hub id already in the local Hugging Face cache. The tensor keeps its stored dtype (GGUF: de-quantized to
    float32). The tensor name comes from a meta-device skeleton of the architecture (``get_output_embeddings()``
    and every parameter name sharing it when the weights are tied), with and without the base-model prefix, then
    transformers' checkpoint-key renames, then legacy names; the shape must match.
    """
    t0 = time.perf_counter()
    src = open_output_embeddings(model, trust_remote_code)
    W = src.full()
    src.info.read_s = time.perf_counter() - t0
    return W, src.info
