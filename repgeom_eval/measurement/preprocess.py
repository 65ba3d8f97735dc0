"""Optional preprocessing of the vectors a metric sees: ``none`` (the papers' default), ``center``,
``standardize`` or ``whiten``.

Why: in some models a handful of hidden dimensions carry almost all of the energy ("massive activations"); cosine
geometry at those layers then measures those few dimensions. Standardizing or whitening the features first shows
the geometry of the rest. Statistics come from the same data (an extra pass over it, memory O(D) or O(D²) per
address) or from a reference file written by an earlier run.

Statistics are kept per (address, kind): kind is a pooling method for pooled vectors, ``views:<pooling>`` for
augmented views, or ``tokens`` for the token vectors of token-level metrics.
"""

from __future__ import annotations

import json
from typing import Any
from pathlib import Path

import torch

from repgeom_eval.spec.errors import RepgeomError

METHODS = ("none", "center", "standardize", "whiten")
EPS = 1e-6  # relative floor on variances / covariance eigenvalues


class VectorStats:
    """Mergeable first and second moments of a stream of D-dimensional vectors (float64)."""

    def __init__(self, full_covariance: bool):
        self.full = full_covariance
        self.n = 0
        self.sum: torch.Tensor | None = None
        self.second: torch.Tensor | None = None  # Σx² per dimension, or Σxxᵀ when full

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().double().cpu()
        if not len(x):
            return
        second = x.T @ x if self.full else (x * x).sum(0)
        s = x.sum(0)
        self.sum = s if self.sum is None else self.sum + s
        self.second = second if self.second is None else self.second + second
        self.n += x.shape[0]

    def merge(self, other: "VectorStats") -> "VectorStats":
        if other.n:
            self.sum = other.sum if self.sum is None else self.sum + other.sum
            self.second = other.second if self.second is None else self.second + other.second
            self.n += other.n
        return self

    def transform(self, method: str) -> dict[str, torch.Tensor]:
        """The affine map ``x ↦ (x − shift) @ matrix`` (or ``/ scale``) that implements ``method``."""
        if self.n < 2 or self.sum is None or self.second is None:
            raise RepgeomError(f"preprocess {method!r} needs statistics over at least 2 vectors, got {self.n}")
        mean = self.sum / self.n
        if method == "center":
            return {"shift": mean}
        if self.full:
            cov = self.second / self.n - torch.outer(mean, mean)
            var = cov.diagonal()
        else:
            var = self.second / self.n - mean * mean
        if method == "standardize":
            floor = EPS * float(var.max().clamp(min=1e-30))
            return {"shift": mean, "scale": var.clamp(min=floor).sqrt()}
        if method == "whiten":
            if not self.full:
                raise RepgeomError("whitening needs full covariance statistics")
            if self.n <= cov.shape[0]:
                raise RepgeomError(
                    f"preprocess 'whiten' needs more vectors than dimensions, got {self.n} vectors of dimension "
                    f"{cov.shape[0]}: with N <= D the whitened vectors are mutually equiangular (every cosine "
                    "-1/(N-1)) whatever the data; use more texts, --preprocess standardize, or --preprocess-stats")
            evals, evecs = torch.linalg.eigh((cov + cov.T) / 2)
            floor = EPS * float(evals.max().clamp(min=1e-30))
            matrix = evecs @ torch.diag(evals.clamp(min=floor).rsqrt()) @ evecs.T  # ZCA whitening
            return {"shift": mean, "matrix": matrix}
        raise RepgeomError(f"unknown preprocess {method!r} (valid: {', '.join(METHODS)})")


