"""Renders the chat window offscreen into a PNG, for the documentation: a conversation whose stored answer has
code with generics and HTML (the text is written here, not by a model; it shows how any answer renders), or
with --live a real conversation: the question is sent to the model and its answer streams in as in use.

    QT_QPA_PLATFORM=offscreen python -m apps.chat.screenshot docs/img/chat_code.png
    python -m apps.chat.screenshot docs/img/chat_smollm2.png --live smollm2 "Give me three tips for a good night's sleep."
"""
import os
import sys
import tempfile
from pathlib import Path

QUESTION = "How do I keep a list of names in Java and show it in a web page?"
ANSWER = """Use a `List<String>` and build the markup as text:

```java
List<String> names = new ArrayList<>();
names.add("Ada");
Map<String, List<Integer>> scores = new HashMap<>();
String html = "<ul>" + names.stream()
    .map(n -> "<li>" + n + "</li>")
    .collect(Collectors.joining()) + "</ul>";
```

Then put it inside a `<div>`: <div id="names"></div> stays visible as written, and so do a<b, &amp; and \
<script>alert(1)</script>.
- **generics**: `Map<K, V>`, `Optional<T>`
- **HTML**: <b>not bold</b>, <!-- not a comment -->"""


def _show(app, win) -> None:
    """The window at the documentation's size, its three panes split as in the pictures."""
    win.resize(1100, 720)
    win.show()
    app.processEvents()
    win.split.setSizes([210, 600, 290])


def _save(win, out: Path) -> str | None:
    """Save the window's picture; the transcript's text, or None when the file was not written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    ok = win.grab().save(str(out))
    text = win.transcript.toPlainText()
    win.close()
    return text if ok else None


def main(argv=None) -> int:
    args = list(argv if argv is not None else sys.argv[1:]) or ["docs/img/chat_code.png"]
    out = Path(args[0])
    if len(args) >= 4 and args[1] == "--live":
        shown = live(out, args[2], args[3])
    else:
        shown = render(out)
    print(f"{'wrote' if shown is not None else 'could not write'} {out}")
    return 0 if shown is not None else 1


def render(out: Path) -> str | None:
    """Saves the window's picture to `out`; returns the transcript's text (None when the file was not written)."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication

    from .model_folders import default_folders
    from .store import ChatStore
    from .window import ChatWindow

    app = QApplication.instance() or QApplication(sys.argv[:1])
    with tempfile.TemporaryDirectory() as tmp:
        store = ChatStore(Path(tmp) / "chat.sqlite")
        older = store.new_conversation("Click the Save button")
        store.add(older, "user", "Click the Save button to store the document.")
        cid = store.new_conversation("Java: List<String> in a web page")
        store.add(cid, "user", QUESTION)
        marks = [[ANSWER.index("names"), ANSWER.index("names") + 5], [ANSWER.index("ArrayList"),
                                                                      ANSWER.index("ArrayList") + 9]]
        store.add(cid, "assistant", ANSWER, {"draft_spans": marks})
        settings = QSettings(str(Path(tmp) / "settings.ini"), QSettings.Format.IniFormat)
        model, draft = default_folders()
        settings.setValue("model", model)
        settings.setValue("draft", draft)
        win = ChatWindow(store, settings=settings)
        _show(app, win)
        app.processEvents()
        return _save(win, out)


def live(out: Path, model: str, question: str, beams: int = 1, timeout_s: float = 300) -> str | None:
    """Ask `model` (a folder or a fetched model's name, with its draft) `question` in the window, wait for the
    answer, save the picture; returns the transcript's text (None when the file was not written)."""
    import time

    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication

    from specbeam_edge.fetch import default_draft, resolve_model

    from .store import ChatStore
    from .window import ChatWindow

    app = QApplication.instance() or QApplication(sys.argv[:1])
    with tempfile.TemporaryDirectory() as tmp:
        settings = QSettings(str(Path(tmp) / "settings.ini"), QSettings.Format.IniFormat)
        settings.setValue("model", resolve_model(model))
        settings.setValue("draft", default_draft(model) or "")
        settings.setValue("beams", beams)
        win = ChatWindow(ChatStore(Path(tmp) / "chat.sqlite"), settings=settings)
        _show(app, win)
        win.input.setPlainText(question)
        win.send_btn.click()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            app.processEvents()
            if win.gen is None and win.store.messages(win.current())[-1:] and \
                    win.store.messages(win.current())[-1]["role"] == "assistant":
                break
            time.sleep(0.05)
        app.processEvents()
        return _save(win, out)


if __name__ == "__main__":
    sys.exit(main())
