"""The resume journal of the translate tool and the lock that keeps one writer per output file.

Format (`<output>.journal`): a header line, then one record per finished input line, each
`<crc32 as 8 hex digits> <json>\n`. The header (`{"journal": 1, "input_sha256": ..., "settings": {...}}`) is
written to a temporary file, fsynced and renamed into place, so the journal is valid from its first byte. A
record is valid only with its newline and a matching checksum: a crash mid-write leaves a torn tail, which
resume cuts off (those lines are translated again).
"""
from __future__ import annotations

import json
import os
import time
import zlib
from pathlib import Path

import filelock

VERSION = 1


class JournalError(Exception):
    """The journal cannot be used as it is; the message says why and what to do."""


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


def atomic_write(path: Path, data: bytes) -> None:
    """Write through a temporary sibling, fsync, rename: readers see the old file or the whole new one."""
    atomic_write_chunks(path, [data])


def atomic_write_chunks(path: Path, chunks) -> None:
    """atomic_write of the concatenated byte strings `chunks` (an iterable: a large file is never held whole)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            for data in chunks:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


class OutputLock:
    """`<output>.lock`: one process writes an output (and its journal) at a time. The holder publishes its pid
    in `<output>.lock.pid` (written whole through a rename, removed before release) so a refused second writer
    can name it. The pid lives beside the lock, not in it: a contender opening the lock file may truncate it,
    and a holder that has just won the lock has not written anything yet (two runs started together raced
    there). The lock file stays after release (removing it races with a process that is opening it)."""

    PID_WAIT_S = 2.0      # how long a refused writer waits for a just-started holder to publish its pid

    def __init__(self, output: Path):
        self.path = output.with_name(output.name + ".lock")
        self.pid_path = output.with_name(output.name + ".lock.pid")
        self.lock = filelock.FileLock(self.path, timeout=0)

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
        try:
            self.lock.acquire()
        except filelock.Timeout:
            raise JournalError(f"{self.path.with_suffix('')} is being written by {self._holder()}; wait for it to "
                               f"finish or write to another -o") from None
        atomic_write(self.pid_path, f"pid {os.getpid()}\n".encode())
        return self

    def __exit__(self, *exc):
        self.pid_path.unlink(missing_ok=True)
        self.lock.release()


class Journal:
    """Finished lines of one output file: `done` maps input line index -> output lines.

    The Ray path keeps its shard manifest in the same format (path= its own file, unit="shard"): records are
    then shard index -> [sha256 of the committed part]."""

    def __init__(self, output: Path, input_sha256: str, settings: dict, resume: bool, *, path: Path | None = None,
                 unit: str = "line"):
        self.path = path or output.with_name(output.name + ".journal")
        self.unit = unit
        self.header = {"journal": VERSION, "input_sha256": input_sha256, "settings": settings}
        self.done: dict[int, list[str]] = {}
        self.notes: list[str] = []
        if self.path.exists() and self._load(resume):
            self.f = open(self.path, "r+b")
            self.f.seek(self.valid_bytes)
            self.f.truncate()
        else:
            atomic_write(self.path, _line(self.header))
            self.f = open(self.path, "ab")

    def _load(self, resume: bool) -> bool:
        """Read an existing journal; True to continue it, False to start over (it holds no work)."""
        try:
            raw = self.path.read_bytes()
        except OSError as e:
            raise JournalError(f"{self.path}: cannot be read ({e.strerror})") from None
        lines = raw.splitlines(keepends=True)
        head = _parse(lines[0]) if lines else None
        if not isinstance(head, dict) or head.get("journal") != VERSION:
            self.notes.append(f"{self.path} holds no usable header (an interrupted start); starting over")
            return False
        records = []
        for line in lines[1:]:
            rec = _parse(line)
            if not (isinstance(rec, dict) and isinstance(rec.get("i"), int) and isinstance(rec.get("out"), list)):
                break
            records.append(rec)
        if not records and not resume:
            self.notes.append(f"{self.path} holds no finished {self.unit}s; starting over")
            return False
        if not resume:
            raise JournalError(f"{self.path} holds {len(records)} finished {self.unit}(s) of an interrupted run; "
                               f"pass --resume to continue it, or delete it to start over")
        if head.get("input_sha256") != self.header["input_sha256"]:
            raise JournalError(f"the input changed since the interrupted run ({self.path} was written for other "
                               f"input); restore the input, or delete the journal to start over")
        old = head.get("settings") or {}
        changed = sorted(k for k in set(old) | set(self.header["settings"])
                         if old.get(k) != self.header["settings"].get(k))
        if changed:
            diff = ", ".join(f"{k}: {old.get(k)!r} -> {self.header['settings'].get(k)!r}" for k in changed)
            raise JournalError(f"{self.path} was written with other settings ({diff}); rerun with the same "
                               f"settings, or delete the journal to start over")
        self.done = {rec["i"]: rec["out"] for rec in records}
        self.valid_bytes = sum(len(line) for line in lines[:1 + len(records)])
        if len(lines) > 1 + len(records):
            self.notes.append(f"{self.path}: dropped a torn tail of {len(lines) - 1 - len(records)} record(s) "
                              f"(those {self.unit}s are translated again)")
        return True

    def add(self, i: int, out: list[str]) -> None:
        """Record one finished input line (or shard) durably (written, flushed and fsynced before returning)."""
        self.f.write(_line({"i": i, "out": out}))
        self.f.flush()
        os.fsync(self.f.fileno())
        self.done[i] = out

    def finish(self, output: Path, n: int) -> None:
        """Write the output file atomically from the records (in input order), then drop the journal."""
        atomic_write(output, output_lines(self.done, 0, n))
        self.f.close()
        self.path.unlink()

    def close(self) -> None:
        self.f.close()
