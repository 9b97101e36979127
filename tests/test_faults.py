"""Faults, bad input and concurrent use: every case ends in exact, identical output or one named message.

The matrix of the reliability issue (journal, lock, CRLF, interrupts, OS errors, non-finite settings, broken
model folders, corrupted or truncated layer files) plus more bad inputs; a short SIGKILL fault injection
(bench/soak_translate.py is the long one).
"""
import json
import re
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apps.translate.__main__ import main
from specbeam_edge.config import GenerationConfig, ModelConfig, ModelFolderError, SpeculativeConfig
from helpers import corpus, interrupt_after
from helpers import translate_args as args_for

ROOT = Path(__file__).resolve().parents[1]




def run(pair, inp, out=None, *extra):
    return main(args_for(pair, inp, out, *extra))


@pytest.fixture
def text_in(tmp_path):
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(corpus(12, seed=5)) + "\n")
    return inp


@pytest.fixture
def reference(pair, text_in, tmp_path):
    ref = tmp_path / "ref.txt"
    assert run(pair, text_in, ref) == 0
    return ref.read_bytes()


def err_of(capsys):
    return capsys.readouterr().err


# -- the journal ----------------------------------------------------------------------------------------------
def test_zero_byte_journal_does_not_block_resume(pair, text_in, reference, tmp_path, capsys):
    """Before: a kill before the first record left a 0-byte journal, and --resume failed forever."""
    out = tmp_path / "out.txt"
    journal = tmp_path / "out.txt.journal"
    journal.write_bytes(b"")
    assert run(pair, text_in, out, "--resume") == 0
    assert "holds no usable header (an interrupted start); starting over" in err_of(capsys)
    assert out.read_bytes() == reference and not journal.exists()
    journal.write_bytes(b"")                                  # and without --resume
    assert run(pair, text_in, out) == 0
    assert out.read_bytes() == reference


def test_journal_header_is_written_atomically(pair, text_in, tmp_path, monkeypatch):
    """The journal exists only with a whole, checksummed header (temp file + fsync + rename)."""
    out = tmp_path / "out.txt"

    interrupt_after(monkeypatch, 0)
    assert run(pair, text_in, out) == 130
    raw = (tmp_path / "out.txt.journal").read_bytes()
    assert raw.count(b"\n") == 1
    head = json.loads(raw[9:])
    assert head["journal"] == 1 and len(head["input_sha256"]) == 64
    assert not list(tmp_path.glob(".*.tmp"))


def test_damaged_record_in_the_middle_keeps_every_valid_record_after_it(pair, text_in, reference, tmp_path,
                                                                        monkeypatch, capsys):
    """Before: one damaged record discarded every record after it (all translated again)."""
    out = tmp_path / "out.txt"
    interrupt_after(monkeypatch, 5)
    assert run(pair, text_in, out) == 130
    monkeypatch.undo()
    journal = tmp_path / "out.txt.journal"
    lines = journal.read_bytes().split(b"\n")
    lines[3] = lines[3].replace(b'"out": ["', b'"out": ["X')     # record 3 of 5: bytes flipped, checksum fails
    journal.write_bytes(b"\n".join(lines))
    capsys.readouterr()
    from specbeam_edge.generate import Engine
    prompts = []
    real = Engine.generate_iter
    monkeypatch.setattr(Engine, "generate_iter", lambda self, p, *a, **kw: prompts.append(len(p)) or real(self, p, *a,
                                                                                                           **kw))
    assert run(pair, text_in, out, "--resume") == 0
    err = err_of(capsys)
    assert "skipped 1 damaged record(s) (those lines are translated again); every valid record is kept" in err
    assert "resuming, 4 lines already done" in err and prompts == [12 - 4]
    assert out.read_bytes() == reference


def test_damaged_header_with_resume_is_refused_never_overwritten(pair, text_in, tmp_path, monkeypatch, capsys):
    """Before: a damaged header discarded every record and overwrote the journal, even with --resume."""
    out = tmp_path / "out.txt"
    interrupt_after(monkeypatch, 4)
    assert run(pair, text_in, out) == 130
    monkeypatch.undo()
    journal = tmp_path / "out.txt.journal"
    raw = journal.read_bytes()
    damaged = raw[:20] + b"X" + raw[21:]
    journal.write_bytes(damaged)
    capsys.readouterr()
    for extra in (["--resume"], []):
        assert run(pair, text_in, out, *extra) == 2
        err = err_of(capsys)
        assert err == (f"specbeam-translate: error: {journal} has a damaged header, so its records cannot be "
                       f"checked against this input and these settings; delete it to start over (its lines are "
                       f"translated again)\n")
        assert journal.read_bytes() == damaged and not out.exists()


