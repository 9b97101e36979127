"""What specbeam-translate writes, and where: never through a planted symlink or a predictable temporary name,
never over a device, FIFO or socket, never over its own input; permission bits kept; its own files never read
as input (Ray's input listing); the lock and pid files gone after a run."""
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from apps.translate.__main__ import main
from helpers import corpus, interrupt_after

ROOT = Path(__file__).resolve().parents[1]


def run(pair, inp, out=None, *extra):
    a = ["-i", str(inp), "--model", pair[0], "--draft", pair[1], "--max_decoding_length", "6", "-q", *extra]
    return main(a + (["-o", str(out)] if out else []))


@pytest.fixture
def text_in(tmp_path):
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(corpus(5, seed=9)) + "\n")
    return inp


# -- special files and the input as -o ----------------------------------------------------------------------
def special_files(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    sock_path = tmp_path / "sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    link = tmp_path / "link"
    link.symlink_to(fifo)           # as /proc/self/fd/N would point at a pipe
    return sock, {"FIFO": fifo, "socket": sock_path, "symlink to a FIFO": link}


def test_special_file_outputs_are_refused_and_kept(pair, text_in, tmp_path, capsys):
    """Before: -o replaced a FIFO (its reader blocked for ever), a socket or /dev/null with a regular file."""
    sock, cases = special_files(tmp_path)
    try:
        for name, path in cases.items():
            assert run(pair, text_in, path) == 2, name
            err = capsys.readouterr().err
            kind = "a socket" if name == "socket" else "a FIFO"
            assert err == (f"specbeam-translate: error: output {path} is {kind}, which would be replaced by a "
                           f"regular file; to stream the translation, leave out -o and redirect stdout\n"), name
        assert stat.S_ISFIFO(os.stat(cases["FIFO"]).st_mode) and stat.S_ISSOCK(os.stat(cases["socket"]).st_mode)
        assert cases["symlink to a FIFO"].is_symlink()
    finally:
        sock.close()


def test_dev_null_is_recognised_as_a_device():
    from apps.translate.journal import special_kind
    assert special_kind(Path("/dev/null")) == "a character device"
    assert special_kind(Path("/nonexistent/x")) is None


def test_output_equal_to_the_input_is_refused(pair, text_in, tmp_path, capsys):
    """Before: -i a.txt -o a.txt replaced the source with its translation (exit 0)."""
    before = text_in.read_bytes()
    hard = tmp_path / "hard.txt"
    os.link(text_in, hard)
    soft = tmp_path / "soft.txt"
    soft.symlink_to(text_in)
    for out in (text_in, hard, soft, tmp_path / "." / "in.txt"):
        assert run(pair, text_in, out) == 2
        assert "the translation would replace the source; write to another -o" in capsys.readouterr().err
    assert text_in.read_bytes() == before


# -- how the files are written ------------------------------------------------------------------------------
def test_planted_symlinks_at_the_old_temporary_names_are_not_followed(pair, text_in, tmp_path):
    """Before: temporary files were .<name>.<pid>.tmp opened with "wb": a symlink planted there got the
    translation (or the pid, or the journal header) written through it, and the output became that symlink."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    out = tmp_path / "out.txt"
    pid = os.getpid()
    for name in (f".out.txt.{pid}.tmp", f".out.txt.lock.pid.{pid}.tmp", f".out.txt.journal.{pid}.tmp"):
        (tmp_path / name).symlink_to(victim)
    assert run(pair, text_in, out) == 0
    assert victim.read_bytes() == b"precious\n"
    assert not out.is_symlink() and out.read_text().count("\n") == 5


def test_the_tools_own_files_never_write_through_a_planted_symlink(pair, text_in, tmp_path, capsys):
    """Before: a symlink planted at <out>.lock.pid had its target replaced by 'pid N', and one at <out>.journal had
    its target replaced by the journal. The pid file's link is replaced, not followed; a linked journal is refused."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    out = tmp_path / "out.txt"
    (tmp_path / "out.txt.lock.pid").symlink_to(victim)
    assert run(pair, text_in, out) == 0
    assert victim.read_bytes() == b"precious\n" and out.read_bytes().count(b"\n") == 5
    assert not (tmp_path / "out.txt.lock.pid").exists()
    out.unlink()
    (tmp_path / "out.txt.journal").symlink_to(victim)
    assert run(pair, text_in, out) == 2
    err = capsys.readouterr().err
    assert "out.txt.journal is a symbolic link; a journal is never read or written through one" in err, err
    assert victim.read_bytes() == b"precious\n" and not out.exists()


def test_permission_bits_of_the_output_and_journal_are_kept(pair, text_in, tmp_path, monkeypatch):
    """Before: a mode-600 output came back 644 (the temporary file's default mode), and so did its journal."""
    out = tmp_path / "out.txt"
    out.write_text("old\n")
    out.chmod(0o600)
    assert run(pair, text_in, out) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    interrupt_after(monkeypatch, 2)                      # the journal of a private output is private too
    assert run(pair, text_in, out) == 130
    monkeypatch.undo()
    assert stat.S_IMODE((tmp_path / "out.txt.journal").stat().st_mode) == 0o600
    assert run(pair, text_in, out, "--resume") == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    new = tmp_path / "new.txt"                           # a new output: the umask's mode, as open() gives
    old_mask = os.umask(0o027)
    try:
        assert run(pair, text_in, new) == 0
    finally:
        os.umask(old_mask)
    assert stat.S_IMODE(new.stat().st_mode) == 0o640


def test_a_fifo_journal_is_refused_instead_of_blocking(pair, text_in, tmp_path, capsys):
    """Before: an <out>.journal that was a FIFO blocked the run for ever (reading it waited for a writer)."""
    out = tmp_path / "out.txt"
    os.mkfifo(tmp_path / "out.txt.journal")
    proc = subprocess.run([sys.executable, "-m", "apps.translate", "-i", str(text_in), "-o", str(out), "--model",
                           pair[0], "--no_draft", "-q", "--resume"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == (f"specbeam-translate: error: {out}.journal is a FIFO, not a journal; remove it or "
                           f"write to another -o\n")


def test_no_lock_or_pid_file_is_left_after_a_run(pair, text_in, tmp_path):
    """Before: <output>.lock stayed after every successful run."""
    out = tmp_path / "out.txt"
    assert run(pair, text_in, out) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.txt"]


def test_lock_removed_by_its_holder_is_not_taken_twice(tmp_path):
    """The remove-on-release protocol: a writer that opened the lock file before its holder removed it must not
    hold the removed file while a third writer holds the new one."""
    from apps.translate.journal import _Busy, _Flock

    path = tmp_path / "out.txt.lock"
    first = _Flock(path)
    first.acquire()
    stale = os.open(path, os.O_RDWR)            # a contender's open, before the holder releases
    first.release()
    assert not path.exists()
    third = _Flock(path)
    third.acquire()                             # the new file
    late = _Flock(path)
    with pytest.raises(_Busy):                  # the contender goes to the path's current file: held
        late.acquire()
    os.close(stale)
    third.release()


# -- Ray's input listing -----------------------------------------------------------------------------------
def test_ray_glob_with_dotdot_after_a_wildcard_is_refused(tmp_path, monkeypatch):
    """Before: docs/*/../../x wrote outputs outside -o."""
    from apps.translate.files import UsageError
    from apps.translate.ray_plan import input_files

    (tmp_path / "docs" / "a").mkdir(parents=True)
    (tmp_path / "secret.txt").write_text("x\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"input glob docs/\*/\.\./\.\./secret\.txt: '\.\.' after a wildcard"):
        input_files("docs/*/../../secret.txt")


def test_ray_double_star_lists_each_real_file_once(tmp_path, monkeypatch):
    """Before: a ** glob followed a symlink loop and listed one file 40 times."""
    from apps.translate.ray_plan import input_files

    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "sub" / "a.txt").write_text("x\n")
    (tmp_path / "docs" / "sub" / "loop").symlink_to(tmp_path / "docs")
    (tmp_path / "docs" / "again.txt").symlink_to(tmp_path / "docs" / "sub" / "a.txt")
    monkeypatch.chdir(tmp_path)
    files, folder = input_files("docs/**/*.txt")
    assert folder and [n for _, n in files] == ["again.txt"]          # sorted: the first name of the one file
    files, _ = input_files("docs")
    assert [n for _, n in files] == ["again.txt"]


def test_ray_output_inside_the_input_folder_is_never_read_as_input(tmp_path, monkeypatch):
    """Before: the shards, lock, pid file and outputs of a run with -o inside the input folder were read as
    input: --resume was refused ("input changed") and a second run translated the first one's output."""
    from apps.translate.files import UsageError
    from apps.translate.ray_plan import input_files, output_paths

    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "a.txt").write_text("x\n")
    (docs / "sub" / "b.txt").write_text("y\n")
    out = docs / "out"
    (out / "sub").mkdir(parents=True)
    (out / "a.txt").write_text("X\n")                               # the first run's output
    (docs / "out.shards").mkdir()
    (docs / "out.shards" / "manifest").write_text("m\n")
    (docs / "out.shards" / "part-000000").write_text("p\n")
    (docs / "out.lock").write_text("")
    (docs / "out.lock.pid").write_text("pid 1\n")
    want = ["a.txt", "sub/b.txt"]
    assert [n for _, n in input_files(str(docs), out)[0]] == want
    monkeypatch.chdir(tmp_path)
    assert [n for _, n in input_files("docs/**/*", Path("docs/out"))[0]] == want
    with pytest.raises(UsageError, match="is the input folder: the outputs would replace their inputs"):
        input_files(str(docs), docs)
    files, folder = input_files(str(docs / "sub"), docs)            # -o above the input: docs/b.txt is fine
    (docs / "sub" / "sub").mkdir()
    (docs / "sub" / "sub" / "b.txt").write_text("z\n")              # ... but docs/sub/b.txt would be replaced
    files, folder = input_files(str(docs / "sub"), docs)
    with pytest.raises(UsageError, match=r"output .*docs/sub/b\.txt would replace the input"):
        output_paths(docs, files, folder)


def test_ray_refuses_actors_no_node_can_hold():
    """Before: --cpus_per_actor 64 on a 2-CPU machine (or --gpus_per_actor 1 without a GPU) waited for ever."""
    from apps.translate.files import UsageError
    from apps.translate.ray_cluster import check_resources

    nodes = [{"Alive": True, "Resources": {"CPU": 2.0}}, {"Alive": False, "Resources": {"CPU": 64.0}}]
    check_resources(nodes, 2, 0)
    with pytest.raises(UsageError, match=r"--cpus_per_actor 64: no node of the Ray cluster has that many CPUs "
                                         r"\(the largest has 2\); pass at most 2"):
        check_resources(nodes, 64, 0)
    with pytest.raises(UsageError, match=r"--gpus_per_actor 1: .* \(it has none\); pass --gpus_per_actor 0"):
        check_resources(nodes, 1, 1)


def test_ray_starts_only_the_actors_the_cluster_holds():
    """Before: --actors 4 on a 2-CPU machine waited for ever for the two actors that could never start."""
    from apps.translate.ray_cluster import actors_that_fit

    two_cpus = [{"Alive": True, "Resources": {"CPU": 2.0}}]
    assert actors_that_fit(two_cpus, 1, 0) == 2 and actors_that_fit(two_cpus, 2, 0) == 1
    nodes = two_cpus + [{"Alive": True, "Resources": {"CPU": 8.0, "GPU": 1.0}}, {"Alive": False,
                                                                               "Resources": {"CPU": 64.0}}]
    assert actors_that_fit(nodes, 2, 0) == 5 and actors_that_fit(nodes, 1, 0.5) == 2


@pytest.mark.parametrize("how", ["file", "folder"])
def test_a_symlink_to_the_output_is_the_same_writer(tmp_path, how):
    """Before: the lock was <the name given>.lock, so a symlink to the same output took a second lock."""
    from apps.translate.journal import JournalError, OutputLock

    (tmp_path / "real").mkdir()
    out = tmp_path / "real" / "out.txt"
    if how == "file":
        out.write_text("")
        other = tmp_path / "link.txt"
        other.symlink_to(out)
    else:
        (tmp_path / "linked").symlink_to(tmp_path / "real", target_is_directory=True)
        other = tmp_path / "linked" / "out.txt"
    with OutputLock(out):
        with pytest.raises(JournalError, match=r"is being written by pid \d+; wait for it to finish"):
            with OutputLock(other):
                pass
    with OutputLock(other):                      # free again once the first writer is done
        pass
