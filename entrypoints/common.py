"""What the analysis commands share besides their options (those are in repgeom_eval/spec/options/groups.py): where the
figures go, and the checks every command runs on its outputs before any compute."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def stem(cfg: Any, default: str) -> str:
    """The base name of a command's files: that of ``--output``, else ``default``."""
    return Path(cfg.output).stem if cfg.output else default


def plot_dir(cfg: Any, create: bool = True) -> Path | None:
    """``--plot-dir``, else the folder of ``--output``, else none (no figures)."""
    if getattr(cfg, "plot_dir", None):
        d = Path(cfg.plot_dir)
        if create:
            d.mkdir(parents=True, exist_ok=True)
        return d
    if cfg.output:
        return Path(cfg.output).resolve().parent
    return None


def plot_files(cfg: Any, default_stem: str, suffixes: list[str]) -> list[Path]:
    """The figure files a command writes (``STEM{suffix}.png`` in :func:`plot_dir`), named before the run so that
    they are checked against the inputs and committed with the other outputs; nothing is created."""
    where = plot_dir(cfg, create=False)
    if where is None:
        return []
    return [where / f"{stem(cfg, default_stem)}{suffix}.png" for suffix in suffixes]


def guard_outputs(cfg: Any, outputs: dict, data: dict, models: list[str] | str | tuple) -> list:
    """The checks every analysis command runs before any compute: no output replaces an input or lands in a model
    folder (repgeom_eval/output/files.py), every output can be written. Returns the output paths, for
    ``commit_together``."""
    from repgeom_eval.modeling.loading import model_files
    from repgeom_eval.output.files import check_creatable_dir, check_outputs, check_writable

    if getattr(cfg, "plot_dir", None):
        check_creatable_dir(cfg.plot_dir, "--plot-dir")
    weight_files, model_dirs = model_files(list(models) if isinstance(models, tuple) else models)
    check_outputs(outputs, inputs={**data, "--model": weight_files}, folders={"--model": model_dirs})
    paths = [p for value in outputs.values() for p in (value if isinstance(value, list) else [value]) if p]
    for label in ("--output", "--per-chunk", "--plot"):
        if outputs.get(label):
            check_writable(outputs[label])
    return paths


def wide_console(minimum: int = 100):
    """A rich console at least ``minimum`` columns wide: a results table truncated to "0.…" is useless."""
    from rich.console import Console

    return Console(width=max(Console().width, minimum))


def run_analysis(cfg: Any, compute: Any, default_stem: str, figures: dict[str, Any] | None = None,
                 inputs: dict | None = None, outputs: dict | None = None) -> tuple[Any, list[Path]]:
    """The body every analysis command shares: name its figure files (``STEM{suffix}.png`` for each ``suffix →
    make(result_dict)`` of ``figures``), guard every output against the inputs (default ``{"--data": cfg.data}``),
    then run ``compute()`` and write the result and its figures together, all of them or none. ``outputs``: more
    output flags than ``--output`` (e.g. ``--per-chunk``). Returns the result (None on a rank > 0 of a distributed
    run: rank 0 writes the merged one) and the figure files."""
    from repgeom_eval.output.files import commit_together

    files = plot_files(cfg, default_stem, list(figures)) if figures else []
    flags = {"--output": cfg.output, **(outputs or {})}
    if figures:
        flags["--plot-dir"] = files
    paths = guard_outputs(cfg, flags, inputs if inputs is not None else {"--data": cfg.data}, cfg.model)
    with commit_together(paths):  # every output, or none
        result = compute()
        if not getattr(result, "is_main", True):
            return None, files
        if cfg.output:
            result.write(cfg.output)
        if files:
            from repgeom_eval.analyses.plots import save_png

            plot_dir(cfg)  # creates --plot-dir
            as_dict = result.to_dict()
            for path, make in zip(files, figures.values()):  # type: ignore[union-attr]
                save_png(make(as_dict), path)
    return result, files


def run_configured(command: type, args: Any, analysis: Any, config: type, default_stem: str,
                   figures: dict[str, Any] | None = None, *, layers: bool = False) -> tuple[Any, Any, list[Path]]:
    """An analysis command up to its printout: its options (``command``) from ``args``, then :func:`run_analysis` of
    ``analysis(model, data, configuration, model_options=...)``, each read from those options (a series of models
    as a list; the configuration: the fields of ``config``, with ``layers`` the layer request as the analyses take
    it). Returns the options, the result and the figure files."""
    from repgeom_eval.spec.options.groups import ModelsGroup
    from repgeom_eval.spec.options.model import ModelOptions

    cfg = command.from_args(args)
    model = list(cfg.model) if isinstance(cfg, ModelsGroup) else cfg.model
    fields = {"layers": cfg.layer_request} if layers else {}
    result, files = run_analysis(
        cfg, lambda: analysis(model, cfg.data, config.of(cfg, **fields), model_options=ModelOptions.of(cfg)),
        default_stem, figures)
    return cfg, result, files


def say_written(console: Any, cfg: Any, figures: list[Path]) -> None:
    """The files an analysis command wrote: its figures, then its results."""
    from rich.markup import escape

    for path in figures:
        console.print(f"plot:    {escape(str(path))}", soft_wrap=True)
    if cfg.output:
        console.print(f"results: {escape(cfg.output)}", soft_wrap=True)
