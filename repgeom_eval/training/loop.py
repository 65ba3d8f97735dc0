"""``repgeom train``'s run: a :class:`~repgeom_eval.spec.options.train.TrainConfig` end to end.

Each domain's texts (:mod:`~repgeom_eval.training.data`) → the model and its tokenizer
(:mod:`~repgeom_eval.training.model`) → blocks → :class:`~repgeom_eval.training.trainer.AuxLossTrainer`
(transformers + accelerate) with evaluation perplexity per domain at the requested steps → ``results.json``
(:mod:`~repgeom_eval.training.results`) and the trained model in ``output_dir``. Nothing is written before the
config, the aux losses, the data and the model have all been checked.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.output.files import write_json
from repgeom_eval.output.progress import mode_of, progress_bar
from repgeom_eval.spec.options.train import GEOMETRY_FILE, TRAINING_DEFAULTS, TrainConfig
from repgeom_eval.training.results import TrainResult



def train(cfg: TrainConfig, progress: bool = True, host: Any = None, overwrite: bool = False) -> TrainResult:
    """Run one training config end to end (see the module docstring).

    ``output_dir`` must not hold an earlier run (its ``results.json``, ``model/`` or trainer checkpoints) unless
    ``overwrite``, and nothing written there may replace an input (:func:`check_train_outputs`)."""
    _check_packages()  # before the Trainer's import, which a missing accelerate may break
    import torch
    import transformers

    from repgeom_eval.plugin_system.host import get_host
    from repgeom_eval.training import results
    from repgeom_eval.training.auxloss import build_aux_loss
    from repgeom_eval.training.data import pack_domains, read_domains
    from repgeom_eval.training.model import build_model
    from repgeom_eval.training.trainer import AuxLossTrainer, EvaluateAtSteps

    t_start = time.perf_counter()
    host = host or get_host()
    losses = [build_aux_loss(spec, host, where=f"aux_losses[{i}]") for i, spec in enumerate(cfg.aux_losses)]
    _check_output_dir(cfg.output_dir)  # before hours of training; created only once the data and model are ready
    check_train_outputs(cfg, overwrite)
    args, arg_kwargs = _training_arguments(cfg)
    if cfg.torch_threads is not None:
        torch.set_num_threads(cfg.torch_threads)

    texts = read_domains(cfg.data, cfg.seed)
    model, tokenizer, source = build_model(cfg, [t for tr, _ in texts.values() for t in tr])
    max_pos = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    if max_pos and cfg.data.block_size > max_pos:
        raise RepgeomError(f"data.block_size {cfg.data.block_size} exceeds the model's context ({max_pos})")
    blocks = pack_domains(texts, tokenizer, cfg.data, cfg.seed)
    geometry = None
    if cfg.geometry_probe is not None:  # its texts, addresses and token sets checked before any training step
        from repgeom_eval.training.geometry import GeometryCallback

        geometry = GeometryCallback(cfg.geometry_probe, output_dir=cfg.output_dir, tokenizer=tokenizer, host=host)
        geometry.setup(model, tokenizer)

    steps = [s for s in cfg.evaluate_at if args.max_steps <= 0 or s <= args.max_steps]
    # processing_class: the Trainer saves the tokenizer into every checkpoint it writes (training.save_strategy:
    # steps), so each output_dir/trainer/checkpoint-N is a model folder that loads on its own (repgeom gap, lm_eval).
    # The collator is named because a tokenizer would otherwise make the Trainer pad with DataCollatorWithPadding;
    # the blocks are already of equal length, and default_data_collator is what it used without a tokenizer.
    trainer = AuxLossTrainer(model=model, args=args, train_dataset=blocks.train, eval_dataset=blocks.eval_sets or None,
                             processing_class=tokenizer, data_collator=transformers.default_data_collator,
                             aux_losses=losses, dispersion_layer=cfg.dispersion_layer, host=host,
                             callbacks=[EvaluateAtSteps(steps)] if blocks.eval_sets else None)  # checks the addresses
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    if overwrite:  # the earlier run's checkpoints go: a later checkpoint-N of it would pass for one of this run
        shutil.rmtree(cfg.output_dir / "trainer", ignore_errors=True)
        (cfg.output_dir / GEOMETRY_FILE).unlink(missing_ok=True)
    if geometry is not None:
        geometry.attach(trainer)  # logs G and the probe dispersion through trainer.log
    # The Trainer prints every log dict (PrinterCallback) or writes it under its bar (ProgressCallback); one bar
    # with the running CE / aux / dispersion says the same without flooding the terminal.
    trainer.remove_callback(transformers.PrinterCallback)
    trainer.remove_callback(transformers.ProgressCallback)
    if mode_of(progress) != "never":
        trainer.add_callback(_progress_callback(progress))
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the Trainer's info/warnings (loss_type, ...) are not for users
    try:
        t0 = time.perf_counter()
        trainer.train()
        t_train = time.perf_counter() - t0
    finally:
        transformers.logging.set_verbosity(verbosity)

    history = trainer.state.log_history
    evaluations, train_log = results.evaluations(history, list(blocks.eval_sets)), results.train_log(history)
    if cfg.save_model:
        _save_model(trainer, tokenizer, cfg.output_dir / "model")
    model_block = results.model_block(trainer.accelerator.unwrap_model(trainer.model), cfg, source, host)
    config = results.config_block(cfg, source=source, losses=losses, host=host, training_arguments=arg_kwargs,
                                  evaluate_at=steps)
    timings = {"total_s": time.perf_counter() - t_start, "train_s": t_train,
               "steps": trainer.state.global_step,
               "s_per_step": t_train / max(trainer.state.global_step, 1)}
    result = TrainResult(config, model_block, blocks.summary, evaluations, train_log, timings)
    write_json(cfg.output_dir / "results.json", result.to_dict())
    return result


def check_train_outputs(cfg: TrainConfig, overwrite: bool = False, config_file: str | Path | None = None) -> None:
    """Refuse, before any work, an ``output_dir`` whose outputs would replace an input (a data file, the model,
    adapter or tokenizer being read, the config file) or lie inside the model folder, and one that holds an earlier
    run's results or model, unless ``overwrite`` (``repgeom train --overwrite``)."""
    from repgeom_eval.modeling.loading import model_files
    from repgeom_eval.output.files import check_outputs

    out = cfg.output_dir
    written = [out / "results.json", out / "trainer"] + ([out / "model"] if cfg.save_model else []) \
        + ([out / GEOMETRY_FILE] if cfg.geometry_probe is not None else [])
    inputs: dict[str, Any] = {"--config": config_file}
    folders: dict[str, Any] = {}
    for name, files in cfg.data.domains.items():
        inputs[f"data.domains.{name}.train"] = files.train
        inputs[f"data.domains.{name}.eval"] = files.eval
    read_models = (("model", cfg.model), ("model.peft", cfg.model_options.peft),
                   ("from_scratch.tokenizer", cfg.from_scratch.tokenizer if cfg.from_scratch else None))
    for label, model in read_models:
        if model:
            weight_files, model_dirs = model_files(str(model))
            inputs[label], folders[label] = weight_files, model_dirs
    check_outputs({"output_dir": written}, inputs=inputs, folders=folders)
    trainer = out / "trainer"
    earlier = [p.name for p in (out / "results.json", out / "model", out / GEOMETRY_FILE) if p.exists()]
    if trainer.is_dir() and any(trainer.iterdir()):
        earlier.append("trainer/")
    if earlier and not overwrite:
        raise RepgeomError(f"output_dir {str(out)!r} already holds a run ({', '.join(earlier)}); pass --overwrite to "
                           "replace it, or choose another output_dir")


