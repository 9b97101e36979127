"""The desktop chat app, offscreen, driven as a user would: type + Enter, Stop, close mid-answer, restart."""
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from PySide6.QtCore import QSettings, Qt  # noqa: E402
from PySide6.QtGui import QTextCursor, QTextFormat  # noqa: E402
from PySide6.QtWidgets import QApplication, QTextBrowser  # noqa: E402

from apps.chat import __main__ as chat_main  # noqa: E402
from apps.chat.render import draft_spans, insert_answer  # noqa: E402
from apps.chat.store import ChatStore  # noqa: E402
from apps.chat.window import ChatWindow, pair_name, status_text  # noqa: E402
from specbeam_edge import Engine  # noqa: E402
from specbeam_edge.text.prompting import CHAT_MAX_NEW_TOKENS  # noqa: E402

ENDE = Path(__file__).resolve().parents[1] / "models" / "ende"


class SlowEngine(Engine):
    """The real engine, with a pause after each target pass so that Stop lands mid-generation."""

    def generate_passes(self, *a, **kw):     # what Engine.stream and the app's worker iterate
        for item in super().generate_passes(*a, **kw):
            time.sleep(0.03)
            yield item


@pytest.fixture
def folders(exported):
    return str(exported("llama", std=0.3, seed=3)), str(exported("llama", std=0.3, seed=11, layers=1))


def make_window(qtbot, tmp_path, folders, factory=Engine, show=False):
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    if folders:
        settings.setValue("model", folders[0])
        settings.setValue("draft", folders[1])
    win = ChatWindow(ChatStore(tmp_path / "chat.sqlite"), engine_factory=factory, settings=settings)
    qtbot.addWidget(win)
    if show:
        win.show()
        qtbot.waitExposed(win)
        win.activateWindow()
        win.input.setFocus()
    return win


def wait_idle(qtbot, win):
    qtbot.waitUntil(lambda: win.gen is None, timeout=30000)


def background_chars(doc) -> str:
    """The characters of a document painted with a background (the draft highlight)."""
    out, block = [], doc.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            frag = it.fragment()
            if frag.charFormat().background().style() != Qt.BrushStyle.NoBrush:
                out.append(frag.text())
            it += 1
        block = block.next()
    return "".join(out)


