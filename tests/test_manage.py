"""`specbeam list` and `specbeam rm` (issue 59): the fetched models with their disk use (kept sources included) and
whether each is complete; removal of a model's folders (its draft's too), of its kept sources only when asked,
never while a fetch runs, never through a link, and a one-line refusal of a name that is not fetched. Before: no
way to see what the data folder held, or to free it, but by hand."""
import json
import os

import pytest

from apps import launch, manage
from apps.fetch_lock import LOCK
from specbeam_edge import fetch

MIB = 2**20


def _folder(path, nbytes, complete=True):
    path.mkdir(parents=True)
    (path / "model.onnx").write_bytes(b"x" * nbytes)
    if complete:
        (path / "specbeam_config.json").write_text("{}")
        (path / fetch.MARKER).write_text(json.dumps({"name": path.name}))


@pytest.fixture
def data(tmp_path, monkeypatch):
    """A data folder holding smollm2 (its draft and kept GGUF) and the coder pair (the 0.5B incomplete)."""
    monkeypatch.setenv(fetch.ENV, str(tmp_path / "data"))
    _folder(fetch.folder("smollm2"), 3 * MIB)
    _folder(fetch.draft_folder("smollm2"), MIB)
    _folder(fetch.folder("qwen2.5-coder-1.5b"), 6 * MIB)
    _folder(fetch.folder("qwen2.5-coder-0.5b"), 2 * MIB, complete=False)
    fetch.sources_dir().mkdir(parents=True)
    fetch.gguf_path("smollm2").write_bytes(b"g" * 5 * MIB)
    return tmp_path / "data"


def _rows(out):
    return {line.split()[0]: line for line in out.splitlines()[1:-1]}


