"""Conversations persisted in a small SQLite file in the user's data folder; Markdown export.

A database that cannot be used as it is never stops the app: an unreadable file (garbage, truncated, another
program's tables) is set aside under a new name and a fresh one started; a read-only one is opened read-only
(its conversations shown; new messages kept for the session only); a folder gets its database inside it.
`notice` then says what happened and where the old file is. A damaged row (invalid statistics, a missing
text) is shown as far as it can be read, and new messages can still be added to its conversation.
"""
from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path

SCHEMA = """
    CREATE TABLE IF NOT EXISTS conversations (id INTEGER PRIMARY KEY, title TEXT, system TEXT, created REAL);
    CREATE TABLE IF NOT EXISTS messages (id INTEGER PRIMARY KEY, conv INTEGER, role TEXT, content TEXT,
                                         stats TEXT, created REAL);
    CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT);
"""
ROLES = ("user", "assistant")
# how long a write waits for another program's lock before it is kept pending (the app waits meanwhile)
BUSY_SECONDS = 2.0


def default_path() -> Path:
    if os.environ.get("SPECBEAM_CHAT_DB"):
        return Path(os.environ["SPECBEAM_CHAT_DB"])
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "specbeam-edge" / "chat.sqlite"


class ReadOnlyDatabase(Exception):
    pass


class StoreLocked(sqlite3.OperationalError):
    """Another program held the database's lock past the busy timeout; the message is one line for the user."""


