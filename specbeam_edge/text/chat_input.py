"""What the user types in `specbeam chat`, read as Ollama reads it: a message per Enter, a multi-line one between
\"\"\" marks, a pasted block (lines that arrive at once on a terminal) as one message, blank lines skipped, and the
commands /bye, /clear and /?. Before, every pasted line was a message of its own and a blank line (common in code)
ended the chat."""
from __future__ import annotations

import select
import sys

from ..commands.flags import MAX_INPUT_BYTES, is_terminal, read_bounded

FENCE = b'"""'
COMMANDS = {"/bye": "end the chat (Ctrl-D too)",
            "/clear": "empty the conversation (the system prompt stays)",
            "/?": "list these commands"}
CHAT_KEYS = ('keys: Enter sends a message; """ starts and ends a multi-line message (a pasted block is one '
             "message); Ctrl-C stops an answer (what it wrote so far is kept in the conversation); /? lists the "
             "commands; /bye, Ctrl-D, or Ctrl-C at the prompt quits")
PASTE_SECONDS = 0.05     # a line that follows within this on a terminal belongs to the same paste


def command_help() -> str:
    return "\n".join([f"  {name:<7} {what}" for name, what in COMMANDS.items()]
                     + [f'  {FENCE.decode():<7} start and end a multi-line message'])


def read_message():
    """The user's next message (stripped; one line that is a command, such as '/bye', is returned as it is), None
    at the end (Ctrl-D, or Ctrl-C at the prompt), False for bytes that are not UTF-8 (reported)."""
    while True:
        print(">>> ", end="", file=sys.stderr, flush=True)      # the marker between turns (Ollama's)
        try:
            raw = _read_block()
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return None
        if raw is None:
            print(file=sys.stderr)
            return None
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            print(f"chat: that message is not valid UTF-8 ({e.reason} at byte {e.start}) and was not sent; type it "
                  f"again", file=sys.stderr)
            return False
        if text:
            return text


def _read_block() -> bytes | None:
    """The bytes of one message: a line; from a line starting with \"\"\" to one ending with it (the marks
    dropped); on a terminal, with the lines that arrived with it. None at the end of input."""
    first = _line()
    if not first:
        return None
    if first.lstrip().startswith(FENCE):
        lines, last = [], first.lstrip()[len(FENCE):]
        while True:
            lines.append(last)
            if last.rstrip().endswith(FENCE):
                break
            print("... ", end="", file=sys.stderr, flush=True)
            last = _line()
            if not last:                # the end of input inside the block: what came is the message
                break
            _bounded(lines)
        text = b"".join(lines).rstrip()
        return text[:-len(FENCE)] if text.endswith(FENCE) else text
    lines = [first]
    while _pending():
        more = _line()
        if not more:
            break
        lines.append(more)
        _bounded(lines)
    return b"".join(lines)


def _line() -> bytes:
    return read_bounded(sys.stdin.buffer, "that message", "send shorter messages", line=True)


def _bounded(lines: list[bytes]) -> None:
    if sum(map(len, lines)) > MAX_INPUT_BYTES:
        raise ValueError(f"that message is longer than {MAX_INPUT_BYTES >> 20} MiB, the most a tool reads at once; "
                         f"send shorter messages")


def _pending() -> bool:
    """On a terminal: whether another line is already there (a paste arrives as lines at once); never for a pipe
    or a file, whose lines are messages one by one."""
    if not is_terminal(sys.stdin):
        return False
    try:
        ready, _, _ = select.select([sys.stdin.fileno()], [], [], PASTE_SECONDS)
    except (OSError, ValueError):
        return False
    return bool(ready)
