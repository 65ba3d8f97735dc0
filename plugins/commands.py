"""Built-in ``repgeom`` sub-commands. The glue lives in ``repgeom_eval.entrypoints``; it is imported lazily."""

from __future__ import annotations

import importlib

from repgeom_eval import Command, hookimpl


def _lazy(module: str) -> tuple:
    def configure(parser):
        importlib.import_module(f"repgeom_eval.entrypoints.{module}").configure(parser)

    def run(args):
        return importlib.import_module(f"repgeom_eval.entrypoints.{module}").run(args)

    return configure, run


COMMANDS = {
    "measure": ("measure_cmd", "Measure geometry metrics at layer addresses over a text file."),
    "plugins": ("plugins_cmd", "List registered metrics, architectures, selectors, commands and failed plugins."),
    "addresses": ("addresses_cmd", "Show the layer addresses a model supports and the module each one hooks."),
    "demo": ("demo_cmd", "Dispersion profile of SmolLM2-135M over text that ships with Python (no arguments)."),
    "gap": ("gap_cmd", "Rank checkpoints by the dispersion gap G of their output projection (no forward pass)."),
    "ppl-bins": ("ppl_bins_cmd", "Perplexity vs token dispersion over corpus chunks, Algorithm 1 binning (paper A)."),
    "knn-keys": ("knn_keys_cmd", "Rank kNN-LM key addresses by the dispersion of last-token vectors (paper A Table 1)."),
    "knnlm": ("knnlm_cmd", "A real kNN-LM: faiss datastore at a key address, perplexity with and without retrieval."),
    "condensation": ("condensation_cmd", "Per-layer cosine histograms and the condensation trend by depth (paper C)."),
    "compare": ("compare_cmd", "Results of several models, layers or tools (measure, lm-eval, MTEB) as one table, "
                "a CSV and overlaid depth profiles."),
    "report": ("report_cmd", "One self-contained offline HTML page from the JSON outputs of the other commands."),
    "clusters": ("clusters_cmd", "Contexts sharing an n-gram continuation: within/between-cluster distance (paper A)."),
    "perturb": ("perturb_cmd", "Prompt entropy and dispersion under repetition, random tokens, length (paper B)."),
    "train": ("train_cmd", "Train a causal LM (continued, or a small GPT-2 from scratch) with auxiliary losses."),
    "mteb": ("mteb_cmd", "MTEB scores and embedding geometry at any layer; layer sweeps in one pass; summaries."),
    "tasks-dir": ("tasks_dir_cmd", "Print the folder of repgeom-eval's lm-eval tasks (for lm_eval --include_path)."),
    "lm-eval": ("lm_eval_cmd", "Run lm-eval's command line with repgeom-eval's tasks and metrics loaded."),
    "slices": ("slices_cmd", "Controlled-slice experiment and calibration from lm-eval samples or vector files."),
}


@hookimpl
def repgeom_register_commands(registry):
    for name, (module, help_text) in COMMANDS.items():
        configure, run = _lazy(module)
        registry.add(Command(name, help_text, configure, run), name=name, description=help_text)
