"""``repgeom train``: continued training of a causal LM, or a small GPT-2 from scratch, with auxiliary losses.

config (YAML) → model + tokenizer → per-domain texts packed into blocks (datasets) → :class:`AuxLossTrainer`
(transformers + accelerate) → per-domain evaluation perplexity at the requested steps → ``results.json`` and the
trained model in ``output_dir``. A config looks like::

    model: ./my-model                 # continued training (a directory, .gguf or cached hub id), or instead:
    # from_scratch: {n_layer: 4, n_embd: 128, n_head: 4, vocab_size: 4096}   # GPT-2; BPE trained on the data
    data:
      block_size: 128
      domains:                        # one label per domain; blocks never mix domains
        prose: {train: prose.jsonl, eval: prose_test.jsonl}
        code: {train: code.jsonl}     # no eval file: eval_fraction of its texts is held out
    aux_losses:
      - {name: push_away, weight: 0.01, cross_domain: true}
    training: {max_steps: 200, per_device_train_batch_size: 8, learning_rate: 5.0e-4}   # TrainingArguments
    evaluate_at: [100, 200]
    output_dir: runs/push_away

Relative paths are relative to the config file. Every default is written into ``results.json``'s ``config``.
"""

from __future__ import annotations

import copy
import difflib
import itertools
import math
import os
import platform
import random
import shutil
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from repgeom_eval import __version__
from repgeom_eval.measurement.texts import TextSet, load_texts
from repgeom_eval.errors import RepgeomError
from repgeom_eval.output.files import write_json

TOP_KEYS = ("model", "from_scratch", "data", "aux_losses", "training", "evaluate_at", "dispersion_layer",
            "output_dir", "seed", "save_model", "torch_threads")
DATA_KEYS = ("domains", "block_size", "text_field", "eval_fraction", "balance")
DOMAIN_KEYS = ("train", "eval")
SCRATCH_DEFAULTS: dict[str, Any] = {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 4096, "tokenizer": None}
DATA_DEFAULTS: dict[str, Any] = {"block_size": 128, "text_field": "text", "eval_fraction": 0.1, "balance": False}
# Our defaults for TrainingArguments (the user's `training:` wins): log every step, no checkpoints, no wandb.
TRAINING_DEFAULTS: dict[str, Any] = {"logging_steps": 1, "save_strategy": "no", "report_to": "none",
                                     "eval_strategy": "no", "per_device_eval_batch_size": 8}
EOS = "<|endoftext|>"


# -- config ----------------------------------------------------------------------------------------------------

@dataclass
class TrainConfig:
    """A validated training config (paths absolute)."""

    raw: dict[str, Any]
    base_dir: Path
    model: str | None
    from_scratch: dict[str, Any] | None
    domains: dict[str, dict[str, str | None]]
    data: dict[str, Any]
    aux_losses: list[dict[str, Any]]
    training: dict[str, Any]
    evaluate_at: list[int]
    dispersion_layer: str
    output_dir: Path
    seed: int
    save_model: bool
    torch_threads: int | None = None


