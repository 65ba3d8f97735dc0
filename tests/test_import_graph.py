"""The package's import graph has no cycle, imports inside functions and lazy("module:name") targets included
(a cycle makes import order matter and hides which module depends on which), every import runs down the one table
of layers (:data:`LAYERS`, printed in docs/development.md), and no module outgrows one idea."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("repgeom_eval", "entrypoints", "plugins")
MAX_LINES = 450
#: the packages from the bottom up: a module imports from its own package and from the layers below its own, never
#: from a layer above nor from another package of its layer (docs/development.md, "Layout", prints this table)
LAYERS: tuple[tuple[str, ...], ...] = (
    ("spec",),
    ("plugin_system",),
    ("functional",),
    ("output",),
    ("modeling",),
    ("measurement",),
    ("analyses",),
    ("lmeval", "mteb_layers", "training"),
    ("testing",),
    ("repgeom_eval",),  # the package's own __init__: the public face, re-exporting names of the layers below
    ("entrypoints",),
    ("plugins", "__main__"),  # the built-in commands are plugins whose glue lives in entrypoints
)
#: the imports that run against LAYERS, each with its reason: (importing module, imported module) -> why
EXCEPTIONS: dict[tuple[str, str], str] = {
    # the metric API binds torch and the math lazily (lazy.py is standard library only), so plugins load light
    ("repgeom_eval.spec.metric", "repgeom_eval.plugin_system.lazy"): "lazy torch",
    ("repgeom_eval.spec.statistics", "repgeom_eval.plugin_system.lazy"): "lazy torch",
    ("repgeom_eval.spec.statistics", "repgeom_eval.functional.dispersion"): "lazy target, bound on first use",
    ("repgeom_eval.spec.statistics", "repgeom_eval.functional.entropy"): "lazy target, bound on first use",
    # annotations only (under TYPE_CHECKING): the hookspecs name the registry type a hook receives
    ("repgeom_eval.spec.hookspecs", "repgeom_eval.plugin_system.kinds"): "TYPE_CHECKING",
    # a built-in layer pick scores with the math and looks itself up in the host, both inside functions
    ("repgeom_eval.spec.layer_pick", "repgeom_eval.functional.entropy"): "inside score()",
    ("repgeom_eval.spec.layer_pick", "repgeom_eval.plugin_system.host"): "inside make_pick()",
}


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _source_name(target: str) -> str:
    """``repgeom_eval.plugins.x`` and ``repgeom_eval.entrypoints.x`` (installed names) as the source tree names them."""
    for folder in ("plugins", "entrypoints"):
        if target == f"repgeom_eval.{folder}" or target.startswith(f"repgeom_eval.{folder}."):
            return target.removeprefix("repgeom_eval.")
    return target


def _imports(name: str, path: Path, known: set[str], version_free: bool = False) -> set[str]:
    """Every module of ours that ``name`` imports anywhere in its text, inside functions, as ``lazy``/``import_module``
    targets (an f-string target counts as its constant head) and under installed names included (the package itself
    excluded: importing a submodule always runs its package, which is not a dependency of the submodule on the
    package's content). With ``version_free``, ``from repgeom_eval import __version__`` is no import of the package:
    the version is the distribution's, not a layer's."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = base + (f".{node.module}" if node.module else "")
            else:
                module = node.module or ""
            if version_free and module == "repgeom_eval" and [a.name for a in node.names] == ["__version__"]:
                continue
            targets = [module] + [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                "lazy", "import_module"):
            targets = [a.value.partition(":")[0] for a in node.args
                       if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            targets += [a.values[0].value.rstrip(".") for a in node.args if isinstance(a, ast.JoinedStr)
                        and a.values and isinstance(a.values[0], ast.Constant)]
        found |= {t for t in map(_source_name, targets) if t in known and t != name}
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    assert _cycles(graph) == []


def test_no_module_over_the_size_of_one_idea():
    big = {name: n for name, path in _modules().items()
           if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert big == {}


def _layer_of(module: str) -> str:
    """The LAYERS package of a module: ``repgeom_eval.X...`` -> X, ``plugins...``/``entrypoints...`` -> the folder,
    ``repgeom_eval`` -> itself."""
    parts = module.split(".")
    if parts[0] != "repgeom_eval":
        return parts[0]
    return parts[1] if len(parts) > 1 else "repgeom_eval"


def _against(graph: dict[str, set[str]]) -> dict[tuple[str, str], str]:
    """Every import (importer, imported) that runs against LAYERS, with the two packages it joins."""
    rank = {package: i for i, layer in enumerate(LAYERS) for package in layer}
    out = {}
    for name, targets in graph.items():
        for target in targets:
            a, b = _layer_of(name), _layer_of(target)
            if a != b and rank[b] >= rank[a]:
                out[(name, target)] = f"{a} -> {b}"
    return out


def _graph(version_free: bool = True) -> dict[str, set[str]]:
    modules = _modules()
    graph = {name: _imports(name, path, set(modules), version_free) for name, path in modules.items()}
    import repgeom_eval  # its lazy names (_LAZY) are imports of the package too

    graph["repgeom_eval"] |= {t for t in repgeom_eval._LAZY.values() if t in modules}
    return graph


def test_every_package_has_a_layer():
    packages = {_layer_of(name) for name in _modules()}
    listed = [package for layer in LAYERS for package in layer]
    assert sorted(listed) == sorted(set(listed)), "a package listed twice"
    assert packages == set(listed)


def test_the_layer_check_finds_an_import_against_the_table(tmp_path):
    assert _against({"repgeom_eval.spec.x": {"repgeom_eval.modeling.y"}, "repgeom_eval.modeling.y": set()}) == {
        ("repgeom_eval.spec.x", "repgeom_eval.modeling.y"): "spec -> modeling"}
    assert _against({"repgeom_eval.training.a": {"repgeom_eval.lmeval.b"}}) == {  # one layer, two packages
        ("repgeom_eval.training.a", "repgeom_eval.lmeval.b"): "training -> lmeval"}
    assert _against({"plugins.a": {"entrypoints.b", "repgeom_eval.spec.c"}}) == {}
    text = "import importlib\nimportlib.import_module(f'repgeom_eval.entrypoints.{x}')\n"
    path = tmp_path / "probe.py"
    path.write_text(text, encoding="utf-8")
    assert _imports("plugins.probe", path, {"entrypoints", "plugins.probe"}) == {"entrypoints"}


def test_imports_run_down_the_layers():
    against = _against(_graph())
    unexplained = {pair: packages for pair, packages in against.items() if pair not in EXCEPTIONS}
    assert unexplained == {}, "imports against LAYERS (tests/test_import_graph.py): fix them or list them in EXCEPTIONS"
    assert sorted(set(EXCEPTIONS) - set(against)) == [], "an exception no import needs any more"


def _doc_layers() -> list[tuple[str, ...]]:
    """The packages column of the table under "## Layout" in docs/development.md, top row first."""
    text = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    section = text.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|") for line in section.splitlines() if re.match(r"\|\s*\d+\s*\|", line)]
    return [tuple(re.findall(r"`([\w.]+)/?`", row[2])) for row in rows]


def test_the_layout_table_in_the_docs_is_layers():
    doc = [tuple(p.removeprefix("repgeom_eval.").removesuffix("/") for p in layer) for layer in _doc_layers()]
    assert doc == [tuple(layer) for layer in LAYERS]


def test_spec_imports_no_torch():
    code = "import sys, repgeom_eval.spec; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    for module in sorted(m for m in _modules() if m.startswith("repgeom_eval.spec")):
        code += f"; import {module}"
    code += "; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'transformers')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:2] == ["[]", "[]"]


def test_the_wheel_lists_every_package():
    """pyproject lists the packages one by one (plugins/ and entrypoints/ install inside the namespace): a folder
    missing from the list is missing from the wheel, and only `make check-install` would notice."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"])
    folders = {"repgeom_eval." + ".".join(p.parent.relative_to(ROOT / "repgeom_eval").parts)
               for p in (ROOT / "repgeom_eval").rglob("__init__.py")}
    folders = {f.rstrip(".") for f in folders}
    for outside in ("plugins", "entrypoints"):
        folders |= {f"repgeom_eval.{outside}" + "".join("." + x for x in p.parent.relative_to(ROOT / outside).parts)
                    for p in (ROOT / outside).rglob("__init__.py")}
    assert folders - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
