"""Ctrl-C while a command is still importing its modules: one line and exit status 130, not a traceback."""
import importlib

import pytest

from apps import launch


@pytest.mark.parametrize("command", ["specbeam", "export", "translate", "chat"])
def test_interrupt_during_imports_is_one_line(command, monkeypatch, capsys):
    def interrupted(name):
        raise KeyboardInterrupt
    monkeypatch.setattr(launch.importlib, "import_module", interrupted)
    assert getattr(launch, command)([]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "interrupted while starting" in err and "Traceback" not in err


def test_commands_run_their_tools_main_with_argv(monkeypatch):
    seen = []
    real = importlib.import_module
    monkeypatch.setattr(launch.importlib, "import_module",
                        lambda name: type("M", (), {"main": staticmethod(lambda argv: seen.append((name, argv)) or 0)})
                        if name.startswith("specbeam") else real(name))
    assert launch.translate(["-h"]) == 0 and seen == [("specbeam_apps.translate.__main__", ["-h"])]
