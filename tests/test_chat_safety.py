"""The chat app's answers never lose text: raw HTML shows as text, code keeps its content, and a stopped,
interrupted or regenerated answer is shown and stored (offscreen Qt)."""
import os
import signal
import sqlite3
import subprocess
import sys
import time
from types import SimpleNamespace
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from PySide6.QtCore import QSettings  # noqa: E402
from PySide6.QtGui import QTextCursor, QTextFormat  # noqa: E402
from PySide6.QtWidgets import QTextBrowser  # noqa: E402

from apps.chat.render import insert_answer  # noqa: E402
from apps.chat.store import ChatStore  # noqa: E402
from apps.chat.window import ChatWindow, searching_text  # noqa: E402
from specbeam_edge import Engine  # noqa: E402
from helpers import chat_session_script  # noqa: E402


class _NoAgreement:
    """A search state whose beams never agree on a prefix (what beam search often does for a long while)."""

    def __init__(self, state):
        self._state = state

    def stable_prefix(self):
        return []

    def __getattr__(self, name):
        return getattr(self._state, name)


class DisagreeingEngine(Engine):
    """The real engine, slowed down, with beams that share no final text until the search ends."""

    def generate_passes(self, *a, **kw):       # what Engine.stream and the app's worker iterate
        for state, stats in super().generate_passes(*a, **kw):
            time.sleep(0.02)
            yield _NoAgreement(state), stats


class SlowEngine(Engine):
    def generate_passes(self, *a, **kw):
        for item in super().generate_passes(*a, **kw):
            time.sleep(0.02)
            yield item


@pytest.fixture
def folders(pair):
    return pair


def window(qtbot, tmp_path, folders, factory=Engine, **settings_values):
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    settings.setValue("model", folders[0])
    settings.setValue("draft", folders[1])
    for key, value in settings_values.items():
        settings.setValue(key, value)
    win = ChatWindow(ChatStore(tmp_path / "chat.sqlite"), engine_factory=factory, settings=settings)
    qtbot.addWidget(win)
    return win


def send(win, text="the quick brown fox"):
    win.input.setPlainText(text)
    win.send_btn.click()


def rendered(text: str, spans=()) -> QTextBrowser:
    view = QTextBrowser()
    insert_answer(QTextCursor(view.document()), text, list(spans), True)
    return view


def test_raw_html_shows_as_text(qapp):
    text = "Use List<String> names = ... <div> a<b"
    assert rendered(text).document().toPlainText() == text       # was "Use List" and nothing after it
    more = "<script>alert(1)</script> <!-- note --> <b>bold?</b> &amp; &lt; &#60; Map<K, V>"
    assert rendered(more).document().toPlainText() == more
    block = "<div>\nblock</div>\n\nafter"
    assert rendered(block).document().toPlainText() == "<div>\nblock</div>\nafter"


def test_code_keeps_its_content_verbatim(qapp):
    text = ("Inline `List<T> a<b &amp;` and ``x`y<z``.\n\n```java\nMap<K, V> m = new HashMap<>(); // <p>&amp;\n"
            "if (a<b && b>c) {}\n```\n\nIndented:\n\n    int x = a<b ? 1 : 2; // &lt;\n")
    view = rendered(text)
    doc = view.document()
    plain = doc.toPlainText()
    assert "Inline List<T> a<b &amp; and x`y<z." in plain
    assert "Map<K, V> m = new HashMap<>(); // <p>&amp;\nif (a<b && b>c) {}" in plain
    assert "int x = a<b ? 1 : 2; // &lt;" in plain and "&lt;  " not in plain
    fenced = [b.text() for b in _blocks(doc) if b.blockFormat().hasProperty(QTextFormat.Property.BlockCodeFence)]
    assert fenced == ["Map<K, V> m = new HashMap<>(); // <p>&amp;", "if (a<b && b>c) {}"]


