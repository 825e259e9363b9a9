"""The package's layers (issue 23, item 5): no import cycle between its packages and top-level
modules, counting imports inside functions too (a cycle closed by a function-level import is still
one). ``TYPE_CHECKING`` imports (annotations only) do not count.

Layers, bottom up (each imports only what is below it): the floors of docs/design.md, section 1
(errors, _jit, kernels -> trace, formats, wall -> scorer -> policies -> cache -> sim -> studies ->
hf, llama -> routetune -> cli). The module-level figures (circles between modules, arrows from
a floor to a higher one, loose top-level modules) come from ``tools/import_graph.py``, a second
reading of the imports written apart from this one."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "expertcache"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "expertcache"


def import_graph() -> dict[str, set[str]]:
    """Unit -> units it imports (a unit: a subpackage or a top-level module of expertcache)."""
    mods = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {id(n) for top in tree.body if isinstance(top, ast.If) and "TYPE_CHECKING" in ast.unparse(top.test)
                       for n in ast.walk(top)}
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or id(node) in typing_only:
                continue
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                target = base + ("." + node.module if node.module else "")
            elif (node.module or "").startswith("expertcache"):
                target = node.module
            else:
                continue
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods]
            for t in (subs if node.module is None and subs else [target, *subs]):
                if t in mods and _unit(t) != _unit(name):
                    graph[_unit(name)].add(_unit(t))
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one unit (each is an import cycle)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
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

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_the_packages_import_no_cycle():
    assert strongly_connected(import_graph()) == []


def test_the_scorer_layer_sits_below_policies():
    g = import_graph()
    assert "policies" in g["learn"] and "scorer" in g["policies"] and "scorer" in g["learn"]
    assert not g["scorer"] & {"policies", "learn", "sim", "cache", "cli", "hf"}
    assert not g["policies"] & {"learn", "sim", "hf", "cli"}
    assert not g["learn"] & {"cli"}


def test_the_checker_sees_a_cycle():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_modules_sit_on_their_floors():
    """No circle between two modules, no import from a floor to a higher one, at most nine loose
    top-level modules (what every floor shares), by ``tools/import_graph.py`` (issue 35)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("import_graph", PKG.parents[1] / "tools" / "import_graph.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    f = tool.figures(PKG)
    assert f["circles"] == [] and f["up"] == []
    assert len(f["loose"]) <= 9, f["loose"]
    assert tool.circles(["a", "b", "c"], {("a", "b"), ("b", "a"), ("b", "c")}) == [["a", "b"]]
