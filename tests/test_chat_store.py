"""The chat app starts whatever state its database and settings are in: an unreadable database is set aside
(renamed) with a message, a read-only one is opened read-only, a damaged conversation is shown as far as it can
be read and can still be written to, and bad settings are replaced by their defaults (offscreen Qt)."""
import json
import os
import shutil
import sqlite3
import subprocess

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from PySide6.QtCore import QSettings, Qt  # noqa: E402

from apps.chat.store import ChatStore  # noqa: E402
from apps.chat.window import DAMAGED, ChatWindow  # noqa: E402


@pytest.fixture
def warnings(monkeypatch):
    shown = []
    monkeypatch.setattr("apps.chat.window.QMessageBox.warning", lambda parent, title, text: shown.append(text))
    monkeypatch.setattr("apps.chat.window.QMessageBox.critical", lambda parent, title, text: shown.append(text))
    return shown


def filled(path, conversations=3, messages=4):
    store = ChatStore(path)
    for c in range(conversations):
        cid = store.new_conversation(f"chat {c}")
        for m in range(messages):
            store.add(cid, "user", f"question {c}.{m} " * 20)
            store.add(cid, "assistant", f"answer {c}.{m} " * 20, {"draft_spans": [[0, 6]]})
    store.close()
    return path


def window(qtbot, tmp_path, db, pair, **values):
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    settings.setValue("model", pair[0])
    settings.setValue("draft", pair[1])
    for key, value in values.items():
        settings.setValue(key, value)
    settings.sync()
    win = ChatWindow(ChatStore(db), settings=QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat))
    qtbot.addWidget(win)
    return win


def send_and_wait(qtbot, win, text="hello"):
    win.max_new.setValue(4)
    win.input.setPlainText(text)
    win.send_btn.click()
    qtbot.waitUntil(lambda: win.gen is None, timeout=20000)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "header only", "other program"])
def test_an_unreadable_database_is_set_aside_and_the_app_starts(qtbot, tmp_path, pair, warnings, damage):
    db = filled(tmp_path / "chat.sqlite")
    data = db.read_bytes()
    if damage == "garbage":
        db.write_bytes(os.urandom(5000))
    elif damage == "truncated":
        db.write_bytes(data[: len(data) // 2])
    elif damage == "header only":
        db.write_bytes(data[:50])
    else:
        db.unlink()
        other = sqlite3.connect(db)
        other.execute("CREATE TABLE messages (x)")
        other.commit()
        other.close()
    before = db.read_bytes()
    win = window(qtbot, tmp_path, db, pair)
    [aside] = [p for p in tmp_path.iterdir() if p.name.startswith("chat.sqlite.unreadable-")]
    assert aside.read_bytes() == before                           # kept as it was, under a new name
    assert len(warnings) == 1 and "could not be read" in warnings[0] and aside.name in warnings[0]
    send_and_wait(qtbot, win)                                      # a fresh database that works
    assert [m["role"] for m in ChatStore(db).messages(win.current())] == ["user", "assistant"]


def test_a_folder_as_database_path(qtbot, tmp_path, pair, warnings):
    folder = tmp_path / "chats"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    win = window(qtbot, tmp_path, folder, pair)
    assert "is a folder" in warnings[0] and str(folder / "chat.sqlite") in warnings[0]
    send_and_wait(qtbot, win)
    assert (folder / "notes.txt").read_text() == "mine" and (folder / "chat.sqlite").is_file()
    window(qtbot, tmp_path, folder, pair)                          # the next start finds the same conversations
    assert ChatStore(folder).messages(win.current())


@pytest.fixture
def read_only(tmp_path):
    """Makes a file and its folder read-only, for root too (chattr +i); undone afterwards."""
    made = []

    def make(*paths):
        for p in paths:
            os.chmod(p, 0o555 if p.is_dir() else 0o444)
            made.append(p)
        if os.geteuid() == 0:
            if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", *map(str, paths)],
                                                                capture_output=True).returncode:
                pytest.skip("running as root without chattr +i: a file cannot be made read-only")
    yield make
    if os.geteuid() == 0 and made:
        subprocess.run(["chattr", "-i", *map(str, made)], capture_output=True)
    for p in made:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)


def test_a_read_only_database_is_shown_and_the_app_works(qtbot, tmp_path, pair, warnings, read_only):
    folder = tmp_path / "ro"
    folder.mkdir()
    db = filled(folder / "chat.sqlite")
    ChatStore(db).close()                                          # checkpointed: no -wal beside it
    for side in ("chat.sqlite-wal", "chat.sqlite-shm"):
        if (folder / side).exists():
            (folder / side).unlink()
    read_only(db, folder)
    win = window(qtbot, tmp_path, db, pair)
    assert win.store.read_only and win.convs.count() == 3
    assert "read-only" in warnings[0] and "not saved" in win.status.text()
    assert "answer 2.3" in win.transcript.toPlainText()
    send_and_wait(qtbot, win)                                      # kept for the session
    assert [m["role"] for m in win.store.messages(win.current())][-2:] == ["user", "assistant"]


def test_a_database_in_a_read_only_folder_cannot_be_created(qtbot, tmp_path, pair, warnings, read_only):
    folder = tmp_path / "ro"
    folder.mkdir()
    read_only(folder)
    win = window(qtbot, tmp_path, folder / "chat.sqlite", pair)
    assert "cannot be created" in warnings[0]
    send_and_wait(qtbot, win)
    assert win.store.messages(win.current())