def test_resume_refuses_changed_model_weights(pair, exported, text_in, tmp_path, monkeypatch, capsys):
    """Before: the journal hashed only the config: model.onnx replaced between interrupt and --resume gave an
    output that mixed two models."""
    target = tmp_path / "target"
    shutil.copytree(pair[0], target)
    mine = (str(target), pair[1])
    out = tmp_path / "out.txt"
    interrupt_after(monkeypatch, 3)
    assert run(mine, text_in, out) == 130
    monkeypatch.undo()
    other = exported("llama", std=0.3, seed=4)                                  # the same graph, other weights
    sums = json.loads((Path(other) / "specbeam_config.json").read_text())["files"]["sha256"]
    for name in sums:                                # the graph files, and their digests (the load checks them)
        shutil.copyfile(Path(other) / name, target / name)
    edit_config(target, lambda c: {**c, "files": {**c["files"], "sha256": sums}})
    capsys.readouterr()
    assert run(mine, text_in, out, "--resume") == 2
    err = err_of(capsys)
    assert "was written with other settings (model file " in err and "changed (its SHA-256 differs)); rerun" in err
    assert not out.exists()


def test_resume_refuses_an_edited_input(pair, text_in, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out.txt"
    interrupt_after(monkeypatch, 3)
    assert run(pair, text_in, out) == 130
    monkeypatch.undo()
    text_in.write_text(text_in.read_text().replace("the", "a", 1))
    capsys.readouterr()
    assert run(pair, text_in, out, "--resume") == 2
    assert ("specbeam-translate: error: the input changed since the interrupted run (" in err_of(capsys))
    assert not out.exists() and (tmp_path / "out.txt.journal").exists()


def test_resume_refuses_changed_settings(pair, text_in, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out.txt"
    interrupt_after(monkeypatch, 0)
    assert run(pair, text_in, out) == 130
    monkeypatch.undo()
    capsys.readouterr()
    assert run(pair, text_in, out, "--resume", "--beam_size", "2") == 2
    err = err_of(capsys)
    # only the setting that differs, by its flag's name (before: two whole dicts in different key orders)
    assert err == (f"specbeam-translate: error: {tmp_path / 'out.txt.journal'} was written with other settings "
                   f"(beam_size: 4 in the journal, 2 now); rerun with the same settings, or delete the journal to "
                   f"start over\n")
    assert run(pair, text_in, out, "--resume", "--budget", "12") == 0      # speculation knobs: same output


def test_second_writer_is_refused_with_the_holder_named(pair, text_in, tmp_path, capsys):
    out = tmp_path / "out.txt"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from apps.translate.journal import OutputLock\n"
        f"with OutputLock(Path({str(out)!r})):\n    print('held', flush=True); time.sleep(60)")],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert run(pair, text_in, out) == 2
        err = err_of(capsys)
        assert f"error: {out} is being written by pid {holder.pid}; wait for it to finish or write to another -o" in err
    finally:
        holder.kill()
        holder.wait()
    assert run(pair, text_in, out) == 0                       # the lock dies with its holder


def test_refused_writer_waits_for_a_just_started_holder_to_name_itself(tmp_path):
    """Two runs started together: the winner holds the lock before it has published its pid. The loser must
    still name it (this raced in CI: the loser read an empty lock file and said 'another process')."""
    import threading
    from apps.translate.journal import JournalError, OutputLock
    out = tmp_path / "out.txt"
    held = OutputLock(out)
    held.lock.acquire()                          # won, pid not written yet
    writer = threading.Timer(0.3, lambda: held.pid_path.write_text(f"pid {os.getpid()}\n"))
    writer.start()
    try:
        with pytest.raises(JournalError, match=f"is being written by pid {os.getpid()}; wait"):
            with OutputLock(out):
                pass
    finally:
        writer.join()
        held.__exit__(None, None, None)
    assert not held.pid_path.exists()
    with OutputLock(out) as lock:                 # released: the next writer gets it and names itself
        assert lock.pid_path.read_text() == f"pid {os.getpid()}\n"


