"""The software versions every output records."""

from __future__ import annotations

import platform
from typing import Any


def package_version(dist: str) -> str | None:
    """The installed version of a distribution, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


#: the libraries repgeom-eval runs with, as `repgeom --version` lists them
LIBRARIES = ("torch", "transformers", "tokenizers", "lm-eval", "mteb", "sentence-transformers", "accelerate", "peft")


def version_line() -> str:
    """``repgeom-eval 0.2.0 (torch 2.13.0, transformers 5.24.0, lm-eval not installed, ...; Python 3.11.7)``, read
    from the installed distributions' metadata (nothing is imported, so it stays instant)."""
    from repgeom_eval import __version__

    parts = [f"{name} {package_version(name) or 'not installed'}" for name in LIBRARIES]
    return f"repgeom-eval {__version__} ({', '.join(parts)}; Python {platform.python_version()})"


def versions() -> dict[str, Any]:
    """repgeom-eval, torch, transformers and Python versions."""
    import torch

    from repgeom_eval import __version__

    return {"repgeom_eval": __version__, "torch": torch.__version__, "transformers": package_version("transformers"),
            "python": platform.python_version()}
