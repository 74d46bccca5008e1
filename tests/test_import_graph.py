"""Imports go one way: down the layers below, never around a loop, never into tools/ or benchmarks/.

The graph is read with `ast` from every module under salaserve/, tools/ and benchmarks/. Imports
inside functions count like module-level ones: a lazy import still runs, only later, and counting
it keeps a cycle from hiding behind one. `import a.b` and `from a import b` (b a submodule) point
at the submodule, `from a.b import name` at a.b. A package's __init__ is a module like any other:
importing a submodule is not an edge to its package's __init__.

Checked for salaserve:
  - every module sits in a layer of LAYERS, and imports only its own layer and those below;
  - no cycle between modules, and none between units (a unit is a layer entry: a package, or a
    module the table names on its own), so sibling packages of one layer cannot import each other
    both ways;
  - nothing imports tools/ or benchmarks/ (they import salaserve, never the reverse).
tools/ and benchmarks/ are checked for cycles between their modules too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "salaserve"
OUTSIDE = ("tools", "benchmarks")  # top-level packages of the repository, not installed

# Lowest first. A module belongs to the longest entry that is its name or a package above it
# (the bare "salaserve" entry matches the package's own __init__ only).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("salaserve._version", "salaserve.config", "salaserve.core")),
    # siblings on core: the caches, the weight formats, speculative decoding's token logic,
    # tensor parallelism's process group and sharding rules (parallel imports quant)
    ("state", ("salaserve.cache", "salaserve.quant", "salaserve.spec", "salaserve.parallel")),
    ("model", ("salaserve.model",)),
    ("kernels", ("salaserve.kernels",)),
    ("engine", ("salaserve.engine",)),
    ("apps", (
        "salaserve.server", "salaserve.bench", "salaserve.evaluation", "salaserve.argparsing", "salaserve.soar",
        "salaserve.cli", "salaserve", "salaserve.spec_train",
        # quant/'s offline quantizer (prepare-model, its GPTQ layer runner and calibration data, the
        # quality tool) runs the reference model and the engine: an application in quant/'s folder
        "salaserve.quant.prepare", "salaserve.quant.layerwise", "salaserve.quant.calib",
        "salaserve.quant.quality",
    )),
]


# ---------------------------------------------------------------------------------------------
# Reading the graph
# ---------------------------------------------------------------------------------------------


def module_files(root: Path, top_packages) -> dict[str, Path]:
    """{dotted module name: file} for every .py file under the given top-level packages."""
    mods = {}
    for top in top_packages:
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _resolve(name: str, known) -> str | None:
    """The known module `name` refers to: itself, else the closest package above it."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _typing_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (they never run: annotations only)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports_of(module: str, source: str, is_package: bool, known) -> set[str]:
    """The known modules that `module` imports anywhere in `source` (at run time: imports under
    `if TYPE_CHECKING:` are left out)."""
    out = set()
    tree = ast.parse(source)
    typing_only = _typing_only(tree)
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out.update(_resolve(a.name, known) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module if is_package else module.rpartition(".")[0]
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in known else _resolve(base, known))
    out.discard(None)
    out.discard(module)
    return out


def import_graph(root: Path = ROOT, top_packages=(PACKAGE, *OUTSIDE)) -> dict[str, set[str]]:
    files = module_files(root, top_packages)
    return {m: imports_of(m, p.read_text(encoding="utf-8"), p.name == "__init__.py", files)
            for m, p in files.items()}


# ---------------------------------------------------------------------------------------------
# Checks: each returns the violations it finds (empty: none)
# ---------------------------------------------------------------------------------------------


def unit_of(module: str, layers=LAYERS) -> str | None:
    """The layer entry `module` belongs to (see LAYERS), or None."""
    best = None
    for _, entries in layers:
        for e in entries:
            inside = module == e or (e != PACKAGE and module.startswith(e + "."))
            if inside and (best is None or len(e) > len(best)):
                best = e
    return best


def layer_index(layers=LAYERS) -> dict[str, int]:
    return {e: i for i, (_, entries) in enumerate(layers) for e in entries}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def unplaced(graph, layers=LAYERS) -> list[str]:
    return sorted(m for m in graph if m.split(".")[0] == PACKAGE and unit_of(m, layers) is None)


def upward_imports(graph, layers=LAYERS) -> list[str]:
    """`a -> b` for every import of a higher layer's module."""
    rank = layer_index(layers)
    bad = []
    for a, targets in sorted(graph.items()):
        ua = unit_of(a, layers)
        for b in sorted(targets):
            ub = unit_of(b, layers)
            if ua is not None and ub is not None and rank[ub] > rank[ua]:
                bad.append(f"{a} ({layers[rank[ua]][0]}) -> {b} ({layers[rank[ub]][0]})")
    return bad


