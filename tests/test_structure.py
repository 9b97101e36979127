"""Issue 48: the runtime stays readable. No import circle between specbeam_edge's modules (counting imports for
annotations and inside functions: each is a dependency a reader follows), no runtime file over 500 lines and no
function over 60."""
import ast
from pathlib import Path

import specbeam_edge

ROOT = Path(specbeam_edge.__file__).parent
MODULES = {p.stem: p for p in ROOT.glob("*.py")}


def imports_of(path: Path) -> set[str]:
    """The package modules `path` imports, by any import statement anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 1 or (node.module or "").split(".")[0] == "specbeam_edge":
            parts = (node.module or "").split(".")[1 if node.level == 0 else 0:]
            if parts and parts[0]:
                out.add(parts[0])
            else:
                out |= {a.name for a in node.names}
    return out & set(MODULES)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
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
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_the_runtime():
    assert cycles({name: imports_of(path) for name, path in MODULES.items()}) == []


def test_the_cycle_finder_finds_a_planted_circle():
    """batch <-> cache as it was before issue 48 (cache imported batch for `TreeCache.score`, batch imported
    cache for its annotations)."""
    graph = {name: imports_of(path) for name, path in MODULES.items()}
    graph["cache"] = graph["cache"] | {"batch"}
    assert any({"batch", "cache"} <= set(comp) for comp in cycles(graph))


def test_runtime_files_and_functions_stay_short():
    long_files = [f"{p.name}: {n} lines" for p in MODULES.values()
                  if (n := len(p.read_text().splitlines())) > 500]
    long_functions = []
    for p in MODULES.values():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    long_functions.append(f"{p.name}:{node.lineno} {node.name}: {n} lines")
    assert long_files == [] and long_functions == []
