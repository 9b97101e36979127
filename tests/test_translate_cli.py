"""specbeam-translate as a new user meets it: input encodings and line ends, what stdout keeps on an interrupt,
--resume on a finished output, defaults that apply only to the default model, flag aliases, help text, progress
in a log, and one-line errors where tracebacks were."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from apps.translate.__main__ import main
from helpers import corpus, translate_args

ROOT = Path(__file__).resolve().parents[1]


def args_for(pair, inp, out=None, *extra):
    return translate_args(pair, inp, out, *extra, max_len=6)


def run(pair, inp, out=None, *extra):
    return main(args_for(pair, inp, out, *extra))


LINES = corpus(6, seed=21)


@pytest.fixture
def text_in(tmp_path):
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(LINES) + "\n")
    return inp


@pytest.fixture
def reference(pair, text_in, tmp_path):
    ref = tmp_path / "ref.txt"
    assert run(pair, text_in, ref) == 0
    return ref.read_bytes()


# -- input --------------------------------------------------------------------------------------------------
def test_utf8_bom_is_dropped_from_line_1(pair, text_in, reference, tmp_path):
    """Before: the BOM reached the model and changed line 1's translation."""
    bom = tmp_path / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbf" + text_in.read_bytes())
    assert run(pair, bom, tmp_path / "o.txt") == 0
    assert (tmp_path / "o.txt").read_bytes() == reference


def test_cr_only_line_ends_are_line_ends(pair, text_in, reference, tmp_path):
    """Before: a CR-only file (old Mac) came back as one empty line, exit 0."""
    cr = tmp_path / "cr.txt"
    cr.write_bytes("\r".join(LINES).encode() + b"\r")
    assert run(pair, cr, tmp_path / "o.txt") == 0
    assert (tmp_path / "o.txt").read_bytes() == reference


# -- stdout under an interrupt ------------------------------------------------------------------------------
def test_interrupt_to_stdout_writes_the_contiguous_lines_and_counts_the_rest(pair, text_in, reference, monkeypatch,
                                                                             capsysbinary):
    """Lines 1, 2 finished, line 3 slow, lines 4, 5 finished: 1-2 are written in order; the message says 2
    finished later lines could not be written (before: they were dropped without a word)."""
    from specbeam_edge.generate import Engine

    real = Engine.generate_iter

    def slow_third(self, *a, **kw):
        done = list(real(self, *a, **kw))
        for k, item in done:
            if k in (0, 1, 3, 4):
                yield k, item
        raise KeyboardInterrupt
    monkeypatch.setattr(Engine, "generate_iter", slow_third)
    assert run(pair, text_in) == 130
    cap = capsysbinary.readouterr()
    assert cap.out == b"".join(reference.splitlines(keepends=True)[:2])
    assert cap.err.decode() == ("\nspecbeam-translate: interrupted; 2 line(s) written; line 3 was not finished, so 2 "
                                "finished later "
                                "line(s) could not be written (stdout is a stream and keeps the lines in order): "
                                "pass -o FILE to keep every finished line and continue with --resume\n")


# -- resume, counting, progress -----------------------------------------------------------------------------
def test_resume_on_a_finished_output_does_nothing(pair, text_in, reference, tmp_path, monkeypatch, capsys):
    """Before: --resume on a finished output silently translated everything again."""
    import apps.translate.job as job

    out = tmp_path / "ref.txt"
    monkeypatch.setattr(job, "engine_from_args", lambda *a, **k: pytest.fail("the model was loaded"))
    assert run(pair, text_in, out, "--resume") == 0
    assert capsys.readouterr().err == (f"specbeam-translate: {out} is complete (its run finished, with these "
                                       f"settings); nothing to do\n")
    assert out.read_bytes() == reference
    (tmp_path / "other.txt").write_text("not\nthis\n")            # a file that is not this input's output
    assert run(pair, text_in, tmp_path / "other.txt", "--resume") == 2
    assert "holds 2 lines, not the 6 of a finished run on this input; delete it" in capsys.readouterr().err


