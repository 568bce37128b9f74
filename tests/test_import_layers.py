"""Our packages' import graph: no cycles among our modules, and the package boundaries (docs/architecture.md).

The graph is read from the source (ast), so it counts every import: module level, inside functions (a lazy import
that dodges a cycle is still the cycle) and under TYPE_CHECKING. `from pkg import name` is an edge to the
submodule pkg.name when that is a module, else to pkg.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGES = {"jaxrl_fp8": ROOT / "src" / "jaxrl_fp8", "pallas_kernels": ROOT / "pallas_kernels",
            "converters": ROOT / "converters"}
CLIS = {"jaxrl_fp8.train", "jaxrl_fp8.serve"}
# jaxrl_fp8.ops, bottom up: reference math (no backend choice) -> backends -> public ops; a module imports only from
# its own layer (acyclic: the cycle test) or a lower one
OPS_LAYERS = (("reference", "xla_gemm", "grouping", "operands"), ("backends", "high_precision", "block_scaled"),
              ("dense", "grouped"))


def _modules(packages: dict[str, Path]) -> dict[str, Path]:
    found = {}
    for pkg, base in packages.items():
        for path in base.rglob("*.py"):
            parts = [pkg, *path.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _resolve(module: str, level: int, current: str, is_package: bool) -> str:
    if not level:
        return module
    base = current.split(".")
    base = base[: len(base) - level + (1 if is_package else 0)]
    return ".".join(base + ([module] if module else []))


def import_graph(packages: dict[str, Path] = PACKAGES) -> dict[str, set[str]]:
    modules = _modules(packages)
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node.module or "", node.level, name, path.name == "__init__.py")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # `import a.b.c` of a non-module tail: its package
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def boundary_violations(graph: dict[str, set[str]]) -> list[str]:
    """precision imports nothing of ours, pallas_kernels only precision, data nothing of ours, and nothing imports the
    CLIs."""
    own = {"jaxrl_fp8.precision": ("jaxrl_fp8.precision",),
           "pallas_kernels": ("pallas_kernels", "jaxrl_fp8.precision"),
           "jaxrl_fp8.data": ("jaxrl_fp8.data",)}
    bad = []
    for src, targets in graph.items():
        for dst in targets:
            if dst in CLIS:
                bad.append(f"{src} imports the CLI {dst}")
            for package, allowed in own.items():
                # the package __init__ `jaxrl_fp8` itself is ours too: importing it from below is upward
                if _in(src, package) and not any(_in(dst, a) for a in allowed):
                    bad.append(f"{src} imports {dst} (allowed: {', '.join(allowed)})")
    return sorted(bad)


def ops_layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a lower ops layer to a higher one, and ops modules in no layer."""
    layer = {f"jaxrl_fp8.ops.{m}": i for i, mods in enumerate(OPS_LAYERS) for m in mods}
    layer["jaxrl_fp8.ops"] = len(OPS_LAYERS)  # the package re-exports the public ops
    bad = [f"{m} is in no layer of OPS_LAYERS" for m in graph if _in(m, "jaxrl_fp8.ops") and m not in layer]
    for src in layer.keys() & graph.keys():
        bad += [f"{src} (layer {layer[src]}) imports {dst} (layer {layer[dst]})" for dst in graph[src]
                if dst in layer and layer[dst] > layer[src]]
    return sorted(bad)


def test_no_import_cycles_among_our_modules():
    assert cycles(import_graph()) == []


def test_design_boundaries_hold():
    assert boundary_violations(import_graph()) == []
    assert ops_layer_violations(import_graph()) == []


def test_the_checks_see_cycles_and_violations():
    """On made-up graphs: a three-module cycle and a two-module one, a kernel importing the model, an ops module
    importing a higher layer and one in no layer."""
    graph = {"pallas_kernels.a": {"pallas_kernels.b"}, "pallas_kernels.b": {"pallas_kernels.a", "jaxrl_fp8.model"},
             "jaxrl_fp8.model": set(), "jaxrl_fp8.rl": {"jaxrl_fp8.train"}, "jaxrl_fp8.train": set(),
             "jaxrl_fp8.ops.x": {"jaxrl_fp8.ops.y"}, "jaxrl_fp8.ops.y": {"jaxrl_fp8.ops.z", "jaxrl_fp8.model"},
             "jaxrl_fp8.ops.z": {"jaxrl_fp8.ops.x"}}
    assert sorted(map(sorted, cycles(graph))) == [["jaxrl_fp8.ops.x", "jaxrl_fp8.ops.y", "jaxrl_fp8.ops.z"],
                                                  ["pallas_kernels.a", "pallas_kernels.b"]]
    assert cycles({k: v - {"pallas_kernels.a"} - {"jaxrl_fp8.ops.x"} for k, v in graph.items()}) == []
    assert boundary_violations(graph) == ["jaxrl_fp8.rl imports the CLI jaxrl_fp8.train",
                                          "pallas_kernels.b imports jaxrl_fp8.model (allowed: pallas_kernels, "
                                          "jaxrl_fp8.precision)"]
    ops = {"jaxrl_fp8.ops.grouping": {"jaxrl_fp8.ops.backends"}, "jaxrl_fp8.ops.backends": set(),
           "jaxrl_fp8.ops.dense": {"jaxrl_fp8.ops.grouping"}, "jaxrl_fp8.ops.new": set()}
    assert ops_layer_violations(ops) == ["jaxrl_fp8.ops.grouping (layer 0) imports jaxrl_fp8.ops.backends (layer 1)",
                                         "jaxrl_fp8.ops.new is in no layer of OPS_LAYERS"]


def test_the_graph_counts_every_import(tmp_path):
    """From source files: a cycle closed by a function-level import, one by an import under TYPE_CHECKING, one by a
    relative `from . import name`, are each found; `import pkg.mod.attr` is an edge to pkg.mod."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from pkg import b\n",
        "b.py": "def f():\n    from pkg.a import thing\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.d\n",
        "d.py": "import pkg.c.something\n",
        "sub/__init__.py": "from . import e\n",
        "sub/e.py": "from .. import sub\n",
        "f.py": "import os\nimport pkg.a\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph({"pkg": pkg})
    assert graph["pkg.f"] == {"pkg.a"} and graph["pkg.d"] == {"pkg.c"}
    assert sorted(map(sorted, cycles(graph))) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"], ["pkg.sub", "pkg.sub.e"]]
