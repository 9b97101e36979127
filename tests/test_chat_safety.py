"""The chat app's answers never lose text: raw HTML shows as text, code keeps its content, and a stopped,
interrupted or regenerated answer is shown and stored (offscreen Qt)."""
import os

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

from PySide6.QtGui import QTextCursor, QTextFormat  # noqa: E402
from PySide6.QtWidgets import QTextBrowser  # noqa: E402

from apps.chat.render import insert_answer  # noqa: E402


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


def _blocks(doc):
    block = doc.begin()
    while block.isValid():
        yield block
        block = block.next()
