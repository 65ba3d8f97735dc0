"""Training with auxiliary losses on hidden states: a :class:`transformers.Trainer` subclass.

:class:`AuxLossTrainer` minimizes ``L_CE + Σ_k λ_k · L_aux,k`` where every ``L_aux,k`` reads hidden states
captured by forward hooks in the *same* forward pass that computes the cross-entropy (no second pass, no
``output_hidden_states``). Everything else is the stock Trainer, so accelerate (DDP, mixed precision), gradient
accumulation, checkpointing and callbacks work as usual. Per optimizer step it logs:

* ``ce``: the cross-entropy part of ``loss`` (same normalization as the Trainer's ``loss``);
* ``aux/NAME``: each aux loss's L_aux (mean over the step's micro-batches that define it) and ``aux/NAME/skipped``
  when some micro-batch did not define it (one token, a single domain in a cross-domain batch ...);
* ``dispersion``: the batch's token dispersion d at ``dispersion_layer`` (mean pairwise cosine distance of every
  non-pad token vector of the micro-batch, paper A's d_avg), and ``dispersion_cross`` (between domains) when the
  batch carries domain labels;
* at evaluation, ``eval_NAME_perplexity = exp(eval_NAME_loss)`` next to every per-dataset eval loss.

Semantics worth knowing:

* The aux terms are added only in training mode (as paper C's trainer); evaluation is plain CE.
* Each aux loss sees one micro-batch (per device): push-away's d is over the micro-batch's tokens. With gradient
  accumulation the aux terms are averaged over micro-batches like the CE.
* The aux losses run outside autocast, in float32 at least (the sum identities need it:
  docs/metrics.md#cosine-dispersion).
* Per-example domain labels travel in the batch under ``domain_key`` (default ``"domain"``, integers); they are
  removed before the model's forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from repgeom_eval.modeling.addresses import Address, HookPoint, resolve
from repgeom_eval.modeling.addresses import parse_request
from repgeom_eval.training.auxloss import AuxLoss
from repgeom_eval.modeling.hooks import Capture
from repgeom_eval.functional.losses import push_away
from repgeom_eval.modeling.loading import wrap_model


@dataclass
class _Plan:
    """Where to hook on one (unwrapped) model: every address needed, and each loss's own addresses."""

    module: torch.nn.Module
    points: dict[Address, HookPoint]
    per_loss: list[list[Address]]
    dispersion: Address


