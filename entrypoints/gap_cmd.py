"""``repgeom gap``: rank checkpoints by the dispersion gap G of their output projection (no forward pass)."""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
from pathlib import Path

from repgeom_eval.spec.options.analyses import GapCommand, GapConfig
from repgeom_eval.spec.errors import RepgeomError


configure = GapCommand.add_arguments


# -- --scores ---------------------------------------------------------------------------------------------------

def _number(text: object, where: str) -> float:
    if isinstance(text, bool):
        raise RepgeomError(f"{where}: accuracy must be a number, got {text!r}")
    try:
        value = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise RepgeomError(f"{where}: accuracy must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise RepgeomError(f"{where}: accuracy must be finite, got {text!r}")
    return value


def read_scores(path: str) -> dict[str, float]:
    """``{model: accuracy}`` from a JSON object or CSV/TSV lines ``model,accuracy`` (an optional header line)."""
    p = Path(path)
    if not p.is_file():
        raise RepgeomError(f"scores file {path!r} " + ("is a directory" if p.is_dir() else "does not exist"))
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RepgeomError(f"scores file {path!r} is not valid UTF-8 (byte {exc.start})") from None
    if not text.strip():
        raise RepgeomError(f"scores file {path!r} is empty; write model,accuracy lines or a JSON object")
    if p.suffix.lower() == ".json" or text.lstrip().startswith(("{", "[")):
        from repgeom_eval.measurement.texts import parse_json

        data = parse_json(text, f"scores file {path!r}")
        if not isinstance(data, dict):
            raise RepgeomError(f"scores file {path!r}: expected a JSON object {{\"model\": accuracy, ...}}, got "
                               f"{type(data).__name__}")
        return {str(k): _number(v, f"scores file {path!r}, model {k!r}") for k, v in data.items()}
    first = next(line for line in text.splitlines() if line.strip())
    delimiter = "\t" if "\t" in first else ","
    scores: dict[str, float] = {}
    first_row = True
    for lineno, row in enumerate(csv.reader(io.StringIO(text), delimiter=delimiter), 1):
        if not row or not any(c.strip() for c in row):
            continue
        if len(row) < 2:
            raise RepgeomError(f"scores file {path!r}:{lineno}: expected model{delimiter}accuracy, got {row!r}")
        name, value = row[0].strip(), row[1].strip()
        if first_row and not _is_number(value):
            first_row = False
            continue  # a header line such as model,accuracy
        first_row = False
        if name in scores:
            raise RepgeomError(f"scores file {path!r}:{lineno}: model {name!r} is listed twice")
        scores[name] = _number(value, f"scores file {path!r}:{lineno}")
    if not scores:
        raise RepgeomError(f"scores file {path!r} has no model{delimiter}accuracy lines")
    return scores


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def match_scores(models: list[str], scores: dict[str, float], source: str) -> dict[str, float]:
    """Accuracy of each model: by the name as given, then the same path, then the directory/file base name."""
    by_path = {os.path.normpath(os.path.abspath(os.path.expanduser(k))): v for k, v in scores.items()}
    by_base: dict[str, list[float]] = {}
    for k, v in scores.items():
        by_base.setdefault(os.path.basename(os.path.normpath(k)), []).append(v)
    out: dict[str, float] = {}
    for m in models:
        if m in scores:
            out[m] = scores[m]
            continue
        full = os.path.normpath(os.path.abspath(os.path.expanduser(m)))
        if full in by_path:
            out[m] = by_path[full]
            continue
        base = by_base.get(os.path.basename(os.path.normpath(m)), [])
        if len(base) == 1:
            out[m] = base[0]
            continue
        keys = ", ".join(repr(k) for k in list(scores)[:8])
        raise RepgeomError(f"scores file {source!r} has no accuracy for model {m!r} (its models: {keys}); add a "
                           f"line {os.path.basename(os.path.normpath(m))},ACCURACY")
    return out


# -- run --------------------------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from repgeom_eval.analyses.gap import screen
    from repgeom_eval.functional.stats import complete_pairs, spearman
    from repgeom_eval.modeling.loading import model_files
    from repgeom_eval.output.console import fmt_number
    from repgeom_eval.output.files import check_outputs, check_writable, jsonable

    cfg = GapCommand.from_args(args)
    models = list(cfg.models)
    weight_files, model_dirs = model_files(models)
    token_files = {label: value for label, value in (("--domain", cfg.domain), ("--reference", cfg.reference))
                   if os.path.isfile(os.path.expanduser(value))}
    check_outputs({"--output": cfg.output}, inputs={"--models": weight_files, "--scores": cfg.scores, **token_files},
                  folders={"--models": model_dirs})
    if cfg.output:
        check_writable(cfg.output)  # fail before reading any checkpoint
    scores = None
    if cfg.scores:
        if len(models) < 2:
            raise RepgeomError("--scores needs at least 2 models to correlate G with accuracy")
        scores = match_scores(models, read_scores(cfg.scores), cfg.scores)
    result = screen(models, GapConfig.of(cfg), trust_remote_code=cfg.trust_remote_code)
    result.config["scores"] = cfg.scores
    if scores is not None:
        for row in result.rows:
            row["accuracy"] = scores[row["model"]]
        pairs = complete_pairs([r["G"] for r in result.rows], [r["accuracy"] for r in result.rows])
        result.spearman = {"rho": spearman(pairs.x, pairs.y), "n": pairs.n, "between": "G and accuracy",
                           "ties": "average ranks", "scores_file": cfg.scores}
    if cfg.output:
        result.write(cfg.output)
    if cfg.json:
        print(json.dumps(jsonable(result.to_dict()), indent=2))
        return 0

    console = Console()
    if not console.is_terminal:  # piped or captured: no terminal width to respect, keep every column whole
        console = Console(width=140)
    conf = result.config
    title = (f"dispersion gap G = within(T) + between(T, T̄) · T={conf['domain']} · T̄={conf['reference']} "
             f"(size {conf['size']}, seed {conf['seed']}) · {conf['distance']}")
    table = Table(title=escape(title))
    table.add_column("rank", justify="right", no_wrap=True, min_width=4)
    table.add_column("model", overflow="fold", min_width=12)
    any_missing = any(r["missing_T"] for r in result.rows)
    for name in ["G", "within(T)", "between", "within(T̄)", "|T|", "|T̄|"] + (["missing"] if any_missing else []):
        table.add_column(escape(name), justify="right", no_wrap=True, min_width=len(name))
    if scores is not None:
        table.add_column("accuracy", justify="right")
    for r in result.rows:
        cells = [str(r["rank"]), escape(r["model"]), *[fmt_number(r[k]) for k in ("G", "within_T", "between",
                                                                                  "within_Tbar")],
                 str(r["n_T"]), str(r["n_Tbar"])]
        if any_missing:
            cells.append(str(len(r["missing_T"])))
        if scores is not None:
            cells.append(f"{r['accuracy']:.4g}")
        table.add_row(*cells)
    console.print(table)
    missing = {tuple(r["missing_T"]) for r in result.rows}
    for r in result.rows if len(missing) > 1 else result.rows[:1]:
        if r["missing_T"]:
            who = f" ({escape(r['model'])})" if len(missing) > 1 else ""
            console.print(f"not in the vocabulary{who}: " + escape(", ".join(r["missing_T"])), soft_wrap=True)
    if not result.vocabulary["shared"]:
        console.print("[bold red]warning:[/] the vocabularies differ (--force); G is not comparable across them")
    if result.spearman is not None:
        console.print(f"Spearman ρ(G, accuracy) = {fmt_number(result.spearman['rho'])} over "
                      f"{result.spearman['n']} models")
    console.print(f"{result.timings['total_s']:.1f} s, peak memory {result.timings['peak_rss_mib']:.0f} MiB"
                  + (f"; results: {escape(str(cfg.output))}" if cfg.output else ""), soft_wrap=True)
    return 0

