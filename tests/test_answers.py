"""What a user gets back from every entry point on a chat model: the prompt in the chat template, Engine.chat,
Ctrl-C that keeps the answer, why an answer ended, and counts of the answer's own tokens (issue 49)."""
import io
import json
import sys

import pytest
from helpers import chat_defaults_folder

from specbeam_edge import Engine
from specbeam_edge.commands.cli import main as cli_main
from specbeam_edge.generate import Engine as _Engine


@pytest.fixture(scope="module")
def folder(exported, tmp_path_factory):
    # a chat model (export/tiny.py gives it a chat template) whose folder names no beams or length, as a fetched one
    return chat_defaults_folder(exported("llama", std=0.3, seed=3), tmp_path_factory.mktemp("chat") / "m")


@pytest.fixture(scope="module")
def engine(folder):
    return Engine(folder)


def test_text_prompts_go_through_the_chat_template(engine):
    """Before: generate/stream/alternatives put a text into prompt_format only, so a chat model got the bare
    text ("Say hello in French." continued as plain text, not answered)."""
    templated = engine.tokenizer.apply_chat_template([{"role": "user", "content": "the lazy dog"}])
    assert engine.encode("the lazy dog") == engine.tokenizer.encode_prompt(templated)
    [a] = engine.generate("the lazy dog", num_beams=2, max_new_tokens=8)
    [b] = engine.generate(templated, num_beams=2, max_new_tokens=8)
    assert a.hypotheses[0].tokens == b.hypotheses[0].tokens
    streamed = "".join(c.text for c in engine.stream("the lazy dog", num_beams=2, max_new_tokens=8))
    assert streamed == b.text
    # raw=True: the text as written
    assert engine.encode("the lazy dog", raw=True) == engine.tokenizer.encode("the lazy dog", special_tokens=True)


def test_chat_api_answers_a_conversation(engine):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the lazy dog"},
            {"role": "assistant", "content": "jumps"}, {"role": "user", "content": "over the fox"}]
    prompt = engine.tokenizer.apply_chat_template(msgs)
    result = engine.chat(msgs, num_beams=2, max_new_tokens=8)
    [want] = engine.generate(prompt, num_beams=2, max_new_tokens=8)
    assert result.text == want.text and result.left_out == 0 and result.finish_reason in ("stop", "length")
    chunks = list(engine.chat(msgs, num_beams=2, max_new_tokens=8, stream=True))
    assert "".join(c.text for c in chunks) == want.text and chunks[-1].result.text == want.text
    with pytest.raises(TypeError, match="messages"):
        engine.chat("the lazy dog")


def test_results_say_why_they_ended(engine):
    """Before: a cut answer looked like a finished one (no finish reason anywhere)."""
    [cut] = engine.generate("the lazy dog", num_beams=2, max_new_tokens=3, eos_token_id=0)
    assert cut.finish_reason == "length" and len(cut.hypotheses[0].tokens) == 3
    ctx = engine.target.cfg.context_length
    [full] = engine.generate([5] * (ctx - 3), num_beams=1, max_new_tokens=50, eos_token_id=0)
    assert full.finish_reason == "context"
    # an answer that ends on EOS: the token it ended on is one of the EOS ids
    first = engine.generate("the lazy dog", num_beams=1, max_new_tokens=1).pop().hypotheses[0].tokens[0]
    [stop] = engine.generate("the lazy dog", num_beams=1, max_new_tokens=5, eos_token_id=first)
    assert stop.finish_reason == "stop"


def test_generated_tokens_are_the_answers_not_the_search_steps(engine):
    """Before: generated_tokens was the search's steps (beam search goes on after its best hypothesis ends, and
    the EOS counted), so a 105-token answer counted 128 and tok/s read high."""
    eos = tuple(range(0, engine.target.cfg.vocab_size, 2))     # half the vocabulary ends an answer: it ends early
    for k in (1, 4):
        [r] = engine.generate("the lazy dog", num_beams=k, max_new_tokens=24, min_new_tokens=3, eos_token_id=eos)
        tokens = r.hypotheses[0].tokens
        assert r.finish_reason == "stop" and r.stats.generated_tokens == len(tokens) - 1 < r.stats.beam_steps
    seen = []
    for chunk in engine.stream("the lazy dog", num_beams=4, max_new_tokens=24):
        seen.append(chunk.stats.generated_tokens)
    assert seen == sorted(seen) and seen[-1] == chunk.result.stats.generated_tokens > 0


def _interrupt_stream_after(monkeypatch, n):
    real = _Engine.stream

    def stopping(self, *a, **kw):
        for k, chunk in enumerate(real(self, *a, **kw)):
            if k == n:
                raise KeyboardInterrupt
            yield chunk
    monkeypatch.setattr(_Engine, "stream", stopping)


