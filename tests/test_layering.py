"""The package's import graph, read with ``ast``: no cycle between modules, no upward import.

Every ``import`` / ``from ... import`` of a ``kvserve`` module counts: at module level, inside
functions (a function-local import defers a cycle to run time, it does not remove it) and
under ``if TYPE_CHECKING:`` (a cycle of types is still a cycle of modules). Not counted: the
implicit import of a module's parent packages, and registries that import by name
(``importlib.import_module``).

``LAYERS`` is the layer order, bottom to top: a module may import modules of its own layer or
of a lower one. The foundation and core layers may in addition import only the standard
library and ``CORE_THIRD_PARTY`` (the scheduler side runs without torch).
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple, Optional

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "kvserve"

#: Bottom to top; a module's layer is that of the longest package prefix listed here that names
#: it ("kvserve" alone is the root package's ``__init__``). A new package must be placed here.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("kvserve.logger", "kvserve.utils", "kvserve.config", "kvserve.sampling_params",
                    "kvserve.request", "kvserve.outputs")),
    # The scheduler side, pure Python. The dynamic-speculation policy is the scheduler's (no torch),
    # kept beside the proposers.
    ("core", ("kvserve.core", "kvserve.spec_decode.dynamic")),
    ("attention", ("kvserve.distributed", "kvserve.attention")),
    ("model", ("kvserve.layers", "kvserve.models", "kvserve.model_loader", "kvserve.sample",
               "kvserve.structured_output", "kvserve.kv_connector")),
    ("worker", ("kvserve.worker", "kvserve.spec_decode")),
    # The root package is the offline API (LLM, SamplingParams, RequestOutput).
    ("engine", ("kvserve.executor", "kvserve.engine", "kvserve")),
    # Offline tools over the LLM API: benchmarks, the EAGLE / EAGLE-3 heads' self-distillation
    # trainers and their prompt set.
    ("tools", ("kvserve.bench", "kvserve.spec_decode.train_eagle", "kvserve.spec_decode.train_eagle3",
               "kvserve.spec_decode.train_prompts")),
    ("server", ("kvserve.entrypoints.openai", "kvserve.metrics")),
    ("router", ("kvserve.router",)),
    ("cli", ("kvserve.entrypoints",)),
]

#: Third-party packages the foundation and core layers may import (besides the standard library).
CORE_THIRD_PARTY = {"numpy", "msgspec"}
NO_TORCH_LAYERS = ("foundation", "core")



class Edge(NamedTuple):
    src: str
    dst: str
    line: int
    local: bool  # inside a function

    def __str__(self) -> str:
        where = "function-local" if self.local else "module level"
        return f"{self.src} -> {self.dst}  ({module_file(self.src)}:{self.line}, {where})"


def module_files() -> dict[str, Path]:
    out = {}
    for p in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(p.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


MODULES = module_files()


def module_file(mod: str) -> str:
    return str(MODULES[mod].relative_to(PACKAGE_DIR.parent))


def _imports(tree: ast.AST):
    """(node, inside a function) for every import statement."""
    def walk(node: ast.AST, local: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, local
            yield from walk(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    yield from walk(tree, False)


def _absolute(mod: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if MODULES[mod].name == "__init__.py" else mod.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> tuple[dict[str, list[Edge]], dict[str, list[tuple[str, int, bool]]]]:
    """``kvserve`` edges per module, and third-party imports per module (top-level name, line, local)."""
    edges: dict[str, list[Edge]] = {m: [] for m in MODULES}
    external: dict[str, list[tuple[str, int, bool]]] = defaultdict(list)
    for mod, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        for node, local in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = _absolute(mod, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
            for t in targets:
                if t == "kvserve" or t.startswith("kvserve."):
                    while t not in MODULES:  # ``import kvserve.x.name`` of a non-module: its module
                        t = t.rsplit(".", 1)[0]
                    e = Edge(mod, t, node.lineno, local)
                    if t != mod and e not in edges[mod]:
                        edges[mod].append(e)
                elif t and not (isinstance(node, ast.ImportFrom) and node.level):
                    external[mod].append((t.split(".")[0], node.lineno, local))
    return edges, external


def layer_of(mod: str) -> tuple[int, str]:
    best: Optional[tuple[int, int, str]] = None
    for i, (name, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            # "kvserve" names the root package itself, not everything under it.
            inside = mod == p or (p != "kvserve" and mod.startswith(p + "."))
            if inside and (best is None or len(p) > best[0]):
                best = (len(p), i, name)
    assert best is not None, f"{mod} is in no layer: add it to LAYERS"
    return best[1], best[2]


def strongly_connected(edges: dict[str, list[Edge]]) -> list[set[str]]:
    """Tarjan's strongly connected components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(edges)))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for e in edges[v]:
            if e.dst not in index:
                visit(e.dst)
                low[v] = min(low[v], low[e.dst])
            elif e.dst in on_stack:
                low[v] = min(low[v], index[e.dst])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def cycle_chain(comp: set[str], edges: dict[str, list[Edge]]) -> list[Edge]:
    """One shortest cycle through the component's first module, as its import edges."""
    start = min(comp)
    prev: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for e in edges[v]:
                if e.dst not in comp:
                    continue
                if e.dst == start:
                    chain = [e]
                    while chain[0].src != start:
                        chain.insert(0, prev[chain[0].src])
                    return chain
                if e.dst not in prev:
                    prev[e.dst] = e
                    nxt.append(e.dst)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def all_cycles() -> dict[frozenset[str], list[Edge]]:
    edges, _ = import_graph()
    return {frozenset(c): cycle_chain(c, edges) for c in strongly_connected(edges)}