@pytest.fixture
def held_lock(tmp_path, monkeypatch):
    """tmp_path/out.txt's OutputLock, held by this test, its pid file not written; a refused writer waits 0.1 s."""
    from apps.translate.journal import OutputLock
    monkeypatch.setattr(OutputLock, "PID_WAIT_S", 0.1)
    held = OutputLock(tmp_path / "out.txt")
    held.lock.acquire()
    yield held
    held.lock.release()


def refused_as(held) -> str:
    """The message of a second writer refused by `held`."""
    from apps.translate.journal import JournalError, OutputLock
    with pytest.raises(JournalError) as e:
        with OutputLock(held.path.with_suffix("")):
            pass
    return str(e.value)


def test_pid_left_by_a_killed_holder_names_nobody(held_lock):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    held_lock.pid_path.write_text(f"pid {dead.pid}\n")       # stale: its writer died without cleaning up
    assert "is being written by another process; wait" in refused_as(held_lock)


def test_unreadable_pid_file_names_nobody(held_lock, monkeypatch):
    """A pid file the refused writer may not read (another user's umask) gives 'another process', not a crash."""
    held_lock.pid_path.write_text(f"pid {os.getpid()}\n")
    real = Path.read_text

    def refuse(self, *a, **kw):
        if self == held_lock.pid_path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **kw)
    monkeypatch.setattr(Path, "read_text", refuse)
    assert "is being written by another process; wait" in refused_as(held_lock)


def test_two_processes_on_one_output_do_not_tear_the_journal(pair, tmp_path):
    """Two runs on one -o: the second is refused while the first writes, and the output is the run alone's. The
    second starts once the first holds the lock; where the first was done by then (a loaded machine: nothing
    overlapped, both exit 0), the run is repeated on a longer input."""
    for n_lines in (150, 600, 2400):
        inp = tmp_path / f"in{n_lines}.txt"
        inp.write_text("\n".join(corpus(n_lines, seed=8)) + "\n")
        out = tmp_path / f"out{n_lines}.txt"
        cmd = [sys.executable, "-m", "apps.translate", *args_for(pair, inp, out)]
        first = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        pid_file = out.with_name(out.name + ".lock.pid")
        deadline = time.monotonic() + 120
        while not pid_file.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        second = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        results = [(p.wait(), p.stderr.read()) for p in (first, second)]
        if sorted(rc for rc, _ in results) == [0, 0]:
            continue                                     # the first finished before the second took the lock
        assert sorted(rc for rc, _ in results) == [0, 2], results
        assert "is being written by pid" in next(e for rc, e in results if rc == 2)
        alone = tmp_path / f"alone{n_lines}.txt"
        assert run(pair, inp, alone) == 0
        assert out.read_bytes() == alone.read_bytes()
        return
    pytest.fail("the first run always finished before the second started; no overlap was tested")


# -- input, output, interrupts ----------------------------------------------------------------------------------
def test_crlf_and_trailing_cr_give_the_same_output_as_lf(pair, tmp_path):
    lines = corpus(6, seed=6)
    lf, crlf, mixed = tmp_path / "lf.txt", tmp_path / "crlf.txt", tmp_path / "mixed.txt"
    lf.write_bytes("\n".join(lines).encode() + b"\n")
    crlf.write_bytes("\r\n".join(lines).encode() + b"\r\n")
    mixed.write_bytes("\r\n".join(lines[:3]).encode() + b"\r\n" + "\n".join(lines[3:]).encode() + b"\r")
    outs = []
    for name, f in (("a", lf), ("b", crlf), ("c", mixed)):
        assert run(pair, f, tmp_path / name) == 0
        outs.append((tmp_path / name).read_bytes())
    assert outs[0] == outs[1] == outs[2] and b"\r" not in outs[0]


def test_sigint_to_stdout_keeps_every_finished_line_in_order(pair, text_in, reference, monkeypatch, capsysbinary):
    """Before: Ctrl-C while translating to stdout lost every finished line."""
    interrupt_after(monkeypatch, 7)
    assert run(pair, text_in) == 130
    cap = capsysbinary.readouterr()
    assert cap.out == b"".join(reference.splitlines(keepends=True)[:7])
    assert cap.err.decode().endswith("specbeam-translate: interrupted; 7 line(s) written\n")


