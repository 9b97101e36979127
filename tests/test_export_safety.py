"""The exporter never deletes its input or anything that is not a previous export, refuses outputs it could not
write before the long work, replaces an old export so that an interrupt leaves the old or the new one, writes
folders another account can read, and checks config.json against the weights actually present."""
import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import export.core as core
from export import ExportError, export
from export.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def src(hf_models, tmp_path):
    """A private copy of a tiny HF folder (tests may damage it), with an unrelated file beside it."""
    folder, _ = hf_models("llama")
    mine = tmp_path / "work" / "hf"
    shutil.copytree(folder, mine)
    (tmp_path / "work" / "notes.txt").write_text("keep me")
    return mine


def _files(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _no_weights_read(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the export started before the output was checked")
    monkeypatch.setattr(core, "read_weights", fail)


@pytest.mark.parametrize("where", ["same", "parent"])
def test_overwrite_never_deletes_the_input(src, where, monkeypatch, capsys):
    _no_weights_read(monkeypatch)
    out = src if where == "same" else src.parent
    before = _files(src.parent)
    assert main(["-i", str(src), "-o", str(out), "--overwrite", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("is the input" in err or "contains the input" in err)
    assert _files(src.parent) == before and (src.parent / "notes.txt").read_text() == "keep me"


def test_output_inside_the_input_and_the_gguf_folder_are_refused(src, monkeypatch):
    _no_weights_read(monkeypatch)
    with pytest.raises(ExportError, match="lies inside the input folder"):
        export(src, src / "onnx", overwrite=True, quiet=True)
    gguf = src.parent / "model.gguf"
    gguf.write_bytes(b"GGUF")                # never opened: refused first
    with pytest.raises(ExportError, match="contains the input"):
        export(gguf, src.parent, overwrite=True, quiet=True)
    assert gguf.read_bytes() == b"GGUF"


def test_overwrite_replaces_only_a_previous_export(src, tmp_path, monkeypatch):
    other = tmp_path / "photos"
    other.mkdir()
    (other / "a.jpg").write_bytes(b"x")
    _no_weights_read(monkeypatch)
    with pytest.raises(ExportError, match="not a specbeam model folder"):
        export(src, other, overwrite=True, quiet=True)
    assert (other / "a.jpg").read_bytes() == b"x"


def test_overwrite_keeps_what_the_export_did_not_write(src, tmp_path):
    out = tmp_path / "out"
    export(src, out, layout="split", quiet=True)
    (out / "notes.txt").write_text("mine")
    other = export(src, out / "other_model", quiet=True)          # another model in a subfolder
    before = _files(other)
    export(src, out, overwrite=True, quiet=True)                   # whole replaces split: weights/ goes
    assert (out / "notes.txt").read_text() == "mine" and _files(other) == before
    assert (out / "model.onnx").is_file() and not (out / "weights").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_overwrite_of_a_folder_that_is_no_export_is_one_line(src, tmp_path, monkeypatch, capsys):
    _no_weights_read(monkeypatch)
    other = tmp_path / "docs"
    (other / "sub").mkdir(parents=True)
    (other / "sub" / "a.txt").write_text("x")
    assert main(["-i", str(src), "-o", str(other), "--overwrite", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a specbeam model folder" in err
    assert _files(other) == ["sub", "sub/a.txt"] and (other / "sub" / "a.txt").read_text() == "x"


def test_every_export_writes_only_names_overwrite_replaces(exported, tmp_path):
    from encdec_models import make_encdec_model
    from export.safety import EXPORT_NAMES

    make_encdec_model(tmp_path / "marian", "marian")
    folders = [exported("llama"), exported("llama", layout="split"), exported("llama", precision="int4"),
               export(tmp_path / "marian", tmp_path / "ed", quiet=True)]
    for folder in folders:
        assert {p.name for p in folder.iterdir()} <= EXPORT_NAMES, folder


def test_a_file_or_a_symlink_as_output_is_refused_up_front(src, tmp_path, monkeypatch):
    _no_weights_read(monkeypatch)
    f = tmp_path / "model.txt"
    f.write_text("data")
    with pytest.raises(ExportError, match="is not a folder"):
        export(src, f, overwrite=True, quiet=True)
    real = tmp_path / "real"
    real.mkdir()
    (real / "specbeam_config.json").write_text("{}")
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    with pytest.raises(ExportError, match="symbolic link"):
        export(src, link, overwrite=True, quiet=True)
    assert f.read_text() == "data" and link.is_symlink() and (real / "specbeam_config.json").is_file()


def test_interrupt_while_replacing_keeps_the_old_export(src, tmp_path, monkeypatch):
    out = tmp_path / "out"
    export(src, out, quiet=True)
    old = (out / "specbeam_config.json").read_text()
    (out / "notes.txt").write_text("mine")        # moved into the new folder, and back when the swap fails
    real_rename = Path.rename

    def rename(self, target):
        if Path(target) == out and self.name.startswith(".out.export-"):
            raise KeyboardInterrupt            # Ctrl-C just when the new folder would go in
        return real_rename(self, target)
    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        export(src, out, overwrite=True, quiet=True)
    assert (out / "specbeam_config.json").read_text() == old and (out / "model.onnx").is_file()
    assert (out / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_ctrl_c_during_the_swap_waits_until_the_new_export_is_in(src, tmp_path, monkeypatch):
    # a Ctrl-C as a user's process gets it: SIGINT unblocked in the main thread, Python's default handler (in the
    # full suite an earlier test leaves one of them changed: this test then saw no KeyboardInterrupt at all)
    old_mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    old_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _swap_with_ctrl_c(src, tmp_path, monkeypatch)
    finally:
        signal.signal(signal.SIGINT, old_handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _swap_with_ctrl_c(src, tmp_path, monkeypatch):
    out = tmp_path / "out"
    export(src, out, quiet=True)
    (out / "weights").mkdir()                   # an export's name only the old folder holds
    real_rename = Path.rename

    def rename(self, target):
        if self == out:                          # the old folder goes aside: Ctrl-C arrives now
            signal.raise_signal(signal.SIGINT)
        return real_rename(self, target)
    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        export(src, out, overwrite=True, quiet=True)
    assert (out / "specbeam_config.json").is_file() and not (out / "weights").exists()   # the new one, whole
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _export_that_hangs(src, out, ready):
    """An export in a child process that stops after writing its first graph (ready names a file it then makes)."""
    code = ("import sys, time\nimport export.save as save\nreal = save._save\n"
            "def slow(model, path):\n    real(model, path)\n    open(sys.argv[1], 'w').close()\n    time.sleep(120)\n"
            "save._save = slow\nfrom export.__main__ import main\n"
            "sys.exit(main(['-i', sys.argv[2], '-o', sys.argv[3], '-q']))")
    child = subprocess.Popen([sys.executable, "-c", code, str(ready), str(src), str(out)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(1200):
        if ready.exists() or child.poll() is not None:
            break
        import time
        time.sleep(0.1)
    assert ready.exists(), child.communicate()
    return child


def _staged_beside(out):
    return [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_terminate_or_hangup_during_an_export_leaves_nothing(src, tmp_path, sig):
    out = tmp_path / "out"
    child = _export_that_hangs(src, out, tmp_path / "ready")
    assert _staged_beside(out)                                   # the export is under way
    child.send_signal(sig)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 128 + sig and err.count("\n") == 1, err
    assert err.startswith(f"specbeam-export: stopped by {signal.Signals(sig).name}; no partial export was left")
    assert not out.exists() and _staged_beside(out) == []


def test_the_next_export_sweeps_what_a_killed_one_left(src, tmp_path):
    out = tmp_path / "out"
    child = _export_that_hangs(src, out, tmp_path / "ready")
    child.kill()
    child.communicate(timeout=60)
    [left] = _staged_beside(out)                                 # kill -9 cannot be caught
    export(src, out, quiet=True)
    assert (out / "specbeam_config.json").is_file() and _staged_beside(out) == []


def test_a_sweep_gives_back_what_a_kill_in_the_swap_left(src, tmp_path):
    """A kill between moving the other files into the new folder and the swap: they go back to the output."""
    out = tmp_path / "out"
    export(src, out, quiet=True)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    staged = tmp_path / f".out.export-{int(gone.stdout)}-abc123"
    shutil.copytree(out, staged)
    (staged / "notes.txt").write_text("mine")
    (staged / "other").mkdir()
    live = tmp_path / f".out.export-{os.getpid()}-def456"           # a running export's: left alone
    live.mkdir()
    export(src, out, overwrite=True, quiet=True)
    assert (out / "notes.txt").read_text() == "mine" and (out / "other").is_dir()
    assert _staged_beside(out) == [live.name]


def test_exported_folders_follow_the_umask(src, tmp_path):
    old = os.umask(0o022)
    try:
        out = export(src, tmp_path / "out", layout="split", quiet=True)
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert stat.S_IMODE((out / "weights").stat().st_mode) == 0o755
    assert stat.S_IMODE((out / "specbeam_config.json").stat().st_mode) == 0o644


@pytest.mark.parametrize("value", ["0", "-32", "24"])
def test_block_size_is_checked_before_any_work(value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["-i", "nowhere", "-o", "nothing", "--block_size", value])
    assert e.value.code == 2 and "--block_size" in capsys.readouterr().err
    with pytest.raises(ExportError, match="block_size must be a power of two"):
        export("nowhere", "nothing", block_size=int(value))


def test_full_disk_is_one_line_and_leaves_nothing(src, tmp_path, monkeypatch, capsys):
    def full(model, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr("export.save._save", full)
    out = tmp_path / "out"
    assert main(["-i", str(src), "-o", str(out), "-q"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device: " in err and "model.onnx" in err
    assert err.endswith("no partial export was left: free space or choose another -o\n")
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only folder")
def test_read_only_parent_is_refused_up_front(src, tmp_path, monkeypatch):
    _no_weights_read(monkeypatch)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(ExportError, match="cannot write into"):
            export(src, ro / "out", quiet=True)
    finally:
        ro.chmod(0o755)


def test_unwritable_parent_is_refused_up_front(src, tmp_path, monkeypatch):
    """The same check, for root too (os.access answers False on a read-only file system)."""
    import export.safety as safety

    _no_weights_read(monkeypatch)
    monkeypatch.setattr(safety.os, "access", lambda p, mode: False)
    with pytest.raises(ExportError, match=r"cannot write into .*read-only file system"):
        export(src, tmp_path / "out", quiet=True)


def test_ctrl_c_during_the_export_is_one_line(src, tmp_path, monkeypatch, capsys):
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr("export.save._save", interrupted)
    assert main(["-i", str(src), "-o", str(tmp_path / "out"), "-q"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specbeam-export: interrupted; no partial export was left")
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_invalid_generation_config_is_named(src, tmp_path):
    (src / "generation_config.json").write_text('{"num_beams": 4,')
    with pytest.raises(ExportError, match=r"generation_config.json: not valid JSON"):
        export(src, tmp_path / "out", quiet=True)
    (src / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ExportError, match=r"generation_config.json: must hold a JSON object"):
        export(src, tmp_path / "out", quiet=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "tiny", "empty"])
def test_damaged_safetensors_is_named(src, tmp_path, damage):
    [f] = src.glob("*.safetensors")
    data = f.read_bytes()
    f.write_bytes({"truncated": data[: len(data) // 2], "garbage": os.urandom(4096), "tiny": b"\x01\x02",
                   "empty": b""}[damage])
    with pytest.raises(ExportError, match=r"not a valid safetensors file .*fetch the file again"):
        export(src, tmp_path / "out", quiet=True)


@pytest.mark.parametrize("layers, msg", [(1, r"num_hidden_layers is 1 in config.json, but the checkpoint has "
                                               r"layers 0-1 \(2\)"),
                                         (3, r"num_hidden_layers is 3 .* layers 0-1 \(2\)"),
                                         (-2, r"num_hidden_layers must be an integer >= 1, got -2")])
def test_layer_count_is_checked_against_the_weights(src, tmp_path, layers, msg):
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2
    cfg["num_hidden_layers"] = layers
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match=msg):
        export(src, tmp_path / "out", quiet=True)


def test_cli_without_the_export_extra_says_what_to_install():
    code = ("import sys; sys.modules['onnx'] = None; from export.__main__ import main; "
            "sys.exit(main(sys.argv[1:]))")
    for args in (["--help"], ["-i", "a", "-o", "b"]):
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr == ("specbeam-export: error: the exporter needs the export extra (no module named 'onnx'): "
                            "pip install 'specbeam-edge[export]'\n")
