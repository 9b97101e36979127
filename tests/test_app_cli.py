"""`specbeam generate` / `specbeam chat` as a user runs them (subprocesses): the prompt format comes from the
model folder, --help shows defaults, and missing shipped models give an error that says what to do."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENDE = ROOT / "models" / "ende"


def specbeam(*args, env=None, stdin=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "specbeam_edge.commands.cli", *args], capture_output=True, text=True,
                          env=env, input=stdin, timeout=120, cwd=ROOT)


def test_generate_uses_the_models_prompt_format():
    formatted = specbeam("generate", "Open the file.", "--num_beams", "4")
    assert formatted.returncode == 0, formatted.stderr
    assert formatted.stdout == "Öffnen Sie die Datei.\n"          # the shipped pair translates, not junk
    raw = specbeam("generate", "--raw", "<|endoftext|>Open the file.<|de|>", "--num_beams", "4")
    assert raw.stdout == formatted.stdout
    old = specbeam("generate", "--format", "Open the file.", "--num_beams", "4")   # old scripts still run
    assert old.stdout == formatted.stdout


def test_generate_help_shows_defaults():
    out = specbeam("generate", "--help").stdout
    assert "(default: 80)" in out and "tree levels below each beam (default: 6)" in out
    assert "models/ende/target" in out and "--raw" in out and "--format" not in out
    assert "(default: None)" not in out and "(default: False)" not in out


def test_missing_shipped_models_say_what_to_do(tmp_path):
    proc = specbeam("generate", "x", env={"SPECBEAM_MODELS": str(tmp_path)})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"specbeam: error: the shipped model folder {tmp_path}/ende/target is not in "
                           f"SPECBEAM_MODELS={tmp_path}: pass your model folders with --model (and --draft), or "
                           f"set SPECBEAM_MODELS to the repository's models/ folder (it holds the pairs ende, "
                           f"text, each with target/ and draft/)\n")
    # an explicit --model needs no shipped models
    ok = specbeam("generate", "Open the file.", "--model", str(ENDE / "target"), "--num_beams", "4",
                  env={"SPECBEAM_MODELS": str(tmp_path)})
    assert ok.stdout == "Öffnen Sie die Datei.\n"


def test_chat_translates_each_line_with_the_pair():
    proc = specbeam("chat", "--num_beams", "4", stdin="Open the file.\n\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "Öffnen Sie die Datei.\n"


def test_generate_into_a_closed_pipe_has_no_traceback():
    """`specbeam generate ... | head`: the reader is gone before the first line is written."""
    proc = subprocess.Popen([sys.executable, "-m", "specbeam_edge.commands.cli", "generate", "Open the file."], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    proc.stdout.close()
    assert proc.wait(timeout=120) == 1
    assert proc.stderr.read() == ""


# -- one-line errors where tracebacks were ------------------------------------------------------------------
def test_empty_prompt_and_unreadable_file_are_one_line(tmp_path):
    """Before: `generate ""` printed 128 underscores; --file missing or a directory was a traceback."""
    cases = [(("generate", ""), "specbeam: error: prompt 1 is empty; pass some text (or --file, or stdin)\n"),
             (("generate", "--file", str(tmp_path / "nope.txt")),
              f"specbeam: error: --file {tmp_path / 'nope.txt'}: cannot be read (No such file or directory)\n"),
             (("generate", "--file", str(tmp_path)),
              f"specbeam: error: --file {tmp_path} is a directory; pass a text file, one prompt per line\n")]
    for args, message in cases:
        proc = specbeam(*args)
        assert proc.returncode == 2 and proc.stdout == "" and proc.stderr == message, (args, proc.stderr)


def _capped_memory():
    """A run that reads without a bound fails with MemoryError here instead of filling the machine."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


