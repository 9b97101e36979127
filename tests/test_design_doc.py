"""docs/DESIGN.md names only what exists, and stays short enough to read.

A backticked span is a reference when it is a dotted name whose first part is a module of the package: either
`module.Name` / `module.Name.attr` (module: a `.py` file in specbeam_edge/, or a module file the design's module
table names, so a module the document promises is checked too), or a path starting with `specbeam_edge.`. Every
other span is skipped: file names (`weights/embed.bin`, `batch.py`: the last part is a file suffix), CLI flags,
ONNX tensor names (`past_key_values.{i}.key`), expressions (`generate(...)`).
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "DESIGN.md"
PACKAGE = ROOT / "specbeam_edge"
MAX_CHARS = 30_000

# a dotted name: identifiers joined by dots, nothing else (no spaces, brackets, slashes, braces, calls)
DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
# last parts that make a dotted span a file name, not an attribute
FILE_SUFFIXES = {"py", "json", "jsonl", "onnx", "bin", "data", "md", "txt", "gguf", "safetensors", "sqlite", "lock",
                 "pid", "png", "sh", "toml", "tsv", "jinja"}


def _text() -> str:
    return DESIGN.read_text(encoding="utf-8")


def _spans(text: str) -> list[str]:
    """Inline code spans outside fenced blocks; a span may continue on the paragraph's next line (as Markdown's do),
    never past a blank line."""
    prose = re.sub(r"(?ms)^```.*?^```", "", text)
    out = []
    for paragraph in re.split(r"\n\s*\n", prose):
        out += [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", paragraph)]
    return out


def _table_modules(text: str) -> set[str]:
    """Modules the design's tables name in their first column, as `name.py` or a bare `name` (the module table:
    a folder, then its modules)."""
    out = set()
    for line in text.splitlines():
        if line.startswith("|"):           # the first column: the folder and its modules
            out.update(re.findall(r"`([a-z_][a-z0-9_]*)(?:\.py)?`", line.split("|")[1]))
    return out


def _package_modules() -> dict[str, str]:
    """Every module of the package by its name (unique across its folders) -> its dotted path."""
    return {p.stem: ".".join(("specbeam_edge", *p.relative_to(PACKAGE).with_suffix("").parts))
            for p in PACKAGE.rglob("*.py") if p.stem != "__init__"}


def _modules(text: str) -> set[str]:
    return set(_package_modules()) | _table_modules(text)


def _references(text: str) -> list[str]:
    modules = _modules(text)
    refs = []
    for span in _spans(text):
        if not DOTTED.fullmatch(span):
            continue
        parts = span.split(".")
        if parts[-1] in FILE_SUFFIXES:
            continue
        if parts[0] == "specbeam_edge" or parts[0] in modules:
            refs.append(span)
    return list(dict.fromkeys(refs))


def _resolve(ref: str) -> str | None:
    """None when `ref` names something that exists, else why not. A first part that is a module's name (modules
    live in the package's folders: `decoding/`, `execution/`, ...) or a dotted path from `specbeam_edge`; the rest
    is a getattr chain."""
    parts = ref.split(".")
    if parts[0] == "specbeam_edge":
        parts = parts[1:]
        while len(parts) > 1 and (PACKAGE.joinpath(*parts[:1]).is_dir()):   # a folder: its module comes next
            parts = [f"{parts[0]}.{parts[1]}", *parts[2:]]
    if not parts:
        return None
    module = _package_modules().get(parts[0], f"specbeam_edge.{parts[0]}")
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError as e:
        return f"no module {module}" if e.name == module else f"importing {module} failed: {e}"
    where = module
    for attr in parts[1:]:
        if not hasattr(obj, attr):
            return f"{where} has no {attr!r}"
        obj, where = getattr(obj, attr), f"{where}.{attr}"
    return None


def test_design_fits_its_budget():
    n = len(_text())
    assert n <= MAX_CHARS, f"docs/DESIGN.md has {n} characters; at most {MAX_CHARS} (history goes to HISTORY.md)"


def test_module_table_names_existing_modules():
    missing = sorted(m for m in _table_modules(_text()) if m not in _package_modules())
    assert not missing, f"docs/DESIGN.md's module table names files not in specbeam_edge/: {missing}"


def test_every_module_reference_resolves():
    refs = _references(_text())
    assert len(refs) > 20, refs             # the rule still finds the document's references
    problems = [f"`{ref}`: {why}" for ref in refs if (why := _resolve(ref)) is not None]
    assert not problems, "docs/DESIGN.md names what does not exist:\n" + "\n".join(problems)


def test_the_rule_skips_what_is_not_a_reference():
    text = ("| `protocol.py` | x |\n\n`batch.score_batch` `weights/embed.bin` `batch.py` `invariance.json` "
            "`--attention fp64` `past_key_values.{i}.key` `present.{i}.key` `generate(target_prefix=...)` `specbeam\n"
            "fetch` `lm_head.token_ids` `specbeam_edge.contract` `protocol.ScoreCall`\n```\nbatch.NotInFences\n```\n")
    assert _references(text) == ["batch.score_batch", "specbeam_edge.contract", "protocol.ScoreCall"]