def test_out_of_order_completion_is_written_in_input_order(pair, text_in, reference, monkeypatch, capsysbinary):
    """generate_iter yields in completion order; stdout must still be in input order."""
    from specbeam_edge.generate import Engine

    real = Engine.generate_iter

    def reversed_order(self, *a, **kw):
        yield from reversed(list(real(self, *a, **kw)))

    monkeypatch.setattr(Engine, "generate_iter", reversed_order)
    assert run(pair, text_in) == 0
    assert capsysbinary.readouterr().out == reference


def test_sigint_during_load(pair, text_in, tmp_path, monkeypatch, capsys):
    import apps.translate.job as job

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "engine_from_args", interrupted)
    assert run(pair, text_in, tmp_path / "o.txt") == 130
    assert err_of(capsys) == ("\nspecbeam-translate: interrupted; finished lines are kept: rerun with --resume to "
                              "continue\n")


def test_sigterm_exits_143_and_resume_finishes(pair, tmp_path):
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(corpus(200, seed=9)) + "\n")
    out = tmp_path / "out.txt"
    journal = tmp_path / "out.txt.journal"
    cmd = [sys.executable, "-m", "apps.translate", *args_for(pair, inp, out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and (not journal.exists() or journal.read_bytes().count(b"\n") < 3):
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait() == 143
    assert re.search(r"specbeam-translate: terminated; \d+ finished line\(s\) kept in .*out\.txt\.journal: rerun "
                     r"with --resume to continue", proc.stderr.read())
    assert run(pair, inp, out, "--resume") == 0
    alone = tmp_path / "alone.txt"
    assert run(pair, inp, alone) == 0
    assert out.read_bytes() == alone.read_bytes()


@pytest.mark.parametrize("case, code, message", [
    ("missing", 2, "error: cannot read input {tmp}/nope.txt: No such file or directory"),
    ("dir_in", 2, "error: input {tmp} is a directory; pass a text file, one sentence per line"),
    ("no_out_dir", 2, "error: the output's directory {tmp}/no/such does not exist; create it first"),
    ("dir_out", 2, "error: output {tmp} is a directory; pass a file path"),
    ("eval_missing", 2, "--eval: cannot read {tmp}/ref.txt (No such file or directory)"),
    ("eval_count", 2, "--eval: 1 reference lines for 2 outputs"),
])
def test_os_errors_are_one_line_messages(pair, tmp_path, capsys, case, code, message):
    inp = tmp_path / "in.txt"
    inp.write_text("hello world\nthe fox\n")
    argv = {"missing": (tmp_path / "nope.txt", tmp_path / "o.txt"), "dir_in": (tmp_path, tmp_path / "o.txt"),
            "no_out_dir": (inp, tmp_path / "no" / "such" / "o.txt"), "dir_out": (inp, tmp_path),
            "eval_missing": (inp, None), "eval_count": (inp, None)}[case]
    extra = []
    if case.startswith("eval"):
        if case == "eval_count":
            (tmp_path / "ref.txt").write_text("one line\n")
        extra = ["--eval", str(tmp_path / "ref.txt")]
    assert run(pair, argv[0], argv[1], *extra) == code
    err = err_of(capsys)
    assert message.format(tmp=tmp_path) in err and "Traceback" not in err


def test_closed_stdin_and_stdout(pair, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "stdin", None)
    assert main(["--model", pair[0], "--no_draft", "-q", "-o", str(tmp_path / "o.txt")]) == 2
    assert err_of(capsys) == "specbeam-translate: error: stdin is closed; pass -i FILE\n"
    proc = subprocess.run([sys.executable, "-m", "apps.translate", "--model", pair[0], "--no_draft", "-q"],
                          cwd=ROOT, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          stdout=subprocess.DEVNULL)
    assert proc.returncode == 0 and proc.stderr == ""          # empty stdin: nothing to do
    closed = subprocess.run(f"{sys.executable} -m apps.translate --model {pair[0]} --no_draft -q <&- ",
                            shell=True, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    assert closed.returncode == 2
    assert closed.stderr == "specbeam-translate: error: stdin is closed; pass -i FILE\n"


def test_empty_input_blank_lines_no_final_newline_and_line_separators(pair, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    assert run(pair, empty, tmp_path / "e.txt") == 0
    assert (tmp_path / "e.txt").read_bytes() == b""
    blanks = tmp_path / "blanks.txt"
    blanks.write_bytes(b"\n  \n\t\n")
    assert run(pair, blanks, tmp_path / "b.txt", "--n_best", "2") == 0
    assert (tmp_path / "b.txt").read_bytes() == b"\n" * 6
    a, b = tmp_path / "a.txt", tmp_path / "b2.txt"
    a.write_bytes(b"hello world\nthe fox\n")
    b.write_bytes(b"hello world\nthe fox")
    assert run(pair, a, tmp_path / "oa") == 0 and run(pair, b, tmp_path / "ob") == 0
    assert (tmp_path / "oa").read_bytes() == (tmp_path / "ob").read_bytes()
    sep = tmp_path / "sep.txt"
    sep.write_text("hello\u2028world\x0bthe\x85fox\n", encoding="utf-8")
    assert run(pair, sep, tmp_path / "os.txt", "--on_error", "copy") == 0
    assert (tmp_path / "os.txt").read_bytes().count(b"\n") == 1


# -- flags ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--max_memory", "inf"], "argument --max_memory: 'inf' is not a size: it must be a finite number >= 0"),
    (["--max_memory", "nan"], "argument --max_memory: 'nan' is not a size: it must be a finite number >= 0"),
    (["--max_memory=-1GB"], "argument --max_memory: '-1GB' is not a size: it must be a finite number >= 0"),
    (["--host_memory", "infGB"], "argument --host_memory: 'infGB' is not a size"),
    (["--max_memory", "12XB"], "argument --max_memory: '12XB' is not a size (examples: 512MB, 1.5GiB, 2e9)"),
    (["--max_decoding_length", "0"], "argument --max_decoding_length: must be an integer >= 1, got 0"),
    (["--beam_size", "0"], "argument --beam_size/--num_beams: must be an integer >= 1, got 0"),
    (["--n_best", "3", "--beam_size", "2"], "--n_best (3) cannot exceed --beam_size (2)"),
    (["--batch_size=-3"], "argument --batch_size: must be an integer >= 1, got -3"),
    (["--batch_size", "x"], "argument --batch_size: 'x' is not an integer"),
    (["--threads", "0"], "argument --threads: must be an integer >= 1, got 0"),
    (["--budget", "0"], "argument --budget: must be an integer >= 1, got 0"),
    (["--budget", "lots"], "argument --budget: 'lots' is not an integer"),
    (["--max_depth", "0"], "argument --max_depth: must be an integer >= 1, got 0"),
    (["--draft_width", "0"], "argument --draft_width: must be an integer >= 1, got 0"),
    (["--max_input_length", "0"], "argument --max_input_length: must be an integer >= 1, got 0"),
    (["--length_penalty", "nan"], "argument --length_penalty: must be a finite number, got 'nan'"),
    (["--length_penalty=-inf"], "argument --length_penalty: must be a finite number, got '-inf'"),
    (["--resume"], "--resume needs -o/--output (the journal lives next to the output file)"),
    (["--batch_type", "lines"], "argument --batch_type: invalid choice: 'lines'"),
])
def test_bad_flags_are_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["-q", *flags])
    assert e.value.code == 2
    err = err_of(capsys)
    assert message in err and "Traceback" not in err


def test_help_shows_defaults_and_specbeam_translate_takes_every_flag(pair, text_in, reference, tmp_path, capsys):
    from apps.launch import specbeam as cli_main

    with pytest.raises(SystemExit) as e:
        cli_main(["translate", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: specbeam-translate") and "are one flag) (default: 4)" in out
    assert cli_main(["translate", *args_for(pair, text_in, tmp_path / "o.txt")]) == 0
    assert (tmp_path / "o.txt").read_bytes() == reference


def test_summary_line_and_stats(pair, text_in, tmp_path, capsys):
    argv = args_for(pair, text_in, tmp_path / "o.txt")
    argv.remove("-q")
    assert main(argv + ["--stats"]) == 0
    err = err_of(capsys).splitlines()
    summary = [line for line in err if line.startswith("specbeam-translate: 12 lines, ")]
    assert len(summary) == 1 and "lines/s" in summary[0] and "beam steps per pass" in summary[0]
    assert "target_passes" in json.loads(err[-1])
    assert main(args_for(pair, text_in, tmp_path / "o2.txt", "--quiet")) == 0
    assert err_of(capsys) == ""


# -- settings -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    (dict(length_penalty=float("nan")), "length_penalty must be a finite number, got nan"),
    (dict(temperature=float("nan")), "temperature must be a finite number, got nan"),
    (dict(temperature=float("inf")), "temperature must be a finite number, got inf"),
    (dict(top_p=float("nan")), "top_p must be a finite number, got nan"),
    (dict(num_beams=True), "num_beams must be an integer, got True"),
    (dict(num_beams=2.0), "num_beams must be an integer, got 2.0"),
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1, got 0"),
    (dict(min_new_tokens=9, max_new_tokens=8), "min_new_tokens must be in [0, 8], got 9"),
    (dict(top_k=-1), "top_k must be >= 0, got -1"),
    (dict(seed=-1), "seed must be >= 0, got -1"),
    (dict(early_stopping="yes"), "early_stopping must be True, False or 'never', got 'yes'"),
    (dict(do_sample="yes"), "do_sample must be True or False, got 'yes'"),
    (dict(eos_token_id=-1), "eos_token_id must be >= 0, got -1"),
    (dict(num_return_sequences=5), "num_return_sequences (5) must be between 1 and num_beams (4)"),
])
def test_generation_config_rejects(kw, message):
    with pytest.raises(ValueError) as e:
        GenerationConfig(**kw)
    assert str(e.value) == message


