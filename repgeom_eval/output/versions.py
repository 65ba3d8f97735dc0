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


def versions() -> dict[str, Any]:
    """repgeom-eval, torch, transformers and Python versions."""
    import torch

    from repgeom_eval import __version__

    return {"repgeom_eval": __version__, "torch": torch.__version__, "transformers": package_version("transformers"),
            "python": platform.python_version()}