@pytest.mark.parametrize("how", ["--file", "stdin"])
def test_an_endless_prompt_input_is_refused_at_the_limit(how):
    """Before: `generate --file /dev/zero` or `generate < /dev/zero` read until memory ran out."""
    args = ("--file", "/dev/zero") if how == "--file" else ()
    with open(os.devnull if args else "/dev/zero", "rb") as stdin:
        proc = subprocess.run([sys.executable, "-m", "specbeam_edge.commands.cli", "generate", *args], capture_output=True,
                              text=True, stdin=stdin, timeout=120, cwd=ROOT, preexec_fn=_capped_memory,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    what, fix = (("--file /dev/zero", "split it into smaller files") if args else
                 ("stdin", "pass the prompts in smaller runs, or as arguments"))
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (f"specbeam: error: {what} is longer than 64 MiB, the most a tool reads at once (an endless "
                           f"stream such as /dev/zero?); {fix}\n")


def test_an_endless_chat_message_is_refused_at_the_limit(monkeypatch):
    """Before: `specbeam chat < /dev/zero` read one endless line until memory ran out."""
    from types import SimpleNamespace

    from specbeam_edge.text import chat_input

    class Endless:
        def readline(self, size=-1):
            assert size >= 0, "a line read without a bound"
            return b"\0" * size
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(buffer=Endless()))
    with pytest.raises(ValueError, match=r"^that message is longer than 64 MiB, .*; send shorter messages$"):
        chat_input.read_message()


def test_cuda_without_the_gpu_build_and_widths_over_the_vocabulary_are_one_line():
    import onnxruntime as ort
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        proc = specbeam("generate", "Open the file.", "--provider", "cuda")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith("specbeam: error: the CUDA provider was asked for")
    for flag in ("--max_branch_width", "--draft_width"):
        proc = specbeam("generate", "Open the file.", "--draft", str(ENDE / "draft"), flag, "100000")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"specbeam: error: {flag} 100000 is larger than the model's vocabulary (")


def test_ctrl_c_during_generate_is_exit_130_and_one_line(monkeypatch, capsys):
    from specbeam_edge.commands.cli import main
    from specbeam_edge.generate import Engine

    def interrupted(self, *a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(Engine, "stream", interrupted)
    assert main(["generate", "Open the file."]) == 130
    assert capsys.readouterr().err == "specbeam: interrupted; the answer so far is above\n"


def test_chat_survives_invalid_utf8_and_a_message_over_the_context():
    """Before: an invalid UTF-8 line was a traceback, and one message over the context ended the session."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    stdin = b"\xff\xfe broken\n" + b"word " * 3000 + b"\nOpen the file.\n\n"
    proc = subprocess.run([sys.executable, "-m", "specbeam_edge.commands.cli", "chat", "--num_beams", "4"], input=stdin,
                          capture_output=True, env=env, timeout=180, cwd=ROOT)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    assert proc.stdout.decode() == "Öffnen Sie die Datei.\n"
    assert "chat: that message is not valid UTF-8 (invalid start byte at byte 0) and was not sent" in err
    assert "chat: that message was not sent (the prompt has " in err and "Traceback" not in err


def test_generate_takes_beam_size_as_num_beams():
    proc = specbeam("generate", "Open the file.", "--beam_size", "4")
    assert proc.returncode == 0 and proc.stdout == "Öffnen Sie die Datei.\n", proc.stderr


def test_generate_lookup_with_no_draft_proposes():
    """Before: `specbeam generate --drafter lookup --no_draft` silently ran plain search (0 tokens proposed);
    --no_draft drops the draft model, and prompt lookup needs none (as in specbeam-translate)."""
    import json

    prompt = "the quick brown fox the quick brown fox the quick brown fox"
    proc = specbeam("generate", prompt, "--no_draft", "--drafter", "lookup", "--always_speculate", "--stats",
                    "--max_new_tokens", "12")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stderr.strip().splitlines()[-1])
    assert stats["draft_tokens_proposed"] > 0, stats