class AuxLossTrainer(Trainer):
    """A ``transformers.Trainer`` that adds weighted auxiliary losses on hidden states to the language-model loss.

    Args:
        aux_losses: :class:`repgeom_eval.training.auxloss.AuxLoss` objects (``build_aux_loss`` makes them from config
            mappings); empty = plain CE, still logging the batch dispersion.
        domain_key: batch key of the per-example domain labels (kept out of the model's forward).
        dispersion_layer: the address whose batch dispersion is logged every step (default ``final``).
        host: the plugin host used to resolve addresses (default: the process-wide one).
        All other arguments go to ``transformers.Trainer``.
    """

    def __init__(self, *args: Any, aux_losses: Sequence[AuxLoss] = (), domain_key: str = "domain",
                 dispersion_layer: str = "final", host: Any = None, **kwargs: Any):
        self.aux_losses = list(aux_losses)
        self.dispersion_layer = dispersion_layer
        self._host = host
        self._plan_cache: tuple[int, _Plan] | None = None
        model = kwargs.get("model", args[0] if args else None)
        if model is not None:  # bad layer addresses fail here, before transformers.Trainer creates output_dir
            self._build_plan(model)
        super().__init__(*args, **kwargs)
        names = [loss.name for loss in self.aux_losses]
        self._keys = [name if names.count(name) == 1 else f"{name}{i}" for i, name in enumerate(names)]
        self.domain_key = domain_key
        self._reset_running()
        self._fix_label_shift_count()

    def _fix_label_shift_count(self) -> None:
        """Count next-token targets as ``labels[..., 1:]`` for every causal-LM loss.

        transformers 5 decides whether the loss shifts labels from ``model.loss_type``, which is ``None`` for
        classes not named ``*ForCausalLM`` (``GPT2LMHeadModel``); it then counts position 0 as a target, and the
        CE it normalizes by ``num_items_in_batch`` (training and evaluation) comes out scaled by (T−1)/T.
        """
        if not hasattr(self, "_loss_shifts_labels") or self.model is None:
            return
        from transformers.loss.loss_utils import ForCausalLMLoss

        model = self.accelerator.unwrap_model(self.model)
        causal = getattr(model, "loss_function", None) is ForCausalLMLoss
        if causal and not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            self._loss_shifts_labels = True

    # -- hook plan -------------------------------------------------------------------------------------------------
    def _plan(self, model: torch.nn.Module) -> _Plan:
        return self._build_plan(self.accelerator.unwrap_model(model))

    def _build_plan(self, module: torch.nn.Module) -> _Plan:
        if self._plan_cache is not None and self._plan_cache[0] == id(module):
            return self._plan_cache[1]
        loaded = wrap_model(module, host=self._host)
        disp = parse_request(self.dispersion_layer, loaded.info, self._host)[0]
        wanted: list[Address] = [disp]
        per_loss = []
        for loss in self.aux_losses:
            addrs = loss.addresses(loaded.info, self._host)
            wanted += [a for a in addrs if a not in wanted]
            per_loss.append(addrs)
        points = resolve(wanted, loaded)
        # one term per tensor: e.g. `final` and `resid_post:-1` are the same tensor on models without a final norm
        deduped = []
        for addrs in per_loss:
            seen: dict[HookPoint, Address] = {}
            for a in addrs:
                seen.setdefault(points[a], a)
            deduped.append(list(seen.values()))
        plan = _Plan(module, points, deduped, disp)
        self._plan_cache = (id(module), plan)
        return plan

    # -- the loss --------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        domains = inputs.pop(self.domain_key, None)
        if not model.training:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        plan = self._plan(model)
        with Capture(plan.module, plan.points, stop_early=False, keep_grad=True) as cap:
            ce, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                               num_items_in_batch=num_items_in_batch)
            hidden = cap.tensors()
        mask = inputs.get("attention_mask")
        ga = max(int(getattr(self, "current_gradient_accumulation_steps", 1) or 1), 1)
        # What Trainer.training_step does next: divide by the accumulation steps unless the CE already is.
        ce_scaled = self._ce_scaled_for_ga(num_items_in_batch)
        self._steps_seen.add(self.state.global_step)
        self._add("ce", ce.detach() / (1 if ce_scaled else ga), 1)
        total = ce
        device_type = ce.device.type
        with torch.autocast(device_type=device_type, enabled=False):
            for key, loss, addrs in zip(self._keys, self.aux_losses, plan.per_loss):
                value = loss({a: hidden[a] for a in addrs}, mask, domains)
                if value is None:
                    self._add(f"aux/{key}/skipped", torch.ones((), device=ce.device), 0)
                    continue
                # ce_scaled: Trainer will not divide by GA, so the aux mean over micro-batches is ours to take.
                total = total + (loss.weight / (ga if ce_scaled else 1)) * value.to(ce.dtype)
                self._add(f"aux/{key}", value.detach(), 1)
            h = hidden[plan.dispersion].detach()
            d = push_away(h, mask)
            if torch.isfinite(d):
                self._add("dispersion", d, 1)
            if domains is not None and len(set(_as_list(domains))) > 1:
                dx = push_away(h, mask, domains=domains)
                if torch.isfinite(dx):
                    self._add("dispersion_cross", dx, 1)
        return (total, outputs) if return_outputs else total

    def _ce_scaled_for_ga(self, num_items_in_batch: Any) -> bool:
        declared = getattr(self, "loss_is_scaled_for_ga", None)  # transformers 5.0.0 has no such attribute
        if declared is not None:
            return bool(declared)
        return bool((self.model_accepts_loss_kwargs and num_items_in_batch is not None)
                    or self.compute_loss_func is not None)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = {k: v for k, v in inputs.items() if k != self.domain_key}
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def _set_signature_columns_if_needed(self) -> None:
        # Keep the domain column when the Trainer drops dataset columns the model's forward does not take.
        super()._set_signature_columns_if_needed()
        if self._signature_columns is not None and self.domain_key not in self._signature_columns:
            self._signature_columns.append(self.domain_key)

    # -- logging ---------------------------------------------------------------------------------------------------
    def _reset_running(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}
        self._steps_seen: set[int] = set()

    def _add(self, key: str, value: torch.Tensor, count: int) -> None:
        value = value.detach().float()
        self._sums[key] = self._sums[key] + value if key in self._sums else value
        self._counts[key] = self._counts.get(key, 0) + count

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._sums:
            logs.update(self._running_means())
        self._add_perplexities(logs)
        super().log(logs, start_time)

    def _running_means(self) -> dict[str, float]:
        """Means since the last log, reduced over processes (every process calls log(), as the Trainer's own)."""
        steps = max(len(self._steps_seen), 1)
        out: dict[str, float] = {}
        for key in sorted(self._sums):
            total = self.accelerator.reduce(self._sums[key].reshape(1), reduction="sum")
            if key == "ce":  # accumulated like the Trainer's loss: per step, already divided by the GA steps
                out[key] = float(total) / steps / self.accelerator.num_processes
            elif key.endswith("/skipped"):
                out[key] = float(total)
            else:
                count = self.accelerator.reduce(
                    torch.tensor([self._counts[key]], dtype=torch.float32, device=total.device), reduction="sum")
                out[key] = float(total) / max(float(count), 1.0)
        self._reset_running()
        return out

    @staticmethod
    def _add_perplexities(logs: dict[str, float]) -> None:
        for key in [k for k in logs if k.startswith("eval") and k.endswith("_loss")]:
            value = logs[key]
            if isinstance(value, (int, float)):
                logs[key[: -len("_loss")] + "_perplexity"] = math.exp(value) if value < 700 else math.inf

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        metrics = super().evaluate(*args, **kwargs)
        self._add_perplexities(metrics)  # also in the returned dict, not only in the log
        return metrics


def _as_list(domains: Any) -> list:
    return domains.reshape(-1).tolist() if isinstance(domains, torch.Tensor) else list(domains)


class EvaluateAtSteps(TrainerCallback):
    """Evaluate at the given optimizer steps (e.g. the two step counts of paper A's tables) and at the end."""

    def __init__(self, steps: Sequence[int]):
        self.steps = set(int(s) for s in steps)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in self.steps or state.global_step >= state.max_steps:
            control.should_evaluate = True
        return control
