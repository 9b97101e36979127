"""specbeam-translate --jsonl: per-line text, target prefix, terms and id in; n-best translations with scores,
constraint status and the line's problems out; the same results as the API; resume; bad lines and flags."""
import json

import pytest

from apps.translate.__main__ import main
from helpers import interrupt_after, translate_args
from specbeam_edge import Engine

LINES = [{"text": "the quick brown fox", "id": 7},
         {"text": "hello world", "target_prefix": "the", "terms": ["lazy", ["dog", "cat"]], "id": "b"},
         {"text": "this is a tiny test"}]


def run(pair, inp, out=None, *extra):
    return main(translate_args(pair, inp, out, "--jsonl", "--beam_size", "4", "--n_best", "2", *extra, max_len=10))


@pytest.fixture
def jsonl_in(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in LINES) + "\n" + "[1, 2]\n" + '{"text": 3}\n')
    return inp


def test_lines_are_the_apis_results(pair, jsonl_in, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert run(pair, jsonl_in, out) == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(got) == 6
    eng = Engine(pair[0])
    for line, obj in zip(LINES, got):
        [ref] = eng.generate(eng.tokenizer.format_prompt(line["text"]), num_beams=4, num_return_sequences=2,
                             max_new_tokens=10, target_prefix=line.get("target_prefix"),
                             constraints=[tuple(t) if isinstance(t, list) else t for t in line["terms"]]
                             if "terms" in line else None)
        assert [t["text"] for t in obj["translations"]] == [h.text for h in ref.hypotheses]
        assert [t["score"] for t in obj["translations"]] == [round(h.score, 6) for h in ref.hypotheses]
        assert obj.get("id") == line.get("id")
    assert got[1]["translations"][0]["constraints_met"] is True and "constraints_met" not in got[0]["translations"][0]
    assert got[1]["translations"][0]["text"].startswith("the")
    assert got[3] == {"translations": []}                                    # an empty line
    assert got[4]["translations"] == [] and "must be a JSON object" in got[4]["problems"][0]
    assert got[5]["translations"] == [] and "'text' (a string) is required" in got[5]["problems"][0]
    err = capsys.readouterr().err
    assert "line 5: a line must be a JSON object" in err and "2 bad line(s)" in err


def test_resume_and_changed_lines(pair, jsonl_in, tmp_path, monkeypatch, capsys):
    whole, out = tmp_path / "whole.jsonl", tmp_path / "out.jsonl"
    assert run(pair, jsonl_in, whole) == 0
    interrupt_after(monkeypatch, 1)
    assert run(pair, jsonl_in, out) == 130
    monkeypatch.undo()
    assert run(pair, jsonl_in, out, "--resume") == 0
    assert out.read_bytes() == whole.read_bytes()
    assert run(pair, jsonl_in, out, "--resume") == 0                         # finished: nothing to do
    assert "nothing to do" in capsys.readouterr().err


def test_flags_that_do_not_fit_jsonl(pair, jsonl_in, tmp_path, capsys):
    for flag in (["--with_score"], ["--alternatives", "2"], ["--target_prefix", str(jsonl_in)]):
        with pytest.raises(SystemExit):
            run(pair, jsonl_in, None, *flag)
        assert "--jsonl carries prefixes and scores" in capsys.readouterr().err


def test_bad_ids_and_lone_surrogates_are_refused_per_line(pair, tmp_path, capsys):
    """Issue 50 rows 10, 16, 17 and issue 49 item 5. Before: an "id" of NaN / 1e999 / -Infinity came back as
    NaN / Infinity (not JSON); an id "\\ud800" stopped the run at its line with a codec error (rc 2, and every
    --resume failed the same way); a lone surrogate in text, target_prefix or terms was a TypeError traceback
    from the tokenizer; a bad line lost its id. Now each such line is refused with its line number, the others
    are translated, every output line is valid JSON (and UTF-8), and a bad line keeps a usable id."""
    lines = ['{"text": "hello world", "id": 1}',
             '{"text": "hello", "id": NaN}',
             '{"text": "hello", "id": 1e999}',
             '{"text": "hello", "id": -Infinity}',
             '{"text": "hello", "id": "\\ud800"}',
             '{"text": "hel\\ud800lo", "id": "t"}',
             '{"text": "hello", "target_prefix": "a\\udc00", "id": "p"}',
             '{"text": "hello", "terms": ["x\\ud800"], "id": "x"}',
             '{"text": "hello", "terms": ["   "], "id": "s"}',
             '{"id": "e"}',
             '{"text": "this is a tiny test", "id": 11}']
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    for out in (None, tmp_path / "out.jsonl"):
        capsys.readouterr()
        assert run(pair, inp, out) == 0
        cap = capsys.readouterr()
        raw, err = out.read_bytes() if out else cap.out.encode(), cap.err
        got = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in the output"))
               for line in raw.decode("utf-8").splitlines()]
        assert len(got) == len(lines)
        assert got[0]["id"] == 1 and got[0]["translations"] and got[10]["id"] == 11 and got[10]["translations"]
        for k in range(1, 10):
            assert got[k]["translations"] == [] and got[k]["problems"], (k, got[k])
        assert [got[k].get("id") for k in range(1, 10)] == [None, None, None, None, "t", "p", "x", "s", "e"]
        for n, what in ((2, "NaN"), (3, "finite"), (4, "Infinity"), (5, "surrogate"), (6, "'text' holds a lone"),
                        (7, "'target_prefix' holds"), (8, "'terms' holds"), (9, "'terms' must be"),
                        (10, "'text' (a string) is required")):
            assert any(f"line {n}: " in e and what in e for e in err.splitlines()), (n, what, err)
