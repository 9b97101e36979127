"""`specbeam list` and `specbeam rm NAME`: the fetched models in the per-user data folder with their disk use, and
their removal (an app beside the fetch app, whose lock it takes: a removal never races a fetch).

    specbeam list                        # each fetched model: its folders, its kept sources, complete or not
    specbeam rm qwen2.5-coder-1.5b       # its folder and its draft's (the 0.5B is fetched as its draft)
    specbeam rm smollm2 --sources        # also the kept GGUF, which a later fetch downloads again

A model's folders are its model folder under <data>/models, the draft `specbeam fetch` built beside it, and the
model that drafts for it (Source.draft_model); its sources are the checked GGUF kept in <data>/sources and the
parts of one still being downloaded.
"""
from __future__ import annotations

import argparse
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

from specbeam_edge.fetch import (ENV, SOURCES, FetchError, data_dir, draft_folder, folder, is_complete, is_name,
                                 models_dir, source, sources_dir)

from .fetch_gguf import parts_dir
from .fetch_lock import LOCK, data_folder_lock


def disk_use(path: Path) -> int:
    """Bytes a file or folder takes on disk (its allocated blocks where the system counts them; links are not
    followed); 0 when it is missing or unreadable."""
    try:
        st = path.lstat()
    except OSError:
        return 0
    own = st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size
    if not stat.S_ISDIR(st.st_mode):
        return own
    try:
        return own + sum(disk_use(p) for p in path.iterdir())
    except OSError:
        return own


def size_text(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MB"


def own_folders(name: str) -> list[Path]:
    """The model folder of `name` and the draft built beside it, present or not."""
    return [folder(name), draft_folder(name)]


def own_sources(name: str) -> list[Path]:
    """The kept GGUF of `name` and the folder of its parts while they download, present or not."""
    src = source(name)
    return [sources_dir() / src.member, parts_dir(src)]


def present(name: str) -> bool:
    return any(os.path.lexists(p) for p in own_folders(name) + own_sources(name))


def fetched_names() -> list[str]:
    """The registry's names with anything of theirs in the data folder, in the registry's order."""
    return [n for n in SOURCES if present(n)]


def fetch_running() -> bool:
    """Whether a `specbeam fetch` holds the data folder's lock now (probed without waiting, and let go at once)."""
    from filelock import FileLock, Timeout

    path = models_dir() / LOCK
    if path.is_symlink() or not path.is_file():
        return False
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return True
    except OSError:
        return False
    lock.release()
    return False


def state(name: str, running: bool = False) -> str:
    """Complete, being fetched (while a fetch runs), incomplete (with the fix), or only its source kept; and whom
    it drafts for, or is drafted by."""
    path = folder(name)
    what = "complete" if is_complete(path) else "being fetched (a `specbeam fetch` is running)" if running else \
        f"incomplete: `specbeam fetch {name} --force` exports it again" if os.path.lexists(path) else \
        "not fetched, its source kept"
    draft = source(name).draft_model
    if draft:
        what += f", drafted by {draft}" + ("" if is_complete(folder(draft)) else " (not fetched)")
    users = [n for n, s in SOURCES.items() if s.draft_model == name]
    return what + (f", the draft of {', '.join(users)}" if users else "")


def cmd_list() -> int:
    names, running = fetched_names(), fetch_running()
    if not names:
        doing = "yet; a `specbeam fetch` is running" if running else \
            f"(`specbeam fetch NAME`: {', '.join(SOURCES)}; {ENV} picks another data folder)"
        print(f"specbeam: no fetched models in {data_dir()} {doing}", file=sys.stderr)
        return 0
    rows = [("NAME", "MODEL", "SOURCES", "STATE")]
    for n in names:
        rows.append((n, size_text(sum(map(disk_use, own_folders(n)))), size_text(sum(map(disk_use, own_sources(n)))),
                     state(n, running)))
    wide = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, wide)) + "  " + r[3])
    print(f"{size_text(disk_use(data_dir()))} in {data_dir()}")
    return 0


class Unremoved(Exception):
    """A removal that failed: the error, and where what was not removed now is."""

    def __init__(self, error: OSError, left: Path):
        super().__init__(error)
        self.error, self.left = error, left


def _delete(path: Path) -> None:
    """A link or file is unlinked; a model folder is first renamed to a staged name (`.NAME.old-*`, which the next
    fetch removes if this is killed midway), so it is never found half removed. A failure raises Unremoved."""
    where = path
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink()
            return
        if path.parent == models_dir():
            gone = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            try:
                path.rename(gone / path.name)
            except OSError:
                gone.rmdir()
                raise
            where = gone
        shutil.rmtree(where)
    except OSError as e:
        raise Unremoved(e, where) from None


def _left(paths: list[Path]) -> str:
    """What is still there, with its disk use."""
    return ", ".join(f"{p} ({size_text(disk_use(p))})" for p in paths if os.path.lexists(p)) or "nothing"


def targets(name: str, sources: bool) -> list[Path]:
    """What `specbeam rm name` removes, present ones only: its folders and its draft model's, and with sources
    their kept sources."""
    names = [name] + ([source(name).draft_model] if source(name).draft_model else [])
    paths = [p for n in names for p in own_folders(n) + (own_sources(n) if sources else [])]
    return [p for p in paths if os.path.lexists(p)]


def cmd_rm(name: str, sources: bool) -> int:
    have = fetched_names()
    if not is_name(name) or source(name).name not in have:
        raise FetchError(f"no fetched model named {name!r}: "
                         + (f"the fetched ones are {', '.join(have)}" if have else f"none is in {data_dir()}"))
    name = source(name).name
    with data_folder_lock("rm"):
        todo = targets(name, sources)
        for i, path in enumerate(todo):
            size = disk_use(path)
            try:
                _delete(path)
            except Unremoved as e:
                left = _left([e.left] + todo[i + 1:])
                raise FetchError(f"cannot remove {path} ({e.error.strerror or e.error}); left {left}: check the "
                                 f"permissions and remove them yourself") from None
            print(f"removed {path} ({size_text(size)})")
    kept = [p for n in [name, source(name).draft_model] if n for p in own_sources(n) if os.path.lexists(p)]
    if kept:
        print(f"specbeam: kept {', '.join(map(str, kept))} ({size_text(sum(map(disk_use, kept)))}) for a later fetch; "
              f"`specbeam rm {name} --sources` removes it", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    """`specbeam list` and `specbeam rm` (the launcher hands both here); errors are one line, exit 2."""
    ap = argparse.ArgumentParser(prog="specbeam", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the fetched models: disk use of their folders and kept sources, complete or not",
                   description=f"The fetched models in the data folder ({ENV} overrides): the disk use of each one's "
                               f"folders (its draft's included) and of its kept sources, and whether it is complete.")
    r = sub.add_parser("rm", help="remove a fetched model's folder and its draft's",
                       description="Remove a fetched model's folder and its draft's (for qwen2.5-coder-1.5b: the "
                                   "0.5B that drafts for it); its kept sources stay unless --sources.")
    r.add_argument("name", help="a fetched model's name (specbeam list shows them)")
    r.add_argument("--sources", action="store_true",
                   help="also remove its kept sources (the checked GGUF; a later fetch downloads it again)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return cmd_list() if args.cmd == "list" else cmd_rm(args.name, args.sources)
    except FetchError as e:
        print(f"specbeam: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