def test_markdown_still_renders_and_marks_land_on_escaped_text(qapp):
    text = "**bold** a<b &amp; c\n- one\n- two"
    amp = text.index("&amp;")
    view = rendered(text, [[amp, amp + 5]])
    doc = view.document()
    assert doc.toPlainText() == "bold a<b &amp; c\none\ntwo"
    painted = []
    block = doc.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            frag = it.fragment()
            if frag.charFormat().background().style().name != "NoBrush":
                painted.append(frag.text())
            it += 1
        block = block.next()
    assert "".join(painted) == "&amp;"


def test_stop_with_beams_that_never_agreed_keeps_the_best_beam(qtbot, tmp_path, folders):
    """Before: the status said "stopped after N tokens" and the answer vanished from transcript and store."""
    win = window(qtbot, tmp_path, folders, DisagreeingEngine, beams=4, max_new_tokens=300)
    send(win)
    qtbot.waitUntil(lambda: win.partial_steps >= 5, timeout=20000)
    assert win.partial.text == ""
    assert searching_text(4, win.partial_steps) in win.transcript.toPlainText()   # progress, not a blank
    win.stop_btn.click()
    qtbot.waitUntil(lambda: win.gen is None, timeout=20000)
    [user, answer] = win.store.messages(win.current())
    assert answer["role"] == "assistant" and answer["stats"]["stopped"]
    assert answer["content"].strip() and answer["content"].strip() in win.transcript.toPlainText()
    assert win.status.text().startswith("stopped after ")
    assert len(answer["stats"]["tokens"]) >= 5


@pytest.mark.parametrize("mode, beams", [(1, 3), (0, 1)])      # beam sampling; greedy (K=1)
def test_stop_keeps_the_best_so_far_in_every_mode(qtbot, tmp_path, folders, mode, beams, monkeypatch):
    import apps.chat.window as chat_window

    # the app seeds sampling with the clock: a fixed one makes the sampled answer the same on every run
    monkeypatch.setattr(chat_window, "time", SimpleNamespace(time=lambda: 1234.0))
    win = window(qtbot, tmp_path, folders, DisagreeingEngine, beams=beams, max_new_tokens=300, mode=mode)
    send(win)
    qtbot.waitUntil(lambda: win.partial_steps >= 4, timeout=20000)
    win.stop_btn.click()
    qtbot.waitUntil(lambda: win.gen is None, timeout=20000)
    [_, answer] = win.store.messages(win.current())
    assert answer["stats"]["stopped"] and "error" not in answer["stats"] and len(answer["stats"]["tokens"]) >= 4
    # the transcript is HTML: runs of whitespace in a sampled answer are drawn as one, or not at all at a line's start
    drawn = " ".join(win.transcript.toPlainText().split())
    assert answer["content"].strip() and " ".join(answer["content"].split()) in drawn


def test_finished_answer_with_beams_is_shown_and_stored_as_the_engine_returns_it(qtbot, tmp_path, folders):
    win = window(qtbot, tmp_path, folders, DisagreeingEngine, beams=3, max_new_tokens=12, speculate=False)
    send(win, "hello there")
    qtbot.waitUntil(lambda: win.gen is None, timeout=20000)
    [_, answer] = win.store.messages(win.current())
    prompt = win.engine.tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}])
    expected = Engine(folders[0]).generate(prompt, num_beams=3, max_new_tokens=12)[0]
    assert answer["content"] == expected.text and answer["stats"]["tokens"] == expected.hypotheses[0].tokens
    assert not answer["stats"].get("stopped")
    assert answer["content"].strip() in win.transcript.toPlainText() and "searching" not in win.transcript.toPlainText()