def _check_output_dir(path: Path) -> None:
    existing = next((p for p in [path, *path.parents] if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise RepgeomError(f"output_dir {str(path)!r}: {str(existing)!r} is a file, not a directory")
    if existing is None or not os.access(existing, os.W_OK):
        raise RepgeomError(f"output_dir {str(path)!r} cannot be created: {str(existing)!r} is not writable")


def _check_packages() -> None:
    """The Trainer needs accelerate and the blocks are a datasets.Dataset: a missing one is one line naming the
    extra, before transformers' own ImportError deep inside TrainingArguments."""
    import importlib.util

    missing = [m for m in ("accelerate", "datasets") if importlib.util.find_spec(m) is None]
    if missing:
        raise RepgeomError(f"repgeom train needs the {' and '.join(missing)} package{'s' if len(missing) > 1 else ''}"
                           " (not installed): pip install 'repgeom-eval[train]'")


def _training_arguments(cfg: TrainConfig) -> tuple[Any, dict[str, Any]]:
    from transformers import TrainingArguments

    kwargs = {**TRAINING_DEFAULTS, **cfg.training, "output_dir": str(cfg.output_dir / "trainer"), "seed": cfg.seed}
    kwargs.setdefault("data_seed", cfg.seed)
    try:
        return TrainingArguments(**kwargs), kwargs
    except TypeError as exc:
        raise RepgeomError(f"training: {exc} (keys are transformers.TrainingArguments fields)") from None
    except ValueError as exc:
        raise RepgeomError(f"training: {str(exc).splitlines()[0]}") from None


def _progress_callback(progress: Any = True):
    from transformers import TrainerCallback

    class TrainProgress(TrainerCallback):
        """A progress bar whose postfix shows the latest CE, aux losses and batch dispersion (no log dumps)."""

        bar = None

        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                self.bar = progress_bar(total=state.max_steps, desc="train", unit="step", progress=progress,
                                        dynamic_ncols=True)

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.bar is None or not logs:
                return
            if "ce" in logs:
                keys = ["ce"] + [k for k in logs if k.startswith("aux/") and not k.endswith("skipped")]
                keys += [k for k in ("dispersion", "dispersion_cross") if k in logs]
                self.bar.set_postfix({k.removeprefix("aux/"): f"{logs[k]:.4g}" for k in keys}, refresh=False)
            ppl = {k[5:-11]: v for k, v in logs.items() if k.startswith("eval_") and k.endswith("_perplexity")}
            if ppl:
                self.bar.write(f"step {state.global_step}: perplexity "
                               + ", ".join(f"{d} {v:.2f}" for d, v in ppl.items()))

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    return TrainProgress()


def _save_model(trainer: Any, tokenizer: Any, path: Path) -> None:
    """Save model + tokenizer next to ``path`` and move them into place only when complete."""
    import transformers

    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bar
    try:
        trainer.save_model(str(tmp))
        tokenizer.save_pretrained(str(tmp))
    except OSError as exc:  # a full disk or a file-size limit: one line, and no half-saved model left
        from repgeom_eval.output.files import write_error

        shutil.rmtree(tmp, ignore_errors=True)
        clean = write_error(path, exc)
        if clean is None:
            raise
        raise clean from None
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
