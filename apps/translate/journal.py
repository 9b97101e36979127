"""The resume journal of the translate tool, the lock that keeps one writer per output file, and safe writes.

Format (`<output>.journal`): a header line, then one record per finished input line, each
`<crc32 as 8 hex digits> <json>\n`. The header (`{"journal": 1, "input_sha256": ..., "settings": {...}}`) is
written to a temporary file, fsynced and renamed into place, so the journal is valid from its first byte. A
record is valid only with its newline and a matching checksum: a crash mid-write leaves a torn tail, which
resume cuts off, and a record damaged in the middle is skipped (its line is translated again) while every valid
record after it is kept. A damaged header cannot be checked against the input and settings: the journal is then
refused, never overwritten.

Every file this module writes (outputs, journal headers, lock pid files, Ray part files) goes through a temporary
file created with O_EXCL (tempfile.mkstemp) in the destination's folder, then renamed over it: a planted symlink
or a predictable name cannot redirect the write, and the destination keeps its permission bits.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import stat
import tempfile
import time
import zlib
from pathlib import Path

from specbeam_edge.contract import file_sha256

from ..launch import deliver

VERSION = 1


class JournalError(Exception):
    """The journal cannot be used as it is; the message says why and what to do."""


class Terminated(BaseException):
    """SIGTERM, raised like KeyboardInterrupt so finished lines are kept the same way."""


def raise_terminated(signum, frame):
    """The tool's SIGTERM and SIGINT handler (the local run and the Ray driver install it): Terminated or
    KeyboardInterrupt, delivered as the launcher delivers every command's signals (never lost in a finalizer)."""
    deliver(signum, frame, KeyboardInterrupt() if signum == signal.SIGINT else Terminated())


def _line(obj) -> bytes:
    body = json.dumps(obj, ensure_ascii=False, sort_keys=True).encode("utf-8")
    return b"%08x %s\n" % (zlib.crc32(body), body)


def _parse(raw: bytes):
    """The object of one journal line, or None if the line is torn or corrupted."""
    if not raw.endswith(b"\n") or len(raw) < 10 or raw[8:9] != b" ":
        return None
    body = raw[9:-1]
    try:
        if int(raw[:8], 16) != zlib.crc32(body):
            return None
        return json.loads(body)
    except ValueError:
        return None


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (the directory entry is data too)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def output_lines(done: dict[int, list[str]], first: int, n: int) -> bytes:
    """The output file's bytes for input lines first..first+n-1: each line's outputs, one per line, in order."""
    return b"".join(line.encode("utf-8") + b"\n" for i in range(first, first + n) for line in done[i])


_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def special_kind(path: Path) -> str | None:
    """'a FIFO', 'a character device', ... if `path` (a symlink followed) exists and is not a regular file."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return next((name for test, name in _KINDS if test(mode)), None)


def default_mode() -> int:
    """The permission bits a new file gets from open(): 0o666 less the umask."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def file_mode(path: Path) -> int | None:
    """The permission bits of an existing regular file, else None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return stat.S_IMODE(st.st_mode) if stat.S_ISREG(st.st_mode) else None


def atomic_write(path: Path, data: bytes, *, mode: int | None = None, follow_symlinks: bool = True) -> None:
    """Write through a temporary sibling, fsync, rename: readers see the old file or the whole new one."""
    atomic_write_chunks(path, [data], mode=mode, follow_symlinks=follow_symlinks)


def atomic_write_chunks(path: Path, chunks, *, mode: int | None = None, follow_symlinks: bool = True) -> None:
    """atomic_write of the concatenated byte strings `chunks` (an iterable: a large file is never held whole).

    The temporary file is created exclusively (mkstemp: O_EXCL, an unpredictable name) in the destination's own
    folder, so nothing planted there is followed or truncated. A symlinked destination is written at its target
    (an output the user named); with follow_symlinks=False (the tool's own files: pid file, journal, shard parts)
    the rename replaces a link planted at that name and its target is never touched. The result keeps the
    permission bits of the file it replaces; a new file gets `mode`, else the umask's."""
    if follow_symlinks:
        path = Path(os.path.realpath(path))
    else:
        path = Path(os.path.abspath(path))
    kind = None if path.is_symlink() else special_kind(path)
    if kind:
        raise JournalError(f"{path} is {kind}, not a regular file; it is never replaced: write to a file path")
    bits = file_mode(path)
    bits = bits if bits is not None else (mode if mode is not None else default_mode())
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), bits)
            for data in chunks:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    _fsync_dir(path.parent)


