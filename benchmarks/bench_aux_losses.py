"""Benchmark: the step-time cost of auxiliary losses in training, at 16k tokens per batch.

One training step = forward with labels (CE) -> + λ·L_aux from the hidden states captured in the same pass ->
backward -> AdamW step, done exactly as :class:`repgeom_eval.training.trainer.AuxLossTrainer.compute_loss` does it
(``Capture(..., stop_early=False, keep_grad=True)`` on the loss's addresses, the loss object built from its config
by ``build_aux_loss``). Modes, interleaved repeat by repeat so that load from other processes hits all alike:

1. ``ce``: CE only (no hooks);
2. ``push_away``: token push-away at ``final``, all B·T vectors, O(N·d) sum identity
   (docs/metrics.md#push_away-and-squeeze);
3. ``push_away_cross``: the same, cross-domain (half the batch domain 0, half domain 1), the experiment's setting;
4. ``angular_spread``: paper C's loss with its default sampling (256 tokens per sequence) at ``final``;
5. ``pairwise``: the naive push-away, ``push_away_pairwise`` (the N×N cosine matrix, N = B·T), for contrast.

Printed: per mode the median wall time and the median process CPU time of a step, their ratios to ``ce`` (target
for push_away: <= 1.05), the aux-loss value, and the rise of the process's peak RSS during the first ``pairwise``
step (the N×N matrix and its gradient), and ("alone") the CPU time of the loss's forward + backward by itself on
a [B, T, d] tensor, as a fraction of the CE-only step: the loss's own cost, which step-to-step noise hides. The order of the modes is shuffled (seeded) in every repeat. On a machine
shared with other work, wall time measures the load as much as the step; CPU time (``time.process_time``, all of
this process's threads) does not, so its ratio is the one to read there (run with ``--threads 1``: with more,
OpenMP threads spinning while they wait for a core count as CPU time too).

The model is the push-away experiment's GPT-2 (4 blocks of width 128, vocabulary 4096; ``--n-layer``,
``--n-embd`` change it), random weights and random token ids (timing does not depend on them). The overhead of a
loss on one layer is a smaller fraction of a bigger model's step.

    .venv/bin/python benchmarks/bench_aux_losses.py              # 32 x 512 = 16,384 tokens: 2 to 5 min on 2 cores
    .venv/bin/python benchmarks/bench_aux_losses.py --quick      # 8 x 128 tokens, seconds: checks that it runs
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from repgeom_eval.modeling.addresses import resolve  # noqa: E402
from repgeom_eval.training.auxloss import AuxLoss, build_aux_loss  # noqa: E402
from repgeom_eval.modeling.hooks import Capture  # noqa: E402
from repgeom_eval.functional.losses import push_away_pairwise  # noqa: E402
from repgeom_eval.modeling.loading import wrap_model  # noqa: E402


class PairwisePushAway(AuxLoss):
    """The naive push-away (N×N cosine matrix), for contrast only; not registered."""

    name = "push_away_pairwise"

    def compute_loss_from_hidden(self, hidden, mask, domains):
        return -push_away_pairwise(hidden, mask)


MODES = {
    "ce": None,
    "push_away": {"name": "push_away", "weight": 0.1},
    "push_away_cross": {"name": "push_away", "weight": 0.01, "cross_domain": True},
    "angular_spread": {"name": "angular_spread", "weight": 0.1},
    "pairwise": "pairwise",
}


def make_step(model, loaded, optimizer, batch, spec):
    """(a closure running one training step and returning the aux-loss value or None, the loss object or None)."""
    loss_obj = None if spec is None else PairwisePushAway(weight=0.1) if spec == "pairwise" else build_aux_loss(spec)
    points = resolve(loss_obj.addresses(loaded.info), loaded) if loss_obj is not None else {}

    def step():
        optimizer.zero_grad(set_to_none=True)
        if loss_obj is None:
            total, aux = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss, None
        else:
            with Capture(model, points, stop_early=False, keep_grad=True) as cap:
                ce = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
                hidden = cap.tensors()
            aux = loss_obj(hidden, batch["attention_mask"], batch["domain"])
            total = ce + loss_obj.weight * aux
        total.backward()
        optimizer.step()
        return None if aux is None else float(aux.detach())

    return step, loss_obj


def isolated_cpu_s(loss_obj, batch, d: int, repeats: int) -> float:
    """Median CPU seconds of L_aux forward + backward alone on a [B, T, d] tensor: the loss's own cost, free of
    the step-to-step noise of the model's forward and backward."""
    b, t = batch["input_ids"].shape
    h = torch.randn(b, t, d, requires_grad=True)
    times = []
    for _ in range(repeats + 1):
        c0 = time.process_time()
        loss_obj(h, batch["attention_mask"], batch["domain"]).backward()
        times.append(time.process_time() - c0)
        h.grad = None
    return statistics.median(times[1:])


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per mode, after one warm-up step")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-pairwise", action="store_true", help="skip the N×N contrast (about 4 GB at N = 16k)")
    ap.add_argument("--quick", action="store_true", help="8 x 128 tokens, 2 repeats")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.seq_len, args.repeats = 8, 128, 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=args.n_layer, n_embd=args.n_embd, n_head=max(args.n_embd // 32, 1),
                     vocab_size=args.vocab, n_positions=max(args.seq_len, 128), bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).train()
    loaded = wrap_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n_params = sum(p.numel() for p in model.parameters())
    b, t = args.batch, args.seq_len
    batch = {"input_ids": torch.randint(0, args.vocab, (b, t)), "attention_mask": torch.ones(b, t, dtype=torch.long),
             "domain": torch.arange(b) % 2}
    modes = {k: v for k, v in MODES.items() if not (k == "pairwise" and args.no_pairwise)}
    print(f"model: GPT-2, {args.n_layer} blocks, width {args.n_embd}, vocab {args.vocab}, {n_params:,} parameters; "
          f"batch {b} x {t} = {b * t:,} tokens; {args.threads} torch threads; median of {args.repeats} steps "
          "after 1 warm-up, modes interleaved")
    built = {name: make_step(model, loaded, optimizer, batch, spec) for name, spec in modes.items()}
    steps = {name: step for name, (step, _) in built.items()}
    wall: dict[str, list[float]] = {name: [] for name in modes}
    cpu: dict[str, list[float]] = {name: [] for name in modes}
    values: dict[str, float | None] = {}
    rss_rise = None
    order, rng = list(modes), random.Random(0)
    for rep in range(args.repeats + 1):
        rng.shuffle(order)
        for name in order:
            before = peak_rss_gb()
            w0, c0 = time.perf_counter(), time.process_time()
            values[name] = steps[name]()
            w1, c1 = time.perf_counter(), time.process_time()
            if name == "pairwise" and rep == 0:
                rss_rise = peak_rss_gb() - before
            if rep > 0:
                wall[name].append(w1 - w0)
                cpu[name].append(c1 - c0)
    wall_ce, cpu_ce = statistics.median(wall["ce"]), statistics.median(cpu["ce"])
    alone = {name: isolated_cpu_s(obj, batch, args.n_embd, 5) for name, (_, obj) in built.items() if obj is not None}
    print(f"\n{'mode':<17}{'wall s':>8}{'x ce':>8}{'CPU s':>8}{'x ce':>8}{'L_aux':>10}{'alone CPU s':>13}{'/ ce':>8}")
    for name in modes:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        value = "-" if values[name] is None else f"{values[name]:.4f}"
        solo = f"{alone[name]:>13.4f}{alone[name] / cpu_ce * 100:>7.2f}%" if name in alone else f"{'-':>13}{'-':>8}"
        print(f"{name:<17}{w:>8.3f}{w / wall_ce:>8.3f}{c:>8.3f}{c / cpu_ce:>8.3f}{value:>10}{solo}")
    for label, table, base in (("wall", wall, wall_ce), ("CPU", cpu, cpu_ce)):
        ratio = statistics.median(table["push_away"]) / base
        print(f"push_away overhead over CE-only ({label} time): {(ratio - 1) * 100:+.1f}% (target <= 5%): "
              f"{'OK' if ratio <= 1.05 else 'ABOVE TARGET'}")
    if rss_rise is not None:
        print(f"pairwise: peak RSS rose {rss_rise:.2f} GB during its first step (N = {b * t:,}: the N×N matrix is "
              f"{(b * t) ** 2 * 4 / 2**30:.2f} GB in float32); push_away forms no N×N matrix")
    print("timings on a shared machine are noisy; ratios of interleaved steps are the number to read")


if __name__ == "__main__":
    main()
