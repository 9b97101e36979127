"""`specbeam chat` reads messages as Ollama does (issue 66): \"\"\" starts and ends a multi-line message, a pasted
block whose lines arrive at once on a terminal is one message, a blank line is skipped (it ended the chat, and code
has blank lines), /bye or Ctrl-D ends it, /clear empties the history, /? lists the commands; `specbeam generate
--system` for a chat model."""
import io
import os
import sys

import pytest

from specbeam_edge.text import chat_input
from specbeam_edge.commands import cli
from specbeam_edge.generate import Engine

CHAT = Engine.chat


@pytest.fixture(scope="module")
def folder(exported):
    return exported("llama", std=0.3, seed=3)       # a chat model (export/tiny.py gives it a chat template)


def chat(monkeypatch, folder, stdin: bytes, *flags):
    """(the conversations sent, one per answered message; stderr) of `specbeam chat` reading stdin."""
    sent = []

    def spy(self, messages, *a, **kw):
        sent.append([dict(m) for m in messages])
        return CHAT(self, messages, *a, **kw)
    monkeypatch.setattr(Engine, "chat", spy)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    assert cli.main(["chat", "--model", str(folder), "--max_new_tokens", "2", *flags]) == 0, err.getvalue()
    return sent, err.getvalue()


def test_multi_line_messages_blank_lines_clear_and_help(folder, monkeypatch):
    stdin = (b'first\n\n\nsecond\n"""\ndef f():\n\n    return 1\n"""\n/?\n/clear\nthird\n'
             b'"""one line"""\n')
    sent, err = chat(monkeypatch, folder, stdin, "--system", "Be brief.")
    users = [[m["content"] for m in conv if m["role"] == "user"] for conv in sent]
    assert users == [["first"], ["first", "second"], ["first", "second", "def f():\n\n    return 1"],
                     ["third"], ["third", "one line"]]
    assert all(conv[0] == {"role": "system", "content": "Be brief."} for conv in sent)   # /clear keeps it
    assert "chat: the conversation is empty (the system prompt stays)" in err
    assert "/bye" in err and "/clear" in err and '"""' in err.split("/clear", 2)[-1]      # /? listed them


def test_bye_ends_the_chat_and_a_fence_left_open_at_the_end_is_sent(folder, monkeypatch):
    sent, _ = chat(monkeypatch, folder, b"one\n/bye\ntwo\n")
    assert [conv[-1]["content"] for conv in sent] == ["one"]
    sent, _ = chat(monkeypatch, folder, b'"""\nan open\nblock\n')
    assert [conv[-1]["content"] for conv in sent] == ["an open\nblock"]


def test_a_paste_on_a_terminal_is_one_message(monkeypatch):
    """Lines that arrive at once on a terminal (a paste) are one message; a pipe's lines stay one message each
    (the test above)."""
    master, slave = os.openpty()
    try:
        tty = os.fdopen(slave, "r", closefd=False)
        monkeypatch.setattr(sys, "stdin", tty)
        os.write(master, b"def f():\n    return 1\n")
        assert chat_input.read_message() == "def f():\n    return 1"
        os.write(master, b"alone\n")
        assert chat_input.read_message() == "alone"
        os.write(master, b"\x04")                                     # Ctrl-D on an empty line: the end
        assert chat_input.read_message() is None
    finally:
        os.close(master)
        os.close(slave)


def test_generate_takes_a_system_prompt(folder, monkeypatch, capsys):
    """`specbeam generate --system TEXT` puts it before the prompt in the chat template."""
    seen = []
    real = Engine.stream

    def spy(self, prompt, *a, **kw):
        seen.append(str(prompt))
        return real(self, prompt, *a, **kw)
    monkeypatch.setattr(Engine, "stream", spy)
    assert cli.main(["generate", "the lazy dog", "--model", str(folder), "--system", "Be brief.",
                     "--max_new_tokens", "2", "-q"]) == 0
    assert seen == ["system: Be brief.\nuser: the lazy dog\nassistant:"]
    assert cli.main(["generate", "x", "--model", str(folder), "--system", "s", "--raw"]) == 2
    assert cli.main(["generate", "x", "--system", "s"]) == 2        # the shipped en->de pair: no chat template
    err = capsys.readouterr().err.splitlines()
    assert err[-2].endswith("--raw sends prompts as they are (put the system prompt into them)")
    assert err[-1].endswith("this model has none (a chat model's folder has chat_template in tokenizer_config.json)")
