"""Conversations persisted in a small SQLite file in the user's data folder; Markdown export."""
from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path


def default_path() -> Path:
    if os.environ.get("SPECBEAM_CHAT_DB"):
        return Path(os.environ["SPECBEAM_CHAT_DB"])
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "specbeam-edge" / "chat.sqlite"


class ChatStore:
    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path)
        self.db.executescript("""
            PRAGMA journal_mode=WAL;
            CREATE TABLE IF NOT EXISTS conversations (id INTEGER PRIMARY KEY, title TEXT, system TEXT,
                                                      created REAL);
            CREATE TABLE IF NOT EXISTS messages (id INTEGER PRIMARY KEY, conv INTEGER, role TEXT, content TEXT,
                                                 stats TEXT, created REAL);
            CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT);
        """)
        self.db.commit()

    def new_conversation(self, title: str = "New chat", system: str = "") -> int:
        cur = self.db.execute("INSERT INTO conversations (title, system, created) VALUES (?, ?, ?)",
                              (title, system, time.time()))
        self.db.commit()
        return cur.lastrowid

    def conversations(self) -> list[tuple[int, str]]:
        return list(self.db.execute("SELECT id, title FROM conversations ORDER BY created DESC, id DESC"))

    def set_title(self, conv: int, title: str):
        self.db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conv))
        self.db.commit()

    def system(self, conv: int) -> str:
        row = self.db.execute("SELECT system FROM conversations WHERE id = ?", (conv,)).fetchone()
        return row[0] if row else ""

    def set_system(self, conv: int, system: str):
        self.db.execute("UPDATE conversations SET system = ? WHERE id = ?", (system, conv))
        self.db.commit()

    def add(self, conv: int, role: str, content: str, stats: dict | None = None) -> int:
        cur = self.db.execute("INSERT INTO messages (conv, role, content, stats, created) VALUES (?, ?, ?, ?, ?)",
                              (conv, role, content, json.dumps(stats) if stats else None, time.time()))
        self.db.commit()
        return cur.lastrowid

    def messages(self, conv: int) -> list[dict]:
        rows = self.db.execute("SELECT id, role, content, stats FROM messages WHERE conv = ? ORDER BY id", (conv,))
        return [{"id": i, "role": r, "content": c, "stats": json.loads(s) if s else None} for i, r, c, s in rows]

    def delete_message(self, msg_id: int):
        self.db.execute("DELETE FROM messages WHERE id = ?", (msg_id,))
        self.db.commit()

    def get(self, key: str, default: str | None = None) -> str | None:
        row = self.db.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def put(self, key: str, value: str):
        self.db.execute("INSERT OR REPLACE INTO settings (key, value) VALUES (?, ?)", (key, value))
        self.db.commit()

    def export_markdown(self, conv: int) -> str:
        title = self.db.execute("SELECT title FROM conversations WHERE id = ?", (conv,)).fetchone()[0]
        out = [f"# {title}", ""]
        if self.system(conv):
            out += [f"*System:* {self.system(conv)}", ""]
        for m in self.messages(conv):
            out += [f"**{m['role']}:** {m['content']}", ""]
        return "\n".join(out)

    def close(self):
        self.db.close()
