"""The transcript in the middle of the chat window: a conversation's messages (answers as Markdown, the draft's
text highlighted), the answer streaming in at its end with a "searching N beams" note while the beams disagree,
and the copy links under code blocks."""
from __future__ import annotations

from PySide6.QtCore import QUrl
from PySide6.QtGui import QColor, QDesktopServices, QGuiApplication, QTextCharFormat, QTextCursor

from .render import COPY_SCHEME, CURSOR, code_text, insert_answer

DAMAGED = ("Part of this conversation could not be read from the database: what could be read is shown, and "
           "new messages are saved.")


class Transcript:
    """ChatWindow's transcript view (a mixin: the window holds the transcript widget, the store, the running
    generation and its partial answer)."""

    def _show_conversation(self, *_):
        if not self.convs.currentItem():
            return
        cid = self.current()
        self.system.setText(self.store.system(cid))
        self.transcript.clear()
        cursor = QTextCursor(self.transcript.document())
        generating = self.gen is not None and self.gen_conv == cid
        messages = self.store.messages(cid)
        if cid in self.store.damaged:
            cursor.insertText(DAMAGED, _note_format())
        for m in messages:
            if generating and m["id"] == self.replacing:     # the new answer streams in its place
                continue
            self._insert_message(cursor, m["role"], m["content"], (m["stats"] or {}).get("draft_spans", []))
        self._answer_at = cursor.position()
        if generating:
            self._show_partial()
        self._scroll_to_end()

    def _insert_message(self, cursor: QTextCursor, role: str, text: str, spans: list):
        if cursor.position() > 0:
            cursor.insertBlock()
        cursor.insertHtml("<b>You:</b>" if role == "user" else "<b>Assistant:</b>")
        cursor.insertBlock()
        cursor.setCharFormat(QTextCharFormat())    # the header's bold stops here
        if role == "user":
            cursor.insertText(text)          # what was typed, as typed
        elif text:
            insert_answer(cursor, text, spans, self.highlight.isChecked())
        else:
            cursor.insertText("(no text)", _note_format())

    def _show_partial(self):
        """Replace the streaming answer at the end of the transcript with its latest text."""
        doc = self.transcript.document()
        cursor = QTextCursor(doc)
        cursor.setPosition(min(self._answer_at, doc.characterCount() - 1))
        cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        self._insert_message(cursor, "assistant", self.partial.text + CURSOR, self.partial.spans)
        if self.gen is not None and self.gen.kwargs.get("num_beams", 1) > 1:
            # several beams: the text above is what all of them agree on; the rest is still being searched
            cursor.insertBlock()
            cursor.insertText(searching_text(self.gen.kwargs["num_beams"], self.partial_steps), _note_format())

    def _link_clicked(self, url: QUrl):
        """A code block's copy link copies that block's text; any other link opens in the browser."""
        if url.scheme() == COPY_SCHEME:
            try:
                text = code_text(self.transcript.document(), int(url.path()))
            except ValueError:
                return
            QGuiApplication.clipboard().setText(text)
            n = text.count("\n") + 1
            self.status.setText(f"copied the code block ({n} line{'s' if n > 1 else ''})")
        elif url.scheme() in ("http", "https", "mailto"):
            QDesktopServices.openUrl(url)

    def _scroll_to_end(self):
        bar = self.transcript.verticalScrollBar()
        bar.setValue(bar.maximum())


def searching_text(beams: int, steps: int) -> str:
    """The note under a streaming answer while several beams have not agreed on more text."""
    return f"searching {beams} beams… {steps} tokens so far"


def _note_format() -> QTextCharFormat:
    fmt = QTextCharFormat()
    fmt.setFontItalic(True)
    fmt.setForeground(QColor("#808080"))
    return fmt
