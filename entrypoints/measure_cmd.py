"""``repgeom measure``: metrics at layer addresses over a text file."""

from __future__ import annotations

import argparse
import json
import sys

from repgeom_eval.spec.errors import RepgeomError
from repgeom_eval.spec.options.measure import MeasureCommand, RunConfig
from repgeom_eval.spec.options.model import ModelOptions


def configure(p: argparse.ArgumentParser) -> None:
    MeasureCommand.add_arguments(p)


PER_MODEL = {"--output": "output", "--per-text": "per_text_path", "--save-preprocess-stats": "save_preprocess_stats",
             "--run-dir": "run_dir"}


def model_slug(model: str) -> str:
    """How ``{model}`` in an output path names a model: its folder or file name (``parent__model`` where the folder
    is a generic ``model/``; ``org__name`` for a hub id)."""
    import os
    import re

    from repgeom_eval.output.results_table import folder_name

    text = str(model).rstrip("/\\")
    name = folder_name(text) if os.path.exists(text) or text.startswith((".", "/", "~")) else text
    return re.sub(r"[^\w.+-]+", "__", name) or "model"


def per_model(cfg: MeasureCommand) -> list[MeasureCommand]:
    """One configuration per ``-m/--model``: several models are measured one after the other, each into the output
    paths with ``{model}`` replaced by its :func:`model_slug`; with several models an output path without
    ``{model}`` is a one-line error (one model's results would replace another's)."""
    models = [cfg.model] if isinstance(cfg.model, str) else list(cfg.model)
    slugs = [model_slug(m) for m in models]
    if len(set(slugs)) < len(slugs):
        dup = next(s for s in slugs if slugs.count(s) > 1)
        raise RepgeomError(f"--model: two models are both named {dup!r} in output paths; give each once")
    if len(models) > 1:
        for flag, name in PER_MODEL.items():
            value = getattr(cfg, name)
            if value and "{model}" not in value:
                raise RepgeomError(f"{flag} {value!r}: with {len(models)} models give a path holding {{model}} "
                                   f"(e.g. {flag} {_example(value)}): one file per model, {{model}} = the model's "
                                   "folder name")
    return [cfg.replace(model=m, **{name: getattr(cfg, name).replace("{model}", slug)
                                    for name in PER_MODEL.values() if getattr(cfg, name)})
            for m, slug in zip(models, slugs)]


def _example(path: str) -> str:
    import os

    stem, ext = os.path.splitext(path)
    return f"{stem}-{{model}}{ext}"


def run(args: argparse.Namespace) -> int:
    cfg = MeasureCommand.from_args(args)
    runs = per_model(cfg)
    if cfg.dry_run:
        for one in runs:
            dry_run(one)
        return 0
    for one in runs:  # every check (outputs, inputs, the memory budget) before the first forward pass
        _check(one)
        if one.state_memory is not None:
            _check_budget(one)
    documents = []
    for one in runs:
        doc = _measure_one(one, print_json=len(runs) == 1)
        if doc is None:
            return 0  # a rank > 0 of a distributed run
        documents.append(doc)
    if cfg.json and len(runs) > 1:  # one JSON document: the list of the models' results, in -m order
        print(json.dumps(documents, indent=2))
    elif len(runs) > 1 and cfg.output and not cfg.json:
        from rich.console import Console
        from rich.markup import escape

        Console().print("compare them: repgeom compare " + " ".join(escape(r.output) for r in runs), soft_wrap=True)
    return _failed_metrics(runs, documents)


#: the exit status of a run that finished without some plugin metrics (docs/plugins.md#when-something-goes-wrong)
EXIT_METRICS_FAILED = 3


def _failed_metrics(runs: list[MeasureCommand], documents: list[dict]) -> int:
    """Said last, on standard error: the plugin metrics a run dropped after they raised (their one-line errors were
    warnings when it happened); exit status 3 then, the other metrics' results being written."""
    failed = [(one, name) for one, doc in zip(runs, documents) for name in doc.get("failed_metrics", {})]
    for one, name in failed:
        where = f"; the other metrics' results are in {one.output}" if one.output else ""
        print(f"repgeom: error: metric {name!r} raised and is left out of the results of {one.model}{where} "
              "(failed_metrics there says why)", file=sys.stderr)
    return EXIT_METRICS_FAILED if failed else 0


