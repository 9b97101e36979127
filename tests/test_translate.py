"""The batch translation app: alignment, bad lines, resume after a crash (byte-identical), --eval."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apps.translate.__main__ import main
from helpers import corpus

ROOT = Path(__file__).resolve().parents[1]




def run(pair, inp: Path, out: Path | None, *extra):
    args = ["-i", str(inp), "--model", pair[0], "--draft", pair[1], "--max_decoding_length", "10", "-q", *extra]
    if out:
        args += ["-o", str(out)]
    return main(args)


def test_alignment_and_bad_lines(pair, tmp_path, capsysbinary):
    inp = tmp_path / "in.txt"
    lines = corpus(6)
    raw = [l.encode() for l in lines]
    raw[2] = b"broken \xff\xfe line"          # invalid UTF-8
    raw[4] = " ".join(["fox"] * 400).encode()  # over the tiny model's 256-token context
    inp.write_bytes(b"\n".join(raw) + b"\n")
    out = tmp_path / "out.txt"
    assert run(pair, inp, out, "--on_error", "skip", "--max_input_length", "1000") == 0
    got = out.read_text().split("\n")[:-1]
    assert len(got) == 6 and got[2] == "" and got[4] == ""
    err = capsysbinary.readouterr().err.decode()
    assert "line 3: invalid UTF-8" in err
    assert "line 5: 401 prompt tokens, over the model's context 256; pass a smaller --max_input_length (at most 254)" \
        in err
    assert run(pair, inp, tmp_path / "o2.txt", "--on_error", "copy", "--max_input_length", "1000") == 0
    got2 = (tmp_path / "o2.txt").read_text().split("\n")[:-1]
    assert got2[4] == raw[4].decode() and got2[2].startswith("broken")
    assert [g for i, g in enumerate(got2) if i not in (2, 4)] == [g for i, g in enumerate(got) if i not in (2, 4)]
    assert run(pair, inp, tmp_path / "o3.txt", "--on_error", "fail", "--max_input_length", "1000") == 1


def test_max_input_length_truncates_like_ctranslate2(pair, tmp_path, capsysbinary):
    """Before: a line over --max_input_length was dropped (an empty output line); CTranslate2 truncates it."""
    from specbeam_edge.text.tokenizer import Tokenizer

    tok = Tokenizer(pair[0])
    long = " ".join(["fox"] * 400)
    inp = tmp_path / "in.txt"
    inp.write_text("hello world\n" + long + "\n")
    out = tmp_path / "out.txt"
    assert run(pair, inp, out, "--max_input_length", "100") == 0
    assert "line 2: 401 tokens, truncated to the first 100 (--max_input_length)" in \
        capsysbinary.readouterr().err.decode()
    cut = tok.decode(tok.encode(long)[:100])
    alone = tmp_path / "cut.txt"
    alone.write_text("hello world\n" + cut + "\n")
    assert run(pair, alone, tmp_path / "cut.out", "--max_input_length", "100") == 0
    got = out.read_text().split("\n")
    assert got[1] != "" and out.read_bytes() == (tmp_path / "cut.out").read_bytes()


def test_translation_cut_by_the_context_is_reported(pair, tmp_path, capsysbinary):
    """Before: a prompt that fits but leaves less room than --max_decoding_length was cut at the context with
    no notice."""
    inp = tmp_path / "in.txt"
    inp.write_text(" ".join(["fox"] * 250) + "\n")
    assert main(["-i", str(inp), "-o", str(tmp_path / "o.txt"), "--model", pair[0], "--no_draft",
                 "--max_decoding_length", "50", "--max_input_length", "1000", "-q"]) == 0
    err = capsysbinary.readouterr().err.decode()
    assert "line 1: the translation reached the model's context (256 tokens) after " in err, err


def test_speculative_equals_plain_and_n_best(pair, tmp_path):
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(corpus(8, seed=1)) + "\n")
    assert run(pair, inp, tmp_path / "a.txt") == 0
    assert run(pair, inp, tmp_path / "b.txt", "--no_draft") == 0
    assert run(pair, inp, tmp_path / "d.txt", "--always_speculate") == 0      # default: adaptive
    assert (tmp_path / "a.txt").read_bytes() == (tmp_path / "b.txt").read_bytes()
    assert (tmp_path / "d.txt").read_bytes() == (tmp_path / "b.txt").read_bytes()
    assert run(pair, inp, tmp_path / "c.txt", "--n_best", "2", "--with_score") == 0
    c = (tmp_path / "c.txt").read_text().splitlines()
    assert len(c) == 16 and all(" ||| " in x for x in c)


def test_resume_after_ctrl_c_and_torn_journal_is_byte_identical(pair, tmp_path, monkeypatch, capsys):
    from specbeam_edge.generate import Engine

    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(corpus(20, seed=2)) + "\n")
    full = tmp_path / "full.txt"
    assert run(pair, inp, full, "--batch_size", "4") == 0
    out = tmp_path / "out.txt"
    journal = out.with_name("out.txt.journal")
    real = Engine.generate_iter

    def interrupted(self, *a, **kw):        # Ctrl-C after eight finished lines
        for n, item in enumerate(real(self, *a, **kw)):
            if n == 8:
                raise KeyboardInterrupt
            yield item

    monkeypatch.setattr(Engine, "generate_iter", interrupted)
    assert run(pair, inp, out, "--batch_size", "4") == 130
    monkeypatch.setattr(Engine, "generate_iter", real)
    assert f"interrupted; 8 finished line(s) kept in {out}.journal: rerun with --resume to continue" in \
        capsys.readouterr().err                                  # how many were kept (issue 49 item 11)
    assert journal.exists() and not out.exists()
    assert journal.read_text().count("\n") == 1 + 8            # header + one record per finished line
    with open(journal, "a") as f:                                # and a record torn by a crash
        f.write('0badc0de {"i": 7, "ou')
    assert run(pair, inp, out, "--batch_size", "4") == 2        # without --resume: refused, nothing lost
    assert "holds 8 finished line(s) of an interrupted run; pass --resume" in capsys.readouterr().err
    assert run(pair, inp, out, "--batch_size", "4", "--resume") == 0
    err = capsys.readouterr().err
    assert "dropped a torn tail of 1 record(s)" in err and "resuming, 8 lines already done" in err
    assert out.read_bytes() == full.read_bytes()
    assert not journal.exists()


@pytest.mark.slow
def test_resume_after_kill_9(pair, tmp_path):
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(corpus(120, seed=3)) + "\n")
    full, out = tmp_path / "full.txt", tmp_path / "out.txt"
    base = [sys.executable, "-m", "apps.translate", "-i", str(inp), "--model", pair[0], "--draft", pair[1],
            "--max_decoding_length", "24", "--batch_size", "4", "-q"]
    subprocess.run(base + ["-o", str(full)], check=True, cwd=ROOT)
    proc = subprocess.Popen(base + ["-o", str(out)], cwd=ROOT)
    journal = out.with_name("out.txt.journal")
    deadline = time.time() + 60
    while time.time() < deadline and (not journal.exists() or journal.read_text().count("\n") < 5):
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert journal.exists() and not out.exists()
    subprocess.run(base + ["-o", str(out), "--resume"], check=True, cwd=ROOT)
    assert out.read_bytes() == full.read_bytes()


def test_eval_and_stdout(pair, tmp_path, capsys):
    inp = tmp_path / "in.txt"
    src = corpus(4, seed=4)
    inp.write_text("\n".join(src) + "\n")
    assert run(pair, inp, None) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    ref = tmp_path / "ref.txt"
    ref.write_text("\n".join(lines) + "\n")
    assert run(pair, inp, None, "--eval", str(ref)) == 0
    assert "chrF 100.00" in capsys.readouterr().err
    # against other references: the scores sacrebleu gives the outputs, line by line (a tool scoring its
    # output against itself, or lines out of order, prints other numbers)
    import sacrebleu

    other = [lines[0], *src[1:3], lines[3][: len(lines[3]) // 2]]
    ref.write_text("\n".join(other) + "\n")
    assert run(pair, inp, None, "--eval", str(ref)) == 0
    bleu, chrf = sacrebleu.corpus_bleu(lines, [other]).score, sacrebleu.corpus_chrf(lines, [other]).score
    assert f"BLEU {bleu:.2f}  chrF {chrf:.2f}" in capsys.readouterr().err
    assert 0 < chrf < 100


def test_bad_model_folder(tmp_path, capsys):
    inp = tmp_path / "in.txt"
    inp.write_text("hello\n")
    assert main(["-i", str(inp), "--model", str(tmp_path / "nope"), "--no_draft", "-q"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_with_score_texts_exact_and_scores_within_the_stated_tolerance(pair, tmp_path):
    """Issue 50 row 11: --with_score under other batch sizes and without speculation: the texts are byte-identical
    and the scores agree to the stated 1e-4 (README "Resume"; they are fp32 sums of passes of other sizes, so
    bit-for-bit equality was promised and not held)."""
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(corpus(12, seed=4)) + "\n")
    runs = {}
    for name, extra in (("batched", ()), ("one", ("--batch_size", "1")), ("plain", ("--no_draft",))):
        assert run(pair, inp, tmp_path / f"{name}.txt", "--with_score", *extra) == 0
        lines = (tmp_path / f"{name}.txt").read_text().splitlines()
        runs[name] = [(float(l.split(" ||| ", 1)[0]), l.split(" ||| ", 1)[1]) for l in lines]
    for name in ("one", "plain"):
        assert [t for _, t in runs[name]] == [t for _, t in runs["batched"]]
        assert max(abs(a - b) for (a, _), (b, _) in zip(runs[name], runs["batched"])) <= 1e-4
