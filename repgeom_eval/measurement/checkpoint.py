"""Resumable runs: metric states checkpointed after every shard under a run directory.

A run directory holds ``run.json`` (the run's key: model content hash, data hash, addresses, metrics and every
parameter that changes the numbers) and one ``state.rankR-of-W.pt`` per process, rewritten atomically after each
shard. ``--resume`` reloads the state and skips the shards it covers; the saved float64 states are exact, and the
remaining shards are batched as before, so a resumed run gives the same numbers as an uninterrupted one. A key that
does not match, or a file that cannot be read, is reported and never silently reused.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.output.files import atomic_open, jsonable

STATE_VERSION = 3  # 2: the energy diagnostic is saved as massive_activations metric state; 3: with field digests
_FULL_HASH_LIMIT = 1 << 30  # files above 1 GiB are hashed by 64 sampled blocks of 1 MiB plus their size


def file_fingerprint(path: Path) -> str:
    """sha256 of a file's content (sampled above 1 GiB: reading a 15 GB checkpoint whole would take minutes)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as fh:
        if size <= _FULL_HASH_LIMIT:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        else:
            for i in range(64):
                fh.seek((size - (1 << 20)) * i // 63)
                digest.update(fh.read(1 << 20))
    return digest.hexdigest()


def model_fingerprint(name: str, source: str, config: Any = None) -> str:
    """A content hash of a local model (directory or .gguf file); the hub revision for a hub id."""
    path = Path(os.path.expanduser(name))
    if path.is_file():
        return "sha256:" + file_fingerprint(path)
    if path.is_dir():
        digest = hashlib.sha256()
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(f"{f.relative_to(path)}\0{file_fingerprint(f)}\0".encode())
        return "sha256:" + digest.hexdigest()
    revision = getattr(config, "_commit_hash", None)
    return f"hub:{name}@{revision or 'unknown-revision'}"


def model_identity(loaded: Any) -> str:
    """What a model is, by content: its files' hash (local folder or .gguf), its weights' hash (a model given as an
    object), or hub id and revision. Keys resumable runs and statistics files."""
    if loaded.info.source == "memory":
        from repgeom_eval.modeling.in_memory import weights_hash

        return "weights:" + weights_hash(loaded.model)
    return model_fingerprint(loaded.info.name, loaded.info.source, loaded.model.config)


class RunDir:
    """The checkpoint files of one run, for one process."""

    def __init__(self, path: str | Path, key: dict[str, Any], rank: int = 0, world: int = 1, resume: bool = False,
                 is_main: bool = True):
        self.path = Path(path)
        self.key = jsonable(key)
        self.rank, self.world, self.resume = rank, world, resume
        if self.path.exists() and not self.path.is_dir():
            raise RepgeomError(f"run directory {str(self.path)!r} is a file; pass a directory")
        self.state_file = self.path / f"state.rank{rank}-of-{world}.pt"
        key_file = self.path / "run.json"
        if key_file.exists():
            try:
                old = json.loads(key_file.read_text(encoding="utf-8"))
            except (OSError, ValueError, RecursionError) as exc:
                raise RepgeomError(f"{key_file}: unreadable run key ({type(exc).__name__}: {str(exc)[:120]}); "
                                   "delete the run directory to start over") from None
            if not isinstance(old, dict):
                raise RepgeomError(f"{key_file}: the run key is a JSON {type(old).__name__}, not an object; delete "
                                   "the run directory to start over")
            self._check_key(old, key_file)
        others = sorted(p.name for p in self.path.glob("state.rank*-of-*.pt")) if self.path.is_dir() else []
        if others and not resume:
            raise RepgeomError(f"run directory {str(self.path)!r} already holds a checkpoint ({others[0]}); pass "
                               "--resume to continue that run, or choose a new --run-dir")
        stale = [n for n in others if not n.endswith(f"-of-{world}.pt")]
        if stale and resume:
            raise RepgeomError(f"run directory {str(self.path)!r} was checkpointed with a different number of "
                               f"processes ({stale[0]}); resume it with the same world size as before")
        if is_main:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise RepgeomError(f"cannot create run directory {str(self.path)!r}: {exc.strerror}") from None
            if not key_file.exists():
                with atomic_open(key_file) as fh:
                    json.dump(self.key, fh, indent=2)

    def _check_key(self, old: dict[str, Any], where: Path) -> None:
        if old == self.key:
            return
        differ = sorted(k for k in set(old) | set(self.key) if old.get(k) != self.key.get(k))
        detail = "; ".join(_difference(k, old.get(k), self.key.get(k)) for k in differ[:4])
        raise RepgeomError(f"run directory {str(self.path)!r} belongs to a different run ({detail}); use a new "
                           f"--run-dir, or delete {where.name} and the state files to start over")

    def load(self) -> dict[str, Any] | None:
        """The saved state of this rank, or None if there is none (a fresh run)."""
        if not self.resume or not self.state_file.exists():
            return None
        try:
            state = torch.load(self.state_file, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - a truncated or foreign file raises many kinds of errors
            raise RepgeomError(f"checkpoint {self.state_file} is corrupt or not a repgeom checkpoint "
                               f"({type(exc).__name__}: {str(exc)[:120]}); delete it to redo its shards") from None
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise RepgeomError(f"checkpoint {self.state_file} has an unknown format; delete it to redo its shards")
        if state.get("key") != self.key:
            raise RepgeomError(f"checkpoint {self.state_file} was written for another run than {self.path}/run.json "
                               "describes; delete the run directory to start over")
        saved_digests, body = state.get("digests"), {k: v for k, v in state.items() if k not in _ENVELOPE}
        now = field_digests(body)
        if not isinstance(saved_digests, dict):
            raise RepgeomError(f"checkpoint {self.state_file} has no field digests; delete it to redo its shards")
        changed = sorted(set(saved_digests) ^ set(now) | {f for f in now if saved_digests.get(f) != now[f]})
        if changed:
            raise RepgeomError(f"checkpoint {self.state_file}: field {changed[0]} was changed after it was written"
                               + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else "")
                               + "; delete the run directory to start over")
        return body

    def save(self, state: dict[str, Any]) -> None:
        """Write this rank's state atomically (a kill mid-write leaves the previous checkpoint intact), with a
        digest of every field, so that a field changed afterwards is named when the run resumes."""
        with atomic_open(self.state_file, "wb") as fh:
            torch.save({**state, "version": STATE_VERSION, "key": self.key, "digests": field_digests(state)}, fh)


_ENVELOPE = ("version", "key", "digests")


def field_digests(state: Any, path: str = "") -> dict[str, str]:
    """``{"metrics.final.dispersion.sum_u": sha256, ...}``: one digest per leaf of a checkpoint's state (a tensor's
    dtype, shape and bytes; any other value's JSON)."""
    if isinstance(state, dict):
        out: dict[str, str] = {}
        for k in sorted(state, key=str):
            out.update(field_digests(state[k], f"{path}.{k}" if path else str(k)))
        return out or {path: hashlib.sha256(b"{}").hexdigest()}
    digest = hashlib.sha256()
    if isinstance(state, torch.Tensor):
        t = state.detach().cpu().contiguous()
        digest.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():  # the tensor's own bytes, read in place (no copy of a state on the host)
            digest.update(t.reshape(-1).view(torch.uint8).numpy())
    else:
        digest.update(json.dumps(jsonable(state), sort_keys=True, default=str).encode())
    return {path: digest.hexdigest()}


def _difference(key: str, then: Any, now: Any) -> str:
    """``plugins.mean_norm.version: 0.1.0 then, 0.2.0 now``: the first differing entry of nested mappings."""
    while isinstance(then, dict) and isinstance(now, dict):
        inner = [k for k in (*then, *(k for k in now if k not in then)) if then.get(k) != now.get(k)]
        if len(inner) != 1:
            break
        key, then, now = f"{key}.{inner[0]}", then.get(inner[0]), now.get(inner[0])
    return f"{key}: {_short(then)} then, {_short(now)} now"


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."