def test_nan_length_penalty_cannot_reach_the_search(pair):
    """Before: length_penalty=nan was accepted and --n_best 4 wrote 3 lines instead of 12."""
    from specbeam_edge.generate import Engine

    engine = Engine(pair[0])
    with pytest.raises(ValueError, match="length_penalty must be a finite number, got nan"):
        engine.generate("hello", length_penalty=float("nan"), max_new_tokens=4)


@pytest.mark.parametrize("kw, message", [
    (dict(auto_slack=float("nan")), "auto_slack must be a finite number, got nan"),
    (dict(decay_factor=float("nan")), "decay_factor must be a finite number, got nan"),
    (dict(width_threshold=float("inf")), "width_threshold must be a finite number, got inf"),
    (dict(budget=0), "budget must be an integer in [1, 1024] (draft nodes a pass) or 'auto', got 0"),
    (dict(budget=True), "budget must be an integer in [1, 1024] (draft nodes a pass) or 'auto', got True"),
    (dict(budget=100000), "budget must be an integer in [1, 1024] (draft nodes a pass) or 'auto', got 100000"),
    (dict(max_depth=1.5), "max_depth must be an integer, got 1.5"),
    (dict(max_depth=100000), "max_depth must be in [1, 64], got 100000"),
    (dict(min_num_beams=0), "min_num_beams must be >= 1, got 0"),
    (dict(adaptive="no"), "adaptive must be True or False, got 'no'"),
])
def test_speculative_config_rejects(kw, message):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig(**kw)
    assert str(e.value) == message


