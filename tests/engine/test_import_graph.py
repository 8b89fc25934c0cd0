"""kvpilot's modules import each other without loops: read from the sources (no import runs), the
graph of module-level imports among ``kvpilot.*`` modules (engine/ and kernels/) has no cycle, and
the pairs that once formed loops (beam search and the engine core, the CUDA graphs and the model
runner, Llama and its tensor-parallel-invariant layers, the `LLM` front end and the parallel
executor) do not import each other in either direction, not even inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = {"kvpilot": REPO / "engine", "kvpilot.kernels": REPO / "kernels"}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, root in ROOTS.items():
        for f in root.rglob("*.py"):
            parts = [p for p in f.relative_to(root).with_suffix("").parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = f
    return mods


MODULES = _modules()


def _statements(tree: ast.Module, everywhere: bool):
    if everywhere:
        yield from ast.walk(tree)
        return
    todo = list(tree.body)
    while todo:  # module level: also inside if / try blocks, never inside a function or class
        node = todo.pop()
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", [])
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]


def imports(name: str, everywhere: bool = False) -> set[str]:
    """The kvpilot modules ``name`` imports (``everywhere``: also inside functions)."""
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in _statements(ast.parse(path.read_text()), everywhere):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m in MODULES and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_reader_sees_a_loop():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert "kvpilot.core.beam_search" in imports("kvpilot.core.engine_core")


def test_no_import_loop_at_module_level():
    graph = {m: imports(m) for m in MODULES}
    assert len(graph) > 50
    assert cycles(graph) == []


@pytest.mark.parametrize("a,b", [("kvpilot.core.beam_search", "kvpilot.core.engine_core"),
                                 ("kvpilot.runner.cuda_graphs", "kvpilot.runner.model_runner"),
                                 ("kvpilot.model.tp_invariant", "kvpilot.model.llama"),
                                 ("kvpilot.parallel.executor", "kvpilot.llm"),
                                 ("kvpilot.parallel.worker", "kvpilot.llm"),
                                 ("kvpilot.tools.bench_figures", "kvpilot.tools.bench")])
def test_former_loop_pairs_import_one_way_only(a, b):
    assert b not in imports(a, everywhere=True), f"{a} imports {b}"
