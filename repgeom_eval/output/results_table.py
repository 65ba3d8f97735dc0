"""Results of several models, several layers and several tools as one long table.

Three kinds of input are read, recognised by their shape:

* a ``repgeom measure`` result (``--output``): one row per address and scalar metric (a metric returning a dict
  gives one row per number, named ``metric.key``); ``source`` is ``measure``, ``task`` the data file's name;
* an lm-eval output (a ``results_*.json`` file that ``lm_eval --output_path`` wrote, or a folder holding such files
  at any depth): one row per task and number; ``repgeom:<metric>@<address>`` values become the metric at that
  address, the tasks' own ``repgeom_*`` values (``repgeom_dispersion``, ``repgeom_auroc`` ...) are read at the
  task's ``repgeom_layer``, other numbers (``acc``, ``acc_norm`` ...) are scores; ``source`` is ``lm-eval``;
* an MTEB result folder written by ``repgeom mteb run`` (``--output-folder``): one row per layer, task, split,
  subset and value: the main score (named by its ``repgeom_main_score_name``), the geometry (``repgeom_dispersion``
  is ``dispersion`` ...) and the ``repgeom.*`` metrics; ``source`` is ``mteb``.

Every row has ``model, revision, source, path, task, split, subset, recipe, address, depth, relative_depth, kind,
metric, value, stderr``: ``kind`` is ``geometry`` or ``score``; ``depth`` is the address's position in the stack
(0 = embeddings, ``resid_post:i`` = i + 1, sub-layers of block i between i and i + 1, ``final`` = the number of
blocks) where it is known, ``relative_depth`` is depth over the model's deepest position. Torch-free; pandas only
for :func:`load_results`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from repgeom_eval.spec.errors import RepgeomError

COLUMNS = ("model", "revision", "source", "path", "task", "split", "subset", "recipe", "address", "depth",
           "relative_depth", "kind", "metric", "value", "stderr")
SOURCES = ("measure", "lm-eval", "mteb")
_MTEB_SKIP = {"repgeom_n_texts", "repgeom_depth", "repgeom_main_score_name", "repgeom_metrics"}
_NOT_RECIPE = {"layer", "model", "device", "name", "revision"}  # loader keys that are no part of the embedding recipe
_SUBLAYER = {"resid_pre": 0.0, "attn_out": 0.5, "resid_mid": 0.5, "mlp_in": 0.5, "mlp_out": 1.0, "resid_post": 1.0}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def address_depth(address: str | None, n_layers: int | None = None) -> float | None:
    """The position of ``address`` in the stack (module docstring); ``None`` where it cannot be told."""
    if address is None:
        return None
    text = str(address).strip()
    if text == "embed":
        return 0.0
    if text == "final":
        return float(n_layers) if n_layers else None
    if re.fullmatch(r"-?\d+", text):
        k = int(text)
        return float(k if k >= 0 or not n_layers else n_layers + 1 + k)
    m = re.fullmatch(r"(\w+):(-?\d+)", text)
    if not m or m.group(1) not in _SUBLAYER:
        return None
    block = int(m.group(2))
    if block < 0:
        if not n_layers:
            return None
        block += n_layers
    return block + _SUBLAYER[m.group(1)]


# -- one reader per source ------------------------------------------------------------------------------------------

def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise RepgeomError(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise RepgeomError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except OSError as exc:
        raise RepgeomError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def is_measure(doc: Any) -> bool:
    return (isinstance(doc, dict) and isinstance(doc.get("results"), dict) and isinstance(doc.get("model"), dict)
            and doc.get("kind", "measure") == "measure" and "layers" in (doc.get("config") or {}))


def is_lmeval(doc: Any) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("results"), dict) and isinstance(doc.get("configs"), dict)


def _value(v: Any) -> float | None:
    """A result value: a number, or NaN for ``null`` (results files write NaN as null), else None (not a value)."""
    return math.nan if v is None else _number(v)


def measure_recipe(config: dict[str, Any]) -> str:
    """What besides the model changes a measure result's numbers: pooling (``default``: each metric's own), dtype,
    preprocessing."""
    prep = config.get("preprocess")
    method = prep.get("method") if isinstance(prep, dict) else prep
    return f"pooling={config.get('pooling') or 'default'},dtype={config.get('dtype')},preprocess={method or 'none'}"


def measure_rows(doc: dict[str, Any], path: str) -> list[dict[str, Any]]:
    model = doc.get("model") or {}
    n_layers = model.get("n_layers")
    task = Path(str((doc.get("data") or {}).get("path") or "texts")).name
    recipe = measure_recipe(doc.get("config") or {})
    rows = []
    for address, per_metric in doc["results"].items():
        depth = address_depth(address, n_layers)
        values: dict[str, float] = {}
        for metric, v in (per_metric or {}).items():
            if isinstance(v, dict):
                values.update({f"{metric}.{k}": _value(x) for k, x in v.items() if _value(x) is not None})
            elif _value(v) is not None:
                values[metric] = _value(v)
        for metric, value in values.items():
            rows.append({"model": str(model.get("name", "?")), "revision": model.get("revision"),
                         "source": "measure", "path": path, "task": task, "recipe": recipe, "address": address,
                         "depth": depth, "relative_depth": depth / n_layers if depth is not None and n_layers else None,
                         "kind": "geometry", "metric": metric, "value": value})
    return rows


def _model_arg(model_args: Any, key: str) -> str | None:
    if isinstance(model_args, dict):
        return None if model_args.get(key) is None else str(model_args[key])
    for part in str(model_args or "").split(","):
        name, sep, value = part.partition("=")
        if sep and name.strip() == key:
            return value.strip()
    return None


def lmeval_rows(doc: dict[str, Any], path: str) -> list[dict[str, Any]]:
    config = doc.get("config") or {}
    model_args = config.get("model_args")
    model = doc.get("model_name") or _model_arg(model_args, "pretrained") or str(config.get("model", "?"))
    revision = _model_arg(model_args, "revision")
    rows = []
    for task, values in doc["results"].items():
        if not isinstance(values, dict):
            raise RepgeomError(f"{path}: results[{task!r}] is not an object; is this an lm-eval results file?")
        repgeom = (((doc.get("configs") or {}).get(task) or {}).get("metadata") or {}).get("repgeom") or {}
        for key, raw in values.items():
            name, _, filter_name = key.partition(",")
            value = _number(raw)
            if value is None or name.endswith("_stderr") or name == "alias":
                continue
            stderr = _number(values.get(f"{name}_stderr,{filter_name}" if filter_name else f"{name}_stderr"))
            address: str | None = None
            kind, metric = "score", name
            if name.startswith("repgeom:"):
                metric, _, address = name[len("repgeom:"):].rpartition("@")
                metric, address, kind = metric or address, address if metric else None, "geometry"
            elif name.startswith("repgeom_"):
                kind, address = "geometry", repgeom.get("layer")
            depth = address_depth(address)
            rows.append({"model": str(model), "revision": revision, "source": "lm-eval", "path": path,
                         "task": task, "subset": filter_name or None, "address": address, "depth": depth,
                         "kind": kind, "metric": metric, "value": value, "stderr": stderr})
    return rows


def mteb_rows(folder: Path) -> list[dict[str, Any]]:
    rows = []
    for meta_file in sorted(folder.rglob("model_meta.json")):
        meta = _read_json(meta_file)
        if not isinstance(meta, dict):
            continue
        # the layer and recipe: in loader_kwargs since the one-model-per-layer layout, in experiment_kwargs before
        exp = {**(meta.get("loader_kwargs") or {}), **(meta.get("experiment_kwargs") or {})}
        if "layer" not in exp:
            continue
        recipe = ",".join(f"{k}={exp[k]}" for k in sorted(exp) if k not in _NOT_RECIPE)
        for result_file in sorted(meta_file.parent.glob("*.json")):
            if result_file.name == "model_meta.json":
                continue
            result = _read_json(result_file)
            if not isinstance(result, dict) or not isinstance(result.get("scores"), dict):
                raise RepgeomError(f"{result_file}: no 'scores' object; not an MTEB task result")
            task = result.get("task_name", result_file.stem)
            for split, subsets in result["scores"].items():
                for scores in subsets or []:
                    depth = _number(scores.get("repgeom_depth"))
                    if depth is None:
                        depth = address_depth(exp["layer"])
                    base = {"model": str(meta.get("name", "?")).partition("@")[0], "revision": meta.get("revision"),
                            "source": "mteb", "path": str(result_file), "task": task, "split": split,
                            "subset": scores.get("hf_subset"), "recipe": recipe, "address": str(exp["layer"]),
                            "depth": depth}
                    main = _number(scores.get("main_score"))
                    if main is not None:
                        name = scores.get("repgeom_main_score_name") or "main_score"
                        rows.append(base | {"kind": "score", "metric": str(name), "value": main})
                    seen: set[str] = set()  # `repgeom_dispersion` and a requested `repgeom.dispersion`: one row
                    for key, raw in scores.items():
                        value = _number(raw)
                        if value is None or key in _MTEB_SKIP or not key.startswith(("repgeom.", "repgeom_")):
                            continue
                        metric = key[len("repgeom."):]
                        if metric not in seen:
                            seen.add(metric)
                            rows.append(base | {"kind": "geometry", "metric": metric, "value": value})
    rows.sort(key=lambda r: (r["model"], str(r["revision"]), r["recipe"], r["task"], r["split"], str(r["subset"]),
                             _sort_depth(r["depth"])))
    # relative depth: over the deepest layer found of each model and recipe
    deepest: dict[tuple, float] = {}
    for r in rows:
        if r["depth"] is not None:
            k = (r["model"], r["revision"], r["recipe"])
            deepest[k] = max(deepest.get(k, 0.0), r["depth"])
    for r in rows:
        top = deepest.get((r["model"], r["revision"], r["recipe"]))
        r["relative_depth"] = r["depth"] / top if r["depth"] is not None and top else None
    return rows


# -- inputs ---------------------------------------------------------------------------------------------------------

def warning_lines(value: Any) -> list[str]:
    """A results file's ``warnings`` as lines: a list of them, or one string; anything else (a file edited by hand)
    holds none (what is printed from it never raises)."""
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, (list, tuple)):
        return [w if isinstance(w, str) else json.dumps(w, default=str) for w in value if w is not None]
    return []


def _file_rows(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    doc = _read_json(path)
    if is_measure(doc):
        return measure_rows(doc, str(path)), warning_lines(doc.get("warnings"))
    if is_lmeval(doc):
        return lmeval_rows(doc, str(path)), []
    kind = doc.get("kind") if isinstance(doc, dict) else None
    what = f"a {kind} result" if isinstance(kind, str) else f"a JSON {type(doc).__name__} of another shape"
    raise RepgeomError(f"{path}: {what}, not a repgeom measure result, an lm-eval results_*.json or an MTEB "
                       "result folder")


def read_results(paths: Sequence[str | Path]) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
    """The rows (every key of :data:`COLUMNS`) of every input, and the warnings each measure result carries (by
    path). A folder is an MTEB result folder if it holds ``model_meta.json`` files of layers, else an lm-eval output
    folder if it holds ``results_*.json`` files, else a folder of measure results (its ``*.json``)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise RepgeomError("give at least one result: a measure .json, an lm-eval output or an MTEB result folder")
    rows: list[dict[str, Any]] = []
    warnings: dict[str, list[str]] = {}
    for p in map(Path, paths):
        if p.is_dir():
            if any(p.rglob("model_meta.json")):
                found = mteb_rows(p)
                if not found:
                    raise RepgeomError(f"{p}: MTEB folder without layer results (written by `repgeom mteb run`?)")
                rows += found
                continue
            files = sorted(p.rglob("results_*.json")) or sorted(p.glob("*.json"))
            if not files:
                raise RepgeomError(f"{p}: folder holds no results_*.json, no *.json and no MTEB layer results")
        elif p.is_file():
            files = [p]
        else:
            raise RepgeomError(f"{p}: does not exist")
        for f in files:
            found, warned = _file_rows(f)
            if not found:
                raise RepgeomError(f"{f}: holds no numeric result")
            rows += found
            if warned:
                warnings[str(f)] = warned
    for r in rows:
        for c in COLUMNS:
            r.setdefault(c, None)
    return [{c: r[c] for c in COLUMNS} for r in rows], warnings


