"""A training-time geometry screen: :class:`GeometryCallback`, a ``transformers.TrainerCallback``.

At every checkpoint the Trainer saves (``on_save``) it measures, on the model in memory:

* the dispersion gap G = within(T) + between(T, T̄) of the output embeddings (paper A §3.2), cosine and
  Euclidean, with the token sets of ``repgeom gap`` (:mod:`repgeom_eval.analyses.gap.vocabulary`, resolved once:
  the tokenizer does not change during training) and its distance code
  (:func:`repgeom_eval.functional.gap_distances.dispersion_gap`, on the same rows in the same order);
* the dispersion of a fixed set of probe texts at the chosen layers, as ``repgeom measure --metrics dispersion``
  computes it (:class:`~repgeom_eval.measurement.forward.Forward` hooks, the same pooling, float64 sums), with the
  model in eval mode (no dropout) and no autograd; every submodule's train/eval mode is restored afterwards.

It rewrites ``geometry_by_checkpoint.json`` (atomically) after each one: the step, G, the probe dispersion per
layer, the evaluation loss logged at that step (if any), the time it took, the config and the *pick*. The values go
to the Trainer's loggers as ``geometry/...`` keys (through ``trainer.log`` when the callback knows its trainer:
:meth:`GeometryCallback.attach`; otherwise into ``state.log_history`` only).

The pick is label-free: among the checkpoints at or after ``burn_in`` × max_steps, the one with the largest cosine
G (paper A §3.2 screens checkpoints by G, higher is better; ties go to the later step). ``burn_in`` (default 0.5)
is this project's choice, not the paper's: a freshly initialised embedding's G is high (unit vectors in random
directions are at cosine distance ≈ 1), so the earliest checkpoints would otherwise win.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from repgeom_eval.analyses.gap.screening import degenerate_rows
from repgeom_eval.analyses.gap.vocabulary import TokenSet, Vocabulary, resolve_token_set
from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.functional.dispersion import dispersion
from repgeom_eval.functional.gap_distances import DISTANCES, SIGN, dispersion_gap
from repgeom_eval.spec.options.train import GEOMETRY_FILE, GeometryProbe
from repgeom_eval.spec.options.settings import ConfigError, from_mapping, recorded

FILE_NAME = GEOMETRY_FILE
PICK_RULE = ("largest cosine G among the checkpoints at or after burn_in × max_steps (ties: the later step); "
             "label-free: no evaluation loss or accuracy is read")


def pick_checkpoint(records: Sequence[Mapping[str, Any]], max_steps: int | None, burn_in: float) -> dict[str, Any]:
    """The label-free pick over ``records`` (each with ``step`` and ``G``: {cosine, euclidean}): see the module
    docstring. ``step`` is None when no checkpoint is eligible (all before the burn-in, or G is NaN)."""
    first = math.ceil(burn_in * max_steps) if max_steps and max_steps > 0 else 0
    eligible = [r for r in records if r["step"] >= first and not math.isnan(r["G"]["cosine"])]
    out: dict[str, Any] = {"rule": PICK_RULE, "burn_in": burn_in, "max_steps": max_steps, "first_eligible_step": first,
                           "n_eligible": len(eligible), "step": None, "checkpoint": None, "G_cosine": None}
    if eligible:
        best = max(eligible, key=lambda r: (r["G"]["cosine"], r["step"]))
        out.update(step=best["step"], checkpoint=best.get("checkpoint"), G_cosine=best["G"]["cosine"])
    return out


def eval_losses_at(history: Sequence[Mapping[str, Any]], step: int) -> dict[str, float] | None:
    """The evaluation losses the Trainer logged at ``step`` (``eval_loss``, ``eval_NAME_loss`` ...), or None."""
    out = {k: v for row in history if row.get("step") == step for k, v in row.items()
           if k.startswith("eval_") and k.endswith("_loss") and isinstance(v, (int, float))}
    return out or None


class GeometryCallback(TrainerCallback):
    """G of the output embeddings and the dispersion of probe texts at every saved checkpoint (module docstring).

    Args:
        probe: a :class:`~repgeom_eval.spec.options.train.GeometryProbe` or a mapping of its keys (a bad one is one
            :class:`~repgeom_eval.spec.options.settings.ConfigError` line); or give its keys as keywords
            (``GeometryCallback(texts=[...], layers=["final", 1])``).
        output_dir: the folder of ``geometry_by_checkpoint.json`` (default: the Trainer's ``args.output_dir``).
        tokenizer: the model's tokenizer (default: the Trainer's ``processing_class``).
        host: the plugin host resolving token sets and addresses (default: the process-wide one).

    With any ``transformers.Trainer``: ``GeometryCallback(texts=[...]).attach(trainer)`` (adds it and lets it log
    through ``trainer.log``), and a ``save_strategy`` that saves checkpoints.
    """

    def __init__(self, probe: GeometryProbe | Mapping[str, Any] | None = None, *, output_dir: str | Path | None = None,
                 tokenizer: Any = None, host: Any = None, **options: Any):
        if probe is None:
            probe = options
        elif options:
            raise RepgeomError(f"give the probe either whole or as keywords, not both ({sorted(options)})")
        if not isinstance(probe, GeometryProbe):
            try:
                probe = from_mapping(GeometryProbe, probe)
            except ConfigError as exc:
                raise exc.inside("geometry_probe") from None
        self.probe: GeometryProbe = probe
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.tokenizer = tokenizer
        self.host = host
        self.records: list[dict[str, Any]] = []
        self.texts: list[str] | None = None
        self._trainer: Any = None
        self._ready: tuple[int, int] | None = None  # (id(model), id(tokenizer)) that setup() resolved for
        self._resolved: dict[str, Any] = {}

    # -- set-up: everything that can fail, before training -----------------------------------------------------------
    def attach(self, trainer: Any) -> "GeometryCallback":
        """Add this callback to ``trainer`` and log through ``trainer.log`` (every ``report_to`` logger sees it)."""
        trainer.add_callback(self)
        self._trainer = trainer
        return self

    def setup(self, model: Any, tokenizer: Any = None) -> None:
        """Read the probe texts, resolve the layer addresses and the token sets T and T̄ for ``model`` (a bad address,
        an empty token set or an unreadable file is a one-line error here, before any training step)."""
        tokenizer = tokenizer if tokenizer is not None else self.tokenizer
        if tokenizer is None:
            raise RepgeomError("GeometryCallback needs the model's tokenizer: pass tokenizer=... or give the Trainer "
                               "a processing_class")
        key = (id(model), id(tokenizer))
        if self._ready == key:
            return
        from repgeom_eval.modeling.addresses import resolve_request
        from repgeom_eval.modeling.loading import wrap_model
        from repgeom_eval.plugin_system.host import get_host

        host = self.host = self.host or get_host()
        p = self.probe
        if self.texts is None:
            self.texts = self._read_texts()
        if getattr(tokenizer, "pad_token", None) is None:  # a copy: the tokenizer saved with checkpoints stays as is
            tokenizer = copy.deepcopy(tokenizer)
            tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token or tokenizer.bos_token
            if tokenizer.pad_token is None:
                raise RepgeomError("GeometryCallback: the tokenizer defines no pad, eos, unk or bos token, so probe "
                                   "texts of different lengths cannot be batched; set tokenizer.pad_token")
        loaded = wrap_model(model, tokenizer, source="memory", host=host)
        plan = resolve_request(list(p.layers), loaded, host)
        W = _output_weight(model)
        vocab = Vocabulary(tokenizer, n_rows=W.shape[0])
        T = resolve_token_set(p.domain, vocab, host=host, seed=p.seed, size=p.size)
        if len(T) < 2:
            raise RepgeomError(f"geometry_probe.domain {p.domain!r} matches {len(T)} token(s) of the model (missing: "
                               f"{', '.join(repr(w) for w in T.missing[:10]) or 'none'}); within(T) needs at least 2")
        Tbar = resolve_token_set(p.reference, vocab, host=host, exclude=T.ids, seed=p.seed, size=p.size)
        if len(Tbar) < 1:
            raise RepgeomError(f"geometry_probe.reference {p.reference!r} matches no token of the model outside the "
                               "domain set")
        self._resolved = {"loaded": loaded, "plan": plan, "T": T, "Tbar": Tbar, "vocab": vocab}
        self._ready = key

    def _read_texts(self) -> list[str]:
        p = self.probe
        if isinstance(p.texts, tuple):
            return list(p.texts)
        from repgeom_eval.measurement.texts import load_texts

        return list(load_texts(p.texts, text_field=p.text_field).texts)

    # -- the measurement ---------------------------------------------------------------------------------------------
    def measure(self, model: Any, tokenizer: Any = None) -> dict[str, Any]:
        """G (cosine and Euclidean, with their parts) and the probe dispersion per layer of ``model`` as it is now."""
        self.setup(model, tokenizer)
        t0 = time.perf_counter()
        gap = self._gap(model)
        t1 = time.perf_counter()
        disp = self._probe_dispersion(model)
        t2 = time.perf_counter()
        return {"G": {d: gap[d]["G"] for d in DISTANCES}, "gap": gap, "dispersion": disp,
                "timings": {"gap_s": t1 - t0, "probe_s": t2 - t1, "total_s": t2 - t0}}

    def _gap(self, model: Any) -> dict[str, dict[str, float]]:
        T: TokenSet = self._resolved["T"]
        Tbar: TokenSet = self._resolved["Tbar"]
        needed = sorted(set(T.ids) | set(Tbar.ids))  # the rows `repgeom gap` reads, in its order
        with torch.no_grad():
            W = _output_weight(model)
            sub = W.index_select(0, torch.as_tensor(needed, dtype=torch.long, device=W.device)).detach().cpu()
        pos = {i: k for k, i in enumerate(needed)}
        t_pos, r_pos = [pos[i] for i in T.ids], [pos[i] for i in Tbar.ids]
        out = {}
        for distance in DISTANCES:
            out[distance] = dispersion_gap(sub, t_pos, r_pos, distance=distance)
            for flag in degenerate_rows("the model in training", sub, t_pos, r_pos, out[distance], distance):
                warnings.warn(flag, stacklevel=3)
        return out

    def _probe_dispersion(self, model: Any) -> dict[str, float]:
        from repgeom_eval.measurement.forward import Forward, context_length
        from repgeom_eval.measurement.pooling import pool64

        loaded, plan = self._resolved["loaded"], self._resolved["plan"]
        param = next(model.parameters(), None)
        if param is not None and param.device != loaded.device:  # the Trainer moved it (to the GPU) after setup()
            loaded.device = param.device
        p = self.probe
        context = context_length(loaded, p.max_length)
        vectors: dict[Any, list[torch.Tensor]] = {a: [] for a in plan.addresses}
        # Forward runs in eval mode (no dropout: the values a saved checkpoint gives under `repgeom measure`) and
        # gives the Trainer its train mode back
        with Forward(loaded, plan.points) as fwd:
            for start in range(0, len(self.texts), p.batch_size):
                batch = fwd.texts(self.texts[start:start + p.batch_size], context, "right")
                for addr in plan.addresses:
                    vecs, _ = pool64(batch.hidden[addr], batch.mask.to(batch.hidden[addr].device), p.pooling)
                    vectors[addr].append(vecs.cpu())
        return {str(addr): float(dispersion(torch.cat(v))) for addr, v in vectors.items()}

    # -- the Trainer's events ----------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        if state.global_step > 0 and not self.records:  # resumed from a checkpoint: the file's earlier records stay
            self.records = _earlier_records(self.output_dir or Path(args.output_dir))
        self.records = [r for r in self.records if r["step"] <= state.global_step]
        if model is not None:
            self.setup(model, self.tokenizer if self.tokenizer is not None else processing_class)

    def on_save(self, args, state, control, model=None, processing_class=None, **kwargs):
        if not state.is_world_process_zero or model is None:
            return
        step = state.global_step
        values = self.measure(model, self.tokenizer if self.tokenizer is not None else processing_class)
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        record = {"step": step, "epoch": state.epoch,
                  "checkpoint": str(Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"),
                  **values, "eval_loss": eval_losses_at(state.log_history, step)}
        self.records = [r for r in self.records if r["step"] != step] + [record]
        self.write(args, state)
        self._log(state, {**{f"geometry/G_{d}": values["G"][d] for d in DISTANCES},
                          **{f"geometry/dispersion/{a}": v for a, v in values["dispersion"].items()},
                          "geometry/time_s": values["timings"]["total_s"]})

    def _log(self, state: Any, logs: dict[str, float]) -> None:
        if self._trainer is not None:
            self._trainer.log(logs)  # log_history and every report_to logger (on_log)
        else:
            state.log_history.append({**logs, "step": state.global_step})

    # -- the file ----------------------------------------------------------------------------------------------------
    def pick(self, max_steps: int | None) -> dict[str, Any]:
        return pick_checkpoint(self.records, max_steps, self.probe.burn_in)

    def config_block(self) -> dict[str, Any]:
        T, Tbar, vocab = self._resolved["T"], self._resolved["Tbar"], self._resolved["vocab"]
        return {**recorded(self.probe), "texts": self.probe.texts if isinstance(self.probe.texts, str) else "(list)",
                "n_texts": len(self.texts or []), "addresses": [str(a) for a in self._resolved["plan"].addresses],
                "metric": "dispersion", "padding_side": "right", "precision": "float64", "sign": SIGN,
                "distances": list(DISTANCES), "n_T": len(T), "n_Tbar": len(Tbar), "missing_T": T.missing,
                "missing_Tbar": Tbar.missing, "token_sets": {"domain": T.config, "reference": Tbar.config,
                                                             "stripped_markers": {"prefixes": list(vocab.prefixes),
                                                                                  "suffixes": list(vocab.suffixes)}},
                "T": T.to_dict(with_tokens=True), "pick_rule": PICK_RULE}

    def to_dict(self, max_steps: int | None) -> dict[str, Any]:
        records = sorted(self.records, key=lambda r: r["step"])
        times = [r["timings"]["total_s"] for r in records]
        return {"config": self.config_block(), "checkpoints": records, "pick": self.pick(max_steps),
                "timings": {"n_saves": len(times), "total_s": sum(times),
                            "mean_s_per_save": sum(times) / len(times) if times else None}}

    def write(self, args: Any, state: Any) -> Path:
        from repgeom_eval.output.files import write_json

        folder = self.output_dir or Path(args.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / FILE_NAME
        write_json(path, self.to_dict(state.max_steps))
        return path


def _earlier_records(folder: Path) -> list[dict[str, Any]]:
    """The checkpoint records of an earlier file in ``folder`` (none if it is missing or unreadable)."""
    import json

    try:
        records = json.loads((folder / FILE_NAME).read_text(encoding="utf-8")).get("checkpoints", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [r for r in records if isinstance(r, dict) and isinstance(r.get("step"), int)]


def _output_weight(model: Any) -> torch.Tensor:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or getattr(head, "weight", None) is None:
        raise RepgeomError(f"{type(model).__name__} has no output embedding (get_output_embeddings()); the dispersion "
                           "gap needs a language-model head")
    return head.weight
