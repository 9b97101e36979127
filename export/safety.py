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
import re
import shutil
import signal
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

from .hf import ExportError


def umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def make_staging(dst: Path) -> Path:
    """An empty temporary folder beside `dst` with the permissions mkdir would give it: mkdtemp makes 0700, so
    another account could not read the exported model. Its name holds this process's id, so the next export
    knows a folder whose writer is gone (`sweep_stale`)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(dst)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.export-{os.getpid()}-", dir=dst.parent))
    tmp.chmod(0o777 & ~umask())
    return tmp


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:                # another account's process
        return True
    return True


def sweep_stale(dst: Path) -> None:
    """Remove the staged and set-aside folders beside `dst` of an export whose process is gone (kill -9, power
    loss). Entries no export writes (a kill in the middle of the swap left them there) go back into `dst`
    first; one that cannot (`dst` is gone or has that name) keeps its folder, and a line says so."""
    pattern = re.compile(rf"\.{re.escape(dst.name)}\.(?:export|old)-(\d+)-\w+")
    for p in dst.parent.iterdir():
        m = pattern.fullmatch(p.name)
        if not m or p.is_symlink() or not p.is_dir() or _alive(int(m[1])):
            continue
        for name in _foreign(p, dst) if dst.is_dir() and not dst.is_symlink() else []:
            (p / name).rename(dst / name)
        if any(q.name not in EXPORT_NAMES for q in p.iterdir()):
            print(f"specbeam-export: kept {p}: a killed export left files there that it did not write; move them "
                  f"where they belong and remove the folder", file=sys.stderr)
        else:
            shutil.rmtree(p, ignore_errors=True)


class Stopped(BaseException):
    """SIGTERM or SIGHUP during an export: unwinds like Ctrl-C, so the staged folder is removed."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.name = signal.Signals(signum).name


# SIGHUP does not exist on Windows
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))


@contextmanager
def stopped_on_signal():
    """SIGTERM and SIGHUP raise `Stopped` while the block runs (their default ends the process at once and left
    the staged folder for good); a signal set to be ignored (nohup) stays ignored. Outside the main thread
    signals cannot be caught: `sweep_stale` removes what such an export leaves."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(n, _frame):
        raise Stopped(n)
    old = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS if signal.getsignal(sig) == signal.SIG_DFL}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextmanager
def signals_deferred():
    """SIGINT, SIGTERM and SIGHUP wait until the block is done (a swap of two folders must not stop halfway) and
    are delivered when it ends. Outside the main thread signals cannot be caught: the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {sig: signal.signal(sig, lambda n, _frame: got.append(n)) for sig in (signal.SIGINT, *STOP_SIGNALS)}
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
    aside = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-{os.getpid()}-", dir=dst.parent))
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
