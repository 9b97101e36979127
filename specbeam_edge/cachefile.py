"""The per-machine cache folder and its JSON files: the invariance measurements (invariance.py) and the model
files already verified against their SHA-256 (integrity.py). Losing it costs time, never correctness."""
from __future__ import annotations

import json
import os
from pathlib import Path


def cache_dir() -> Path:
    """SPECBEAM_CACHE_DIR, else <SPECBEAM_DATA_DIR>/cache (a user who moved the data out of the home folder moved
    all of it), else the per-user cache folder (platformdirs)."""
    env = os.environ.get("SPECBEAM_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    data = os.environ.get("SPECBEAM_DATA_DIR")      # fetch.ENV (not imported: fetch reads config, this nothing)
    if data:
        return Path(data).expanduser() / "cache"
    import platformdirs

    return Path(platformdirs.user_cache_dir("specbeam-edge"))


def entries(path: Path) -> dict:
    """The cache file's entries ({} when it is missing or damaged: a cache is never a reason to fail, and the
    next store_entry writes it anew)."""
    try:
        found = json.loads(path.read_text())
    except Exception:        # any damage: OSError, ValueError, RecursionError on deep nesting, MemoryError
        return {}
    return found if isinstance(found, dict) else {}


def store_entry(path: Path, key: str, value, keep: int | None = None) -> None:
    """Add one entry to a JSON cache file (under a file lock; a cache that cannot be written is only slower);
    `keep`: the most entries kept, the oldest dropped first."""
    from filelock import FileLock, Timeout

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock", timeout=5):
            stored = entries(path)
            stored.pop(key, None)           # a stored key moves to the end: the newest
            stored[key] = value
            for old in list(stored)[:max(0, len(stored) - keep)] if keep else ():
                del stored[old]
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(stored, indent=1))
            os.replace(tmp, path)
    except (OSError, Timeout):
        pass
