"""The Python API and CLI: streaming, configuration validation, clear errors for bad input."""
import json
import shutil

import pytest

from specbeam_edge import Engine, GenerationConfig, ModelFolderError, SpeculativeConfig
from specbeam_edge.commands.cli import main as cli_main
from helpers import plain


@pytest.fixture(scope="module")
def engine(exported):
    t = exported("llama", std=0.3, seed=3)
    return Engine(t, draft=exported("llama", std=0.3, seed=11, layers=1))


@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("spec", [None, SpeculativeConfig(adaptive=False, budget=24, max_depth=4)])
def test_stream_prefixes_are_final(engine, K, spec):
    pieces, shown = [], ""
    for chunk in engine.stream("the quick brown fox", num_beams=K, max_new_tokens=20, speculative=spec):
        shown += chunk.text
        pieces.append(shown)
    final = chunk.result.text
    assert shown == final
    assert all(final.startswith(p) for p in pieces)
    [ref] = plain(engine, "the quick brown fox", num_beams=K, max_new_tokens=20)
    assert final == ref.text


@pytest.mark.parametrize("K", [1, 4])
def test_stream_chunks_are_one_per_target_pass(engine, K):
    """The documented contract of empty chunks: one chunk per target pass (an empty one when the pass made
    nothing final), each stats snapshot one pass further, then the closing chunk with the Result."""
    chunks = list(engine.stream("the quick brown fox", num_beams=K, max_new_tokens=20))
    passes = [c.stats.target_passes for c in chunks[:-1]]
    assert passes == list(range(passes[0], passes[0] + len(passes)))
    assert chunks[-1].result is not None and chunks[-1].result.stats.target_passes == passes[-1]
    assert all(c.result is None for c in chunks[:-1])
    assert "".join(c.text for c in chunks) == chunks[-1].result.text


def test_config_validation():
    with pytest.raises(ValueError, match="num_return_sequences"):
        GenerationConfig(num_beams=2, num_return_sequences=3)
    with pytest.raises(ValueError, match="early_stopping"):
        GenerationConfig(early_stopping="sometimes")
    with pytest.raises(ValueError, match="num_beams"):
        GenerationConfig(num_beams=0)
    with pytest.raises(ValueError, match="drafter"):
        SpeculativeConfig(adaptive=False, drafter="magic")
    with pytest.raises(ValueError, match="unknown generation option"):
        GenerationConfig.from_dict({}, beams=3)


def test_bad_requests(engine):
    with pytest.raises(ValueError, match="budget"):
        engine.generate("hello", num_beams=4, speculative=SpeculativeConfig(adaptive=False, budget=2))
    with pytest.raises(ValueError, match="empty"):
        engine.generate("", num_beams=2)
    with pytest.raises(ValueError, match="context length"):
        engine.generate([5] * 300, num_beams=2)
    with pytest.raises(ValueError, match="num_return_sequences"):
        engine.generate("hello", num_beams=2, num_return_sequences=3)


def test_bad_folders(exported, tmp_path):
    t = exported("llama", std=0.3, seed=3)
    with pytest.raises(ModelFolderError, match="does not exist"):
        Engine(t, draft=tmp_path / "missing")
    other = tmp_path / "other_tok"
    shutil.copytree(exported("llama", std=0.3, seed=11, layers=1), other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ModelFolderError, match="tokenizer"):
        Engine(t, draft=other)


def test_chat_template(engine):
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "user: hi\nassistant:"


