"""Renders the chat window offscreen into a PNG, for the documentation: a conversation whose stored answer has
code with generics and HTML (the text is written here, not by a model; it shows how any answer renders).

    QT_QPA_PLATFORM=offscreen python -m apps.chat.screenshot docs/img/chat_code.png
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


def main(argv=None) -> int:
    out = Path((argv or sys.argv[1:] or ["docs/img/chat_code.png"])[0])
    shown = render(out)
    print(f"{'wrote' if shown is not None else 'could not write'} {out}")
    return 0 if shown is not None else 1


def render(out: Path) -> str | None:
    """Saves the window's picture to `out`; returns the transcript's text (None when the file was not written)."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication

    from .store import ChatStore
    from .window import ChatWindow, default_folders

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
        win.resize(1100, 720)
        win.show()
        app.processEvents()
        win.split.setSizes([210, 600, 290])
        app.processEvents()
        out.parent.mkdir(parents=True, exist_ok=True)
        ok = win.grab().save(str(out))
        text = win.transcript.toPlainText()
        win.close()
    return text if ok else None


if __name__ == "__main__":
    sys.exit(main())