def test_a_damaged_conversation_is_shown_and_can_be_written_to(qtbot, tmp_path, pair, warnings):
    db = filled(tmp_path / "chat.sqlite", conversations=2)
    raw = sqlite3.connect(db)
    ids = [r[0] for r in raw.execute("SELECT id FROM messages WHERE conv = 2 ORDER BY id")]
    raw.execute("UPDATE messages SET stats = '{broken' WHERE id = ?", (ids[1],))
    raw.execute("UPDATE messages SET content = NULL WHERE id = ?", (ids[2],))
    raw.execute("UPDATE messages SET role = 'robot', stats = '[1, 2]' WHERE id = ?", (ids[3],))
    raw.execute("UPDATE messages SET stats = ? WHERE id = ?", (json.dumps({"draft_spans": "x"}), ids[5]))
    raw.execute("UPDATE messages SET content = x'ff00' WHERE id = ?", (ids[4],))
    raw.execute("UPDATE conversations SET title = NULL WHERE id = 2")
    raw.commit()
    raw.close()
    win = window(qtbot, tmp_path, db, pair)                        # conversation 2 is the newest: shown first
    assert win.current() == 2 and win.convs.currentItem().text() == "Untitled"
    text = win.transcript.toPlainText()
    assert text.startswith(DAMAGED) and "question 1.0" in text and "question 1.3" in text
    send_and_wait(qtbot, win, "still here?")
    msgs = win.store.messages(2)
    assert [m["content"] for m in msgs[-2:-1]] == ["still here?"] and msgs[-1]["role"] == "assistant"
    assert warnings == []


def test_a_damaged_page_hides_only_what_it_held(tmp_path):
    db = filled(tmp_path / "chat.sqlite", conversations=12, messages=10)
    raw = sqlite3.connect(db)
    try:
        leaves = [r[0] for r in raw.execute(
            "SELECT pageno FROM dbstat WHERE name = 'messages' AND pagetype = 'leaf' ORDER BY pageno")]
    except sqlite3.OperationalError:
        pytest.skip("this sqlite3 has no dbstat table")
    page_size = raw.execute("PRAGMA page_size").fetchone()[0]
    raw.close()
    page = leaves[len(leaves) // 2]
    data = bytearray(db.read_bytes())
    data[(page - 1) * page_size: page * page_size] = b"\xff" * page_size
    db.write_bytes(bytes(data))
    store = ChatStore(db)
    counts = {cid: len(store.messages(cid)) for cid, _ in store.conversations()}
    assert len(counts) == 12 and sum(counts.values()) < 12 * 20
    assert sum(n == 20 for n in counts.values()) >= 9               # one page: one or two conversations
    assert store.damaged == {cid for cid, n in counts.items() if n < 20}
    cid = min(store.damaged)
    store.add(cid, "user", "new")
    assert store.messages(cid)[-1]["content"] == "new"


@pytest.mark.parametrize("key, value, expected", [
    ("beams", "abc", 4), ("max_new_tokens", "99999999999999999999", 1024), ("max_new_tokens", "-5", 1),
    ("budget", "1e9", None), ("temperature", "nan", 1.0), ("mode", "7", 0), ("highlight", "maybe", True)])
def test_bad_settings_are_reset_with_a_message(qtbot, tmp_path, pair, warnings, key, value, expected):
    win = window(qtbot, tmp_path, tmp_path / "chat.sqlite", pair, **{key: value})
    widget = {"beams": win.beams, "max_new_tokens": win.max_new, "budget": win.budget,
              "temperature": win.temperature}.get(key)
    if key == "mode":
        assert win.mode.currentIndex() == expected
    elif key == "highlight":
        assert win.highlight.isChecked() is expected
    elif expected is not None:
        assert widget.value() == pytest.approx(expected)
    assert len(warnings) == 1 and f"{key}={value}" in warnings[0] and "settings.ini" in warnings[0]
    send_and_wait(qtbot, win)


def test_a_locked_database_keeps_every_change_and_says_so_in_one_line(qtbot, tmp_path, pair, warnings, monkeypatch):
    """Before: a write while another program held the database's lock raised 'database is locked' out of the
    app's action (a traceback) and the change was lost."""
    monkeypatch.setattr("apps.chat.store.BUSY_SECONDS", 0.05)
    monkeypatch.setattr("apps.chat.window.RETRY_MS", 50)
    db = filled(tmp_path / "chat.sqlite", conversations=2, messages=1)
    win = window(qtbot, tmp_path, db, pair)
    cid, gone = win.current(), win.convs.item(1).data(Qt.ItemDataRole.UserRole)
    other = sqlite3.connect(db)
    other.execute("BEGIN IMMEDIATE")                # another program holds the write lock
    win.rename_conversation(cid, "renamed while locked")
    win.system.setText("be brief")
    win._save_system()
    win.delete_conversation(gone)
    assert win.status.text() == (f"The conversation database {db} is locked by another program; the change is "
                                 f"kept and saved once it is free")
    win.input.setPlainText("a question")
    win.send_btn.click()
    assert win.input.toPlainText() == "a question" and win.status.text().endswith("your message stays in the box")
    other.rollback()
    other.close()
    qtbot.waitUntil(lambda: not win.store.pending, timeout=5000)
    saved = ChatStore(db)
    assert saved.title(cid) == "renamed while locked" and saved.system(cid) == "be brief"
    assert [c for c, _ in saved.conversations()] == [cid] and warnings == []
