"""A whole-layout folder's graph files against the SHA-256 the exporter recorded (`files.sha256`).

The first load of a file version reads and hashes it; the result is remembered per machine in the cache folder,
keyed by the file's path, size, mtime, ctime and inode, so later loads cost a stat, not a read of the weights.
Any write to the file (a copy over it, an edit, a truncation) changes its mtime or ctime and brings the hash
back; damage that changes no metadata after the first load (a failing disk) is not seen again. Split folders
check each layer file on its first read in a process (offload.LayerStore); their embedding table, read a few rows a
pass, is checked through the open file it reads (`verify_open`), at load and again whenever its identity changes.
Folders exported before the fields load as they did.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ..cachefile import cache_dir, entries, store_entry
from ..config import ModelFolderError
from ..contract import file_sha256

CACHE_FILE = "verified.json"


def verify(folder: Path, sums: dict | None) -> None:
    """Every file `sums` names ({name: hex SHA-256}, relative to folder) has its recorded SHA-256; a mismatch is
    one line naming the file and the fix."""
    path = cache_dir() / CACHE_FILE
    seen = entries(path)
    for name, want in (sums or {}).items():
        file = Path(folder) / name
        key, stamp = _stamp(file)
        if seen.get(key) == [stamp, want]:
            continue
        got = file_sha256(file)
        if got != want:
            raise ModelFolderError(f"{file}: SHA-256 {got[:12]}... does not match the {want[:12]}... recorded at "
                                   f"export (the file was damaged or replaced); restore it or re-export the model")
        store_entry(path, key, [stamp, want])


def verify_open(file: Path, fd: int, want: str) -> os.stat_result:
    """The open file `fd` (file's) against its recorded SHA-256: a version known to match (same identity: size,
    mtime, ctime, inode; in the cache) costs an fstat, another is read through fd and hashed. Returns the
    stat of the version checked; a mismatch is one line naming the file and the fix."""
    st = os.fstat(fd)
    key, stamp = str(Path(file).resolve()), [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    path = cache_dir() / CACHE_FILE
    if entries(path).get(key) != [stamp, want]:
        h = hashlib.sha256()
        os.lseek(fd, 0, os.SEEK_SET)
        while block := os.read(fd, 1 << 20):
            h.update(block)
        if h.hexdigest() != want:
            raise ModelFolderError(f"{file}: SHA-256 {h.hexdigest()[:12]}... does not match the {want[:12]}... "
                                   f"recorded at export (the file was damaged or replaced); restore it or re-export "
                                   f"the model")
        store_entry(path, key, [stamp, want])
    return st


def _stamp(file: Path) -> tuple[str, list[int]]:
    """(cache key, the file's version): its resolved path; size, mtime, ctime and inode."""
    st = os.stat(file)
    return str(Path(file).resolve()), [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