def _describe(cycles: dict[frozenset[str], list[Edge]]) -> str:
    return "\n".join(f"cycle {' -> '.join([e.src for e in chain] + [chain[0].src])} ({len(c)} modules "
                     "import each other in all):\n    " + "\n    ".join(map(str, chain))
                     for c, chain in cycles.items())


def test_every_module_has_a_layer():
    for mod in MODULES:
        layer_of(mod)


def test_no_import_cycles():
    cycles = all_cycles()
    print(_describe(cycles) or "no cycles")
    assert not cycles, "import cycles (each with one closing chain of imports):\n" + _describe(cycles)


def test_no_upward_imports():
    edges, _ = import_graph()
    bad = []
    for mod, es in sorted(edges.items()):
        lo, lo_name = layer_of(mod)
        for e in es:
            hi, hi_name = layer_of(e.dst)
            if hi > lo:
                bad.append(f"{e}: layer {lo_name} imports layer {hi_name}")
    assert not bad, "imports from a lower layer to a higher one (LAYERS):\n  " + "\n  ".join(bad)


def test_bench_does_not_import_entrypoints():
    edges, _ = import_graph()
    bad = [str(e) for m, es in edges.items() if m.startswith("kvserve.bench") for e in es
           if e.dst.startswith("kvserve.entrypoints")]
    assert not bad, "kvserve.bench imports kvserve.entrypoints:\n  " + "\n  ".join(bad)


def test_core_is_pure_python():
    """Foundation and core: the standard library, ``CORE_THIRD_PARTY`` and themselves only (no torch)."""
    _, external = import_graph()
    bad = []
    for mod, imps in sorted(external.items()):
        if layer_of(mod)[1] not in NO_TORCH_LAYERS:
            continue
        for name, line, local in imps:
            if name not in sys.stdlib_module_names and name not in CORE_THIRD_PARTY:
                bad.append(f"{module_file(mod)}:{line} imports {name}" + (" (function-local)" if local else ""))
    assert not bad, "third-party imports in the torch-free layers:\n  " + "\n  ".join(bad)


if __name__ == "__main__":  # print every cycle (python tests/test_layering.py)
    print(_describe(all_cycles()) or "no cycles")