def dry_run(cfg: MeasureCommand) -> None:
    """``--dry-run``: the memory estimate of one model's run (repgeom_eval/measurement/estimate.py)."""
    from repgeom_eval.measurement.estimate import estimate, render

    config = RunConfig.of(cfg, per_text=bool(cfg.per_text_path))
    est = estimate(cfg.model, config, ModelOptions.of(cfg))
    if cfg.json:
        print(json.dumps(est.to_dict(), indent=2))
        return
    render(est)


def _check_budget(cfg: MeasureCommand) -> None:
    from repgeom_eval.measurement.estimate import check_budget, count_texts, estimate

    est = estimate(cfg.model, RunConfig.of(cfg, per_text=bool(cfg.per_text_path)), ModelOptions.of(cfg))
    check_budget(est, int(cfg.state_memory or 0), count_texts(cfg.data))


def _check(cfg: MeasureCommand) -> None:
    from repgeom_eval.measurement.texts import source_files
    from repgeom_eval.modeling.loading import model_files
    from repgeom_eval.output.files import check_creatable_dir, check_outputs, check_writable

    if cfg.run_dir:
        check_creatable_dir(cfg.run_dir, "--run-dir")
    outputs = {"--output": cfg.output, "--per-text": cfg.per_text_path,
               "--save-preprocess-stats": cfg.save_preprocess_stats, "--run-dir": run_dir_files(cfg.run_dir)}
    weight_files, model_dirs = model_files(cfg.model)
    check_outputs(outputs, inputs={"--data": source_files(cfg.data), "--preprocess-stats": cfg.preprocess_stats,
                                   "--model": weight_files}, folders={"--model": model_dirs})
    for path in (cfg.output, cfg.per_text_path, cfg.save_preprocess_stats):
        if path:
            check_writable(path)  # fail before the forward passes, not after


def _measure_one(cfg: MeasureCommand, print_json: bool = True) -> dict | None:
    """Measure one model, write its outputs and print its table (``--json``: its results); returns the results
    (``None`` on a rank > 0 of a distributed run)."""
    from rich.console import Console

    from repgeom_eval.measurement.engine import measure
    from repgeom_eval.output.console import results_table
    from repgeom_eval.output.files import commit_together, jsonable

    config = RunConfig.of(cfg, per_text=bool(cfg.per_text_path))
    with commit_together([cfg.output, cfg.per_text_path, cfg.save_preprocess_stats]):  # all of them, or none
        result = measure(cfg.model, cfg.data, config, model_options=ModelOptions.of(cfg))
        if not result.is_main:
            return None  # a rank > 0 of a distributed run: the merged results and the files belong to rank 0
        if cfg.output:
            result.write(cfg.output, cfg.per_text_path)
        elif cfg.per_text_path:
            from repgeom_eval.output.files import write_jsonl

            write_jsonl(cfg.per_text_path, result.per_text)
    doc = jsonable(result.to_dict())
    if cfg.json:
        if print_json:
            print(json.dumps(doc, indent=2))
        return doc
    # Wide enough for every metric column: a results table truncated to "1.…" is useless.
    names = {m for per_metric in result.results.values() for m in per_metric}
    needed = 18 + sum(max(len(m), 9) + 3 for m in names)
    console = Console(width=max(Console().width, needed))
    t = result.timings
    title = f"{result.model['name']} · {result.data['n_texts']} texts · {t['total_s']:.1f}s"
    console.print(results_table(result.results, title=title))
    if cfg.output:
        console.print(f"results: {cfg.output}" + (f", per-text scores: {cfg.per_text_path}" if cfg.per_text_path
                                                  else ""))
    return doc


def run_dir_files(run_dir: str | None) -> list[str]:
    """The files a checkpointed run writes into ``--run-dir`` (repgeom_eval/measurement/checkpoint.py): its key and
    one state file per process."""
    if not run_dir:
        return []
    import os

    world = max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))
    return [os.path.join(run_dir, "run.json")] + [os.path.join(run_dir, f"state.rank{r}-of-{world}.pt")
                                                   for r in range(world)]