def test_list_shows_disk_use_sources_and_state(data, capsys):
    assert manage.main(["list"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert list(rows) == ["smollm2", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"]
    folders = manage.disk_use(fetch.folder("smollm2")) + manage.disk_use(fetch.draft_folder("smollm2"))
    assert folders >= 4 * MIB
    smol = rows["smollm2"].split()
    assert smol[1:3] == manage.size_text(folders).split() and smol[3:5] == manage.size_text(
        manage.disk_use(fetch.gguf_path("smollm2"))).split() and smol[5] == "complete"
    assert rows["qwen2.5-coder-1.5b"].endswith("complete, drafted by qwen2.5-coder-0.5b (not fetched)")
    assert "incomplete: `specbeam fetch qwen2.5-coder-0.5b --force` exports it again, the draft of " \
           "qwen2.5-coder-1.5b" in rows["qwen2.5-coder-0.5b"]
    assert out.splitlines()[-1] == f"{manage.size_text(manage.disk_use(data))} in {data}"


def test_list_of_an_empty_data_folder_says_how_to_fetch(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(fetch.ENV, str(tmp_path / "none"))
    assert manage.main(["list"]) == 0
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"specbeam: no fetched models in {tmp_path / 'none'} (`specbeam fetch NAME`:")


def test_rm_removes_the_folders_and_keeps_sources_unless_asked(data, capsys):
    assert manage.main(["rm", "smollm2-135m-instruct"]) == 0          # the folder's name works as the short one
    out, err = capsys.readouterr()
    assert not fetch.folder("smollm2").exists() and not fetch.draft_folder("smollm2").exists()
    assert out.splitlines()[0].startswith(f"removed {fetch.folder('smollm2')} (")
    assert fetch.gguf_path("smollm2").is_file() and "`specbeam rm smollm2 --sources` removes it" in err
    assert not [p for p in fetch.models_dir().iterdir() if p.name.startswith(".smollm2")]   # nothing staged left
    manage.main(["list"])
    assert _rows(capsys.readouterr().out)["smollm2"].endswith("not fetched, its source kept")
    assert manage.main(["rm", "smollm2", "--sources"]) == 0
    assert not fetch.gguf_path("smollm2").exists() and "smollm2" not in manage.fetched_names()
    # the coder pair goes with the draft that was fetched with it; nothing of anything else is touched
    assert manage.main(["rm", "qwen2.5-coder-1.5b"]) == 0
    assert manage.fetched_names() == [] and sorted(os.listdir(fetch.models_dir())) == [LOCK]


def test_rm_refuses_a_name_that_is_not_fetched_in_one_line(data, capsys):
    for name in ("llama", "smollm2x"):
        assert manage.main(["rm", name]) == 2
        assert capsys.readouterr().err == f"specbeam: error: no fetched model named {name!r}: the fetched ones are " \
                                          f"smollm2, qwen2.5-coder-1.5b, qwen2.5-coder-0.5b\n"
    manage.main(["rm", "smollm2", "--sources"])
    capsys.readouterr()
    assert manage.main(["rm", "smollm2"]) == 2 and "the fetched ones are qwen2.5" in capsys.readouterr().err


def test_rm_never_races_a_fetch(data, capsys):
    from filelock import FileLock

    with FileLock(str(fetch.models_dir() / LOCK)):         # what a running `specbeam fetch` holds
        assert manage.main(["rm", "smollm2"]) == 2
    assert capsys.readouterr().err == f"specbeam: error: a `specbeam fetch` is running on {data}; run `specbeam rm` " \
                                      f"again once it has finished\n"
    assert fetch.is_complete(fetch.folder("smollm2"))


def test_rm_removes_a_link_not_what_it_points_to(data, tmp_path, capsys):
    elsewhere = tmp_path / "mine"
    _folder(elsewhere, MIB)
    (fetch.folder("qwen2.5-coder-0.5b") / "model.onnx").unlink()
    fetch.folder("qwen2.5-coder-0.5b").rmdir()
    fetch.folder("qwen2.5-coder-0.5b").symlink_to(elsewhere)
    assert manage.main(["rm", "qwen2.5-coder-0.5b"]) == 0
    assert not os.path.lexists(fetch.folder("qwen2.5-coder-0.5b")) and (elsewhere / "model.onnx").is_file()


def test_the_specbeam_command_hands_list_and_rm_to_this_app(data, capsys):
    from specbeam_edge.commands import cli

    assert launch.specbeam(["list"]) == 0 and "smollm2" in capsys.readouterr().out
    assert cli.main(["rm", "smollm2"]) == 2                       # the runtime's own parser runs no app
    assert capsys.readouterr().err == "specbeam: error: rm is the fetch app's command: run specbeam rm (the " \
                                      "installed command) or python -m apps.manage rm in a checkout\n"
    assert fetch.is_complete(fetch.folder("smollm2"))


def test_a_failed_rm_says_what_it_left(data, monkeypatch, capsys):
    import errno
    import shutil

    def denied(path):
        (path / fetch.folder("smollm2").name / fetch.MARKER).unlink()      # part of it goes, then a denial
        raise PermissionError(errno.EACCES, "Permission denied", str(path))
    monkeypatch.setattr(manage.shutil, "rmtree", denied)
    assert manage.main(["rm", "smollm2"]) == 2
    err = capsys.readouterr().err
    [aside] = [p for p in fetch.models_dir().iterdir() if p.name.startswith(".smollm2")]
    monkeypatch.setattr(manage.shutil, "rmtree", shutil.rmtree)
    left = [aside, fetch.draft_folder("smollm2")]
    assert err == (f"specbeam: error: cannot remove {fetch.folder('smollm2')} (Permission denied); left "
                   f"{', '.join(f'{p} ({manage.size_text(manage.disk_use(p))})' for p in left)}: check the "
                   f"permissions and remove them yourself\n")
    assert fetch.is_complete(fetch.draft_folder("smollm2"))


def test_list_while_a_fetch_runs_says_being_fetched(data, tmp_path, monkeypatch, capsys):
    """During a fetch `specbeam list` said "not fetched" (or "incomplete ... --force") for the model on its way;
    while the fetch lock is held an unfinished model is "being fetched", and an empty data folder says a fetch
    runs. Once the lock is let go the states are the usual ones."""
    from filelock import FileLock

    lock = FileLock(str(fetch.models_dir() / LOCK))
    with lock:
        assert manage.main(["list"]) == 0
        rows = _rows(capsys.readouterr().out)
        assert "being fetched (a `specbeam fetch` is running), the draft of" in rows["qwen2.5-coder-0.5b"]
        assert rows["smollm2"].split()[5] == "complete"
    assert manage.main(["list"]) == 0
    assert "incomplete: " in _rows(capsys.readouterr().out)["qwen2.5-coder-0.5b"]
    monkeypatch.setenv(fetch.ENV, str(tmp_path / "starting"))
    fetch.models_dir().mkdir(parents=True)
    with FileLock(str(fetch.models_dir() / LOCK)):
        assert manage.main(["list"]) == 0
        assert capsys.readouterr().err.endswith("yet; a `specbeam fetch` is running\n")
