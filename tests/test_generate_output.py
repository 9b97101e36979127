"""What `specbeam generate` shows a user (issue 59): the answer streams on a terminal and comes whole into a pipe
(--stream / --no_stream choose), a chat model's answer is not cut at 128 tokens, and every answer ends with one
line on stderr: its tokens, speed, tokens a pass and why it ended. Before: nothing for the seconds of loading,
a function cut at 128 tokens, and no line saying how fast or why it stopped."""
import io
import json
import re
import sys

import pytest

from specbeam_edge import cli
from specbeam_edge.generate import Engine

STREAM = Engine.stream           # the real one: each run's spy wraps it, not the spy of the run before
ARGS = ["generate", "the lazy dog", "--num_beams", "1", "--max_new_tokens", "12", "--min_new_tokens", "12"]


class Console(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.fixture(scope="module")
def folder(exported):
    return exported("llama", std=0.3, seed=3)       # a chat model: export/tiny.py gives it a chat template


def run(monkeypatch, folder, *flags, tty=False, err_tty=False):
    """(stdout, stderr, stdout's length as each chunk was made) of `specbeam generate`."""
    out, err, seen = Console(tty), Console(err_tty), []
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)

    def spy(self, *a, **kw):
        for chunk in STREAM(self, *a, **kw):
            seen.append(len(out.getvalue()))
            yield chunk
    monkeypatch.setattr(Engine, "stream", spy)
    assert cli.main([*ARGS, "--model", str(folder), *flags]) == 0, err.getvalue()
    return out.getvalue(), err.getvalue(), seen


def test_a_terminal_gets_the_answer_as_it_is_made_a_pipe_gets_it_whole(folder, monkeypatch):
    tty, _, tty_seen = run(monkeypatch, folder, tty=True)
    pipe, _, pipe_seen = run(monkeypatch, folder)
    assert tty == pipe and pipe.strip()
    assert tty_seen[-1] > 0 and max(pipe_seen) == 0        # text before the last chunk on a terminal only
    assert max(run(monkeypatch, folder, "--no_stream", tty=True)[2]) == 0
    assert run(monkeypatch, folder, "--stream")[2][-1] > 0


def test_every_answer_ends_with_one_line_of_speed_and_why(folder, monkeypatch):
    out, err, _ = run(monkeypatch, folder, "--stats")
    line, stats = err.splitlines()
    stats = json.loads(stats)
    assert line.startswith(f"specbeam: {stats['generated_tokens']} tokens in ")
    # (the JSON rounds tok/s to 2 decimals first, so the line's 1-decimal figure may differ in its last digit)
    speed = float(re.search(r", ([0-9.]+) tok/s, ", line).group(1))
    assert abs(speed - stats["tokens_per_second"]) <= 0.051, (line, stats)
    assert f" tok/s, {stats['beam_steps_per_pass']:.2f} tokens a pass; " in line
    assert line.endswith("cut at --max_new_tokens 12 (a larger one lets it finish)")
    _, quiet, _ = run(monkeypatch, folder, "-q")             # -q: only the cut
    assert quiet == "specbeam: the answer was cut at --max_new_tokens 12; pass a larger --max_new_tokens to let it " \
                    "finish\n"


def test_loading_shows_a_status_line_on_a_terminal_only(folder, monkeypatch):
    _, err, _ = run(monkeypatch, folder, err_tty=True)
    assert f"\r\033[Kspecbeam: loading {folder.name}..." in err and "specbeam: generating..." in err
    assert err.endswith("a larger one lets it finish)\n") and "\r\033[Kspecbeam: 12 tokens in " in err
    _, piped, _ = run(monkeypatch, folder)
    assert "\r" not in piped and "loading" not in piped and len(piped.splitlines()) == 1


def test_a_chat_model_answers_past_128_tokens(folder, monkeypatch, tmp_path):
    """The search's default of 128 new tokens cut a function in the middle; a chat model gets
    cli.CHAT_MAX_NEW_TOKENS unless its folder or the flags name a limit."""
    out, err = Console(False), Console(False)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    # 150 new tokens at least: more than 128, within the tiny model's context of 256
    assert cli.main(["generate", "the lazy dog", "--model", str(folder), "--num_beams", "1", "--min_new_tokens",
                     "150", "--stats"]) == 0, err.getvalue()
    assert json.loads(err.getvalue().splitlines()[-1])["generated_tokens"] >= 150
    engine = Engine(folder)
    assert cli.length_default(engine, {}) == {"max_new_tokens": cli.CHAT_MAX_NEW_TOKENS}
    assert cli.length_default(engine, {"max_new_tokens": 7}) == {"max_new_tokens": 7}
    engine.tokenizer.chat_template = None                      # a model without a chat template keeps its default
    assert cli.length_default(engine, {}) == {}