def test_parse_size():
    from specbeam_edge.commands.flags import parse_size

    assert parse_size("1.5GiB") == 3 * 2**29 and parse_size("2e9") == 2 * 10**9 and parse_size("0") == 0
    assert parse_size("512MB") == 512 * 2**20 and parse_size(None) is None


# -- model folders --------------------------------------------------------------------------------------------
@pytest.fixture
def folder(pair, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(pair[0], dst)
    return dst


def edit_config(folder, fn):
    path = folder / "specbeam_config.json"
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps(fn(cfg)))
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda c: [c], "{path}: must hold a JSON object ({{...}}), found a list"),
    (lambda c: {**c, "num_layers": "six"}, "{path}: num_layers must be an integer >= 1, got 'six'; re-export"),
    (lambda c: {**c, "context_length": 0}, "{path}: context_length must be an integer >= 2, got 0"),
    (lambda c: {**c, "vocab_size": 3.5}, "{path}: vocab_size must be an integer >= 1, got 3.5"),
    (lambda c: {**c, "eos_token_ids": "0"}, "{path}: eos_token_ids must be a list of token ids, got '0'"),
    (lambda c: {**c, "mask_value": float("nan")}, "{path}: mask_value must be a finite number, got nan"),
    (lambda c: {**c, "files": []}, "{path}: files must be a JSON object, got []"),
    (lambda c: {**c, "num_kv_heads": 3}, "{path}: num_kv_heads must be a divisor of num_heads (4), got 3"),
    (lambda c: {k: v for k, v in c.items() if k != "head_dim"}, "{path}: missing key 'head_dim'"),
    (lambda c: {**c, "format_version": 99}, "{path}: format_version 99, this runtime reads 1"),
])
def test_broken_model_config_names_the_file(folder, edit, message):
    path = edit_config(folder, edit)
    with pytest.raises(ModelFolderError) as e:
        ModelConfig.load(folder)
    assert message.format(path=path) in str(e.value)


