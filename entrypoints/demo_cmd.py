"""``repgeom demo``: the main job on an embedded default, no arguments needed."""

from __future__ import annotations

import argparse
from pathlib import Path


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-dir", default="repgeom-demo", help="where results.json and the plot go "
                                                                 "(default: ./repgeom-demo)")
    p.add_argument("--n-texts", type=int, default=96, help="paragraphs of pydoc_data.topics (default 96)")
    p.add_argument("--max-length", type=int, default=192, help="tokens per text (default 192)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--model", default=None, help="override the model (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--dtype", default="auto")


def run(args: argparse.Namespace) -> int:
    import sys

    from rich.console import Console

    from repgeom_eval.demo import python_doc_paragraphs, smollm2_path
    from repgeom_eval.pipeline import measure
    from repgeom_eval.plotting import plot_profile
    from repgeom_eval.report import results_table

    console = Console()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model or str(smollm2_path())
    texts = python_doc_paragraphs(args.n_texts)
    console.print(f"[bold]repgeom demo[/bold]: {Path(model).name} over {len(texts)} paragraphs of the Python docs "
                  f"(pydoc_data.topics), every hidden state, pooling=last")
    result = measure(model, texts, layers="all", metrics=["dispersion", "token_dispersion"], pooling="last",
                     batch_size=args.batch_size, max_length=args.max_length, dtype=args.dtype,
                     progress=sys.stderr.isatty())
    result.data["path"] = "pydoc_data.topics (paragraphs)"
    result.write(out / "results.json")
    plot = plot_profile(result.to_dict(), out / "dispersion_profile.png")
    console.print(results_table(result.results, title=f"dispersion by depth · {result.timings['total_s']:.0f}s"))
    console.print(f"results: {out / 'results.json'}\nplot:    {plot}")
    return 0