def unit_graph(graph, layers=LAYERS) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for a, targets in graph.items():
        ua = unit_of(a, layers)
        if ua is None:
            continue
        units.setdefault(ua, set()).update(
            ub for ub in (unit_of(b, layers) for b in targets) if ub is not None and ub != ua)
    return units


def imports_from_outside(graph) -> list[str]:
    """`a -> b` for every salaserve module that imports tools/ or benchmarks/."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() if a.split(".")[0] == PACKAGE
                  for b in targets if b.split(".")[0] in OUTSIDE)


# ---------------------------------------------------------------------------------------------
# The repository
# ---------------------------------------------------------------------------------------------

GRAPH = import_graph()
PACKAGE_GRAPH = {m: {t for t in ts if t.split(".")[0] == PACKAGE} for m, ts in GRAPH.items()
                 if m.split(".")[0] == PACKAGE}


def test_the_graph_is_read():
    assert len(PACKAGE_GRAPH) > 100
    assert "salaserve.engine.runner" in GRAPH["salaserve.engine.engine"]  # module level
    assert "salaserve.quant.load" in GRAPH["salaserve.model.loader"]  # inside a function
    assert "salaserve.kernels.sparse._common" in GRAPH["salaserve.kernels.sparse"]  # `from pkg import sub`


def test_every_module_has_a_layer():
    assert unplaced(PACKAGE_GRAPH) == []


def test_imports_go_down_the_layers():
    assert upward_imports(PACKAGE_GRAPH) == []


def test_no_cycles_between_modules():
    assert cycles(GRAPH) == []


def test_no_cycles_between_packages():
    assert cycles(unit_graph(PACKAGE_GRAPH)) == []


def test_the_package_never_imports_tools_or_benchmarks():
    assert imports_from_outside(GRAPH) == []


# ---------------------------------------------------------------------------------------------
# The checks themselves, on a small repository with one violation of each kind
# ---------------------------------------------------------------------------------------------

TOY_LAYERS = [("low", ("salaserve.core",)), ("mid", ("salaserve.model", "salaserve.cache")),
              ("high", ("salaserve.engine", "salaserve"))]


def _toy_repo(tmp_path, files: dict[str, str]):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for d in list(tmp_path.rglob("*")):
        if d.is_dir() and not (d / "__init__.py").exists():
            (d / "__init__.py").write_text("")
    return import_graph(tmp_path)


def test_reading_counts_function_level_and_relative_imports(tmp_path):
    g = _toy_repo(tmp_path, {
        "salaserve/core/a.py": "def f():\n    from salaserve.model import b\n",
        "salaserve/model/b.py": "from . import c\nfrom .c import x\nimport salaserve.core.a as a\n",
        "salaserve/model/c.py": "x = 1\n",
        "tools/t.py": "from salaserve.model.b import y\n",
    })
    assert g["salaserve.core.a"] == {"salaserve.model.b"}
    assert g["salaserve.model.b"] == {"salaserve.model.c", "salaserve.core.a"}
    assert g["tools.t"] == {"salaserve.model.b"}


def test_checks_catch_each_kind_of_violation(tmp_path):
    g = _toy_repo(tmp_path, {
        "salaserve/core/a.py": "def f():\n    from salaserve.engine import e\n",  # upward, cycle
        "salaserve/engine/e.py": "from salaserve.core import a\n",
        "salaserve/model/m.py": "from salaserve.cache import k\nfrom tools import t\n",  # outside
        "salaserve/cache/k.py": "def f():\n    from salaserve.model import n\n",  # package cycle
        "salaserve/model/n.py": "",
        "salaserve/stray.py": "",  # in no layer
        "tools/t.py": "",
    })
    package = {m: ts for m, ts in g.items() if m.startswith("salaserve")}
    assert upward_imports(package, TOY_LAYERS) == ["salaserve.core.a (low) -> salaserve.engine.e (high)"]
    assert cycles(g) == [["salaserve.core.a", "salaserve.engine.e"]]
    assert cycles(unit_graph(package, TOY_LAYERS)) == [["salaserve.cache", "salaserve.model"],
                                                      ["salaserve.core", "salaserve.engine"]]
    assert imports_from_outside(g) == ["salaserve.model.m -> tools.t"]
    assert unplaced(package, TOY_LAYERS) == ["salaserve.stray"]


def test_checks_pass_a_clean_graph(tmp_path):
    g = _toy_repo(tmp_path, {
        "salaserve/core/a.py": "",
        "salaserve/model/m.py": "from salaserve.core import a\nfrom salaserve.cache import k\n",
        "salaserve/cache/k.py": "import salaserve.core.a\n",
        "salaserve/engine/e.py": "def f():\n    from salaserve.model import m\n",
    })
    package = {m: ts for m, ts in g.items() if m.startswith("salaserve")}
    assert upward_imports(package, TOY_LAYERS) == []
    assert cycles(g) == [] and cycles(unit_graph(package, TOY_LAYERS)) == []
    assert imports_from_outside(g) == [] and unplaced(package, TOY_LAYERS) == []