def load_results(paths: str | Path | Sequence[str | Path]):
    """Results of ``repgeom measure``, lm-eval and ``repgeom mteb run`` (files or folders, any mix) as one long
    ``pandas.DataFrame``, one row per model, source, task, split, subset, address and metric (columns:
    :data:`COLUMNS`; module docstring). ``df.attrs["warnings"]`` maps each file that carries warnings to them."""
    try:
        import pandas as pd
    except ImportError:
        raise RepgeomError("load_results needs pandas: pip install 'repgeom-eval[compare]'") from None
    rows, warnings = read_results([paths] if isinstance(paths, (str, Path)) else list(paths))
    frame = pd.DataFrame(rows, columns=list(COLUMNS))
    frame.attrs["warnings"] = warnings
    return frame


# -- views ----------------------------------------------------------------------------------------------------------

# Folder names that say nothing about the model (a package's `model/`, a trainer's `checkpoint/`): the parent's name
# goes first, so that two such models stay apart in a table
GENERIC_FOLDERS = frozenset({"model", "models", "checkpoint", "final", "hf", "transformers", "pytorch", "weights"})


def folder_name(path: str | Path) -> str:
    """A local model's short name: its folder or file name, ``parent/name`` where that name is generic."""
    p = Path(str(path).rstrip("/\\"))
    return f"{p.parent.name}/{p.name}" if p.name.lower() in GENERIC_FOLDERS and p.parent.name else p.name