class ChatStore:
    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else default_path()
        self.notice = ""            # what was done to a database that could not be used as it was
        self.read_only = False      # True: changes live in memory for this session only
        self.damaged: set[int] = set()   # conversations whose rows could not all be read
        # changes made while another program held the lock, in order: saved before the next change (`retry`)
        self.pending: list[tuple[str, tuple]] = []
        if self.path.is_dir():
            folder = self.path
            self.path = folder / "chat.sqlite"
            self.notice = f"The conversation database {folder} is a folder; using {self.path} inside it."
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.db = _open(self.path)
        except ReadOnlyDatabase as e:
            self._open_read_only(str(e))
        except (sqlite3.DatabaseError, OSError) as e:
            if not self.path.is_file():                # cannot be created there (a read-only folder)
                self._in_memory(f"The conversation database {self.path} cannot be created ({e})")
            elif _read_only(self.path, e):
                self._open_read_only(str(e))
            else:
                try:
                    self._set_aside(e)
                except OSError as e2:                  # cannot be renamed either
                    self._in_memory(f"The conversation database {self.path} cannot be read ({e}) nor set "
                                    f"aside ({e2})")

    # -- opening a database that cannot be used as it is ----------------------------------------------------
    def _set_aside(self, error: Exception):
        stamp = f"{self.path.name}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}"
        aside, n = self.path.with_name(stamp), 1
        while aside.exists():
            n += 1
            aside = self.path.with_name(f"{stamp}-{n}")
        os.replace(self.path, aside)
        for side in ("-wal", "-shm", "-journal"):     # a journal belongs to the file it was written for
            extra = self.path.with_name(self.path.name + side)
            if extra.exists():
                os.replace(extra, aside.with_name(aside.name + side))
        self.db = _open(self.path)
        self.notice = _join(self.notice, f"The conversation database {self.path} could not be read ({error}); it "
                            f"was renamed to {aside.name} and a new one started (sqlite3 can try to recover the "
                            f"old one: sqlite3 {aside} .recover).")

    def _in_memory(self, what: str):
        self.db = sqlite3.connect(":memory:")
        self.db.executescript(SCHEMA)
        self.read_only = True
        self.notice = _join(self.notice, f"{what}: conversations are kept only until the app closes (Export "
                            f"Markdown saves one). Start with --db a file in a writable folder.")

    def _open_read_only(self, reason: str):
        src = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro&immutable=1", uri=True)
        try:
            _check(src)
            self.db = sqlite3.connect(":memory:")
            src.backup(self.db)
        except sqlite3.DatabaseError as e:          # read-only and unreadable: nothing to show from it
            self.db = sqlite3.connect(":memory:")
            reason = f"{reason}; it cannot be read either: {e}"
        finally:
            src.close()
        self.db.executescript(SCHEMA)
        self.read_only = True
        self.notice = _join(self.notice, f"The conversation database {self.path} is read-only ({reason}): its "
                            f"conversations are shown, but new messages are kept only until the app closes "
                            f"(Export Markdown saves one). Make it and its folder writable or start with --db "
                            f"another file.")

    # -- conversations and messages -------------------------------------------------------------------------
    # -- writes: a locked database keeps them pending instead of dropping them --------------------------------
    def _write(self, *statements: tuple[str, tuple], keep: bool = True) -> int | None:
        """Run the pending changes, then `statements`, in one transaction; the last row id. While the database is
        locked: StoreLocked, and with `keep` the statements wait in `pending` (a change made in the app is never
        dropped); without it (a caller that needs the new id) nothing is kept."""
        todo = self.pending + list(statements)
        try:
            with self.db:                   # one transaction: all of it is saved, or none
                cur = None
                for sql, args in todo:
                    cur = self.db.execute(sql, args)
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) and "busy" not in str(e):
                raise
            if keep:
                self.pending = todo
            raise StoreLocked(f"The conversation database {self.path} is locked by another program; "
                              f"{'the change is kept and saved once it is free' if keep else 'try again'}") from None
        self.pending = []
        return cur.lastrowid if cur is not None else None

    def retry(self) -> bool:
        """Save the pending changes; True when none is left (StoreLocked while the lock is still held)."""
        if self.pending:
            self._write()
        return not self.pending

    def new_conversation(self, title: str = "New chat", system: str = "") -> int:
        return self._write(("INSERT INTO conversations (title, system, created) VALUES (?, ?, ?)",
                            (title, system, time.time())), keep=False)

    def conversations(self) -> list[tuple[int, str]]:
        rows = _rows(self.db, "SELECT id, title FROM conversations ORDER BY created DESC, id DESC")[0]
        return [(cid, _text(title) or "Untitled") for cid, title in rows]

    def set_title(self, conv: int, title: str):
        self._write(("UPDATE conversations SET title = ? WHERE id = ?", (title, conv)))

    def title(self, conv: int) -> str:
        row = self.db.execute("SELECT title FROM conversations WHERE id = ?", (conv,)).fetchone()
        return (_text(row[0]) if row else "") or "Untitled"

    def delete_conversation(self, conv: int):
        self._write(("DELETE FROM messages WHERE conv = ?", (conv,)),
                    ("DELETE FROM conversations WHERE id = ?", (conv,)))

    def system(self, conv: int) -> str:
        row = self.db.execute("SELECT system FROM conversations WHERE id = ?", (conv,)).fetchone()
        return _text(row[0]) if row else ""

    def set_system(self, conv: int, system: str):
        self._write(("UPDATE conversations SET system = ? WHERE id = ?", (system, conv)))

    def add(self, conv: int, role: str, content: str, stats: dict | None = None, keep: bool = False) -> int | None:
        """Store a message; its id. keep: while the database is locked, keep it pending (see `_write`)."""
        return self._write(("INSERT INTO messages (conv, role, content, stats, created) VALUES (?, ?, ?, ?, ?)",
                            (conv, role, content, json.dumps(stats) if stats else None, time.time())), keep=keep)

    def messages(self, conv: int) -> list[dict]:
        """The conversation's messages, as far as they can be read: a row with invalid statistics keeps its text
        (without draft marks), a missing text reads as empty, an unknown role as the assistant's; rows after a
        damaged page are left out and the conversation is listed in `damaged`."""
        rows, gaps = _scan(self.db, conv)
        ids = [r[0] for r in rows]
        # a gap of unreadable ids next to or inside this conversation's ids may have held its messages
        if any(not ids or (a <= ids[-1] + 1 and b >= ids[0] - 1) for a, b in gaps):
            self.damaged.add(conv)
        out = []
        for i, r, c, s in rows:
            stats = _stats(s)
            if (s is not None and stats is None) or r not in ROLES or not isinstance(c, str):
                self.damaged.add(conv)
            out.append({"id": i, "role": r if r in ROLES else "assistant", "content": _text(c), "stats": stats})
        return out

    def delete_message(self, msg_id: int):
        self._write(("DELETE FROM messages WHERE id = ?", (msg_id,)))

    def get(self, key: str, default: str | None = None) -> str | None:
        try:
            row = self.db.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone()
        except sqlite3.DatabaseError:
            return default
        return row[0] if row and isinstance(row[0], str) else default

    def put(self, key: str, value: str):
        self._write(("INSERT OR REPLACE INTO settings (key, value) VALUES (?, ?)", (key, value)))

    def export_markdown(self, conv: int) -> str:
        out = [f"# {self.title(conv)}", ""]
        if self.system(conv):
            out += [f"*System:* {self.system(conv)}", ""]
        for m in self.messages(conv):
            out += [f"**{m['role']}:** {m['content']}", ""]
        return "\n".join(out)

    def close(self):
        self.db.close()