def test_invalid_json_files_are_named(folder, text_in, capsys):
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelFolderError, match=r"tokenizer_config.json: not valid JSON"):
        ModelConfig.load(folder)
    assert main(["-i", str(text_in), "--model", str(folder), "--no_draft", "-q"]) == 2
    assert f"error: {folder}/tokenizer_config.json: not valid JSON" in err_of(capsys)
    (folder / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ModelFolderError, match=r"tokenizer_config.json: must hold a JSON object"):
        ModelConfig.load(folder)
    (folder / "specbeam_config.json").write_bytes(b"\xff\xfe")
    with pytest.raises(ModelFolderError, match=r"specbeam_config.json: not valid JSON"):
        ModelConfig.load(folder)


# -- layer files ----------------------------------------------------------------------------------------------
@pytest.fixture
def split(exported, tmp_path):
    dst = tmp_path / "split"
    shutil.copytree(exported("llama", layout="split", std=0.3, seed=3), dst)
    return dst


def test_export_writes_one_checksum_per_layer_file(split):
    import hashlib

    cfg = ModelConfig.load(split)
    sums = cfg.files["layer_sha256"]
    assert sums == [hashlib.sha256((split / "weights" / f"layer_{i}.bin").read_bytes()).hexdigest()
                    for i in range(cfg.num_layers)]


def flip_byte(path: Path, at: int = 1000):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("places", [["resident", "resident"], ["disk", "disk"]])
def test_corrupted_layer_bytes_are_refused(split, places):
    """Before: a layer file with corrupted bytes of the right size was used without notice."""
    from specbeam_edge.generate import Engine

    flip_byte(split / "weights" / "layer_1.bin")
    with pytest.raises(ModelFolderError) as e:
        Engine(split, placement=places).generate("hello", max_new_tokens=3)
    assert str(e.value).startswith(f"{split}/weights/layer_1.bin: SHA-256 ")
    assert "does not match the manifest" in str(e.value)


def test_layer_truncated_while_streaming_names_the_file(split):
    from specbeam_edge.generate import Engine

    engine = Engine(split, placement=["disk", "disk"])
    first = engine.generate("hello", max_new_tokens=3)[0].text
    assert engine.generate("hello", max_new_tokens=3)[0].text == first
    path = split / "weights" / "layer_0.bin"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ModelFolderError) as e:
        engine.generate("hello", max_new_tokens=3)
    assert str(e.value).startswith(f"{path}: {size - 100} bytes, the manifest needs {size} (the file was "
                                   f"truncated or replaced after loading)")


def test_bad_checksum_list_is_named(split):
    path = edit_config(split, lambda c: {**c, "files": {**c["files"], "layer_sha256": ["00"]}})
    with pytest.raises(ModelFolderError) as e:
        ModelConfig.load(split)
    assert str(e.value) == (f"{path}: files.layer_sha256 must list 2 hex SHA-256 digests (one per layer file); "
                            f"re-export the model")


def test_exports_without_checksums_still_load(split):
    from specbeam_edge.generate import Engine

    ref = Engine(split, placement=["disk", "resident"]).generate("hello", max_new_tokens=3)[0]
    edit_config(split, lambda c: {**c, "files": {k: v for k, v in c["files"].items() if k != "layer_sha256"}})
    # the same tokens as with the checksums (it asserted only `text is not None`, which a store that skipped
    # reading unchecked layers would also pass)
    assert Engine(split, placement=["disk", "resident"]).generate("hello", max_new_tokens=3)[0].hypotheses[0].tokens \
        == ref.hypotheses[0].tokens


