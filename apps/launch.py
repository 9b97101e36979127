"""The console commands' entry points: a tool's imports (numpy, onnxruntime, tokenizers; torch for the exporter)
take seconds, and Ctrl-C during them printed a KeyboardInterrupt traceback. Each command imports its module
here, where that interrupt becomes one line and exit status 130, as it does once the tool runs."""
from __future__ import annotations

import importlib
import sys


def _run(module: str, prog: str, argv) -> int:
    try:
        main = importlib.import_module(module).main
    except KeyboardInterrupt:
        print(f"{prog}: interrupted while starting", file=sys.stderr)
        return 130
    return main(argv)


def specbeam(argv=None) -> int:
    """`specbeam generate|chat|fetch` run the runtime's CLI; `specbeam translate` is the translate tool (an app:
    the runtime imports no app, so the dispatch lives here)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["translate"]:     # every later flag, --help included, belongs to the translate tool
        return translate(argv[1:])
    return _run("specbeam_edge.cli", "specbeam", argv)


def export(argv=None) -> int:
    return _run("specbeam_export.__main__", "specbeam-export", argv)


def translate(argv=None) -> int:
    return _run("specbeam_apps.translate.__main__", "specbeam-translate", argv)


def chat(argv=None) -> int:
    return _run("specbeam_apps.chat.__main__", "specbeam-chat", argv)
