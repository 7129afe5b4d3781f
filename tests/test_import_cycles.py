"""`specdeploy/` has no import cycles (DESIGN.md: nothing below a layer imports from above it).

Every import statement counts, at module level or inside a function (a lazy import is still a
dependency); only `if TYPE_CHECKING:` blocks are left out, as they never run.
"""
from __future__ import annotations

import ast
from pathlib import Path

import specdeploy

ROOT = Path(specdeploy.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for f in ROOT.rglob("*.py"):
        parts = ["specdeploy", *f.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = f
    return mods


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_lines(tree)
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for a in node.names:  # `from pkg import submodule` depends on the submodule
                    deps.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = import_graph()  # the graph is real: known edges are present
    assert "specdeploy.deploy.pipeline" in graph["specdeploy.deploy.build"]
    assert "specdeploy.checkpoint.errors" in graph["specdeploy.checkpoint.gguf"]
