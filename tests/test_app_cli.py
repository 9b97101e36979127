"""`specbeam generate` / `specbeam chat` as a user runs them (subprocesses): the prompt format comes from the
model folder, --help shows defaults, and missing shipped models give an error that says what to do."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENDE = ROOT / "models" / "ende"


def specbeam(*args, env=None, stdin=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "specbeam_edge.cli", *args], capture_output=True, text=True,
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
    proc = subprocess.Popen([sys.executable, "-m", "specbeam_edge.cli", "generate", "Open the file."], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    proc.stdout.close()
    assert proc.wait(timeout=120) == 1
    assert proc.stderr.read() == ""