def model_label(row: dict[str, Any]) -> str:
    """How a model is named in a table or legend: its folder or hub name, ``@revision`` where one is given."""
    name = str(row["model"]).removeprefix("local/")  # `repgeom mteb run` names a local folder local/<folder>
    name = folder_name(name) if ("/" in name and Path(name).exists()) or name.startswith(("/", ".")) else name
    return name + (f"@{str(row['revision'])[:12]}" if row.get("revision") else "")


def _sort_depth(value: Any) -> float:
    return math.inf if value is None else float(value)


def identity(row: dict[str, Any]) -> tuple[str, str, str]:
    """What a column of the comparison stands for: the model (its path or hub id), its revision or content hash,
    and the recipe (pooling, dtype, preprocessing; MTEB's pooling and normalisation)."""
    return str(row["model"]), str(row.get("revision") or ""), str(row.get("recipe") or "")


def column_labels(rows: Iterable[dict[str, Any]]) -> dict[tuple[str, str, str], str]:
    """A distinct label for every :func:`identity`: the model's short name (:func:`model_label`), made longer with
    its parent folders where two models share it (``a/gpt2``, ``b/gpt2``), and with the recipe where one model was
    measured two ways (``gpt2 [pooling=mean,...]``)."""
    ids = list(dict.fromkeys(identity(r) for r in rows))
    label = {i: model_label({"model": i[0], "revision": i[1]}) for i in ids}
    for depth in range(2, 64):
        by_label: dict[str, set[str]] = {}
        for i in ids:
            by_label.setdefault(label[i], set()).add(i[0])
        clash = {m for names in by_label.values() if len(names) > 1 for m in names}
        if not clash:
            break
        for i in ids:
            if i[0] in clash:
                parts = i[0].removeprefix("local/").rstrip("/").split("/")
                label[i] = "/".join(parts[-depth:]) + (f"@{i[1][:12]}" if i[1] else "")
    counts: dict[str, int] = {}
    for i in ids:
        counts[label[i]] = counts.get(label[i], 0) + 1
    for i in ids:
        if counts[label[i]] > 1 and i[2]:
            label[i] = f"{label[i]} [{i[2]}]"
    return label


