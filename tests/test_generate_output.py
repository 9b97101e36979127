"""What `specbeam generate` shows a user (issue 59): the answer streams on a terminal and comes whole into a pipe
(--stream / --no_stream choose), a chat model's answer is not cut at 128 tokens, and every answer ends with one
line on stderr: its tokens, speed, tokens a pass and why it ended. Before: nothing for the seconds of loading,
a function cut at 128 tokens, and no line saying how fast or why it stopped."""
import io
import json
import re
import sys

import pytest

from helpers import chat_defaults_folder
from specbeam_edge.commands import cli, options
from specbeam_edge.config import GenerationConfig, ModelConfig
from specbeam_edge.generate import Engine
from specbeam_edge.text.prompting import CHAT_MAX_NEW_TOKENS, has_chat_template
from specbeam_edge.shipped import shipped

STREAM = Engine.stream           # the real one: each run's spy wraps it, not the spy of the run before
ARGS = ["generate", "the lazy dog", "--num_beams", "1", "--max_new_tokens", "12", "--min_new_tokens", "12"]


class Console(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.fixture(scope="module")
def folder(exported, tmp_path_factory):
    # a chat model (export/tiny.py gives it a chat template) whose folder names no beams or length, as a fetched one
    return chat_defaults_folder(exported("llama", std=0.3, seed=3), tmp_path_factory.mktemp("chat") / "m")


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
    options.CHAT_MAX_NEW_TOKENS unless its folder or the flags name a limit."""
    out, err = Console(False), Console(False)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    # 150 new tokens at least: more than 128, within the tiny model's context of 256
    assert cli.main(["generate", "the lazy dog", "--model", str(folder), "--num_beams", "1", "--min_new_tokens",
                     "150", "--stats"]) == 0, err.getvalue()
    assert json.loads(err.getvalue().splitlines()[-1])["generated_tokens"] >= 150


def test_the_api_gives_a_chat_model_the_clis_length(folder):
    """Engine.generate / chat / stream take the same default as the CLI (issue 66: the API kept 128 and cut code
    mid-line); a folder's own max_new_tokens or the caller's wins, and a model without a chat template keeps the
    search's 128."""
    engine = Engine(folder)
    assert engine.generation_config().max_new_tokens == CHAT_MAX_NEW_TOKENS == options.CHAT_MAX_NEW_TOKENS
    assert engine.generation_config(max_new_tokens=7).max_new_tokens == 7
    assert engine.generation_config({"num_beams": 1}).max_new_tokens == CHAT_MAX_NEW_TOKENS
    long = engine.chat([{"role": "user", "content": "the lazy dog"}], num_beams=1, min_new_tokens=150)
    assert len(long.hypotheses[0].tokens) >= 150 and long.finish_reason != "length"
    engine.target.cfg.generation["max_new_tokens"] = 9        # the folder's own limit wins
    assert engine.generation_config().max_new_tokens == 9
    del engine.target.cfg.generation["max_new_tokens"]
    engine.tokenizer.chat_template = None                      # a model without a chat template keeps its default
    assert engine.generation_config().max_new_tokens == GenerationConfig().max_new_tokens
    assert engine.generation_config().num_beams == GenerationConfig().num_beams > 1


def test_the_api_searches_a_chat_model_greedily_as_the_cli_does(folder):
    """Engine.generate on a chat folder searched with 4 beams (translation's default) while specbeam chat and
    generate were greedy (issue 66); the folder's own num_beams or the caller's wins."""
    engine = Engine(folder)
    assert engine.generation_config().num_beams == 1
    assert engine.generation_config({"max_new_tokens": 5}).num_beams == 1
    seen = []
    real = Engine.generation_config
    engine.generation_config = lambda *a, **kw: seen.append(real(engine, *a, **kw)) or seen[-1]
    engine.generate("the lazy dog", max_new_tokens=4)
    del engine.generation_config
    assert [gen.num_beams for gen in seen] == [1]
    assert engine.generation_config(num_beams=3).num_beams == 3
    engine.target.cfg.generation["num_beams"] = 2             # the folder's own beams win
    assert engine.generation_config().num_beams == 2


def test_generate_on_a_chat_model_is_greedy_as_chat_is(folder, monkeypatch):
    """`specbeam generate` searched a chat model with the engine's 4 beams (translation's default) while `specbeam
    chat` and the app were greedy: 6.5 vs 10.1 tok/s on the coder pair, and no lookahead head. Now a chat folder
    that names no num_beams is greedy in both; --num_beams still wins, and a folder without a chat template keeps
    its beams."""
    seen = []

    def spy(self, prompt, gen, *a, **kw):
        seen.append(gen.num_beams)
        yield from STREAM(self, prompt, gen, *a, **kw)
    monkeypatch.setattr(Engine, "stream", spy)
    base = ["generate", "the lazy dog", "--max_new_tokens", "3", "-q"]
    assert cli.main([*base, "--model", str(folder)]) == 0
    assert cli.main([*base, "--model", str(folder), "--num_beams", "3"]) == 0
    assert seen == [1, 3]
    assert has_chat_template(folder)
    assert cli.main([*base]) == 0              # the shipped translation pair: its folder's beams
    ende = shipped("ende", "target")
    assert not has_chat_template(ende) and seen[-1] == GenerationConfig.from_dict(
        ModelConfig.load(ende).generation).num_beams > 1


def test_sampling_flags_sample_and_beams_say_beam_steps(folder, monkeypatch):
    """--temperature without --do_sample was ignored in silence (transformers' rule); as in llama.cpp and Ollama
    it samples now (--top_k and --top_p too), one sequence on a chat model, and --temperature 0 is greedy search.
    The closing line said "tokens a pass" for beam steps (fewer tokens than passes) with beams."""
    seen = []

    def spy(self, prompt, gen, *a, **kw):
        seen.append((gen.do_sample, gen.num_beams, gen.temperature))
        yield from STREAM(self, prompt, gen, *a, **kw)
    monkeypatch.setattr(Engine, "stream", spy)
    base = ["generate", "the lazy dog", "--model", str(folder), "--max_new_tokens", "3", "-q", "--seed", "1"]
    for flags in (["--temperature", "0.7"], ["--top_k", "5"], ["--top_p", "0.9"], ["--temperature", "0"], []):
        assert cli.main([*base, *flags]) == 0
    assert seen == [(True, 1, 0.7), (True, 1, 1.0), (True, 1, 1.0), (False, 1, 1.0), (False, 1, 1.0)]
    _, err, _ = run(monkeypatch, folder, "--num_beams", "2")
    assert " beam steps a pass; " in err and " tokens a pass" not in err
    _, err, _ = run(monkeypatch, folder)
    assert " tokens a pass; " in err


def test_printed_stats_are_a_summary_not_the_per_step_lists(folder):
    """print(result.stats) dumped the per-step lists (a value per beam step and per pass); now one line, and repr
    (inside print(result)) the summarised fields."""
    engine = Engine(folder, draft=folder)
    [result] = engine.generate("the lazy dog", num_beams=2, max_new_tokens=40, min_new_tokens=40,
                               speculative={"adaptive": False})
    stats = result.stats
    assert len(stats.from_draft) >= 40 and stats.draft_tokens_proposed
    line = str(stats)
    assert "\n" not in line and "[" not in line and line.startswith(f"{stats.generated_tokens} tokens in ")
    assert f"{stats.draft_tokens_accepted} of {stats.draft_tokens_proposed} drafted tokens accepted" in line
    assert "[" not in repr(stats) and "steps_from_draft=" in repr(stats) and len(repr(stats)) < 600
    assert "[" not in repr(result).split("stats=")[1]
