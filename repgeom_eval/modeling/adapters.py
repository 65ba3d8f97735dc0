"""PEFT adapters: applied so that their layers sit inside the base model's own modules (what the hooks read), or
refused where they act elsewhere (prompt, prefix and p-tuning)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from repgeom_eval.spec.errors import RepgeomError, first_line


def adapter_base(config_file: Path) -> str:
    """" (its base model is X)", from an adapter's config, or nothing."""
    import json

    try:
        base = json.loads(config_file.read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return ""
    return f" (its base model is {base})" if isinstance(base, str) and base else ""


def apply_adapter(model: Any, adapter: str, name: str) -> Any:
    """The model with a PEFT adapter applied: the base model's own modules, with the adapter's layers inside them
    (so every address is found and read as on the base model)."""
    try:
        from peft import PeftModel
    except ImportError:
        raise RepgeomError("--peft needs the peft package: pip install 'repgeom-eval[peft]'") from None
    path = Path(os.path.expanduser(adapter))
    if path.exists() and not (path / "adapter_config.json").is_file():
        raise RepgeomError(f"--peft {adapter!r}: the folder has no adapter_config.json; pass a PEFT adapter folder "
                           "(written by PeftModel.save_pretrained)")
    try:
        wrapped = PeftModel.from_pretrained(model, str(path) if path.exists() else adapter)
    except Exception as exc:  # noqa: BLE001 - peft raises ValueError, OSError, KeyError ... for a foreign adapter
        raise RepgeomError(f"cannot apply the adapter {adapter!r} to model {name!r}: {first_line(exc)}") from None
    return adapted_base_model(wrapped.eval(), f"--peft {adapter}")


def adapted_base_model(peft_model: Any, what: str) -> Any:
    """The base model of a ``PeftModel`` with the adapter's layers inside its modules, which is what the hooks read;
    an adapter that acts in ``PeftModel``'s own forward instead (prompt, prefix and p-tuning add virtual tokens or
    key/value prefixes there) is refused in one line, since the base model would be measured without it. Checked on
    a few token ids too: the base model must compute what the whole ``PeftModel`` computes."""
    configs = getattr(peft_model, "peft_config", {}) or {}
    config = configs.get(getattr(peft_model, "active_adapter", None)) or next(iter(configs.values()), None)
    kind = str(getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", "adapter")))
    refusal = (f"{what}: a {kind} adapter acts in PEFT's own forward pass (virtual tokens or key/value prefixes in "
               "front of the text), which the layer hooks of the base model do not see, so the numbers would be the "
               "bare model's; measure without it, or use an adapter that changes the model's layers (LoRA, IA3 ...)")
    if getattr(config, "is_prompt_learning", False):
        raise RepgeomError(refusal)
    from repgeom_eval.modeling.probe import probe_ids

    base = peft_model.get_base_model()
    ids = probe_ids(base, base.config, rows=1, length=5).to(next(base.parameters()).device)
    modes = [m for m in peft_model.modules() if m.training]
    peft_model.eval()  # no dropout in either pass
    try:
        with torch.no_grad():
            mine = peft_model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
            theirs = base(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
        a = getattr(mine, "hidden_states", None) or ()
        b = getattr(theirs, "hidden_states", None) or ()
        same = len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))
    except Exception:  # noqa: BLE001 - a model that needs other inputs: the adapter type decided above
        same = True
    finally:
        for m in modes:
            m.training = True
    if not same:
        raise RepgeomError(refusal)
    return base