def test_resume_on_a_finished_output_with_other_settings_or_input_is_refused(pair, text_in, reference, tmp_path,
                                                                            monkeypatch, capsys):
    """Before: --resume with a changed setting on a finished output exited 0 (its journal was gone, so nothing
    was left to compare with): the output of other settings was taken as done. Now the finished run's record
    (the cache folder) is compared, without loading the model; without a record, the line count is all there is."""
    import apps.translate.job as job

    out = tmp_path / "ref.txt"
    monkeypatch.setattr(job, "engine_from_args", lambda *a, **k: pytest.fail("the model was loaded"))
    assert run(pair, text_in, out, "--resume", "--beam_size", "3", "--max_decoding_length", "7") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("ref.txt was finished with other settings (max_decoding_length: 6 in the "
                                      "finished run, 7 now; beam_size: 4 in the finished run, 3 now); delete it"
                                      in err)
    other = tmp_path / "other_in.txt"                     # same line count, other text
    other.write_text(text_in.read_text().replace("the", "a"))
    assert run(pair, other, out, "--resume") == 2
    assert "ref.txt was finished from other input; delete it" in capsys.readouterr().err
    out.write_bytes(out.read_bytes().replace(b"e", b"E", 1))   # edited since: the record no longer speaks for it
    assert run(pair, text_in, out, "--resume", "--beam_size", "3") == 0
    assert "no record of its settings is left, so only its line count was checked" in capsys.readouterr().err
    assert out.read_bytes() != reference                  # untouched


def test_summary_counts_every_input_line_and_the_log_gets_no_bar(pair, tmp_path, capsys):
    """Before: the local summary counted only the lines sent to the model (196 of 200, where Ray said 200), and
    tqdm's carriage-return updates filled a redirected log."""
    inp = tmp_path / "in.txt"
    inp.write_bytes(b"hello world\n\nthe fox\n\xff\xfe\nlazy dog\n")
    argv = args_for(pair, inp, tmp_path / "o.txt")
    argv.remove("-q")
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "specbeam-translate: 5 lines, " in err


def test_settings_refusal_names_only_what_differs(pair, text_in, tmp_path, monkeypatch, capsys):
    from specbeam_edge.generate import Engine

    real = Engine.generate_iter

    def stop(self, *a, **kw):
        for k, item in enumerate(real(self, *a, **kw)):
            if k == 2:
                raise KeyboardInterrupt
            yield item
    monkeypatch.setattr(Engine, "generate_iter", stop)
    out = tmp_path / "out.txt"
    assert run(pair, text_in, out, "--beam_size", "4") == 130
    monkeypatch.undo()
    capsys.readouterr()
    assert run(pair, text_in, out, "--resume", "--num_beams", "3", "--max_decoding_length", "7") == 2
    err = capsys.readouterr().err
    assert ("(max_decoding_length: 6 in the journal, 7 now; beam_size: 4 in the journal, 3 now); rerun with the "
            "same settings" in err) and "{" not in err
    # the decoding-constraint flags are named as the user typed them, not as GenerationConfig fields
    assert run(pair, text_in, out, "--resume", "--min_decoding_length", "2", "--no_repeat_ngram_size", "3") == 2
    err = capsys.readouterr().err
    assert "min_decoding_length: 0 in the journal, 2 now" in err and "no_repeat_ngram_size: 0 in the journal, 3 now" \
        in err and "generation." not in err, err


# -- flags and defaults -------------------------------------------------------------------------------------
def test_help_has_no_doubled_or_empty_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "(default: None)" not in out and "(default: False)" not in out
    assert "(default: stdin)" in out and "--num_beams" in out and "--with_lookup" in out


