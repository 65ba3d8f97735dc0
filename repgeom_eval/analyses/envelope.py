"""The JSON envelope every analysis writes.

Every output carries ``kind`` (the command that wrote it, e.g. ``"ppl-bins"``), so ``repgeom report`` — or anyone —
can tell files apart without guessing from their shape::

    {"kind": "ppl-bins", "repgeom_version": "0.1.0", "model": {...} | "models": [...], "data": {...},
     "config": {... every parameter and default actually used, plugins, versions ...}, "results": {...},
     "warnings": [...], "timings": {...}}

``config["plugins"]`` names every loaded plugin with its distribution and version (``{plugin: {"distribution",
"version"}}``, :meth:`~repgeom_eval.plugin_system.host.PluginHost.plugin_versions`): an analysis may use any of them
(an architecture table, a token set, a metric), so all are recorded (docs/plugins.md#provenance).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from repgeom_eval import __version__
from repgeom_eval.output.files import write_json
from repgeom_eval.output.versions import versions


@dataclass
class AnalysisResult:
    kind: str
    config: dict[str, Any]
    results: dict[str, Any]
    model: dict[str, Any] | None = None
    models: list[dict[str, Any]] | None = None
    data: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    is_main: bool = True  # False on ranks > 0 of a distributed run: rank 0 holds the merged result and writes it

    def warn(self, message: str) -> None:
        """Record a caveat in the output and show it (once) on stderr."""
        self.warnings.append(message)
        warnings.warn(message, stacklevel=2)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "repgeom_version": __version__}
        if self.model is not None:
            out["model"] = self.model
        if self.models is not None:
            out["models"] = self.models
        from repgeom_eval.plugin_system.host import get_host

        config = self.config | {"plugins": get_host().plugin_versions(), "versions": versions()}
        out.update({"data": self.data, "config": config, "results": self.results,
                    "warnings": self.warnings, "timings": self.timings})
        return out

    def write(self, path: str | Path) -> None:
        write_json(path, self.to_dict())
