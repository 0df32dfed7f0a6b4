"""spd's modules import downward only: the graph of its own imports has no cycle.

Edges are read from the source with ast (nothing is imported): every `from .x import y`,
`from ..x import y`, `from spd.x import y` and `import spd.x`, at module level AND inside
functions. A lazy in-function import counts like a top-level one: it only moves the cycle to
run time, and the two modules still each need the other. `from . import name` is an edge to the
submodule `name` when there is one, else to the package's `__init__`. The implicit import of a
module's parent package (`spd.bench` before `spd.bench.harness`) is not an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "spd"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_edges(root: Path = SRC) -> dict[str, set[str]]:
    """{module: the spd modules it imports}, read with ast from every .py file under `root`."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.add(sub if sub in modules else target)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        edges[name] = {t for t in found if t in modules and t != name}
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, iterative)."""
    state = {}   # 1: on the current path, 2: done
    for start in sorted(edges):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(edges[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(edges[nxt])))
    return None


def test_spd_imports_have_no_cycle():
    edges = import_edges()
    assert len(edges) > 50 and "spd.engine" in edges and "spd.cli" in edges   # it read the package
    cycle = find_cycle(edges)
    assert cycle is None, ("import cycle: " + " -> ".join(cycle) + ". Move what both need into a lower "
                           "module that imports neither.")


@pytest.mark.parametrize("lazy", [False, True])
def test_a_cycle_is_found_at_module_level_and_inside_functions(tmp_path, lazy):
    """The must-fail control: two modules that import each other, one of them lazily or not."""
    pkg = tmp_path / "spd"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "low.py").write_text("from .sub.high import thing\n")
    body = "def f():\n    from ..low import other\n" if lazy else "from spd import low\n"
    (pkg / "sub" / "high.py").write_text(body)
    edges = import_edges(pkg)
    assert edges["spd.low"] == {"spd.sub.high"} and edges["spd.sub.high"] == {"spd.low"}
    assert find_cycle(edges) in (["spd.low", "spd.sub.high", "spd.low"], ["spd.sub.high", "spd.low", "spd.sub.high"])
    (pkg / "sub" / "high.py").write_text("x = 1\n")
    assert find_cycle(import_edges(pkg)) is None
