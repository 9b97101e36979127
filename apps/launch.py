"""The console commands' entry points: a tool's imports (numpy, onnxruntime, tokenizers; torch for the exporter;
Qt for the chat app) take seconds, and Ctrl-C during them printed a traceback (or, inside onnxruntime's import,
"ImportError: import numpy failed"). Each command imports its module here with SIGINT and SIGTERM held back; one
that arrived meanwhile ends the command with one line and exit status 130 (143 for SIGTERM) before the tool
starts, as the tool itself ends on them once it runs."""
from __future__ import annotations

import importlib
import os
import signal
import sys
import threading

_STOPS = {signal.SIGINT: 130, signal.SIGTERM: 143}
_resent: list[threading.Timer] = []     # signals `deliver` sends again, until the command that got them ends


def _import_held(module: str, preload: tuple[str, ...]):
    """(the module's main, the signal that arrived during the imports or None), with SIGINT/SIGTERM blocked
    meanwhile: a signal waits as pending instead of raising inside an extension module's import."""
    held = set(_STOPS)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        main = importlib.import_module(module).main
        for name in preload:            # what main() imports first: the slow part of starting
            try:
                importlib.import_module(name)
            except ImportError:         # not installed: main() says so in its own words
                pass
        pending = held & signal.sigpending()
        got = min(pending) if pending else None
        for sig in pending:
            signal.sigwait({sig})       # consume it, so that unblocking does not deliver it
        return main, got
    finally:
        # the command then runs with both deliverable, also when whoever started it had them blocked (a test
        # blocks them before its "launched" marker, so that a signal right after it waits for this function)
        signal.pthread_sigmask(signal.SIG_SETMASK, old - held)


def deliver(signum: int, frame, exc: BaseException) -> None:
    """A signal handler's body: raise exc, unless the signal landed inside a finalizer (`__del__`, e.g. tqdm's as
    a bar is collected), where an exception is printed as 'Exception ignored' and dropped and the command went on
    (the real-signal launch test caught it once); there the signal is sent again 20 ms later, to land outside."""
    f = frame
    while f is not None:
        if f.f_code.co_name == "__del__":
            timer = threading.Timer(0.02, os.kill, (os.getpid(), signum))
            timer.daemon = True         # never a thread the interpreter's exit waits for
            _resent.append(timer)
            timer.start()
            return
        f = f.f_back
    raise exc


def _interrupt(signum, frame):
    deliver(signum, frame, KeyboardInterrupt())


def version() -> str:
    """The installed package's version, from its metadata (a checkout that was not installed has none)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("specbeam-edge")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e . in the checkout)"


def _run(module: str, prog: str, argv, preload: tuple[str, ...] = ()) -> int:
    if (sys.argv[1:] if argv is None else list(argv))[:1] == ["--version"]:    # before the seconds of imports
        print(f"{prog} {version()}")
        return 0
    try:
        main, got = _import_held(module, preload)
    except KeyboardInterrupt:           # delivered to another thread during the imports
        got = signal.SIGINT
    if got is not None:
        print(f"{prog}: {'interrupted' if got == signal.SIGINT else 'terminated'} while starting", file=sys.stderr)
        return _STOPS[got]
    old = signal.signal(signal.SIGINT, _interrupt)    # a tool may install its own (translate: SIGTERM too)
    try:
        return main(argv)
    except KeyboardInterrupt:           # between the imports and the tool's own handling
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130
    finally:
        _settle(old)


def _settle(old_sigint) -> None:
    """After a command: a signal `deliver` was about to send again belongs to the command that ended; it is
    dropped, not raised at the caller or in the interpreter's exit (a SIGINT 0.5 s into a short translate landed
    in a finalizer, its re-send fired while exit waited for the timer's thread, and Python printed a traceback
    there). SIGINT and SIGTERM are ignored while the timers are cancelled and joined, then SIGINT gets the
    caller's handler back and SIGTERM its own."""
    term = signal.getsignal(signal.SIGTERM)
    term = signal.SIG_DFL if term is None else term      # None: a handler not set from Python
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        while _resent:
            timer = _resent.pop()
            timer.cancel()
            timer.join()
    finally:
        signal.signal(signal.SIGTERM, term)
        signal.signal(signal.SIGINT, old_sigint)


def specbeam(argv=None) -> int:
    """`specbeam generate|chat` run the runtime's CLI; `specbeam translate` is the translate tool, `specbeam fetch`
    the fetch app, `specbeam list|rm` its neighbour and `specbeam serve` the server (apps: the runtime imports no
    app, so the dispatch lives here)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["translate"]:     # every later flag, --help included, belongs to the translate tool
        return translate(argv[1:])
    if argv[:1] == ["fetch"]:         # the fetch app runs the exporter, which the runtime never imports
        return _run("specbeam_apps.fetch", "specbeam fetch", argv[1:])
    if argv[:1] in (["list"], ["rm"]):  # the fetched models on disk: rm takes the fetch app's lock
        return _run("specbeam_apps.manage", f"specbeam {argv[0]}", argv)
    if argv[:1] == ["serve"]:         # the OpenAI-compatible server (the serve extra)
        return _run("specbeam_apps.serve.__main__", "specbeam serve", argv[1:])
    return _run("specbeam_edge.commands.cli", "specbeam", argv, ("specbeam_edge.generate",))


def export(argv=None) -> int:
    return _run("specbeam_export.__main__", "specbeam-export", argv, ("torch", "transformers", "onnx"))


def translate(argv=None) -> int:
    return _run("specbeam_apps.translate.__main__", "specbeam-translate", argv, ("specbeam_edge.generate",))


def chat(argv=None) -> int:
    return _run("specbeam_apps.chat.__main__", "specbeam-chat", argv,
                ("PySide6.QtWidgets", "specbeam_apps.chat.window"))
