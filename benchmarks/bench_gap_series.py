"""Benchmark: screening a series of large checkpoints with `repgeom gap` vs loading every model.

The point of the dispersion gap is to rank checkpoints without a forward pass. This script writes a series of
random Llama checkpoints of about 1.1 B parameters each (``--params`` picks the size), sharded safetensors in
bfloat16 with an index file, as published models are (the tensors are written shard by shard from the shapes of a
meta-device model, so writing needs little memory), then times, each in a fresh process:

  gap     ``repgeom gap --models CKPT_1 ... CKPT_n`` (tokenizer, the output projection located through the index,
          only the |T ∪ T̄| rows read from its shard, G per model, the ranking, the JSON)
  load    what screening costs when each model is loaded instead: ``AutoModelForCausalLM.from_pretrained`` of each
          checkpoint in turn, every weight read once (``p.sum()``, as a forward pass would), W taken from the model,
          G computed by the same code; one model in memory at a time

for one checkpoint and for the whole series, and prints time and peak RSS (VmHWM) of each and their ratios
(target: gap ≥ 10× faster, ≤ 1/10 of the memory). The page cache is dropped before each child when the kernel lets
us (root); otherwise the series is larger than memory anyway and the first reads of each run come from disk.

    .venv/bin/python benchmarks/bench_gap_series.py                   # 10 checkpoints of ~1.1 B (about 22 GB)
    .venv/bin/python benchmarks/bench_gap_series.py --n 3 --params small
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

SIZES = {  # hidden, layers, intermediate, heads, kv heads, vocab
    "1b": (2048, 16, 8192, 32, 8, 32000),
    "small": (512, 4, 1408, 8, 4, 8000),
}


def _peak_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def write_series(root: str, n: int, size: str) -> tuple[list[str], int, float]:
    """``n`` random checkpoints under ``root``; returns their folders, the parameter count and GB per checkpoint."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from repgeom_eval.testing import make_tokenizer, tiny_config

    hidden, layers, inter, heads, kv, vocab = SIZES[size]
    tok = make_tokenizer()
    cfg = tiny_config("llama", vocab, n_layers=layers, width=hidden)
    cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads = inter, heads, kv
    cfg.head_dim = hidden // heads
    cfg.tie_word_embeddings = False
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    n_params = sum(int(torch.Size(s).numel()) for s in shapes.values())
    budget = 1 << 30  # bytes per shard, as save_pretrained's default
    folders = []
    for i in range(n):
        folder = os.path.join(root, f"ckpt-{i:02d}")
        os.makedirs(folder)
        cfg.save_pretrained(folder)
        tok.save_pretrained(folder)
        gen = torch.Generator().manual_seed(i)
        shards: list[dict[str, torch.Tensor]] = [{}]
        size_now = 0
        for name, shape in shapes.items():
            t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
            if size_now and size_now + t.numel() * 2 > budget:
                shards.append({})
                size_now = 0
            shards[-1][name] = t
            size_now += t.numel() * 2
        weight_map = {}
        for j, shard in enumerate(shards):
            fname = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(folder, fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {"total_size": n_params * 2}, "weight_map": weight_map}, fh)
        folders.append(folder)
    gb = sum(os.path.getsize(os.path.join(folders[0], f)) for f in os.listdir(folders[0])) / 1e9
    return folders, n_params, gb


def child(mode: str, folders: list[str]) -> None:
    import torch
    import transformers  # noqa: F401 - imported before the clock in every mode

    torch.set_num_threads(2)
    from repgeom_eval.analyses.gap import screening
    from repgeom_eval.modeling.checkpoint_tensors import EmbeddingInfo, OutputEmbeddings
    from repgeom_eval.entrypoints import gap_cmd

    t0 = time.perf_counter()
    if mode == "load":
        from transformers import AutoModelForCausalLM

        def open_via_model(name):
            model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)
            with torch.no_grad():
                for p in model.parameters():
                    p.sum()  # page every weight in, as any forward pass would
            W = model.get_output_embeddings().weight.detach()
            info = EmbeddingInfo(model=name, path=name, source="from_pretrained", tensor="lm_head", file="",
                                 tied=None, shape=tuple(W.shape), dtype=str(W.dtype), found_by="full load")
            return OutputEmbeddings(info, lambda ids, _w=W: _w[ids], lambda _w=W: _w)

        screening.open_output_embeddings = open_via_model
    parser = argparse.ArgumentParser()
    gap_cmd.configure(parser)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "gap.json")
        gap_cmd.run(parser.parse_args(["--models", *folders, "--domain", "digits", "--output", out]))
        with open(out) as fh:
            g = [row["G"] for row in json.load(fh)["results"]]
    print("BENCH " + json.dumps({"seconds": time.perf_counter() - t0, "peak_kib": _peak_kib(), "G": g}))


def run_child(mode: str, folders: list[str]) -> dict:
    dropped = _drop_caches()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, *folders],
                          capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"child {mode!r} failed with status {proc.returncode}")
    return json.loads(lines[-1][len("BENCH "):]) | {"cold": dropped}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs="+", metavar="ARG", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=10, help="checkpoints in the series (default 10)")
    ap.add_argument("--params", choices=sorted(SIZES), default="1b", help="checkpoint size (default 1b: ~1.1 B)")
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary folder)")
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1:])
        return
    with tempfile.TemporaryDirectory(prefix="bench-gap-series-", dir=args.dir) as root:
        t0 = time.perf_counter()
        folders, n_params, gb = write_series(root, args.n, args.params)
        print(f"{args.n} random Llama checkpoints of {n_params / 1e9:.2f} B parameters, bfloat16, sharded "
              f"safetensors ({gb:.1f} GB each), written in {time.perf_counter() - t0:.0f} s; 2 threads\n")
        print(f"{'checkpoints':<12} {'mode':<5} {'time (s)':>9} {'peak RSS (MiB)':>15} {'cold cache':>11}")
        for label, subset in (("1", folders[:1]), (str(len(folders)), folders)):
            res = {mode: run_child(mode, subset) for mode in ("gap", "load")}
            for mode, r in res.items():
                print(f"{label:<12} {mode:<5} {r['seconds']:>9.2f} {r['peak_kib'] / 1024:>15.0f} {str(r['cold']):>11}")
            print(f"{'':<12} load / gap: time {res['load']['seconds'] / res['gap']['seconds']:.1f}x, "
                  f"peak RSS {res['load']['peak_kib'] / res['gap']['peak_kib']:.1f}x; "
                  f"G equal: {res['gap']['G'] == res['load']['G']}\n")


if __name__ == "__main__":
    main()
