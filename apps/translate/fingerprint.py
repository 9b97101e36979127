"""SHA-256 of a model folder's files, for the resume journal: a model replaced between an interrupt and
--resume is refused instead of mixing two models' translations in one output.

Every regular file of the folder counts (model.onnx and its external data, encoder.onnx, split layer files,
tokenizer and config), except documentation (*.md) and hidden files. Hashing a large model on every run costs
seconds, so each file's digest is cached by (real path, device, inode, size, mtime_ns, ctime_ns) in
sha256.json of the cache folder (specbeam_edge.cachefile.cache_dir): any write to a file changes its mtime or
ctime (ctime cannot be set back), so a cached digest is used only for the very bytes it was computed from. The cache is optional: a cache
that cannot be read or written is ignored.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

from specbeam_edge.cachefile import cache_dir
from specbeam_edge.contract import file_sha256

SKIP_SUFFIXES = (".md",)


def cache_path() -> Path:
    return cache_dir() / "sha256.json"


def _key(path: Path, st: os.stat_result) -> str:
    return f"{os.path.realpath(path)}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"


def _load_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except Exception:        # any damage (RecursionError on deep nesting too): the hashes are computed again
        return {}


def _save_cache(path: Path, cache: dict) -> None:
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".sha256.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(cache, f)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def folder_sha256(folder: Path) -> dict[str, str]:
    """{path relative to the folder: SHA-256} of the files that make the model (see the module docstring)."""
    where = cache_path()
    cache = _load_cache(where)
    out, dirty = {}, False
    inside = [(path, path.relative_to(folder).as_posix()) for path in sorted(folder.rglob("*"))]
    inside = [(path, rel) for path, rel in inside if not any(p.startswith(".") for p in Path(rel).parts)
              and path.suffix not in SKIP_SUFFIXES and path.is_file()]
    # a config's `files` may name a graph outside the folder: it makes the model as much as one inside
    outside = [(path, f"files: {name}") for name, path in _named_files(folder)
               if path.is_file() and not _within(path, folder)]
    for path, rel in inside + outside:
        st = path.stat()
        key = _key(path, st)
        digest = cache.get(key)
        if not isinstance(digest, str):
            digest = cache[key] = file_sha256(path)
            dirty = True
        out[rel] = digest
    if dirty:
        _save_cache(where, {k: v for k, v in cache.items() if os.path.exists(k.split("|", 1)[0])})
    return out


def _within(path: Path, folder: Path) -> bool:
    try:
        Path(os.path.realpath(path)).relative_to(os.path.realpath(folder))
        return True
    except ValueError:
        return False


def _named_files(folder: Path) -> list[tuple[str, Path]]:
    """(name as written, path) of every file specbeam_config.json's `files` names (strings, in lists or dicts)."""
    try:
        files = json.loads((folder / "specbeam_config.json").read_text()).get("files", {})
    except (OSError, ValueError, AttributeError):
        return []
    out, stack = [], [files]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            out.append((x, folder / x))
        elif isinstance(x, dict):
            stack += list(x.values())
        elif isinstance(x, list):
            stack += x
    return sorted(out)
