"""specbeam chat: the desktop chat app (PySide6).

    python -m apps.chat [--db PATH]
"""
import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m apps.chat", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default=None, help="conversation database (default: the user's data folder)")
    args = ap.parse_args(argv)
    try:
        from PySide6.QtWidgets import QApplication
    except ImportError:
        print("the chat app needs PySide6: pip install -e '.[app]'", file=sys.stderr)
        return 2
    from .store import ChatStore
    from .window import ChatWindow

    app = QApplication(sys.argv[:1])
    win = ChatWindow(ChatStore(args.db))
    win.show()
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
