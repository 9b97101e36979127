"""specbeam chat: the desktop chat app (PySide6).

    specbeam-chat [--db PATH] [--settings PATH]      (from a checkout also: python -m apps.chat)

On Linux, Qt's X11 plugin needs a few system libraries (Debian/Ubuntu: apt-get install libxcb-cursor0
libxkbcommon-x11-0 libxcb-icccm4 libxcb-keysyms1 libegl1 libgl1; the app names any other that is missing);
without a display run it under `xvfb-run`, or set QT_QPA_PLATFORM=offscreen to render without showing anything.
Ctrl-C in the terminal (SIGINT) or SIGTERM closes the window as its close button does: a running answer is
stopped and its text so far saved; the exit status is then 130 or 143.
"""
import argparse
import ctypes.util
import os
import re
import sys

# every X11 library Qt's xcb plugin links against (libqxcb.so, libQt6XcbQpa.so.6; as ctypes.util.find_library names
# it) -> Debian/Ubuntu package. A fresh Debian 12 with libxcb-cursor0 and libxkbcommon-x11-0 still lacked
# libxcb-icccm4 and libxcb-keysyms1, and Qt aborted naming only xcb-cursor.
XCB_LIBRARIES = {"xcb-cursor": "libxcb-cursor0", "xkbcommon-x11": "libxkbcommon-x11-0", "xcb-icccm": "libxcb-icccm4",
                 "xcb-keysyms": "libxcb-keysyms1", "xcb-image": "libxcb-image0", "xcb-randr": "libxcb-randr0",
                 "xcb-render-util": "libxcb-render-util0", "xcb-render": "libxcb-render0", "xcb-shape": "libxcb-shape0",
                 "xcb-shm": "libxcb-shm0", "xcb-sync": "libxcb-sync1", "xcb-util": "libxcb-util1",
                 "xcb-xfixes": "libxcb-xfixes0", "xcb-xkb": "libxcb-xkb1", "xcb": "libxcb1", "X11-xcb": "libx11-xcb1",
                 "X11": "libx11-6", "xkbcommon": "libxkbcommon0"}
SONAME_PACKAGES = {"libEGL": "libegl1", "libGL": "libgl1", "libOpenGL": "libopengl0", "libxkbcommon": "libxkbcommon0",
                   "libfontconfig": "libfontconfig1", "libdbus-1": "libdbus-1-3", "libglib-2.0": "libglib2.0-0"}


def display_problem(environ=os.environ, platform=sys.platform, find_library=ctypes.util.find_library) -> str | None:
    """Why Qt's X11 plugin would abort at start-up (it prints a hint and exits with SIGABRT), or None."""
    qpa = environ.get("QT_QPA_PLATFORM", "")
    if not platform.startswith("linux") or (qpa and not qpa.startswith("xcb")):
        return None
    if not qpa and environ.get("WAYLAND_DISPLAY"):
        return None
    missing = [pkg for lib, pkg in XCB_LIBRARIES.items() if find_library(lib) is None]
    if missing:
        return (f"Qt's X11 plugin needs system libraries that are not installed: {', '.join(missing)} "
                f"(Debian/Ubuntu: sudo apt-get install {' '.join(missing)})")
    if not environ.get("DISPLAY"):
        return ("no display: DISPLAY is not set. Run the app in a desktop session, under `xvfb-run specbeam-chat`, "
                "or with QT_QPA_PLATFORM=offscreen (renders without showing a window)")
    return None


def import_problem(error: ImportError) -> str:
    """PySide6 is missing, or a system library that Qt links against is (e.g. libEGL.so.1)."""
    lib = re.search(r"(lib[\w.+-]+?)\.so", str(error))
    if lib is None:
        return (f"the chat app needs PySide6: pip install 'specbeam-edge[app]' (from a checkout: pip install -e "
                f"'.[cpu,app]') ({error})")
    pkg = SONAME_PACKAGES.get(lib.group(1))
    hint = f" (Debian/Ubuntu: sudo apt-get install {pkg})" if pkg else ""
    return f"Qt cannot load the system library {lib.group(1)}: {error}{hint}"


def refcount_problem() -> str | None:
    """Some PySide6 builds (6.12.0 under Python 3.11) drop a reference to None on every void method call; the
    app then aborts with 'none_dealloc' after a few thousand calls. 100 calls show it. (None is immortal from
    Python 3.12 on, where such a build does no harm.)"""
    if sys.version_info >= (3, 12):
        return None
    import PySide6
    from PySide6.QtCore import QObject

    probe, before = QObject(), sys.getrefcount(None)
    for _ in range(100):
        probe.setObjectName("probe")
    if sys.getrefcount(None) > before - 50:
        return None
    return (f"PySide6 {PySide6.__version__} loses a reference to None on each call under Python "
            f"{sys.version.split()[0]} and the app would crash: pip install 'PySide6-Essentials>=6.6,!=6.12.0'")


def install_signal_handlers(app) -> list:
    """SIGTERM and SIGINT (Ctrl-C in the terminal) close every window as its close button does (a running answer
    is stopped and its text so far saved, the settings remembered) and end the event loop with 128 + the
    signal's number. Qt's event loop runs in C++, where Python cannot run its handlers: the wakeup fd wakes it.
    Returns the objects that must stay alive as long as the app runs."""
    import signal
    import socket

    from PySide6.QtCore import QSocketNotifier

    rsock, wsock = socket.socketpair()
    for sock in (rsock, wsock):
        sock.setblocking(False)
    signal.set_wakeup_fd(wsock.fileno())
    notifier = QSocketNotifier(rsock.fileno(), QSocketNotifier.Type.Read)

    def drain():                        # Python code runs here, and with it the handler below
        try:
            rsock.recv(4096)
        except OSError:
            pass
    notifier.activated.connect(drain)
    closing = []

    def handler(signum, frame):
        if closing:                     # a second Ctrl-C while the windows close: they are closing already
            return
        closing.append(signum)
        app.closeAllWindows()
        app.exit(128 + signum)          # ignored before the event loop runs: main() checks `closing` then
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    return [rsock, wsock, notifier, handler, closing]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="specbeam-chat", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default=None, help="conversation database (default: the user's data folder)")
    ap.add_argument("--settings", default=None,
                    help="settings file (INI; default: Qt's per-user settings for specbeam-edge/chat)")
    args = ap.parse_args(argv)
    try:
        from PySide6.QtCore import QSettings, QTimer
        from PySide6.QtWidgets import QApplication
    except ImportError as e:
        print(f"specbeam chat: {import_problem(e)}", file=sys.stderr)
        return 2
    problem = refcount_problem() or display_problem()
    if problem:
        print(f"specbeam chat: {problem}", file=sys.stderr)
        return 2
    from specbeam_edge import share_threads

    from .store import ChatStore
    from .window import ChatWindow

    share_threads()                     # the app's process is ours: one thread pool for every model it loads

    app = QApplication.instance() or QApplication(sys.argv[:1])
    keep = install_signal_handlers(app)
    settings = QSettings(args.settings, QSettings.Format.IniFormat) if args.settings else None
    win = ChatWindow(ChatStore(args.db), settings=settings)
    closing = keep[-1]
    if closing:                         # Ctrl-C or SIGTERM while the window was being built (models loading)
        code = 128 + closing[0]
    else:
        win.show()
        # a signal between this check and the loop's start: app.exit() came too early, so ask again from inside
        QTimer.singleShot(0, lambda: closing and app.exit(128 + closing[0]))
        code = app.exec()
    del win, keep    # the window (and its thread) go before the application object
    return code


if __name__ == "__main__":
    sys.exit(main())