def _unknown_keys(given: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    for key in given:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise RepgeomError(f"{where}: unknown key {key!r}{hint} (valid: {', '.join(allowed)})")


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RepgeomError(f"{where} must be a mapping, got {type(value).__name__}: {value!r}")
    return dict(value)


def set_dotted(raw: dict[str, Any], assignment: str) -> None:
    """Apply one ``--set a.b.c=VALUE`` override (VALUE parsed as YAML) to a config mapping."""
    key, sep, text = assignment.partition("=")
    if not sep or not key.strip():
        raise RepgeomError(f"--set expects KEY=VALUE (e.g. training.max_steps=100), got {assignment!r}")
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise RepgeomError(f"--set {assignment!r}: {part!r} is not a mapping in the config")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RepgeomError(f"--set {assignment!r}: the value is not valid YAML ({exc})") from None


def read_config(path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read and validate a training config file; ``overrides`` are ``a.b=VALUE`` strings applied first."""
    p = Path(path)
    if not p.is_file():
        raise RepgeomError(f"training config {str(path)!r} " + ("is a directory" if p.is_dir() else "does not exist"))
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise RepgeomError(f"training config {str(path)!r} is not valid YAML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise RepgeomError(f"training config {str(path)!r} is not valid UTF-8 (byte {exc.start})") from None
    raw = _mapping(raw, f"training config {str(path)!r}")
    for assignment in overrides:
        set_dotted(raw, assignment)
    return parse_config(raw, p.resolve().parent, where=str(path))


def parse_config(raw: Mapping[str, Any], base_dir: str | Path = ".", where: str = "training config") -> TrainConfig:
    """Validate a config mapping (see the module docstring); relative paths are taken from ``base_dir``."""
    raw = copy.deepcopy(dict(raw))
    base = Path(base_dir)
    _unknown_keys(raw, TOP_KEYS, where)

    def path_of(value: Any, what: str) -> str:
        if not isinstance(value, str) or not value.strip():
            raise RepgeomError(f"{where}: {what} must be a file path, got {value!r}")
        return str((base / os.path.expanduser(value)).resolve()) if not os.path.isabs(value) else value

    model, scratch = raw.get("model"), raw.get("from_scratch")
    if (model is None) == (scratch is None):
        raise RepgeomError(f"{where}: give exactly one of `model` (continued training of a local directory, "
                           "a .gguf file or a hub id) or `from_scratch` (a small GPT-2: {n_layer, n_embd, ...})")
    if model is not None:
        if not isinstance(model, str) or not model.strip():
            raise RepgeomError(f"{where}: model must be a path or hub id, got {model!r}")
        local = base / os.path.expanduser(model)
        model = str(local.resolve()) if (model.startswith((".", "/", "~")) or local.exists()) else model
    if scratch is not None:
        scratch = {**SCRATCH_DEFAULTS, **_mapping(scratch, f"{where}: from_scratch")}
        for key in ("n_layer", "n_embd", "n_head", "vocab_size"):
            value = scratch[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RepgeomError(f"{where}: from_scratch.{key} must be a positive integer, got {value!r}")
        if scratch["n_embd"] % scratch["n_head"]:
            raise RepgeomError(f"{where}: from_scratch.n_embd ({scratch['n_embd']}) must be divisible by n_head "
                               f"({scratch['n_head']})")
        if scratch["tokenizer"] is not None:
            tok = str(scratch["tokenizer"])
            local = base / os.path.expanduser(tok)
            scratch["tokenizer"] = str(local.resolve()) if local.exists() else tok

    data = _mapping(raw.get("data"), f"{where}: data")
    _unknown_keys(data, DATA_KEYS, f"{where}: data")
    data = {**DATA_DEFAULTS, **data}
    bs = data["block_size"]
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 2:
        raise RepgeomError(f"{where}: data.block_size must be an integer >= 2, got {bs!r}")
    frac = data["eval_fraction"]
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac < 1:
        raise RepgeomError(f"{where}: data.eval_fraction must be in [0, 1), got {frac!r}")
    if not isinstance(data["balance"], bool):
        raise RepgeomError(f"{where}: data.balance must be true or false, got {data['balance']!r}")
    domains_raw = _mapping(data.pop("domains", None), f"{where}: data.domains")
    if not domains_raw:
        raise RepgeomError(f"{where}: data.domains is empty; give at least one, e.g. "
                           "domains: {{text: {{train: texts.jsonl}}}}")
    domains: dict[str, dict[str, str | None]] = {}
    for name, entry in domains_raw.items():
        if isinstance(entry, str):
            entry = {"train": entry}
        entry = _mapping(entry, f"{where}: data.domains.{name}")
        _unknown_keys(entry, DOMAIN_KEYS, f"{where}: data.domains.{name}")
        if "train" not in entry:
            raise RepgeomError(f"{where}: data.domains.{name} has no `train` file")
        domains[str(name)] = {"train": path_of(entry["train"], f"data.domains.{name}.train"),
                              "eval": path_of(entry["eval"], f"data.domains.{name}.eval")
                              if entry.get("eval") is not None else None}

    aux = raw.get("aux_losses") or []
    if isinstance(aux, Mapping):
        aux = [aux]
    if not isinstance(aux, list):
        raise RepgeomError(f"{where}: aux_losses must be a list of mappings like {{name: push_away, weight: 0.1}}")
    training = _mapping(raw.get("training"), f"{where}: training")
    for key in ("output_dir", "seed"):
        if key in training:
            raise RepgeomError(f"{where}: set {key} at the top level of the config, not under training")
    if "max_steps" not in training and "num_train_epochs" not in training:
        raise RepgeomError(f"{where}: training needs max_steps (or num_train_epochs)")
    evaluate_at = raw.get("evaluate_at") or []
    if isinstance(evaluate_at, int):
        evaluate_at = [evaluate_at]
    if not isinstance(evaluate_at, list) or any(isinstance(s, bool) or not isinstance(s, int) or s < 1
                                                for s in evaluate_at):
        raise RepgeomError(f"{where}: evaluate_at must be a list of positive step counts, got {evaluate_at!r}")
    seed = raw.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise RepgeomError(f"{where}: seed must be an integer, got {seed!r}")
    save_model = raw.get("save_model", True)
    if not isinstance(save_model, bool):
        raise RepgeomError(f"{where}: save_model must be true or false, got {save_model!r}")
    out = raw.get("output_dir")
    if out is None:
        raise RepgeomError(f"{where}: no output_dir (the results and the trained model are written there)")
    dispersion_layer = raw.get("dispersion_layer", "final")
    threads = raw.get("torch_threads")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise RepgeomError(f"{where}: torch_threads must be a positive integer or null, got {threads!r}")
    return TrainConfig(raw=raw, base_dir=base, model=model, from_scratch=scratch, domains=domains, data=data,
                       aux_losses=[dict(a) if isinstance(a, Mapping) else a for a in aux], training=training,
                       evaluate_at=sorted(set(evaluate_at)), dispersion_layer=str(dispersion_layer),
                       output_dir=Path(path_of(out, "output_dir")), seed=seed, save_model=save_model,
                       torch_threads=threads)


# -- data ------------------------------------------------------------------------------------------------------

def split_texts(texts: TextSet, fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(train, eval) texts: a seeded ``fraction`` of the texts held out (at least one of each when possible)."""
    order = list(range(len(texts.texts)))
    random.Random(seed).shuffle(order)
    n_eval = min(max(1, round(fraction * len(order))), len(order) - 1) if fraction > 0 else 0
    held = set(order[:n_eval])
    train = [t for i, t in enumerate(texts.texts) if i not in held]
    return train, [t for i, t in enumerate(texts.texts) if i in held]


def pack_blocks(texts: Sequence[str], tokenizer: Any, block_size: int, domain: int):
    """A ``datasets.Dataset`` of ``block_size``-token blocks: texts tokenized, joined by EOS, cut (remainder
    dropped), ``labels = input_ids``, every example labelled ``domain`` (run_clm's ``group_texts``)."""
    import datasets
    import transformers

    eos = tokenizer.eos_token_id
    sep = [] if eos is None else [eos]

    def tokenize(batch):
        return {"input_ids": tokenizer(batch["text"], add_special_tokens=False)["input_ids"]}

    def group(batch):
        ids = list(itertools.chain.from_iterable(x + sep for x in batch["input_ids"]))
        n = len(ids) // block_size * block_size
        blocks = [ids[i:i + block_size] for i in range(0, n, block_size)]
        return {"input_ids": blocks, "attention_mask": [[1] * block_size for _ in blocks],
                "labels": [list(b) for b in blocks], "domain": [domain] * len(blocks)}

    bars = datasets.is_progress_bar_enabled()
    verbosity = transformers.logging.get_verbosity()
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()  # "sequence longer than the model's max length": we cut it below
    try:
        ds = datasets.Dataset.from_dict({"text": list(texts)})
        ds = ds.map(tokenize, batched=True, remove_columns=["text"])
        ds = ds.map(group, batched=True, remove_columns=["input_ids"], batch_size=1000)
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()
    return ds.with_format("torch")


def train_tokenizer(texts: Sequence[str], vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2 style) trained on ``texts``, with ``<|endoftext|>`` as BOS/EOS/pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS)


# -- model -----------------------------------------------------------------------------------------------------

def build_model(cfg: TrainConfig, train_texts: Sequence[str]):
    """(model in train mode, tokenizer, source description)."""
    import transformers

    if cfg.model is not None:
        from repgeom_eval.modeling.loading import load_model

        loaded = load_model(cfg.model, dtype="float32", device="cpu")  # the Trainer moves it to its device
        model = loaded.model.train().requires_grad_(True)
        return model, loaded.tokenizer, {"kind": "continued", "model": cfg.model}
    scratch = dict(cfg.from_scratch or {})
    tok_name = scratch.pop("tokenizer")
    vocab_size = scratch.pop("vocab_size")
    if tok_name is None:
        tokenizer = train_tokenizer(train_texts, vocab_size)
    else:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(tok_name)
        except (OSError, ValueError) as exc:
            raise RepgeomError(f"cannot load tokenizer {tok_name!r}: {str(exc).splitlines()[0]}") from None
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    kwargs = dict(n_layer=scratch.pop("n_layer"), n_embd=scratch.pop("n_embd"), n_head=scratch.pop("n_head"),
                  n_positions=int(cfg.data["block_size"]), vocab_size=len(tokenizer),
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    try:
        config = transformers.GPT2Config(**kwargs, **scratch)
    except (TypeError, ValueError) as exc:
        raise RepgeomError(f"from_scratch: bad GPT-2 config: {exc}") from None
    unknown = [k for k in scratch if not hasattr(config, k)]
    if unknown:
        raise RepgeomError(f"from_scratch: {unknown} are not GPT-2 config keys (e.g. n_layer, n_embd, n_head, "
                           "vocab_size, resid_pdrop, embd_pdrop, attn_pdrop)")
    transformers.set_seed(cfg.seed)
    model = transformers.GPT2LMHeadModel(config).train()
    return model, tokenizer, {"kind": "from_scratch", "gpt2": {**kwargs, **scratch},
                              "tokenizer": tok_name or f"byte-level BPE trained on the training texts ({vocab_size})"}


# -- run -------------------------------------------------------------------------------------------------------

@dataclass
class TrainResult:
    """What ``repgeom train`` writes to ``results.json``."""

    config: dict[str, Any]
    model: dict[str, Any]
    data: dict[str, Any]
    evaluations: list[dict[str, Any]]
    train_log: list[dict[str, Any]]
    timings: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "model": self.model, "data": self.data, "evaluations": self.evaluations,
                "train_log": self.train_log, "timings": self.timings}

    def perplexity_table(self) -> list[dict[str, Any]]:
        """One row per evaluation: {step, DOMAIN: perplexity, ...}."""
        return [{"step": e["step"], **e["perplexity"]} for e in self.evaluations]


def _progress_callback():
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class TrainProgress(TrainerCallback):
        """A progress bar whose postfix shows the latest CE, aux losses and batch dispersion (no log dumps)."""

        bar = None

        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                self.bar = tqdm(total=state.max_steps, desc="train", unit="step", dynamic_ncols=True)

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


def _training_arguments(cfg: TrainConfig):
    from transformers import TrainingArguments

    kwargs = {**TRAINING_DEFAULTS, **cfg.training, "output_dir": str(cfg.output_dir / "trainer"),
              "seed": cfg.seed}
    kwargs.setdefault("data_seed", cfg.seed)
    try:
        return TrainingArguments(**kwargs), kwargs
    except TypeError as exc:
        raise RepgeomError(f"training: {exc} (keys are transformers.TrainingArguments fields)") from None
    except ValueError as exc:
        raise RepgeomError(f"training: {str(exc).splitlines()[0]}") from None


def train(cfg: TrainConfig, progress: bool = True, host: Any = None, overwrite: bool = False) -> TrainResult:
    """Run one training config end to end (see the module docstring).

    ``output_dir`` must not hold an earlier run (its ``results.json``, ``model/`` or trainer checkpoints) unless
    ``overwrite``, and nothing written there may replace an input (:func:`check_train_outputs`)."""
    import torch
    import transformers

    from repgeom_eval.training.auxloss import build_aux_loss
    from repgeom_eval.plugin_system.host import get_host
    from repgeom_eval.training.trainer import AuxLossTrainer, EvaluateAtSteps

    t_start = time.perf_counter()
    host = host or get_host()
    losses = [build_aux_loss(spec, host, where=f"aux_losses[{i}]") for i, spec in enumerate(cfg.aux_losses)]
    _check_output_dir(cfg.output_dir)  # before hours of training; created only once the data and model are ready
    check_train_outputs(cfg, overwrite)
    args, arg_kwargs = _training_arguments(cfg)
    if cfg.torch_threads is not None:
        torch.set_num_threads(cfg.torch_threads)

    # texts, per domain
    texts: dict[str, tuple[list[str], list[str]]] = {}
    for i, (name, files) in enumerate(cfg.domains.items()):
        train_set = load_texts(files["train"], text_field=cfg.data["text_field"])
        if files["eval"] is not None:
            texts[name] = (train_set.texts, load_texts(files["eval"], text_field=cfg.data["text_field"],
                                                       min_texts=1).texts)
        else:
            texts[name] = split_texts(train_set, cfg.data["eval_fraction"], cfg.seed + i)
    model, tokenizer, source = build_model(cfg, [t for tr, _ in texts.values() for t in tr])
    max_pos = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    if max_pos and cfg.data["block_size"] > max_pos:
        raise RepgeomError(f"data.block_size {cfg.data['block_size']} exceeds the model's context ({max_pos})")

    train_parts, eval_sets, data_summary = [], {}, {}
    for i, (name, (tr, ev)) in enumerate(texts.items()):
        train_ds = pack_blocks(tr, tokenizer, cfg.data["block_size"], i)
        eval_ds = pack_blocks(ev, tokenizer, cfg.data["block_size"], i) if ev else None
        if len(train_ds) == 0:
            raise RepgeomError(f"domain {name!r}: its training texts give no block of {cfg.data['block_size']} "
                               "tokens; add text or lower data.block_size")
        train_parts.append(train_ds)
        if eval_ds is not None and len(eval_ds) > 0:
            eval_sets[name] = eval_ds
        else:
            warnings.warn(f"domain {name!r} has no evaluation block of {cfg.data['block_size']} tokens; "
                          "its perplexity is not reported (give it an eval file or more text)", stacklevel=2)
        data_summary[name] = {"id": i, **{k: v for k, v in cfg.domains[name].items()}, "train_texts": len(tr),
                              "eval_texts": len(ev), "train_blocks": len(train_ds),
                              "eval_blocks": len(eval_ds) if eval_ds is not None else 0}
    if cfg.data["balance"] and len(train_parts) > 1:
        n = min(len(d) for d in train_parts)
        train_parts = [d.shuffle(seed=cfg.seed).select(range(n)) if len(d) > n else d for d in train_parts]
        for name, d in zip(data_summary, train_parts):
            data_summary[name]["train_blocks_used"] = len(d)
    import datasets

    train_ds = datasets.concatenate_datasets(train_parts) if len(train_parts) > 1 else train_parts[0]

    steps = [s for s in cfg.evaluate_at if args.max_steps <= 0 or s <= args.max_steps]
    # processing_class: the Trainer saves the tokenizer into every checkpoint it writes (training.save_strategy:
    # steps), so each output_dir/trainer/checkpoint-N is a model folder that loads on its own (repgeom gap, lm_eval).
    # The collator is named because a tokenizer would otherwise make the Trainer pad with DataCollatorWithPadding;
    # the blocks are already of equal length, and default_data_collator is what it used without a tokenizer.
    trainer = AuxLossTrainer(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_sets or None,
                             processing_class=tokenizer, data_collator=transformers.default_data_collator,
                             aux_losses=losses, dispersion_layer=cfg.dispersion_layer, host=host,
                             callbacks=[EvaluateAtSteps(steps)] if eval_sets else None)  # checks the addresses
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    if overwrite:  # the earlier run's checkpoints go: a later checkpoint-N of it would pass for one of this run
        shutil.rmtree(cfg.output_dir / "trainer", ignore_errors=True)
    # The Trainer prints every log dict (PrinterCallback) or writes it under its bar (ProgressCallback); one bar
    # with the running CE / aux / dispersion says the same without flooding the terminal.
    trainer.remove_callback(transformers.PrinterCallback)
    trainer.remove_callback(transformers.ProgressCallback)
    if progress:
        trainer.add_callback(_progress_callback())
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the Trainer's info/warnings (loss_type, ...) are not for users
    try:
        t0 = time.perf_counter()
        trainer.train()
        t_train = time.perf_counter() - t0
    finally:
        transformers.logging.set_verbosity(verbosity)

    evaluations = _evaluations(trainer.state.log_history, list(eval_sets))
    train_log = [row for row in trainer.state.log_history if "loss" in row and "ce" in row]
    if cfg.save_model:
        _save_model(trainer, tokenizer, cfg.output_dir / "model")
    from repgeom_eval.modeling.loading import wrap_model

    info = wrap_model(trainer.accelerator.unwrap_model(trainer.model), name=cfg.model or "gpt2 (from scratch)",
                      source=source["kind"], host=host).info
    config = {
        "model": cfg.model, "from_scratch": cfg.from_scratch, "source": source,
        "data": {**cfg.data, "domains": cfg.domains},
        "aux_losses": [loss.get_config_dict() for loss in losses],
        "plugins": host.provenance("aux_loss", [loss.name for loss in losses]),  # docs/plugins.md#provenance
        "objective": "CE + " + " + ".join(f"{loss.weight}·{loss.name}" for loss in losses) if losses else "CE",
        "training": {k: v for k, v in arg_kwargs.items() if k != "output_dir"},
        "evaluate_at": steps, "dispersion_layer": cfg.dispersion_layer, "seed": cfg.seed,
        "torch_threads": cfg.torch_threads or torch.get_num_threads(),
        "output_dir": str(cfg.output_dir), "save_model": cfg.save_model,
        "versions": {"repgeom_eval": __version__, "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
    }
    timings = {"total_s": time.perf_counter() - t_start, "train_s": t_train,
               "steps": trainer.state.global_step,
               "s_per_step": t_train / max(trainer.state.global_step, 1)}
    result = TrainResult(config, info.to_dict(), data_summary, evaluations, train_log, timings)
    write_json(cfg.output_dir / "results.json", result.to_dict())
    return result


def check_train_outputs(cfg: TrainConfig, overwrite: bool = False, config_file: str | Path | None = None) -> None:
    """Refuse, before any work, an ``output_dir`` whose outputs would replace an input (a data file, the model or
    tokenizer being read, the config file) or lie inside the model folder, and one that holds an earlier run's
    results or model, unless ``overwrite`` (``repgeom train --overwrite``)."""
    from repgeom_eval.modeling.loading import model_inputs
    from repgeom_eval.output.files import check_outputs

    out = cfg.output_dir
    written = [out / "results.json", out / "trainer"] + ([out / "model"] if cfg.save_model else [])
    inputs: dict[str, Any] = {"--config": config_file}
    folders: dict[str, Any] = {}
    for name, files in cfg.domains.items():
        for kind, path in files.items():
            inputs[f"data.domains.{name}.{kind}"] = path
    for label, model in (("model", cfg.model), ("from_scratch.tokenizer", (cfg.from_scratch or {}).get("tokenizer"))):
        if model:
            model_files, model_dirs = model_inputs(str(model))
            inputs[label], folders[label] = model_files, model_dirs
    check_outputs({"output_dir": written}, inputs=inputs, folders=folders)
    trainer = out / "trainer"
    earlier = [p.name for p in (out / "results.json", out / "model") if p.exists()]
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


def _evaluations(history: list[dict[str, Any]], domains: list[str]) -> list[dict[str, Any]]:
    """Group the Trainer's per-dataset eval logs by step: [{step, loss: {domain: ..}, perplexity: {domain: ..}}]."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in history:
        for name in domains:
            key = f"eval_{name}_loss"
            if key in row:
                entry = by_step.setdefault(row["step"], {"step": row["step"], "loss": {}, "perplexity": {}})
                entry["loss"][name] = row[key]
                entry["perplexity"][name] = math.exp(row[key]) if row[key] < 700 else math.inf
    return [by_step[s] for s in sorted(by_step)]


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