def test_regenerate_then_stop_keeps_the_old_answer_and_the_partial_new_one(qtbot, tmp_path, folders):
    """Before: Regenerate deleted the old answer first, and a stop before any final text stored nothing."""
    win = window(qtbot, tmp_path, folders, DisagreeingEngine, beams=4, max_new_tokens=6)
    send(win)
    qtbot.waitUntil(lambda: win.gen is None, timeout=20000)
    cid = win.current()
    [_, old] = win.store.messages(cid)
    win.max_new.setValue(300)
    win.regen_btn.click()
    qtbot.waitUntil(lambda: win.partial_steps >= 3, timeout=20000)
    assert old["content"] not in win.transcript.toPlainText() or old["content"] == ""   # the new one streams
    win.stop_btn.click()
    qtbot.waitUntil(lambda: win.gen is None, timeout=20000)
    msgs = win.store.messages(cid)
    assert [m["role"] for m in msgs] == ["user", "assistant", "assistant"]
    assert msgs[1] == old and msgs[2]["stats"]["stopped"] and msgs[2]["content"]
    assert "previous answer is kept" in win.status.text()
    # a regeneration that finishes replaces the answer it regenerates (the last one)
    win.max_new.setValue(6)
    win.regen_btn.click()
    qtbot.waitUntil(lambda: win.gen is None, timeout=20000)
    again = win.store.messages(cid)
    assert [m["id"] for m in again[:2]] == [msgs[0]["id"], old["id"]] and len(again) == 3
    assert not again[2]["stats"].get("stopped")


def test_regenerate_stopped_before_any_step_keeps_the_old_answer(qtbot, tmp_path, folders):
    win = window(qtbot, tmp_path, folders, SlowEngine, beams=2, max_new_tokens=6)
    send(win)
    qtbot.waitUntil(lambda: win.gen is None, timeout=20000)
    cid = win.current()
    before = win.store.messages(cid)
    win.regen_btn.click()
    win.gen.stop()                      # before the first target pass returns
    qtbot.waitUntil(lambda: win.gen is None, timeout=20000)
    after = win.store.messages(cid)
    assert after[:2] == before
    assert before[1]["content"].strip() in win.transcript.toPlainText() or before[1]["content"] == ""


def test_a_conversation_longer_than_the_context_still_gets_answers(qtbot, tmp_path, folders, monkeypatch):
    """Before: once the history outgrew the model's context every message failed ("the prompt has N tokens")."""
    failed = []
    monkeypatch.setattr("apps.chat.window.QMessageBox.warning", lambda parent, title, text: failed.append(text))
    win = window(qtbot, tmp_path, folders, beams=1, max_new_tokens=8)
    cid = win.current()
    for i in range(12):
        win.store.add(cid, "user", f"question {i} " * 10)
        win.store.add(cid, "assistant", f"answer {i} " * 10)
    send(win, "the last question")
    qtbot.waitUntil(lambda: win.gen is None, timeout=20000)
    assert failed == []
    assert win.store.messages(cid)[-1]["role"] == "assistant" and "left out to fit the model's context" in \
        win.status.text()
    prompt = win._prompt(cid)
    assert "the last question" in prompt and "question 0 " not in prompt and prompt.startswith("user: ")
    assert len(win.engine.encode(prompt)) <= win.engine.target.cfg.context_length - 8


# `specbeam-chat` as a user runs it (main(), app.exec()), offscreen; QTest types the message; the search is
# slowed down so the signal lands mid-answer. Prints "streaming" once the answer is under way.
SESSION = chat_session_script('"streaming"')


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_answer_saves_the_partial_answer_and_quits(tmp_path, folders, sig):
    """Before: SIGTERM killed the app with only the user message stored; Ctrl-C (SIGINT) was ignored."""
    settings = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    for key, value in (("model", folders[0]), ("draft", folders[1]), ("beams", 2), ("max_new_tokens", 400)):
        settings.setValue(key, value)
    settings.sync()
    script = tmp_path / "session.py"
    script.write_text(SESSION)
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, str(script), "--db", str(tmp_path / "chat.sqlite"), "--settings",
                             str(tmp_path / "s.ini")], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "streaming\n", proc.stderr.read()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    db = sqlite3.connect(tmp_path / "chat.sqlite")
    rows = db.execute("SELECT role, content, stats FROM messages ORDER BY id").fetchall()
    db.close()
    assert [r[0] for r in rows] == ["user", "assistant"] and rows[1][1] and '"stopped": true' in rows[1][2]
    assert QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat).value("geometry") is not None


def _blocks(doc):
    block = doc.begin()
    while block.isValid():
        yield block
        block = block.next()