def wide(rows: Iterable[dict[str, Any]]) -> tuple[list[str], list[tuple[tuple, dict[str, float]]]]:
    """The comparison table: one column per model and recipe (:func:`column_labels`), one row per (source, task,
    split, metric, address) in depth order (relative depth where known, so that ``final`` comes last for every model);
    returns (column labels, [(row key, {label: value})]). Two results of one model and recipe that give the same row
    from different files are refused in one line: one of them would hide the other."""
    rows = list(rows)
    names = column_labels(rows)
    labels: list[str] = []
    table: dict[tuple, dict[str, float]] = {}
    origin: dict[tuple, str] = {}
    depth: dict[tuple, Any] = {}
    for r in rows:
        label = names[identity(r)]
        if label not in labels:
            labels.append(label)
        key = (r["source"], r["task"], r["split"] or "", r["subset"] or "", r["metric"], r["address"] or "")
        if label in table.get(key, {}) and origin[key + (label,)] != r["path"] and r["source"] == "measure":
            raise RepgeomError(f"{origin[key + (label,)]} and {r['path']} both give {r['metric']} at {r['address']} "
                               f"of {label} on {r['task']}: the same model and recipe twice; compare them "
                               "separately, or measure them under different data file names")
        table.setdefault(key, {})[label] = r["value"]
        origin[key + (label,)] = r["path"]
        at = r["relative_depth"] if r["relative_depth"] is not None else r["depth"]  # models of different depth
        if at is not None and (depth.get(key) is None or at < depth[key]):
            depth[key] = at
        depth.setdefault(key, None)
    order = sorted(table, key=lambda k: (k[0], k[1], k[2], k[3], k[4], _sort_depth(depth[k]), k[5]))
    return labels, [(k, table[k]) for k in order]
