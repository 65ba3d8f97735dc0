"""The de-quantized form of a ``.gguf`` file, kept as a plain model directory so that later loads take seconds."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

CACHE_DTYPE = torch.float32  # what the one de-quantized copy holds (every GGUF quantization fits it exactly)


def check_gguf_packages(name: str) -> None:
    """A ``.gguf`` file is parsed by the gguf package and loaded through accelerate (transformers needs both): a
    missing one is a RepgeomError naming the extra that installs them, instead of transformers' ImportError."""
    import importlib.util

    from repgeom_eval.spec.errors import RepgeomError

    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise RepgeomError(f"model {name!r} is a GGUF file; loading it needs the {' and '.join(missing)} "
                           f"package{'s' if len(missing) > 1 else ''}: pip install 'repgeom-eval[gguf]'")


def gguf_cache_dir(path: Path) -> Path | None:
    """Where the de-quantized form of a ``.gguf`` file is kept, or None when the cache is switched off.

    transformers parses a GGUF file several times (config, tokenizer, weights) and de-quantizes every tensor: about
    a minute for SmolLM2-135M on 2 cores. The result is saved once, in float32, as a plain model directory
    (safetensors), and every later load reads that in seconds and casts it to the dtype asked for: one entry per
    file, whatever the dtypes. Keyed by the file's content and the transformers version; ``REPGEOM_GGUF_CACHE=0``
    switches it off, ``REPGEOM_CACHE`` moves it (default ``~/.cache/repgeom-eval``).
    """
    if os.environ.get("REPGEOM_GGUF_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    import hashlib

    import transformers

    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    digest.update(f"{CACHE_DTYPE}|{transformers.__version__}".encode())
    root = Path(os.environ.get("REPGEOM_CACHE") or Path.home() / ".cache" / "repgeom-eval").expanduser()
    return root / "gguf" / f"{path.stem}-{digest.hexdigest()[:16]}"


def save_gguf_cache(model: Any, tokenizer: Any, cache: Path) -> None:
    """Save the converted model next to its final place, then rename it in: readers never see half a cache entry.
    A cache that cannot be written (read-only home, full disk) costs only speed: warn and go on."""
    import shutil
    import tempfile

    import transformers

    tmp = None
    verbosity = transformers.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.", dir=cache.parent))
        transformers.logging.set_verbosity_error()
        # save_pretrained refuses a model loaded through the GGUF quantizer (even though its weights are plain
        # de-quantized tensors now): write the weights and a config without the quantizer's entry directly.
        from safetensors.torch import save_model

        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, cache)
    except OSError as exc:
        if not (cache / "config.json").is_file():  # another process may have won the race: that is fine
            warnings.warn(f"could not cache the converted GGUF model under {cache}: {exc}; the next load converts "
                          "it again (set REPGEOM_GGUF_CACHE=0 to stop trying)", stacklevel=3)
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.utils.logging.enable_progress_bar()
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """No transformers warnings, log lines or progress bars inside; the caller's settings restored afterwards."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            transformers.logging.set_verbosity_error()
            transformers.utils.logging.disable_progress_bar()
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.utils.logging.enable_progress_bar()


def convert_gguf(target: str, extra: dict[str, Any], remote: dict[str, Any], cache: Path,
                 model_class: Callable[[Any], Any]) -> None:
    """De-quantize a ``.gguf`` file once, in float32, into its cache entry (every later load, in any dtype, reads
    that; ``model_class(config)`` is the class to load it with). A file that does not convert is left to the ordinary load, which reports it in one line."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        with quiet_transformers():
            config = AutoConfig.from_pretrained(target, **extra, **remote)
            tokenizer = AutoTokenizer.from_pretrained(target, **extra, **remote)
            model = model_class(config).from_pretrained(target, dtype=CACHE_DTYPE, **extra, **remote)
    except Exception:  # noqa: BLE001 - the load below reads the same file and says what is wrong with it
        return
    save_gguf_cache(model, tokenizer, cache)
