"""Where an export may write, and how it replaces a previous one without ever losing both.

An export runs for minutes and then puts a finished folder in place, so everything that could make that last
step fail or destroy data is checked first (`check_output`): a file or a symbolic link where the folder goes,
an unwritable parent, and with --overwrite anything that is not a previous export, above all a folder that is,
contains or lies inside the input (deleting it would delete the source). The replacement itself
(`replace_folder`) renames the old folder aside, the new one in, and only then deletes the old one; what the old
folder holds that no export writes (EXPORT_NAMES: notes, another model in a subfolder) moves into the new one.
"""
from __future__ import annotations

import errno
import os
import shutil
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

from specbeam_edge.contract import file_sha256  # noqa: F401  (export.core and encdec import it from here)

from .hf import ExportError


def umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def make_staging(dst: Path) -> Path:
    """An empty temporary folder beside `dst` with the permissions mkdir would give it: mkdtemp makes 0700, so
    another account could not read the exported model."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    tmp.chmod(0o777 & ~umask())
    return tmp


@contextmanager
def signals_deferred():
    """SIGINT and SIGTERM wait until the block is done (a swap of two folders must not stop halfway) and are
    delivered when it ends. Outside the main thread signals cannot be caught: the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {sig: signal.signal(sig, lambda n, _frame: got.append(n)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for n in got:
            signal.raise_signal(n)


# the top-level names an export writes (whole, split, encoder-decoder; an attach's leftovers): --overwrite replaces
# these and keeps everything else (tests/test_export_safety.py checks that every export's names are here)
EXPORT_NAMES = frozenset({"specbeam_config.json", "specbeam_config.json.tmp", "tokenizer.json",
                          "tokenizer_config.json", "weights", "model.onnx.ahead.tmp",
                          *(f"{g}{ext}" for g in ("model", "encoder", "layer", "layer_resident", "head")
                            for ext in (".onnx", ".onnx.data"))})


def _foreign(folder: Path, new: Path) -> list[str]:
    """The names in `folder` that no export writes and the new export `new` does not hold: kept on overwrite."""
    return sorted(p.name for p in folder.iterdir() if p.name not in EXPORT_NAMES and not (new / p.name).exists())


def replace_folder(tmp: Path, dst: Path) -> None:
    """Put the finished folder `tmp` at `dst`. What the old `dst` holds that no export writes moves into `tmp`
    first; then `dst` is renamed aside, the new one renamed in, and only then is the old one deleted (when a rename
    fails the old folder and its other entries go back): an interrupt at any point leaves the old or the new
    export at `dst`, never neither, and never loses a file the export did not write."""
    if not dst.exists():
        tmp.rename(dst)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old.", dir=dst.parent))
    swapped, moved = False, []
    try:
        with signals_deferred():
            for name in _foreign(dst, tmp):
                (dst / name).rename(tmp / name)
                moved.append(name)
            dst.rename(aside)              # onto the empty folder mkdtemp reserved: one atomic rename
            try:
                tmp.rename(dst)
                swapped = True
            except BaseException:
                aside.rename(dst)          # the old export goes back
                raise
    finally:                               # also when a deferred Ctrl-C arrives at the end of the swap
        if swapped:
            shutil.rmtree(aside, ignore_errors=True)
        else:
            for name in moved:             # before the staged folder is removed
                (tmp / name).rename(dst / name)
            if aside.is_dir() and not any(aside.iterdir()):
                aside.rmdir()


def _within(a: Path, b: Path) -> bool:
    """a is b or lies inside it (both resolved)."""
    return a == b or b in a.parents


def check_output(src: Path, dst: Path, overwrite: bool) -> None:
    """Refuse, before any work, an output the export could not write or must not replace (module docstring)."""
    if dst.is_symlink():
        raise ExportError(f"output {dst} is a symbolic link; pass the folder it points to ({dst.resolve()}) or "
                          f"another path")
    if dst.exists() and not dst.is_dir():
        raise ExportError(f"output {dst} exists and is not a folder; choose another -o or remove the file")
    s, d = src.resolve(), dst.resolve()
    if _within(s, d):
        what = "is" if s == d else "contains"
        raise ExportError(f"output {dst} {what} the input {src}; choose an -o outside the input "
                          f"(--overwrite would delete it)")
    if _within(d, s) and src.is_dir():
        raise ExportError(f"output {dst} lies inside the input folder {src}; choose an -o outside the input")
    if dst.exists() and not overwrite:
        raise ExportError(f"output folder {dst} exists; pass --overwrite to replace it")
    if dst.exists() and any(dst.iterdir()) and not (dst / "specbeam_config.json").is_file():
        raise ExportError(f"output folder {dst} is not a specbeam model folder (no specbeam_config.json): "
                          f"--overwrite replaces only a previous export; choose another -o or empty it yourself")
    parent = next(p for p in d.parents if p.exists())
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"cannot write into {parent} (permission denied or a read-only file system); choose "
                          f"another -o")


_HINTS = {errno.ENOSPC: "free space or choose another -o", errno.EDQUOT: "free space or choose another -o",
          errno.EROFS: "choose a writable -o", errno.EACCES: "check the permissions or choose another -o",
          errno.EPERM: "check the permissions or choose another -o"}


def os_error_message(e: OSError) -> str:
    """A failed read or write (a full or read-only disk, a permission) as one line; the partial export has
    already been removed by then."""
    where = f": {e.filename}" if e.filename else ""
    hint = _HINTS.get(e.errno, "fix it and run the export again")
    return f"{e.strerror or e}{where}; no partial export was left: {hint}"