def test_enter_sends_shift_enter_adds_a_line_and_focus_stays(qtbot, tmp_path, folders):
    win = make_window(qtbot, tmp_path, folders, show=True)
    win.max_new.setValue(6)
    qtbot.keyClicks(win.input, "first line")
    qtbot.keyClick(win.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(win.input, "second line")
    assert win.input.toPlainText() == "first line\nsecond line"
    qtbot.keyClick(win.input, Qt.Key.Key_Return)
    assert win.input.toPlainText() == "" and win.gen is not None
    wait_idle(qtbot, win)
    assert [m["content"] for m in win.store.messages(win.current())][0] == "first line\nsecond line"
    assert "first line\nsecond line" in win.transcript.toPlainText()   # the user's newline is kept
    assert QApplication.focusWidget() is win.input                    # the next message goes to the input
    qtbot.mouseClick(win.send_btn, Qt.MouseButton.LeftButton)           # a click on Send keeps it there too
    assert QApplication.focusWidget() is win.input and win.model_edit.selectedText() == ""


def test_stream_then_stop_status_is_honest(qtbot, tmp_path, folders):
    win = make_window(qtbot, tmp_path, folders, SlowEngine)
    win.max_new.setValue(200)
    win.beams.setValue(2)
    win.input.setPlainText("the quick brown fox")
    win.send_btn.click()
    qtbot.waitUntil(lambda: len(win.partial.text) > 0, timeout=20000)
    assert not win.send_btn.isEnabled() and win.stop_btn.isEnabled()   # the UI stays responsive meanwhile
    assert win.partial.text + "▌\nsearching 2 beams… " in win.transcript.toPlainText()
    win.stop_btn.click()
    wait_idle(qtbot, win)
    msgs = win.store.messages(win.current())
    assert [m["role"] for m in msgs] == ["user", "assistant"]
    st = msgs[1]["stats"]
    assert st["stopped"] and 0 < st["generated_tokens"] < 200 and st["tokens_per_second"] > 0
    assert win.status.text().startswith(f"stopped after {st['generated_tokens']} tokens in ")
    assert not re.search(r"\(0\.0 tok/s\)", win.status.text())     # "30.0 tok/s" is fine


def test_close_mid_answer_keeps_the_partial_answer(qtbot, tmp_path, folders):
    win = make_window(qtbot, tmp_path, folders, SlowEngine)
    win.max_new.setValue(300)
    win.input.setPlainText("the quick brown fox")
    win.send_btn.click()
    qtbot.waitUntil(lambda: len(win.partial.text) > 0, timeout=20000)
    gen, cid = win.gen, win.current()
    win.close()
    assert win.gen is None and gen.isFinished()                        # joined, not destroyed while running
    store = ChatStore(tmp_path / "chat.sqlite")
    answer = store.messages(cid)[-1]
    assert answer["role"] == "assistant" and answer["stats"]["stopped"]
    assert answer["content"].startswith(gen.answer.text) and answer["content"]
    store.close()


def test_restart_keeps_answers_marks_and_settings_across_a_model_switch(qtbot, tmp_path, folders):
    win = make_window(qtbot, tmp_path, (str(ENDE / "target"), str(ENDE / "draft")))   # a pair that drafts well
    win.beams.setValue(1)
    win.max_new.setValue(24)
    win.mode.setCurrentIndex(0)
    win.highlight.setChecked(True)
    win.input.setPlainText("Click the Save button to store the document.")
    win.send_btn.click()
    wait_idle(qtbot, win)
    cid = win.current()
    [_, answer] = win.store.messages(cid)
    spans = answer["stats"]["draft_spans"]
    assert spans
    marked = "".join(answer["content"][a:b] for a, b in spans)
    assert answer["stats"]["tokens"] and answer["stats"]["steps_from_draft"] > 0
    assert background_chars(win.transcript.document()) == marked.replace("\n", "")
    win.close()
    # restart with other models (another tokenizer): the stored answer is shown as it was, marks included
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    settings.setValue("model", folders[0])
    settings.setValue("draft", folders[1])
    again = ChatWindow(ChatStore(tmp_path / "chat.sqlite"), settings=settings)
    qtbot.addWidget(again)
    assert again.engine_name == pair_name(*folders) and again.beams.value() == 1
    assert again.max_new.value() == 24
    assert answer["content"] in again.transcript.toPlainText()
    assert background_chars(again.transcript.document()) == marked.replace("\n", "")


def test_settings_are_remembered_and_temperature_only_for_sampling(qtbot, tmp_path, folders):
    win = make_window(qtbot, tmp_path, folders)
    assert not win.temperature.isEnabled()                              # exact beam search: no temperature
    win.mode.setCurrentIndex(1)
    assert win.temperature.isEnabled()
    win.beams.setValue(3)
    win.max_new.setValue(77)
    win.budget.setValue(20)
    win.temperature.setValue(0.7)
    win.speculate.setChecked(False)
    win.highlight.setChecked(False)
    win.close()
    again = make_window(qtbot, tmp_path, None)
    assert (again.mode.currentIndex(), again.beams.value(), again.max_new.value(), again.budget.value()) == (1, 3, 77, 20)
    assert again.temperature.value() == pytest.approx(0.7) and again.temperature.isEnabled()
    assert not again.speculate.isChecked() and not again.highlight.isChecked()
    assert again.model_edit.text() == folders[0] and again.draft_edit.text() == folders[1]


def test_speculation_switch_and_pair_name(qtbot, tmp_path, folders):
    win = make_window(qtbot, tmp_path, folders)
    assert win.pair.text() == pair_name(*folders) and "draft draft" not in win.status.text()
    assert win.status.text() == f"ready: {win.engine_name}" and win.speculate.isEnabled()
    win.speculate.setChecked(False)
    win.max_new.setValue(8)
    win.input.setPlainText("hello")
    win.send_btn.click()
    wait_idle(qtbot, win)
    st = win.store.messages(win.current())[-1]["stats"]
    assert st["speculative"] is False and st["draft_passes"] == 0 and st["draft_spans"] == []
    assert "no speculation" in win.status.text()
    assert pair_name(str(ENDE / "target"), str(ENDE / "draft")) == "ende (target + draft)"
    assert pair_name("/m/qwen", "/d/tiny") == "qwen + tiny" and pair_name("/m/qwen", "") == "qwen (no draft)"


def test_bad_draft_keeps_the_loaded_models_and_names_the_draft(qtbot, tmp_path, folders, monkeypatch):
    shown = []
    monkeypatch.setattr("apps.chat.window.QMessageBox.critical", lambda parent, title, text: shown.append(text))
    win = make_window(qtbot, tmp_path, folders)
    engine, name = win.engine, win.engine_name
    win.draft_edit.setText(str(tmp_path / "no_such_draft"))
    assert win.load_models() is False
    assert win.engine is engine and win.engine_name == name
    assert shown[0] == (f"draft model folder {tmp_path / 'no_such_draft'} does not exist\n\n"
                        f"Still using {name}.")
    assert folders[0] not in shown[0]
    assert win.status.text().endswith(f"still using {name}")
    assert QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat).value("draft") == folders[1]