def apply(x: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
    out = x.double() - params["shift"].to(x.device, non_blocking=True)
    if "scale" in params:
        out = out / params["scale"].to(x.device, non_blocking=True)
    if "matrix" in params:
        out = out @ params["matrix"].to(x.device, non_blocking=True)
    return out


class Preprocessor:
    """Per-(address, kind) transforms; ``identity`` when the method is ``none``."""

    def __init__(self, method: str = "none", transforms: dict[str, dict[str, torch.Tensor]] | None = None,
                 source: str | None = None, identity: dict[str, Any] | None = None):
        if method not in METHODS:
            raise RepgeomError(f"unknown preprocess {method!r} (valid: {', '.join(METHODS)})")
        self.method = method
        self.transforms = transforms or {}
        self.source = source
        # What produced the statistics (model content hash and name, addresses, poolings, data hash): written into a
        # saved file, read back from one (None: a file written before identities were recorded)
        self.identity = identity
        self.accepted_from_other_model: dict[str, Any] | None = None
        self.from_file = False

    @property
    def active(self) -> bool:
        return self.method != "none"

    @staticmethod
    def key(address: str, kind: str) -> str:
        return f"{address}|{kind}"

    @classmethod
    def from_stats(cls, method: str, stats: dict[str, VectorStats], source: str) -> "Preprocessor":
        return cls(method, {k: s.transform(method) for k, s in stats.items()}, source)

    def __call__(self, address: str, kind: str, x: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return x
        key = self.key(address, kind)
        if key not in self.transforms:
            have = sorted(self.transforms)
            raise RepgeomError(f"preprocess statistics have no entry for {address} ({kind}) in {self.source}; "
                               f"they cover: {', '.join(have[:8])}{' ...' if len(have) > 8 else ''}")
        params = self.transforms[key]
        width = params["shift"].shape[-1]
        if x.shape[-1] != width:
            raise RepgeomError(f"preprocess statistics in {self.source} are for vectors of dimension {width}, but "
                               f"{address} has dimension {x.shape[-1]}; they come from another model")
        return apply(x, params)

    def config(self) -> dict[str, object]:
        out: dict[str, object] = {"method": self.method, "statistics": self.source if self.active else None}
        if self.active and self.from_file and self.identity is not None:  # where a file's statistics came from
            out["statistics_identity"] = self.identity
        if self.accepted_from_other_model is not None:
            out["allow_other_stats"] = self.accepted_from_other_model
        return out

    def check_identity(self, model: str, model_name: str, allow_other: bool = False) -> None:
        """Refuse statistics of another model (its content hash ``model`` differs from the one recorded), or of
        unknown origin, unless ``allow_other``: then what was accepted is recorded in :meth:`config`."""
        recorded = (self.identity or {}).get("model")
        if recorded == model:
            return
        if recorded is None:
            problem = "record no model identity (written by an earlier version)"
        else:
            problem = (f"were computed on {self.identity.get('model_name')!r} ({recorded[:23]}), not on "  # type: ignore[union-attr]
                       f"{model_name!r} ({model[:23]})")
        if not allow_other:
            raise RepgeomError(f"preprocess statistics {self.source} {problem}; recompute them on this model with "
                               "--save-preprocess-stats, or pass --allow-other-stats to apply them anyway (recorded "
                               "in the output)")
        self.accepted_from_other_model = {"statistics_model": recorded, "this_model": model}

    # -- reference files ---------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        from safetensors.torch import save

        from repgeom_eval.output.files import atomic_open

        tensors = {f"{key}|{name}": t.contiguous() for key, params in self.transforms.items()
                   for name, t in params.items()}
        with atomic_open(path, "wb") as fh:
            fh.write(save(tensors, metadata={"repgeom_preprocess": json.dumps({"method": self.method}),
                                             "repgeom_identity": json.dumps(self.identity or {})}))

    @classmethod
    def load(cls, path: str | Path, method: str) -> "Preprocessor":
        from safetensors import safe_open

        p = Path(path)
        if not p.is_file():
            raise RepgeomError(f"preprocess statistics file {str(p)!r} does not exist")
        try:
            with safe_open(str(p), framework="pt") as fh:
                meta = json.loads((fh.metadata() or {}).get("repgeom_preprocess", "{}"))
                identity = json.loads((fh.metadata() or {}).get("repgeom_identity", "{}")) or None
                transforms: dict[str, dict[str, torch.Tensor]] = {}
                for name in fh.keys():
                    key, _, param = name.rpartition("|")
                    transforms.setdefault(key, {})[param] = fh.get_tensor(name)
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError on a corrupt file
            raise RepgeomError(f"{p}: not a repgeom preprocess statistics file ({exc})") from None
        if meta.get("method") != method:
            raise RepgeomError(f"{p} holds {meta.get('method')!r} statistics but --preprocess {method!r} was asked; "
                               "use the same method or recompute the statistics")
        if identity is not None and not isinstance(identity, dict):
            raise RepgeomError(f"{p}: its recorded identity is a JSON {type(identity).__name__}, not an object; "
                               "recompute the statistics")
        out = cls(method, transforms, str(p), identity)
        out.from_file = True
        return out