def test_streamed_store_is_verified_once_per_file(split, monkeypatch):
    import hashlib as h

    from specbeam_edge.execution import offload
    from specbeam_edge.generate import Engine

    calls = []
    real = h.sha256
    # offload's own hashlib only (other modules hash their files too: the tokenizer check, the journal)
    from types import SimpleNamespace
    monkeypatch.setattr(offload, "hashlib", SimpleNamespace(sha256=lambda data=b"": calls.append(1) or real(data)))
    engine = Engine(split, placement=["disk", "disk"])
    for _ in range(3):
        engine.generate("hello", max_new_tokens=4)
    assert len(calls) == 2                                     # one per layer file, not one per read
    assert engine.target.runner.store.stats.passes > 3


# -- SIGKILL fault injection (short; bench/soak_translate.py is the long version) --------------------------------
@pytest.mark.slow
def test_sigkill_at_random_moments_leaves_a_byte_identical_file(pair, tmp_path):
    from bench.soak_translate import soak, translate_cmd

    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(corpus(150, seed=10)) + "\n")
    extra = ["--model", pair[0], "--draft", pair[1], "--max_decoding_length", "12", "--batch_size", "4"]
    full = tmp_path / "full.txt"
    t0 = time.perf_counter()                      # the uninterrupted run, in a process of its own as the killed ones
    subprocess.run(translate_cmd(inp, full, *extra), cwd=ROOT, check=True)
    T = time.perf_counter() - t0
    # kill moments as fractions of an uninterrupted run on this machine (fixed seconds missed every run on a quiet
    # machine, where the whole job takes under a second); a resumed run has less left, so later kills come sooner
    rng = random.Random(1)
    delays = [T * rng.uniform(lo, hi) for lo, hi in ((0.05, 0.3), (0.3, 0.6), (0.05, 0.3), (0.2, 0.5),
                                                      (0.05, 0.3), (0.1, 0.4))]
    out = tmp_path / "out.txt"
    counts = soak(inp, out, full.read_bytes(), extra, delays, log=lambda *_: None, want_kills=4,
                  damage=random.Random(2))          # and a damaged middle record after each kill
    assert counts["kills"] >= 2 and counts["mismatches"] == 0, counts


def test_soak_damage_flips_one_middle_record_and_resume_skips_only_it(tmp_path):
    from apps.translate.journal import Journal, _line
    from bench.soak_translate import damage_record

    out = tmp_path / "o.txt"
    journal = tmp_path / "o.txt.journal"
    journal.write_bytes(b"".join(_line(x) for x in [{"journal": 1, "input_sha256": "s", "settings": {}},
                                                   *({"i": i, "out": [f"line {i}"]} for i in range(6))]))
    assert damage_record(journal, random.Random(3))
    j = Journal(out, "s", {}, resume=True)
    j.close()
    assert len(j.done) == 5 and any("skipped 1 damaged record(s)" in n for n in j.notes)


@pytest.mark.slow
def test_soak_output_path_faults_hold(pair, tmp_path):
    from bench.soak_translate import path_faults, translate_cmd

    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(corpus(8, seed=12)) + "\n")
    extra = ["--model", pair[0], "--no_draft", "--max_decoding_length", "6"]
    full = tmp_path / "full.txt"
    subprocess.run(translate_cmd(inp, full, *extra), cwd=ROOT, check=True)
    log = []
    assert path_faults(inp, tmp_path, extra, full.read_bytes(), log=log.append) == [], log
    assert len(log) == 7 and all(line.endswith(": held") for line in log), log


def test_batching_flags_reach_generate_iter_and_do_not_change_output(pair, text_in, reference, tmp_path,
                                                                     monkeypatch):
    from specbeam_edge.generate import Engine

    real, seen = Engine.generate_iter, []

    def spy(self, prompts, *a, **kw):
        seen.append((len(prompts), kw["max_batch_size"], kw["max_batch_tokens"]))
        yield from real(self, prompts, *a, **kw)

    monkeypatch.setattr(Engine, "generate_iter", spy)
    assert run(pair, text_in, tmp_path / "a.txt") == 0                          # batched by default
    assert run(pair, text_in, tmp_path / "b.txt", "--batch_type", "tokens", "--batch_size", "40") == 0
    assert seen == [(12, 32, None), (12, 12, 40)]
    assert (tmp_path / "a.txt").read_bytes() == (tmp_path / "b.txt").read_bytes() == reference