def test_bad_model_folder_at_start_is_a_dialog(qtbot, tmp_path, monkeypatch):
    shown = []
    monkeypatch.setattr("apps.chat.window.QMessageBox.critical", lambda parent, title, text: shown.append(text))
    win = make_window(qtbot, tmp_path, (str(tmp_path / "no_such_model"), ""))
    assert win.engine is None
    assert shown == [f"model folder {tmp_path / 'no_such_model'} does not exist\n\nNo model is loaded."]


def test_system_prompt_follows_the_models_template(qtbot, tmp_path, folders):
    win = make_window(qtbot, tmp_path, folders)             # the test models have a chat template
    assert win.system.isEnabled()
    win.system.setText("be brief")
    win.system.editingFinished.emit()
    win.store.add(win.current(), "user", "hi")
    assert win._prompt(win.current()).startswith("system: be brief\nuser: hi\n")
    win.model_edit.setText(str(ENDE / "target"))             # a translation model: no template
    win.draft_edit.setText("")
    assert win.load_models()
    assert not win.system.isEnabled() and "no chat template" in win.system.toolTip()
    assert win._prompt(win.current()) == "<|endoftext|>hi<|de|>"


def test_persistence_regenerate_and_export(qtbot, tmp_path, folders):
    win = make_window(qtbot, tmp_path, folders)
    win.max_new.setValue(8)
    win.system.setText("be brief")
    win.system.editingFinished.emit()
    win.input.setPlainText("hello world")
    win.send_btn.click()
    wait_idle(qtbot, win)
    win.regen_btn.click()
    wait_idle(qtbot, win)
    cid = win.current()
    assert [m["role"] for m in win.store.messages(cid)] == ["user", "assistant"]
    win.export_markdown(str(tmp_path / "chat.md"))
    md = (tmp_path / "chat.md").read_text()
    assert "**user:** hello world" in md and "be brief" in md


def test_markdown_answer_with_highlight(qapp):
    view = QTextBrowser()
    cursor = QTextCursor(view.document())
    text = "Some **bold** text\nnext line\n\n- item one\n- item two\n\n```\ndef f():\n    return 1\n```"
    bold = text.index("bold")
    insert_answer(cursor, text, [[bold, bold + 4], [text.index("two"), text.index("two") + 3]], True)
    doc = view.document()
    # the code block, then its copy link
    assert doc.toPlainText() == "Some bold text\nnext line\nitem one\nitem two\ndef f():\n    return 1\nCopy code"
    lists = [b.text() for b in _blocks(doc) if b.textList() is not None]
    assert lists == ["item one", "item two"]
    assert background_chars(doc) == "boldtwo"
    code = [b.text() for b in _blocks(doc) if b.blockFormat().hasProperty(QTextFormat.Property.BlockCodeFence)]
    assert code == ["def f():", "    return 1"]


