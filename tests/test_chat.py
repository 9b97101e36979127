"""The desktop chat app, offscreen: stream then Stop, persistence across a restart, a bad model folder."""
import os
import time

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from apps.chat.store import ChatStore  # noqa: E402
from apps.chat.window import ChatWindow  # noqa: E402
from specbeam_edge import Engine  # noqa: E402


class SlowEngine(Engine):
    """The real engine, with a pause after each target pass so that Stop lands mid-generation."""

    def stream(self, *a, **kw):
        for chunk in super().stream(*a, **kw):
            time.sleep(0.03)
            yield chunk


@pytest.fixture
def folders(exported):
    return str(exported("llama", std=0.3, seed=3)), str(exported("llama", std=0.3, seed=11, layers=1))


def make_window(qtbot, db, folders, factory=Engine):
    store = ChatStore(db)
    store.put("model", folders[0])
    store.put("draft", folders[1])
    win = ChatWindow(store, engine_factory=factory)
    qtbot.addWidget(win)
    return win


def test_stream_then_stop(qtbot, tmp_path, folders):
    win = make_window(qtbot, tmp_path / "chat.sqlite", folders, SlowEngine)
    win.max_new.setValue(200)
    win.beams.setValue(2)
    win.input.setPlainText("the quick brown fox")
    win.send_btn.click()
    qtbot.waitUntil(lambda: len(win.partial) > 0, timeout=20000)
    assert not win.send_btn.isEnabled() and win.stop_btn.isEnabled()   # the UI stays responsive meanwhile
    win.stop_btn.click()
    qtbot.waitUntil(lambda: win.thread is None, timeout=20000)
    msgs = win.store.messages(win.current())
    assert [m["role"] for m in msgs] == ["user", "assistant"]
    assert msgs[1]["stats"]["stopped"] and msgs[1]["stats"]["generated_tokens"] < 200
    assert "stopped" in win.status.text()


def test_persistence_regenerate_and_export(qtbot, tmp_path, folders):
    db = tmp_path / "chat.sqlite"
    win = make_window(qtbot, db, folders)
    win.max_new.setValue(8)
    win.system.setText("be brief")
    win.system.editingFinished.emit()
    win.input.setPlainText("hello world")
    win.send_btn.click()
    qtbot.waitUntil(lambda: win.thread is None and len(win.store.messages(win.current())) == 2, timeout=20000)
    win.regen_btn.click()
    qtbot.waitUntil(lambda: win.thread is None, timeout=20000)
    cid = win.current()
    assert [m["role"] for m in win.store.messages(cid)] == ["user", "assistant"]
    win.export_markdown(str(tmp_path / "chat.md"))
    md = (tmp_path / "chat.md").read_text()
    assert "**user:** hello world" in md and "be brief" in md
    win.close()
    win.store.close()
    again = make_window(qtbot, db, folders)          # a restart: same database
    assert again.store.messages(cid)[0]["content"] == "hello world"
    assert again.convs.count() >= 1 and again.system.text() == "be brief"
    assert again.model_edit.text() == folders[0]


def test_bad_model_folder_is_a_dialog(qtbot, tmp_path, folders, monkeypatch):
    shown = []
    monkeypatch.setattr("apps.chat.window.QMessageBox.critical", lambda parent, title, text: shown.append(text))
    store = ChatStore(tmp_path / "c.sqlite")
    store.put("model", str(tmp_path / "no_such_model"))
    store.put("draft", "")
    win = ChatWindow(store)
    qtbot.addWidget(win)
    assert win.engine is None and shown and str(tmp_path / "no_such_model") in shown[0]
    assert "does not exist" in shown[0]
