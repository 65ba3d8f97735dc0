"""The precision matrix: model type × dtype × surface → labels equal to float32's, and the largest value difference.

Twelve model types at tiny size, made realistic where half precision breaks (``make_realistic``: norm gains spread
over 0.4–2.5, one massive hidden dimension), plus SmolLM2-135M (``--smollm2``). Each is loaded in float32, bfloat16
and float16 and measured through

* ``measure``: ``dispersion`` and ``token_dispersion`` (mean pooling) at every hidden state;
* the MTEB sweep (what ``repgeom mteb run`` runs): ``repgeom.dispersion`` of the embeddings of a local STS task at
  every hidden state;
* ``repgeom-hf`` (causal types, SmolLM2 from its de-quantized GGUF cache folder): ``repgeom:dispersion@ADDRESS``
  over a local lm-eval task at every hidden state.

"labels equal" means the load check's layout (what each hidden_states[k] is called, where each site is read) and the
addresses each surface reports are float32's; "max |Δ|" is the largest absolute difference from float32's value at
the same address (docs/metrics.md#precision states 0.02 for bfloat16 and 0.005 for float16).

    .venv/bin/python benchmarks/precision_matrix.py              # tiny types, about 3 minutes on 2 cores
    .venv/bin/python benchmarks/precision_matrix.py --smollm2    # and SmolLM2 (about 5 minutes more)

Writes benchmarks/results/precision_matrix.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

DTYPES = ("float32", "bfloat16", "float16")
TYPES = {"gpt2": "causal", "llama": "causal", "qwen3": "causal", "mixtral": "causal", "opt": "causal",
         "gemma2": "causal", "gpt_neox": "causal", "phi": "causal", "falcon": "causal", "t5": "encoder",
         "bert": "encoder", "roberta-prelayernorm": "encoder"}
TEXTS = ["The quick brown fox jumps over the lazy dog near the river bank today.", "Short text.",
         "Numbers such as 3 and 4 appear here, in a sentence of middling length.", "x y z",
         "Another sentence, of ordinary words, to pad the batch out a little further."]
RESULT = Path(__file__).parent / "results" / "precision_matrix.json"
LM_PAIRS = [("the cat sat on", "mat"), ("dogs ran over green", "hills"), ("birds sang near old", "towns"),
            ("a quick brown fox", "jumps"), ("numbers like three and", "four"), ("rain fell on the", "roof")]


def signature(layout) -> tuple:
    return (layout.hidden_states, str(layout.embed.point), str(layout.final.point),
            tuple((s, str(site.point), site.verified) for block in layout.sites for s, site in block.items()))


def surface_measure(path: str, dtype: str, texts: list[str]) -> dict[str, float]:
    import repgeom_eval as rg

    result = rg.measure(path, texts, layers="all", metrics=["dispersion", "token_dispersion"], pooling="mean",
                        dtype=dtype, batch_size=4, progress=False)
    return {f"{m}@{a}": v for a, values in result.results.items() for m, v in values.items()}


def surface_mteb(path: str, dtype: str, task) -> dict[str, float]:
    from repgeom_eval.mteb_layers import run_layers

    result = run_layers(path, [task()], "all", pooling="mean", output_folder=None, progress=False,
                        metrics=["dispersion"], dtype=dtype, batch_size=8)
    return {f"dispersion@{row['layer']}": row["repgeom.dispersion"] for row in result.rows}


def surface_lm_eval(path: str, dtype: str, task_dir: Path) -> dict[str, float]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from repgeom_eval.lmeval.model import RepgeomHFLM

    lm = RepgeomHFLM(pretrained=path, batch_size=3, device="cpu", dtype=dtype, repgeom_metrics="dispersion",
                     repgeom_layers="all", repgeom_pooling="mean")
    out = simple_evaluate(model=lm, tasks=["rg_precision"], bootstrap_iters=0,
                          task_manager=TaskManager(include_defaults=False, include_path=str(task_dir)))
    return {k.removesuffix(",none"): v for k, v in out["results"]["rg_precision"].items()
            if k.startswith("repgeom:dispersion@") and isinstance(v, float)}


def compare(values: dict[str, dict[str, float]]) -> dict[str, dict]:
    ref = values["float32"]
    out = {}
    for dtype in DTYPES[1:]:
        got = values[dtype]
        same = list(got) == list(ref)
        diff = max((abs(got[k] - ref[k]) for k in ref if k in got), default=float("nan"))
        out[dtype] = {"addresses_equal": same, "n_addresses": len(got), "max_abs_diff": diff}
    return out


def row_for(name: str, path: str, kind: str, task, task_dir: Path, texts: list[str], lm_eval: bool) -> dict:
    from repgeom_eval.modeling.loading import load_model

    row: dict = {"model": name, "kind": kind}
    t0 = time.perf_counter()
    sigs = {dtype: signature(load_model(path, dtype=dtype).layout) for dtype in DTYPES}
    row["labels_equal"] = {dtype: sigs[dtype] == sigs["float32"] for dtype in DTYPES[1:]}
    surfaces = {"measure": lambda d: surface_measure(path, d, texts), "mteb": lambda d: surface_mteb(path, d, task)}
    if lm_eval and kind == "causal":
        surfaces["repgeom-hf"] = lambda d: surface_lm_eval(path, d, task_dir)
    row["surfaces"] = {s: compare({d: run(d) for d in DTYPES}) for s, run in surfaces.items()}
    row["seconds"] = time.perf_counter() - t0
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | dtype | labels equal | measure: addresses equal, max abs diff | MTEB sweep | repgeom-hf |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        for dtype in DTYPES[1:]:
            cells = []
            for s in ("measure", "mteb", "repgeom-hf"):
                c = row["surfaces"].get(s, {}).get(dtype)
                cells.append("—" if c is None else f"{'yes' if c['addresses_equal'] else 'NO'} "
                                                   f"({c['n_addresses']}), {c['max_abs_diff']:.1e}")
            lines.append(f"| {row['model']} | {dtype} | {'yes' if row['labels_equal'][dtype] else 'NO'} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smollm2", action="store_true", help="add SmolLM2-135M")
    parser.add_argument("--types", nargs="*", default=list(TYPES), help="tiny model types (default: all twelve)")
    parser.add_argument("--no-lm-eval", action="store_true", help="skip the repgeom-hf surface")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    import transformers

    from repgeom_eval.mteb_layers import make_task
    from repgeom_eval.mteb_layers.examples import build_tasks, pydoc_documents
    from repgeom_eval.testing.tiny_models import save_tiny

    spec = build_tasks(pydoc_documents(), "pydoc", size="small", seed=0)["PydocSTS"]

    def task():
        return make_task({"name": "PydocSTS", **spec})

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        from repgeom_eval.testing import write_lm_eval_task

        task_dir = write_lm_eval_task(Path(tmp) / "lm-task", "rg_precision", LM_PAIRS)
        for model_type in args.types:
            path = str(save_tiny(model_type, Path(tmp) / model_type, TYPES[model_type], realistic=True))
            rows.append(row_for(f"tiny {model_type}", path, TYPES[model_type], task, task_dir, TEXTS,
                                not args.no_lm_eval))
            print(f"{model_type}: {rows[-1]['seconds']:.0f} s", flush=True)
        if args.smollm2:
            from repgeom_eval.testing.demo import python_doc_paragraphs, smollm2_path

            from repgeom_eval.modeling.gguf_cache import gguf_cache_dir
            from repgeom_eval.modeling.loading import load_model

            gguf = str(smollm2_path())
            load_model(gguf)  # de-quantizes once into the GGUF cache, a plain model folder lm-eval's HFLM can read
            folder = gguf_cache_dir(Path(gguf))
            row = row_for("SmolLM2-135M", gguf, "causal", task, task_dir, python_doc_paragraphs(16, max_chars=400),
                          False)
            if not args.no_lm_eval and folder is not None:
                row["surfaces"]["repgeom-hf"] = compare({d: surface_lm_eval(str(folder), d, task_dir)
                                                         for d in DTYPES})
            rows.append(row)
    doc = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU", "transformers": transformers.__version__,
           "tolerance": {"bfloat16": 0.02, "float16": 0.005}, "rows": rows}
    RESULT.parent.mkdir(exist_ok=True)
    RESULT.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(rows))
    bad = [r["model"] for r in rows if not all(r["labels_equal"].values()) or any(
        not c["addresses_equal"] or c["max_abs_diff"] > doc["tolerance"][d]
        for s in r["surfaces"].values() for d, c in s.items())]
    print(f"\n{len(rows)} models; outside the stated tolerance or relabelled: {', '.join(bad) or 'none'}")


if __name__ == "__main__":
    main()