def _blocks(doc):
    block = doc.begin()
    while block.isValid():
        yield block
        block = block.next()


def test_draft_spans_from_tokens():
    pieces = {1: "ab", 2: "c", 3: " de"}
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    assert draft_spans(decode, [1, 2, 3], [False, True, True]) == [[2, 6]]
    assert draft_spans(decode, [1, 2, 3], [True, False, True], offset=10) == [[10, 12], [13, 16]]
    assert draft_spans(decode, [1, 2, 3], [True]) == [[0, 2]]        # steps without a flag: not drafted


def test_status_text():
    assert status_text(dict(generated_tokens=12, wall_seconds=0.5, tokens_per_second=24.0, speculative=True,
                            beam_steps=12, beam_steps_per_pass=2.4, steps_from_draft=6)) == \
        "12 tokens in 0.5 s (24.0 tok/s) · 2.40 beam steps per target pass · draft supplied 50% of steps"
    assert status_text(dict(generated_tokens=3, wall_seconds=1.0, tokens_per_second=3.0, stopped=True)) == \
        "stopped after 3 tokens in 1.0 s (3.0 tok/s) · no speculation"


def test_startup_names_the_missing_qt_library():
    none = lambda lib: None  # noqa: E731
    found = lambda lib: f"lib{lib}.so"  # noqa: E731
    msg = chat_main.display_problem({"DISPLAY": ":0"}, "linux", none)
    assert msg.startswith("Qt's X11 plugin needs system libraries that are not installed: libxcb-cursor0, "
                          "libxkbcommon-x11-0, libxcb-icccm4, libxcb-keysyms1, ")
    assert all(pkg in msg for pkg in chat_main.XCB_LIBRARIES.values())
    # what a fresh Debian 12 lacked beside libxcb-cursor0 and libxkbcommon-x11-0 (Qt then aborted)
    some = lambda lib: None if lib in ("xcb-icccm", "xcb-keysyms") else f"lib{lib}.so"  # noqa: E731
    assert chat_main.display_problem({"DISPLAY": ":0"}, "linux", some) == (
        "Qt's X11 plugin needs system libraries that are not installed: libxcb-icccm4, libxcb-keysyms1 "
        "(Debian/Ubuntu: sudo apt-get install libxcb-icccm4 libxcb-keysyms1)")
    assert "DISPLAY is not set" in chat_main.display_problem({}, "linux", found)
    assert chat_main.display_problem({"DISPLAY": ":0"}, "linux", found) is None
    assert chat_main.display_problem({"QT_QPA_PLATFORM": "offscreen"}, "linux", none) is None
    assert chat_main.display_problem({}, "darwin", none) is None
    err = ImportError("libEGL.so.1: cannot open shared object file: No such file or directory")
    assert chat_main.import_problem(err) == ("Qt cannot load the system library libEGL: " + str(err)
                                             + " (Debian/Ubuntu: sudo apt-get install libegl1)")
    # before: `pip install -e '.[app]'`, which works only in a checkout and brings no onnxruntime
    hint = chat_main.import_problem(ImportError("No module named 'PySide6'"))
    assert "pip install 'specbeam-edge[app]'" in hint and "pip install -e '.[cpu,app]'" in hint


def test_main_reports_the_problem_instead_of_aborting(monkeypatch, capsys):
    monkeypatch.setattr(chat_main, "display_problem", lambda: "no display: DISPLAY is not set")
    assert chat_main.main([]) == 2
    assert capsys.readouterr().err == "specbeam chat: no display: DISPLAY is not set\n"


def test_stats_json_is_small(qtbot, tmp_path, folders):
    win = make_window(qtbot, tmp_path, folders)
    win.max_new.setValue(8)
    win.input.setPlainText("hello")
    win.send_btn.click()
    wait_idle(qtbot, win)
    st = win.store.messages(win.current())[-1]["stats"]
    assert "from_draft" not in st and "widths" not in st and len(json.dumps(st)) < 2000