def _open_own(path: Path, append: bool = True):
    """One of the tool's own files for writing, never through a symbolic link (O_NOFOLLOW)."""
    flags = (os.O_WRONLY | os.O_APPEND if append else os.O_RDWR) | getattr(os, "O_NOFOLLOW", 0) | \
        getattr(os, "O_CLOEXEC", 0)
    return os.fdopen(os.open(path, flags), "ab" if append else "r+b")


class _Busy(Exception):
    pass


class _Flock:
    """An exclusive flock on a lock file that is removed on release. Whoever opened the file before the holder
    removed it and then wins the flock holds an unlinked inode: acquire() checks that the locked file is still the
    one at the path and otherwise opens the new one (the usual remove-on-release protocol)."""

    def __init__(self, path: Path):
        self.path, self.fd = path, None

    def acquire(self) -> None:
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        while True:
            fd = os.open(self.path, flags, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise _Busy() from None
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path, follow_symlinks=False))
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return
            os.close(fd)            # the holder removed it between our open and our lock: take the new file

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)    # while still locked: a later opener sees another inode and retries
        os.close(self.fd)           # closing drops the flock
        self.fd = None


class OutputLock:
    """`<output>.lock`: one process writes an output (and its journal) at a time. The holder publishes its pid
    in `<output>.lock.pid` (written whole through a rename, removed before release) so a refused second writer
    can name it. The pid lives beside the lock, not in it: a holder that has just won the lock has not written
    anything yet (two runs started together raced there). Both files are removed on release, so a finished run
    leaves nothing beside its output. The lock is the resolved output's: the output is written at its target,
    so two names of one file (a symlink, a linked folder) are one writer."""

    PID_WAIT_S = 2.0      # how long a refused writer waits for a just-started holder to publish its pid

    def __init__(self, output: Path):
        output = Path(os.path.realpath(output))
        self.path = output.with_name(output.name + ".lock")
        self.pid_path = output.with_name(output.name + ".lock.pid")
        self.lock = _Flock(self.path)

    def _live_pid(self) -> int | None:
        """The pid in the pid file if that process is alive (a pid file left by a killed holder names nobody)."""
        try:
            pid = int(self.pid_path.read_text().split()[1])
        except (OSError, ValueError, IndexError):
            return None
        try:
            os.kill(pid, 0)
        except PermissionError:
            pass                                      # alive, another user's
        except OSError:
            return None
        return pid

    def _holder(self) -> str:
        """'pid N' of the live process that holds the lock, or 'another process' if it does not say in time."""
        deadline = time.monotonic() + self.PID_WAIT_S
        while (pid := self._live_pid()) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return "another process" if pid is None else f"pid {pid}"

    def __enter__(self):
        kind = special_kind(self.path)
        if kind:
            raise JournalError(f"{self.path} is {kind}, not a lock file; remove it or write to another -o")
        try:
            self.lock.acquire()
        except _Busy:
            raise JournalError(f"{self.path.with_suffix('')} is being written by {self._holder()}; wait for it to "
                               f"finish or write to another -o") from None
        try:
            atomic_write(self.pid_path, f"pid {os.getpid()}\n".encode(), follow_symlinks=False)
        except BaseException:
            self.lock.release()
            raise
        return self

    def __exit__(self, *exc):
        self.pid_path.unlink(missing_ok=True)
        self.lock.release()


def flatten(settings: dict, prefix: str = "") -> dict:
    """{"generation": {"num_beams": 4}} -> {"generation.num_beams": 4} (how a settings difference is named)."""
    out = {}
    for key, value in settings.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def differences(old: dict, new: dict, labels: dict | None = None, then: str = "in the journal") -> list[str]:
    """Each setting that differs, as 'beam_size: 4 in the journal, 5 now' (labels: dotted key -> flag name)."""
    labels = labels or {}
    a, b = flatten(old), flatten(new)
    out = []
    for key in sorted(set(a) | set(b)):
        if a.get(key, ...) == b.get(key, ...):
            continue
        if key.startswith("model_files."):
            name = key[len("model_files."):]
            state = ("is new" if key not in a else "is gone" if key not in b else "changed (its SHA-256 differs)")
            out.append(f"model file {name} {state}")
            continue
        show = lambda v: "not set" if v is ... else repr(v)   # noqa: E731
        out.append(f"{labels.get(key, key)}: {show(a.get(key, ...))} {then}, {show(b.get(key, ...))} now")
    return out


