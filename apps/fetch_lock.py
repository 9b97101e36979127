"""The data folder's fetch lock (one fetch at a time; `specbeam rm` refused while one runs) and the removal of what
a killed fetch left behind (staged folders and files), done only while no fetch runs.
"""
from __future__ import annotations

import shutil
from contextlib import contextmanager, suppress

from specbeam_edge.fetch import FetchError, data_dir, models_dir, sources_dir

LOCK = ".fetch.lock"             # in <data>/models: one fetch at a time


@contextmanager
def data_folder_lock(command: str, log=None):
    """The data folder's fetch lock, so staged folders of a fetch that was killed can be removed safely by the
    next one: one fetch at a time, a second waiting (and saying so through `log`); without `log` (specbeam rm) a
    running fetch is refused with what to do, not waited for."""
    from filelock import FileLock, Timeout

    path = models_dir() / LOCK
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise FetchError(f"{path} is a symbolic link or not a file (fetch never makes one); remove it and run "
                         f"`specbeam {command}` again")
    lock = FileLock(str(path))
    try:
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if log is None:
                raise FetchError(f"a `specbeam fetch` is running on {data_dir()}; run `specbeam {command}` again "
                                 f"once it has finished") from None
            log("another `specbeam fetch` is running on this data folder; waiting for it")
            lock.acquire()
    except OSError as e:
        raise FetchError(f"cannot lock {path} ({e.strerror or e}); remove it (or check the folder's permissions) "
                         f"and run `specbeam {command}` again") from None
    try:
        yield
    finally:
        lock.release()


def remove_stale() -> None:
    """Staged folders and files left by a fetch that was killed (SIGKILL, power loss): no fetch holds them now.
    A join stages a file (`_staged_file`), not a folder: rmtree alone left it (up to a model's size)."""
    for parent, pattern in ((models_dir(), ".*.partial-*"), (models_dir(), ".*.old-*"),
                            (sources_dir(), ".download-*")):
        if parent.is_dir():
            for p in parent.glob(pattern):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    with suppress(OSError):
                        p.unlink()


def remove_stale_if_idle() -> None:
    """`remove_stale` when no fetch runs now: a fetch of a model already there takes no lock, and would
    otherwise never clean up after a killed one."""
    from filelock import FileLock, Timeout

    path = models_dir() / LOCK
    if not models_dir().is_dir() or path.is_symlink():
        return
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except (Timeout, OSError):
        return
    try:
        remove_stale()
    finally:
        lock.release()