def test_missing_shipped_pair_says_what_to_do(qtbot, tmp_path, monkeypatch):
    shown = []
    monkeypatch.setattr("apps.chat.window.QMessageBox.critical", lambda parent, title, text: shown.append(text))
    monkeypatch.setenv("SPECBEAM_MODELS", str(tmp_path / "models"))
    win = make_window(qtbot, tmp_path, None)       # first start: the shipped text pair is the default
    assert win.engine is None and win.model_edit.text() == str(tmp_path / "models" / "text" / "target")
    assert shown == [f"the shipped model folder {tmp_path}/models/text/target is not in SPECBEAM_MODELS="
                     f"{tmp_path}/models: pass your model folders with the Model and Draft fields, or set "
                     f"SPECBEAM_MODELS to the repository's models/ folder (it holds the pairs ende, text, each "
                     f"with target/ and draft/)\n\nNo model is loaded."]


def test_installed_qt_keeps_references_to_none(qapp):
    """PySide6 6.12.0 under Python 3.11 drops a reference to None per void call: the app aborted mid-answer."""
    assert chat_main.refcount_problem() is None
    before = sys.getrefcount(None)
    label = QTextBrowser()
    for _ in range(200):
        label.setPlainText("x")
    assert sys.getrefcount(None) >= before - 5


def test_main_reports_a_broken_qt_build(monkeypatch, capsys):
    monkeypatch.setattr(chat_main, "refcount_problem", lambda: "PySide6 6.12.0 loses a reference to None")
    assert chat_main.main([]) == 2
    assert capsys.readouterr().err == "specbeam chat: PySide6 6.12.0 loses a reference to None\n"


def test_folders_remembered_by_an_earlier_version_are_carried_over(qtbot, tmp_path, folders):
    store = ChatStore(tmp_path / "chat.sqlite")          # where the previous version kept them
    store.put("model", folders[0])
    store.put("draft", "")
    store.close()
    win = make_window(qtbot, tmp_path, None)
    assert (win.model_edit.text(), win.draft_edit.text()) == (folders[0], "")
    assert win.engine is not None and win.engine.draft is None and not win.speculate.isEnabled()


def test_picking_another_model_folder_clears_its_old_draft(qtbot, tmp_path, folders, monkeypatch):
    """Before: a model picked with '…' kept the previous model's draft, so loading the new pair could fail on a
    draft that does not go with it; a default (or earlier) draft applies only to its own target."""
    win = make_window(qtbot, tmp_path, folders)
    assert win.draft_edit.text() == folders[1]
    other = str(tmp_path / "another-model")
    monkeypatch.setattr("apps.chat.settings_panel.QFileDialog.getExistingDirectory", lambda *a, **k: other)
    win._pick_model()
    assert win.model_edit.text() == other and win.draft_edit.text() == ""
    assert "draft cleared" in win.status.text()
    monkeypatch.setattr("apps.chat.settings_panel.QFileDialog.getExistingDirectory", lambda *a, **k: "")   # cancelled
    win.draft_edit.setText(folders[1])
    win._pick_model()
    assert win.model_edit.text() == other and win.draft_edit.text() == folders[1]



def test_max_new_tokens_on_a_first_start_is_the_engines_default(qtbot, tmp_path, folders):
    """A chat model's answers were cut at 128 tokens by the panel's default (code stopped mid-line) while the CLI
    gave 512: on a first start the panel shows the engine's default for the folder (a saved value stays: see
    test_settings_are_remembered_and_temperature_only_for_sampling)."""
    for name in ("chat", "text"):
        (tmp_path / name).mkdir()
    win = make_window(qtbot, tmp_path / "chat", folders)
    assert win.max_new.value() == CHAT_MAX_NEW_TOKENS == Engine(folders[0]).generation_config().max_new_tokens
    text = make_window(qtbot, tmp_path / "text", [str(ENDE.parent / "text" / t) for t in ("target", "draft")])
    assert text.max_new.value() == 128