def _open(path: Path) -> sqlite3.Connection:
    """A connection to a usable database at `path` (created when missing); raises sqlite3.DatabaseError for a
    file that is not one of ours or cannot be read, ReadOnlyDatabase when it cannot be written."""
    db = sqlite3.connect(path, timeout=BUSY_SECONDS)
    try:
        _check(db)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(SCHEMA)
            db.execute("BEGIN IMMEDIATE")          # the write lock: fails at once on a read-only file
            db.rollback()
        except sqlite3.OperationalError as e:
            if "readonly" in str(e) or "read-only" in str(e):
                raise ReadOnlyDatabase(str(e)) from None
            raise
        _check(db)
    except BaseException:
        db.close()
        raise
    return db


def _check(db: sqlite3.Connection):
    """Reads the schema and the tables' first rows: raises sqlite3.DatabaseError for garbage, a truncated
    file, or tables of another program."""
    db.execute("SELECT count(*) FROM sqlite_master").fetchone()
    names = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "conversations" in names:
        db.execute("SELECT id, title, system, created FROM conversations LIMIT 1").fetchall()
    if "messages" in names:
        db.execute("SELECT id, conv, role, content, stats, created FROM messages LIMIT 1").fetchall()


def _read_only(path: Path, error: Exception) -> bool:
    """An error that comes from the file or its folder not being writable (not from what the file holds)."""
    if isinstance(error, PermissionError) or "readonly" in str(error):
        return True
    if "unable to open" in str(error) and path.is_file():
        return not os.access(path, os.W_OK) or not os.access(path.parent, os.W_OK)
    return False


def _rows(db, query: str, args=()) -> tuple[list, bool]:
    """The rows a query yields until a damaged page stops it; (rows, whether all were read)."""
    rows = []
    try:
        for row in db.execute(query, args):
            rows.append(row)
    except sqlite3.DatabaseError:
        return rows, False
    return rows, True


def _scan(db, conv: int) -> tuple[list, list]:
    """A conversation's (id, role, content, stats) rows in order, read past damaged pages: where a page cannot
    be read, the scan resumes at the first message id that can (found by bisection on the id b-tree). Returns
    the rows and the [first, last] id ranges that could not be read."""
    rows, gaps, after = [], [], 0
    query = "SELECT id, conv, role, content, stats FROM messages WHERE id > ? ORDER BY id"
    while True:
        try:
            for row in db.execute(query, (after,)):
                after = row[0]
                if row[1] == conv:
                    rows.append((row[0], *row[2:]))
            return rows, gaps
        except sqlite3.DatabaseError:
            pass
        resume = _next_readable(db, after + 1)
        gaps.append([after + 1, resume - 1 if resume is not None else 2**62])
        if resume is None:
            return rows, gaps
        after = resume - 1


def _next_readable(db, start: int) -> int | None:
    """The smallest id >= start where a scan of messages can begin, or None when nothing after it reads."""
    def readable(i):
        try:
            db.execute("SELECT id, conv, role, content, stats FROM messages WHERE id >= ? LIMIT 1", (i,)).fetchall()
            return True
        except sqlite3.DatabaseError:
            return False
    bad, step = start, 1
    while not readable(bad + step):
        if bad + step > 2**62:
            return None
        bad, step = bad + step, step * 2
    lo, hi = bad, bad + step          # lo fails, hi reads
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if readable(mid) else (mid, hi)
    return hi


def _stats(raw) -> dict | None:
    """A message's statistics; None when missing or not valid (its draft marks are then left out)."""
    if raw is None:
        return None
    try:
        stats = json.loads(raw)
    except (TypeError, ValueError):
        return None
    if not isinstance(stats, dict):
        return None
    spans = stats.get("draft_spans", [])
    if not (isinstance(spans, list) and all(isinstance(s, list) and len(s) == 2
                                            and all(isinstance(x, int) for x in s) for s in spans)):
        stats["draft_spans"] = []
    return stats


def _text(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _join(a: str, b: str) -> str:
    return f"{a} {b}" if a else b
