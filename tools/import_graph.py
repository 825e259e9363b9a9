"""The package's import graph in figures (the restructuring's measure, docs/design.md).

    python tools/import_graph.py [--json] [--src src/expertcache]

Every ``import`` of an ``expertcache`` module in every file of the package, at module top or
inside a function (``if TYPE_CHECKING:`` blocks are counted apart: they are not run). Prints:

* ``loose``: modules at the package's top level that are not packages (``__init__`` and
  ``__main__``, the package's face and its command, excluded);
* ``circles``: strongly connected groups of modules (two or more) over the run-time imports;
* ``up``: run-time imports from a lower floor to a higher one (:data:`FLOORS`, bottom first;
  a top-level module is on floor 0 with the shared helpers, but ``__main__``, which runs the
  command line, is on the command line's);
* ``inner``: run-time imports inside a function body (some keep a heavy optional dependency lazy);
* ``files`` and ``lines`` of the package.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLOORS = [
    {"errors", "_io", "_jit", "_progress", "_resample", "_text", "_units", "kernels"},
    {"trace", "formats", "wall"},
    {"scorer"},
    {"policies"},
    {"cache"},
    {"sim", "analysis"},
    {"bounds", "costmodel", "learn", "tier", "grid", "report"},
    {"hf", "llama"},
    {"routetune"},
    {"cli", "__main__"},
]
"""Floors, bottom first, by the first name below ``expertcache`` (docs/design.md)."""


def floor_of(mod: str) -> int | None:
    head = mod.split(".")[1] if "." in mod else ""
    for i, names in enumerate(FLOORS):
        if head in names:
            return i
    return 0 if mod.count(".") == 1 else None


def module_name(path: Path, src: Path) -> str:
    rel = path.relative_to(src.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def edges(src: Path):
    """``(importer, imported, inner, type_checking)`` for every import of a package module."""
    mods = {module_name(p, src): p for p in src.rglob("*.py")}
    out = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        is_pkg = path.name == "__init__.py"

        def visit(node, inner: bool, tc: bool):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    for c in child.body:
                        visit_one(c, inner, True)
                    for c in child.orelse:
                        visit_one(c, inner, tc)
                    continue
                visit_one(child, inner, tc)

        def visit_one(child, inner, tc):
            if isinstance(child, ast.Import):
                for a in child.names:
                    add(a.name, inner, tc)
            elif isinstance(child, ast.ImportFrom):
                target = resolve(mod, is_pkg, child)
                for a in child.names:
                    full = f"{target}.{a.name}"
                    add(full if full in mods else target, inner, tc)
            else:
                visit(child, inner or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)), tc)

        def add(name, inner, tc):
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != mod and name.startswith(src.name):
                out.append((mod, name, inner, tc))

        visit(tree, False, False)
    return mods, out


def circles(nodes, arcs) -> list[list[str]]:
    """Tarjan's strongly connected components of two or more modules."""
    graph = {n: set() for n in nodes}
    for a, b in arcs:
        graph[a].add(b)
    index, low, stack, on, out = {}, {}, [], set(), []
    sys.setrecursionlimit(10000)

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for n in sorted(graph):
        if n not in index:
            strong(n)
    return out


def figures(src: Path) -> dict:
    mods, es = edges(src)
    top = src.name
    loose = sorted(m for m, p in mods.items() if m.count(".") == 1 and p.name not in ("__init__.py", "__main__.py"))
    run = {(a, b) for a, b, _, tc in es if not tc and not b.endswith("__init__") and b != top}
    # an import of a package's __init__ is not an arrow into every module of it: drop package nodes
    pkgs = {m for m, p in mods.items() if p.name == "__init__.py"}
    arcs = {(a, b) for a, b in run if a not in pkgs and b not in pkgs}
    up = sorted({(a, b) for a, b in run if floor_of(a) is not None and floor_of(b) is not None
                 and floor_of(b) > floor_of(a)})
    inner = sorted({(a, b) for a, b, i, tc in es if i and not tc})
    lines = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in mods.values())
    return {"files": len(mods), "lines": lines, "loose": loose, "circles": circles(mods, arcs),
            "up": [f"{a} -> {b}" for a, b in up], "inner_imports": len(inner)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=str(REPO / "src" / "expertcache"), help="the package's folder")
    ap.add_argument("--json", action="store_true", help="one JSON object")
    args = ap.parse_args(argv)
    src = Path(args.src)
    if not (src / "__init__.py").is_file():
        print(f"import_graph: {src}: not a package folder", file=sys.stderr)
        return 2
    f = figures(src)
    if args.json:
        print(json.dumps(f, indent=1))
        return 0
    print(f"{f['files']} files, {f['lines']} lines; {len(f['loose'])} loose top-level modules, "
          f"{len(f['circles'])} circles, {len(f['up'])} arrows up, {f['inner_imports']} imports inside functions")
    for name in ("loose", "circles", "up"):
        for x in f[name]:
            print(f"  {name}: {' <-> '.join(x) if isinstance(x, list) else x}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