def test_ctrl_c_in_generate_prints_the_partial_answer_and_stats(folder, monkeypatch, capsys):
    """Before: SIGINT during `specbeam generate` without --stream printed nothing (answer and --stats lost)."""
    args = ["generate", "the lazy dog", "--model", str(folder), "--num_beams", "1", "--max_new_tokens", "20",
            "--min_new_tokens", "20"]
    assert cli_main(args) == 0
    full = capsys.readouterr().out
    _interrupt_stream_after(monkeypatch, 6)
    assert cli_main(args + ["--stats"]) == 130
    out, err = capsys.readouterr()
    assert out.strip() and full.startswith(out.rstrip("\n")), (out, full)
    stats = json.loads(next(line for line in err.splitlines() if line.startswith("{")))
    assert stats["finish_reason"] == "interrupted" and stats["target_passes"] == 6
    assert err.rstrip().endswith("specbeam: interrupted; the answer so far is above")


def test_ctrl_c_in_chat_stops_the_answer_and_keeps_the_conversation(folder, monkeypatch, capsys):
    """Before: Ctrl-C during an answer ended the whole chat ("specbeam: interrupted")."""
    seen = []
    _interrupt_stream_after(monkeypatch, 4)
    real = _Engine.stream

    def spy(self, prompt, *a, **kw):
        seen.append(str(prompt))
        return real(self, prompt, *a, **kw)
    monkeypatch.setattr(_Engine, "stream", spy)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"the lazy dog\nover the fox\n")))
    assert cli_main(["chat", "--model", str(folder), "--num_beams", "1", "--max_new_tokens", "20",
                     "--min_new_tokens", "20"]) == 0
    out, err = capsys.readouterr()
    assert len(seen) == 2, err                           # the chat went on after the first Ctrl-C
    first = out.splitlines()[0]
    assert first and first in seen[1] and "over the fox" in seen[1]    # the partial answer stays in the history
    assert "chat: stopped; the answer so far is kept in the conversation" in err


def test_cut_answers_are_reported_by_the_cli_and_chat(folder, monkeypatch, capsys):
    """Before: an answer cut by --max_new_tokens or the context ended as if finished."""
    assert cli_main(["generate", "the lazy dog", "--model", str(folder), "--num_beams", "2", "--max_new_tokens",
                     "3", "--min_new_tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert err.rstrip().endswith("; cut at --max_new_tokens 3 (a larger one lets it finish)")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"the lazy dog\n")))
    assert cli_main(["chat", "--model", str(folder), "--max_new_tokens", "3", "--min_new_tokens", "3"]) == 0
    assert "chat: the answer was cut at --max_new_tokens 3" in capsys.readouterr().err


def test_terminal_chat_marks_turns_lists_keys_and_defaults_to_the_models_own_search(folder, monkeypatch, capsys):
    """Before: no marker between turns, no keys in --help, and the engine's 4 beams (for translation) on every
    chat model: SmolLM2-135M looped on a phrase. Now the model's generation_config, greedy where it names no
    num_beams (transformers' default)."""
    with pytest.raises(SystemExit):
        cli_main(["chat", "--help"])
    helptext = " ".join(capsys.readouterr().out.split())
    assert "Ctrl-C stops an answer" in helptext and "Ctrl-D" in helptext
    beams = []
    real = _Engine.stream

    def spy(self, prompt, generation=None, *a, **kw):
        beams.append(self.generation_config(generation, **kw).num_beams)
        return real(self, prompt, generation, *a, **kw)
    monkeypatch.setattr(_Engine, "stream", spy)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"the lazy dog\nover the fox\n")))
    assert cli_main(["chat", "--model", str(folder), "--max_new_tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert beams == [1, 1] and err.count(">>> ") == 3, err     # a prompt marker before each turn and the quit
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"the lazy dog\n")))
    assert cli_main(["chat", "--model", str(folder), "--max_new_tokens", "4", "--num_beams", "3"]) == 0
    assert beams[-1] == 3


def test_usage_errors_are_two_lines_and_an_empty_file_is_an_error(tmp_path, capsys):
    """Before: a bad flag printed ~30 lines of usage above the one that matters; `generate --file empty` exited 0
    silently."""
    with pytest.raises(SystemExit) as e:
        cli_main(["generate", "hi", "--num_beams", "zero"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 2, err
    assert err.startswith("specbeam generate: error: argument --num_beams") and "--help" in err
    empty = tmp_path / "empty.en"
    empty.write_text("\n  \n")
    assert cli_main(["generate", "--file", str(empty)]) == 2
    assert capsys.readouterr().err == f"specbeam: error: --file {empty} has no prompts (it is empty or only blank " \
                                      f"lines); put one prompt a line\n"
