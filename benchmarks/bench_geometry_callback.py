"""Benchmark: the cost of :class:`repgeom_eval.training.GeometryCallback` per saved checkpoint, against a training step.

A plain ``transformers.Trainer`` trains the push-away experiment's GPT-2 (4 blocks of width 128, vocabulary 4096;
``--n-layer``, ``--n-embd`` change it) from random weights on blocks of Python's own documentation, with a byte-level
BPE trained on the same text (as ``repgeom train``'s ``from_scratch``). It saves a checkpoint every ``--save-steps``
steps (model only) with the callback attached: at each save it computes G (cosine and Euclidean; T = ``digits``,
T̄ = ``general``, 1000 tokens) and the dispersion of ``--probe-texts`` probe texts at ``final`` and
``resid_post:1``, rewrites ``geometry_by_checkpoint.json`` and logs through ``trainer.log``.

Timed, every one from this run's clocks (wall: ``time.perf_counter``; CPU: ``time.process_time``, all threads of
this process, the figure to read on a machine shared with other work):

* a training step: ``on_step_begin`` → ``on_step_end`` (forward, backward, optimizer), saves excluded;
* the callback's whole ``on_save`` (measure + JSON + log), and its parts (G, probe forward) from the JSON record;
* the Trainer's own checkpoint write, for scale: from ``on_step_end`` to the end of ``on_save`` of a step that
  saved, less the callback's ``on_save``.

Printed: medians over the saves (the first save, which also runs the one-time set-up, is reported apart), and the
callback's time per save as a fraction of one training step and, amortised, of the ``--save-steps`` steps between
saves.

    .venv/bin/python benchmarks/bench_geometry_callback.py            # 60 steps, a save every 5: about a minute
    .venv/bin/python benchmarks/bench_geometry_callback.py --quick    # 10 steps: seconds, checks that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import (GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments, default_data_collator)

from repgeom_eval.training import GeometryCallback, pack_blocks  # noqa: E402
from repgeom_eval.training.geometry import FILE_NAME  # noqa: E402
from repgeom_eval.training.model import train_tokenizer  # noqa: E402


def corpus() -> list[str]:
    from pydoc_data.topics import topics

    return [" ".join(topics[k].split()) for k in sorted(topics)]


class Clock(TrainerCallback):
    """Step times (saves excluded) and the time from a step's end to the end of its save."""

    def __init__(self):
        self.steps, self.steps_cpu, self.after_step, self.save_total = [], [], {}, []

    def on_step_begin(self, args, state, control, **kwargs):
        self._t, self._c = time.perf_counter(), time.process_time()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.steps.append(now - self._t)
        self.steps_cpu.append(time.process_time() - self._c)
        self.after_step[state.global_step] = now

    def on_save(self, args, state, control, **kwargs):  # runs after the GeometryCallback's on_save
        self.save_total.append(time.perf_counter() - self.after_step[state.global_step])


class TimedGeometry(GeometryCallback):
    """The callback, with its whole on_save timed (wall and CPU)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.wall, self.cpu = [], []

    def on_save(self, *args, **kwargs):
        t, c = time.perf_counter(), time.process_time()
        super().on_save(*args, **kwargs)
        self.wall.append(time.perf_counter() - t)
        self.cpu.append(time.process_time() - c)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10 steps, a save every 2 (checks that it runs)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--save-steps", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--probe-texts", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    if a.quick:
        a.steps, a.save_steps, a.probe_texts = 10, 2, 8
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)

    texts = corpus()
    tok = train_tokenizer(texts, a.vocab_size)
    model = GPT2LMHeadModel(GPT2Config(n_layer=a.n_layer, n_embd=a.n_embd, n_head=4, vocab_size=len(tok),
                                       n_positions=max(a.block_size, 128), bos_token_id=tok.bos_token_id,
                                       eos_token_id=tok.eos_token_id))
    blocks = pack_blocks(texts, tok, a.block_size, 0)
    probe = [" ".join(t.split()[:64]) for t in texts[: a.probe_texts]]

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=a.steps, per_device_train_batch_size=a.batch_size,
                                 learning_rate=1e-3, save_strategy="steps", save_steps=a.save_steps,
                                 save_only_model=True, logging_steps=10**6, report_to="none", use_cpu=True,
                                 disable_tqdm=True, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=blocks, processing_class=tok,
                          data_collator=default_data_collator)
        trainer.remove_callback(PrinterCallback)  # no log dicts on the screen
        geometry = TimedGeometry(texts=probe, layers=["final", "resid_post:1"], domain="digits",
                                 reference="general", size=1000, burn_in=0.5).attach(trainer)
        clock = Clock()
        trainer.add_callback(clock)  # after the geometry callback: its on_save sees the save completed
        t0 = time.perf_counter()
        geometry.setup(model, tok)
        setup_s = time.perf_counter() - t0
        trainer.train()
        record = json.loads((Path(out) / FILE_NAME).read_text())

    step, step_cpu = statistics.median(clock.steps), statistics.median(clock.steps_cpu)
    rest = slice(1, None) if len(geometry.wall) > 1 else slice(None)
    cb, cb_cpu = statistics.median(geometry.wall[rest]), statistics.median(geometry.cpu[rest])
    parts = record["checkpoints"][rest]
    gap_s = statistics.median(r["timings"]["gap_s"] for r in parts)
    probe_s = statistics.median(r["timings"]["probe_s"] for r in parts)
    ckpt = statistics.median(t - g for t, g in zip(clock.save_total[rest], geometry.wall[rest]))
    cfg = record["config"]
    print(f"model: GPT-2 {a.n_layer} blocks x {a.n_embd}, vocabulary {len(tok)}; batch {a.batch_size} x "
          f"{a.block_size} tokens; {a.steps} steps, a save every {a.save_steps} ({len(geometry.wall)} saves); "
          f"torch threads {a.threads}")
    print(f"probe: {cfg['n_texts']} texts at {', '.join(cfg['addresses'])}; G: |T| = {cfg['n_T']} "
          f"({cfg['domain']}), |T̄| = {cfg['n_Tbar']} ({cfg['reference']})")
    print(f"one-time set-up (texts, addresses, token sets), before training: {setup_s * 1e3:.1f} ms")
    print(f"training step (median):                  {step * 1e3:9.1f} ms wall  {step_cpu * 1e3:9.1f} ms CPU")
    print(f"callback per save (median, first apart): {cb * 1e3:9.1f} ms wall  {cb_cpu * 1e3:9.1f} ms CPU "
          f"(G {gap_s * 1e3:.1f} ms, probe forward {probe_s * 1e3:.1f} ms); first save {geometry.wall[0] * 1e3:.1f} ms")
    print(f"Trainer's own checkpoint write (median): {ckpt * 1e3:9.1f} ms wall")
    print(f"callback per save / training step:       {cb / step:9.3f} wall  {cb_cpu / step_cpu:9.3f} CPU")
    print(f"amortised over {a.save_steps} steps per save:        {cb / (a.save_steps * step):9.4f} wall  "
          f"{cb_cpu / (a.save_steps * step_cpu):9.4f} CPU")
    pick = record["pick"]
    print(f"pick: step {pick['step']} (G cosine {pick['G_cosine']}); rule: {pick['rule']}")


if __name__ == "__main__":
    main()