@pytest.mark.parametrize("argv", [["--beam_size", "0"], ["--resume"], ["--no_such_flag"]])
def test_a_usage_error_is_two_lines(argv, capsys):
    """The problem, then where the flags are, as `specbeam`'s usage errors (issue 66: 40 lines of usage before)."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    problem, where = capsys.readouterr().err.splitlines()
    assert problem.startswith("specbeam-translate: error: ") and argv[0] in problem
    assert where == "specbeam-translate: see specbeam-translate --help for the flags"


def test_beam_size_and_num_beams_are_one_flag_and_with_lookup_is_accepted(pair, text_in, tmp_path):
    """Before: specbeam-translate rejected --num_beams and --with_lookup (documented next to translation)."""
    assert run(pair, text_in, tmp_path / "a.txt", "--beam_size", "2") == 0
    assert run(pair, text_in, tmp_path / "b.txt", "--num_beams", "2", "--with_lookup") == 0
    assert (tmp_path / "a.txt").read_bytes() == (tmp_path / "b.txt").read_bytes()


def test_shipped_draft_applies_only_to_the_shipped_target(pair, text_in, tmp_path, capsys):
    """Before: `--model MY_EXPORT` without --no_draft paired the shipped en->de draft with it and failed
    ("draft tokenizer ... differs from the target's")."""
    base = ["-i", str(text_in), "--model", pair[0], "--max_decoding_length", "6", "-q"]
    assert main(base + ["-o", str(tmp_path / "a.txt")]) == 0, capsys.readouterr().err
    assert main(base + ["--no_draft", "-o", str(tmp_path / "b.txt")]) == 0
    assert main(base + ["--drafter", "lookup", "-o", str(tmp_path / "c.txt")]) == 0, capsys.readouterr().err
    assert (tmp_path / "a.txt").read_bytes() == (tmp_path / "b.txt").read_bytes() == (tmp_path / "c.txt").read_bytes()


def test_lookup_with_no_draft_proposes(pair, tmp_path, capsys):
    """Before: --drafter lookup --no_draft silently proposed nothing (plain beam search)."""
    inp = tmp_path / "in.txt"
    inp.write_text("the quick brown fox the quick brown fox the quick brown fox\n" * 2)
    assert main(["-i", str(inp), "-o", str(tmp_path / "o.txt"), "--model", pair[0], "--no_draft", "--drafter",
                 "lookup", "--always_speculate", "--max_decoding_length", "12", "-q", "--stats"]) == 0
    stats = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert stats["draft_passes"] > 0 or stats["draft_tokens_proposed"] > 0, stats


def test_without_shipped_models_the_error_names_the_flags(text_in, tmp_path, monkeypatch, capsys):
    """Before: specbeam-translate named a site-packages path it could not find."""
    monkeypatch.setenv("SPECBEAM_MODELS", str(tmp_path / "none"))
    assert main(["-i", str(text_in), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model" in err and "SPECBEAM_MODELS" in err


# -- one-line errors ------------------------------------------------------------------------------------------
def test_cuda_provider_without_the_gpu_build_is_one_line(pair, text_in, capsys):
    import onnxruntime as ort
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider")
    assert run(pair, text_in, None, "--provider", "cuda") == 2
    err = capsys.readouterr().err
    assert err.startswith("specbeam-translate: error: the CUDA provider was asked for") and err.count("\n") == 1


@pytest.mark.parametrize("flag", ["--max_branch_width", "--draft_width"])
def test_tree_widths_over_the_vocabulary_are_one_line(pair, text_in, flag, capsys):
    from helpers import VOCAB
    assert run(pair, text_in, None, flag, "100000") == 2
    assert capsys.readouterr().err == (f"specbeam-translate: error: {flag} 100000 is larger than the model's "
                                       f"vocabulary ({VOCAB} tokens); pass at most {VOCAB}\n")


def test_prompt_format_with_an_unknown_field_is_one_line(pair, text_in, tmp_path, capsys):
    target = tmp_path / "target"
    shutil.copytree(pair[0], target)
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**cfg, "prompt_format": "{src} =>"}))
    assert main(["-i", str(text_in), "--model", str(target), "--no_draft", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"specbeam-translate: error: {target}/tokenizer_config.json: prompt_format '{{src}} =>' ")
    assert err.count("\n") == 1 and "{source}" in err


def test_closed_stderr_sends_nothing_to_stdout(pair, tmp_path):
    """Before: with stderr closed (2>&-), diagnostics went to stdout (4 lines out for 2 in), and without -q
    tqdm crashed."""
    inp = tmp_path / "in.txt"
    inp.write_bytes(b"hello world\n\xff broken\n")
    for quiet in ("-q", ""):
        cmd = (f"{sys.executable} -m apps.translate -i {inp} --model {pair[0]} --no_draft "
               f"--max_decoding_length 4 {quiet} 2>&-")
        proc = subprocess.run(cmd, shell=True, cwd=ROOT, capture_output=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout.count(b"\n") == 2, (quiet, proc.stdout)
        assert proc.stdout.endswith(b"\n\n")           # the bad line: an empty line, its report nowhere


def test_decoding_constraints_reach_the_search():
    """--min_decoding_length (CTranslate2's name; --min_new_tokens too) and --no_repeat_ngram_size become the
    GenerationConfig the run decodes with; specbeam generate takes the same two flags."""
    import argparse

    from apps.translate.__main__ import parse_args
    from apps.translate.job import generation_overrides
    from specbeam_edge.commands.options import add_search_args, configs

    args = parse_args(["--min_decoding_length", "3", "--no_repeat_ngram_size", "2", "--repetition_penalty", "1.2"])
    over = generation_overrides(args)
    assert over["min_new_tokens"] == 3 and over["no_repeat_ngram_size"] == 2 and over["repetition_penalty"] == 1.2
    assert generation_overrides(parse_args(["--min_new_tokens", "4"]))["min_new_tokens"] == 4
    ap = argparse.ArgumentParser()
    add_search_args(ap)
    gen, _ = configs(ap.parse_args(["--min_decoding_length", "5", "--no_repeat_ngram_size", "3",
                                    "--repetition_penalty", "1.3"]))
    assert gen["min_new_tokens"] == 5 and gen["no_repeat_ngram_size"] == 3 and gen["repetition_penalty"] == 1.3


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero")
def test_devices_are_refused_as_inputs(pair, text_in, tmp_path, monkeypatch, capsys):
    """Issue 50 row 18: /dev/zero (or /dev/urandom) as -i, --target_prefix, --glossary, --jsonl -i, --eval or
    stdin was read until memory ran out (a MemoryError traceback). Now each is one line naming the flag, rc 2,
    before any reading."""
    import io

    zero = "/dev/zero"
    for extra, what in ((["-i", zero], "input /dev/zero is a character device"),
                        (["-i", zero, "--jsonl"], "input /dev/zero is a character device"),
                        (["--target_prefix", zero], "--target_prefix /dev/zero is a character device"),
                        (["--glossary", zero, "--beam_size", "2"], "--glossary /dev/zero is a character device"),
                        (["--eval", zero], "--eval /dev/zero is a character device")):
        capsys.readouterr()
        a = args_for(pair, text_in, None, *extra)
        if "-i" in extra:                   # the later -i wins
            a = a[2:]
        assert main(a) == 2, extra
        err = capsys.readouterr().err
        assert what in err and "Traceback" not in err and len(err.splitlines()) == 1, err
    with open(zero, "rb") as f:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(f))
        assert main(args_for(pair, text_in)[2:]) == 2
    assert "stdin is a device" in capsys.readouterr().err


def test_the_journal_covers_a_graph_named_outside_the_folder(tmp_path, monkeypatch):
    """Issue 50 row 8: a config whose files.model names a graph outside the model folder: after an interrupt
    that graph was replaced and --resume went on, mixing two graphs' output (the journal hashed only the files
    inside the folder). Every file the config's `files` names is now in the fingerprint, so the replacement is a
    changed model on --resume."""
    from apps.translate.fingerprint import folder_sha256

    monkeypatch.setenv("SPECBEAM_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "m"
    model.mkdir()
    (model / "specbeam_config.json").write_text(json.dumps({"files": {"model": "../graph.onnx",
                                                                       "layers": ["../l0.onnx"]}}))
    (tmp_path / "graph.onnx").write_bytes(b"one")
    (tmp_path / "l0.onnx").write_bytes(b"layer")
    before = folder_sha256(model)
    assert {"files: ../graph.onnx", "files: ../l0.onnx"} <= set(before)
    (tmp_path / "graph.onnx").write_bytes(b"two")
    after = folder_sha256(model)
    assert after != before and after["specbeam_config.json"] == before["specbeam_config.json"]
