"""Issue 48: the runtime stays readable. No import circle between specbeam_edge's modules (counting imports for
annotations and inside functions: each is a dependency a reader follows), no runtime file over 500 lines and no
function over 60."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

import specbeam_edge

ROOT = Path(specbeam_edge.__file__).parent
# every module of the runtime by its name (names are unique across its folders), the folders' __init__ aside
MODULES = {p.stem: p for p in sorted(ROOT.rglob("*.py")) if p.name != "__init__.py" or p.parent == ROOT}


def imports_of(path: Path) -> set[str]:
    """The package modules `path` imports, by any import statement anywhere in it (`from .execution.model import
    X` and `from .execution import model` both name `model`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level >= 1 or (node.module or "").split(".")[0] == "specbeam_edge":
            out |= set((node.module or "").split(".")) | {a.name for a in node.names}
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


MAX_FILE, MAX_FUNCTION = 500, 60
PROJECT = ROOT.parent


def too_long(paths, root: Path = PROJECT) -> list[str]:
    """Files over MAX_FILE lines and functions over MAX_FUNCTION, named with their sizes."""
    out = []
    for p in paths:
        text = p.read_text()
        if (n := len(text.splitlines())) > MAX_FILE:
            out.append(f"{p.relative_to(root)}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION:
                    out.append(f"{p.relative_to(root)}:{node.lineno} {node.name}: {n} lines")
    return out


def test_runtime_files_and_functions_stay_short():
    assert too_long(MODULES.values()) == []


@pytest.mark.parametrize("folder", ["export", "apps", "models"])
def test_the_exporter_apps_and_model_scripts_keep_the_size_rules(folder):
    """Issue 65 item 4: the runtime's size rules hold outside it too (apps/chat/window.py was 1,002 lines,
    models/train.py's train_lm 164)."""
    if not (PROJECT / folder).is_dir():
        pytest.skip(f"{folder}/ is not installed beside the package")
    assert too_long(sorted((PROJECT / folder).rglob("*.py"))) == []


def test_the_size_check_finds_a_planted_long_file_and_function(tmp_path):
    planted = tmp_path / "long.py"
    planted.write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION + "\n" * (MAX_FILE - MAX_FUNCTION))
    assert too_long([planted], tmp_path) == [f"long.py: {MAX_FILE + 1} lines", f"long.py:1 f: {MAX_FUNCTION + 1} lines"]
    planted.write_text("def f():\n" + "    x = 1\n" * (MAX_FUNCTION - 1))
    assert too_long([planted], tmp_path) == []


# the exporter and the apps import the runtime, never the reverse (an install may hold the runtime alone)
OUTSIDE = ("export", "apps", "specbeam_export", "specbeam_apps")


def outside_imports(path: Path) -> list[str]:
    """`path`'s imports of the exporter or the apps: import statements anywhere in it, and import_module /
    __import__ calls with a literal name."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and \
                getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__"):
            names = [str(node.args[0].value)]
        out += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] in OUTSIDE]
    return out


def test_the_runtime_imports_neither_the_exporter_nor_the_apps():
    assert [hit for p in sorted(ROOT.rglob("*.py")) for hit in outside_imports(p)] == []


def test_the_outside_import_finder_finds_planted_imports(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import export.core\nfrom apps.translate import job\nimport importlib\n"
                       "def f():\n    from specbeam_apps import launch\n"
                       "    importlib.import_module('specbeam_export.graph')\n"
                       "import exporter\nfrom .apps import x\n")
    assert [h.split(" ", 1)[1] for h in outside_imports(planted)] == [
        "export.core", "apps.translate", "specbeam_apps", "specbeam_export.graph"]


def test_the_contract_and_the_config_load_no_onnxruntime():
    """The exporter writes its folders with specbeam_edge.contract; importing it (or the config) runs the package's
    __init__, which names the public classes lazily instead of importing the engine and so onnxruntime."""
    code = ("import sys, specbeam_edge.contract, specbeam_edge.config\n"
            "assert 'onnxruntime' not in sys.modules, 'onnxruntime loaded'\n"
            "from specbeam_edge import Engine, SpeculativeConfig, fetch\n"
            "assert 'onnxruntime' in sys.modules and Engine.__module__ == 'specbeam_edge.generate'\n"
            "import specbeam_edge\n"
            "try:\n    specbeam_edge.Nothing\nexcept AttributeError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "module 'specbeam_edge' has no attribute 'Nothing'\n"


def engine_private_uses(paths, root: Path = PROJECT) -> list[str]:
    """`x._name` anywhere in `paths` where _name is a private name of the Engine (its methods, its mixins', and
    the attributes its __init__ and _init_state set)."""
    from specbeam_edge.generate import Engine

    private = {n for n in dir(Engine) if n.startswith("_") and not n.startswith("__")}
    for source in (ROOT / "generate.py", ROOT / "search_setup.py", ROOT / "text" / "prompting.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                private.add(node.attr)
    out = []
    for p in paths:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in private and \
                    not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.append(f"{p.relative_to(root)}:{node.lineno} .{node.attr}")
    return out


def test_no_app_model_script_or_bench_calls_a_private_name_of_the_engine():
    """Issue 65 item 1: apps/translate/job.py called engine._forced_bos and ._prefix_ids, models/evaluate.py
    ._statics, bench/quant.py set ._invariance; each has a public method now (decoder_start, prefix_ids,
    encoder_outputs, skip_invariance_check)."""
    folders = [PROJECT / f for f in ("apps", "models", "bench") if (PROJECT / f).is_dir()]
    if not folders:
        pytest.skip("apps/, models/ and bench/ are not installed beside the package")
    assert engine_private_uses(sorted(p for f in folders for p in f.rglob("*.py"))) == []


def test_the_private_use_finder_finds_a_planted_call(tmp_path):
    planted = tmp_path / "app.py"
    planted.write_text("def f(engine):\n    return engine._statics([[1]], 1)\n")
    assert engine_private_uses([planted], tmp_path) == ["app.py:2 ._statics"]