class Journal:
    """Finished lines of one output file: `done` maps input line index -> output lines.

    The Ray path keeps its shard manifest in the same format (path= its own file, unit="shard"): records are
    then shard index -> [sha256 of the committed part]. `labels` names settings in a refusal (dotted key ->
    flag name)."""

    def __init__(self, output: Path, input_sha256: str, settings: dict, resume: bool, *, path: Path | None = None,
                 unit: str = "line", labels: dict | None = None):
        self.path = path or output.with_name(output.name + ".journal")
        self.unit, self.labels = unit, labels
        self.header = {"journal": VERSION, "input_sha256": input_sha256, "settings": settings}
        self.done: dict[int, list[str]] = {}
        self.notes: list[str] = []
        if self.path.is_symlink():
            raise JournalError(f"{self.path} is a symbolic link; a journal is never read or written through one "
                               f"(it could point anywhere): remove it, or write to another -o")
        kind = special_kind(self.path)
        if kind:
            raise JournalError(f"{self.path} is {kind}, not a journal; remove it or write to another -o")
        if self.path.exists() and self._load(resume):
            if self.rewrite is not None:          # damaged records in the middle: keep only the valid ones
                atomic_write(self.path, self.rewrite, follow_symlinks=False)
                self.f = _open_own(self.path)
            else:
                self.f = _open_own(self.path, append=False)
                self.f.seek(self.valid_bytes)
                self.f.truncate()
        else:
            # a new journal holds the output's translations: it gets the output's permission bits if it exists
            atomic_write(self.path, _line(self.header), mode=file_mode(output), follow_symlinks=False)
            self.f = _open_own(self.path)

    def _load(self, resume: bool) -> bool:
        """Read an existing journal; True to continue it, False to start over (it holds no work)."""
        try:
            raw = self.path.read_bytes()
        except OSError as e:
            raise JournalError(f"{self.path}: cannot be read ({e.strerror})") from None
        parts = raw.split(b"\n")
        lines = [p + b"\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
        if not lines:
            self.notes.append(f"{self.path} holds no usable header (an interrupted start); starting over")
            return False
        head = _parse(lines[0])
        if not isinstance(head, dict) or head.get("journal") != VERSION:
            if len(lines) == 1 and not resume:
                self.notes.append(f"{self.path} holds no usable header and no records; starting over")
                return False
            raise JournalError(f"{self.path} has a damaged header, so its records cannot be checked against this "
                               f"input and these settings; delete it to start over (its {self.unit}s are "
                               f"translated again)")
        records, kept, bad = [], [lines[0]], []
        for n, line in enumerate(lines[1:], 1):
            rec = _parse(line)
            if isinstance(rec, dict) and isinstance(rec.get("i"), int) and isinstance(rec.get("out"), list):
                records.append(rec)
                kept.append(line)
            else:
                bad.append(n)
        bad_set = set(bad)
        last_good = max((n for n in range(1, len(lines)) if n not in bad_set), default=0)
        torn = sum(1 for n in bad if n > last_good)
        damaged = len(bad) - torn
        if not records and not resume:
            self.notes.append(f"{self.path} holds no finished {self.unit}s; starting over")
            return False
        if not resume:
            raise JournalError(f"{self.path} holds {len(records)} finished {self.unit}(s) of an interrupted run; "
                               f"pass --resume to continue it, or delete it to start over")
        if head.get("input_sha256") != self.header["input_sha256"]:
            raise JournalError(f"the input changed since the interrupted run ({self.path} was written for other "
                               f"input); restore the input, or delete the journal to start over")
        changed = differences(head.get("settings") or {}, self.header["settings"], self.labels)
        if changed:
            raise JournalError(f"{self.path} was written with other settings ({'; '.join(changed)}); rerun with "
                               f"the same settings, or delete the journal to start over")
        self.done = {rec["i"]: rec["out"] for rec in records}
        self.valid_bytes = sum(len(line) for line in lines[:last_good + 1])
        self.rewrite = b"".join(kept) if damaged else None
        if damaged:
            self.notes.append(f"{self.path}: skipped {damaged} damaged record(s) (those {self.unit}s are "
                              f"translated again); every valid record is kept")
        if torn:
            self.notes.append(f"{self.path}: dropped a torn tail of {torn} record(s) (those {self.unit}s are "
                              f"translated again)")
        return True

    def add(self, i: int, out: list[str]) -> None:
        """Record one finished input line (or shard) durably (written, flushed and fsynced before returning)."""
        self.f.write(_line({"i": i, "out": out}))
        self.f.flush()
        os.fsync(self.f.fileno())
        self.done[i] = out

    def finish(self, output: Path, n: int, settings: dict | None = None) -> None:
        """Write the output file atomically from the records (in input order), then drop the journal; a new
        output takes the journal's permission bits (which were the old output's). `settings`: what the record
        of finished runs keeps for a later --resume (remember_finished)."""
        atomic_write(output, output_lines(self.done, 0, n), mode=file_mode(self.path))
        if settings is not None:
            remember_finished(output, self.header["input_sha256"], settings)
        self.f.close()
        self.path.unlink()

    def close(self) -> None:
        self.f.close()


# -- the record of finished runs ---------------------------------------------------------------------------------
# A finished run drops its journal, so a later --resume would find only the output. Its input's SHA-256 and its
# settings as the flags and the folder decide them (job.file_settings: no model is loaded to check them) are kept
# in the cache folder, keyed by the output's real path, beside the output's SHA-256: a --resume with other
# settings or other input is refused instead of taken as done. Losing the cache loses only that check.
FINISHED = "translate_finished.json"
KEEP_FINISHED = 512                # the most recent outputs remembered


def remember_finished(output: Path, input_sha256: str, settings: dict) -> None:
    """Record the finished `output` (written just now) with its input's SHA-256 and settings."""
    from specbeam_edge.cachefile import cache_dir, store_entry

    store_entry(cache_dir() / FINISHED, str(output.resolve()),
                {"output_sha256": file_sha256(output), "input_sha256": input_sha256, "settings": settings},
                keep=KEEP_FINISHED)


def finished_record(output: Path) -> dict | None:
    """The record of the run that finished `output` as it is now; None when there is none or the output changed
    since (edited, or written by something else)."""
    from specbeam_edge.cachefile import cache_dir, entries

    rec = entries(cache_dir() / FINISHED).get(str(output.resolve()))
    if not isinstance(rec, dict) or not isinstance(rec.get("settings"), dict):
        return None
    return rec if rec.get("output_sha256") == file_sha256(output) else None


def lines_sha256(lines: list[bytes]) -> str:
    """The SHA-256 an input is known by (a journal's header, a finished run's record): of its lines, so line ends
    and a BOM that do not change what is translated do not change it."""
    return hashlib.sha256(b"\n".join(lines)).hexdigest()


def finished_note(output: Path, recorded: bool) -> str:
    """What --resume says of a finished output it takes as done (recorded: checked against its run's record)."""
    how = "with these settings" if recorded else ("no record of its settings is left, so only its line count was "
                                                  "checked")
    return f"{output} is complete (its run finished, {how}); nothing to do"


def finished_as(output: Path, input_sha256: str, settings: dict, labels: dict | None = None) -> bool:
    """True when the record says `output` was finished from this input with these settings; False when there is
    no record of it as it is now. Other input or settings: JournalError naming what differs."""
    rec = finished_record(output)
    if rec is None:
        return False
    if rec.get("input_sha256") != input_sha256:
        raise JournalError(f"{output} was finished from other input; delete it (or write to another -o) to "
                           f"translate this input")
    changed = differences(rec["settings"], settings, labels, then="in the finished run")
    if changed:
        raise JournalError(f"{output} was finished with other settings ({'; '.join(changed)}); delete it (or "
                           f"write to another -o) to translate with these, or rerun with the same settings")
    return True