def test_cli_generate_same_text_with_and_without_draft(exported, capsys):
    t = exported("llama", std=0.3, seed=3)
    d = exported("llama", std=0.3, seed=11, layers=1)
    assert cli_main(["generate", "the lazy dog", "--model", str(t), "--num_beams", "4", "--max_new_tokens", "12"]) == 0
    without_draft = capsys.readouterr().out
    assert cli_main(["generate", "the lazy dog", "--model", str(t), "--draft", str(d), "--num_beams", "4",
                     "--max_new_tokens", "12", "--stats"]) == 0
    cap = capsys.readouterr()
    assert cap.out == without_draft
    stats = json.loads(cap.err.strip().splitlines()[-1])
    assert stats["target_passes"] >= 1 and stats["beam_steps"] >= 12
    # the target as its own draft, trees on every pass: the draft is used (its levels are accepted, several beam
    # steps per pass) and the text is still plain search's
    assert cli_main(["generate", "the lazy dog", "--model", str(t), "--draft", str(t), "--num_beams", "4",
                     "--max_new_tokens", "12", "--always_speculate", "--stats"]) == 0
    cap = capsys.readouterr()
    assert cap.out == without_draft
    stats = json.loads(cap.err.strip().splitlines()[-1])
    assert stats["plain_passes"] == 0 and stats["draft_tokens_proposed"] > 0 and stats["steps_from_draft"] > 0
    assert stats["beam_steps_per_pass"] > 1.5, stats
    assert cli_main(["generate", "x", "--model", str(t) + "_nope"]) == 2


def test_cli_speculation_is_adaptive_unless_asked(exported, capsys):
    """With a draft, `generate` speculates adaptively (the chooser measures plain passes first, so some passes
    draft nothing); --always_speculate drafts on every pass."""
    t = exported("llama", std=0.3, seed=3)
    base = ["generate", "the lazy dog", "--model", str(t), "--draft", str(t), "--num_beams", "2",
            "--max_new_tokens", "16", "--stats"]
    runs = {}
    for extra in ([], ["--always_speculate"]):
        assert cli_main(base + extra) == 0
        cap = capsys.readouterr()
        runs[bool(extra)] = (cap.out, json.loads(cap.err.strip().splitlines()[-1]))
    (adaptive_out, adaptive), (always_out, always) = runs[False], runs[True]
    assert adaptive_out == always_out
    assert adaptive["plain_passes"] > 0, adaptive
    assert always["plain_passes"] == 0 and always["draft_passes"] > 0, always


def test_chat_prompt_leaves_the_earliest_messages_out_to_fit(engine):
    """A conversation longer than the context: the earliest messages go (the system message stays, the kept
    history starts with a question) until the prompt leaves `room` tokens for the answer."""
    ctx = engine.target.cfg.context_length
    long = " ".join(["fox"] * (ctx // 6))
    msgs = [{"role": "system", "content": "be brief"}]
    for k in range(8):
        msgs += [{"role": "user", "content": f"{k} {long}"}, {"role": "assistant", "content": f"answer {k}"}]
    msgs.append({"role": "user", "content": "last question"})
    prompt, left_out = engine.chat_prompt(msgs, room=16)
    assert 0 < left_out < len(msgs) - 2 and len(engine.encode(prompt)) <= ctx - 16
    kept = [msgs[0]] + msgs[1 + left_out:]
    assert kept[1]["role"] == "user" and prompt == engine.tokenizer.apply_chat_template(kept)
    short = [{"role": "user", "content": "hi"}]
    assert engine.chat_prompt(short) == (engine.tokenizer.apply_chat_template(short), 0)


def test_terminal_chat_keeps_going_when_the_history_outgrows_the_context(engine, exported, monkeypatch, capsys):
    """Before: with a chat-template model, `specbeam chat` refused every message once the history was longer than
    the context; it now leaves the earliest messages out of the turn (as the desktop app does) and says so."""
    import io
    import sys

    ctx = engine.target.cfg.context_length
    lines = "".join(f"{k} " + " ".join(["fox"] * (ctx // 5)) + "\n" for k in range(6))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines.encode())))
    assert cli_main(["chat", "--model", str(exported("llama", std=0.3, seed=3)), "--max_new_tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) >= 6, (out, err)           # every message answered
    assert "were left out of this turn" in err and "was not sent" not in err
