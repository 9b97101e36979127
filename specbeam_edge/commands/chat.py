"""`specbeam chat`: a conversation on the terminal, each answer streamed as it becomes final (the input's
keys and commands: text/chat_input.py)."""
from __future__ import annotations

import json
import sys

from ..text.chat_input import CHAT_KEYS, command_help, read_message
from ..text.chat_template import ChatTemplateError
from .options import chat_defaults, configs, cut_note, implied_sampling, open_engine, say_streaming


def cmd_chat(args) -> int:
    implied_sampling(args)
    chat_defaults(args)
    overrides, spec = configs(args)
    engine = open_engine(args, spec)
    gen = engine.generation_config(**overrides)   # bad settings fail here, not per message
    messages = [{"role": "system", "content": args.system}] if args.system else []
    if sys.stdin is None:
        raise ValueError("stdin is closed; chat reads your messages from it")
    print(f"chat: {CHAT_KEYS}", file=sys.stderr)
    say_streaming(engine, args)
    while True:
        line = read_message()
        if line is None or line == "/bye":      # Ctrl-D, Ctrl-C at the prompt, /bye
            return 0
        if line is False:           # not valid UTF-8: said so, nothing sent
            continue
        if line == "/clear":
            messages = messages[:1] if args.system else []
            print("chat: the conversation is empty" + (" (the system prompt stays)" if args.system else ""),
                  file=sys.stderr)
            continue
        if line in ("/?", "/help"):
            print(command_help(), file=sys.stderr)
            continue
        turn = messages + [{"role": "user", "content": line}]
        answered = _answer(engine, turn, gen, spec)
        if answered is None:        # refused before the answer: said so, the conversation is unchanged
            continue
        answer, chunk, stopped = answered
        _report_turn(engine, args, gen, chunk, stopped)
        messages = turn + [{"role": "assistant", "content": answer}]
    return 0


def _answer(engine, turn: list[dict], gen, spec):
    """Stream the answer to one turn to stdout: (answer text, last chunk, stopped by Ctrl-C), or None when the
    message was refused before any answer (reported)."""
    answer, chunk, stopped = "", None, False
    try:
        for chunk in engine.chat(turn, gen, spec, stream=True):
            answer += chunk.text
            print(chunk.text, end="", flush=True)
    except KeyboardInterrupt:
        stopped = True
    except ChatTemplateError as e:      # the model folder's template refused this conversation (or broke)
        print(f"chat: that message was not sent: {e}", file=sys.stderr)
        return None
    except ValueError as e:         # e.g. over the model's context, a template error: refused before the answer
        if answer:
            raise
        print(f"chat: that message was not sent ({e}); send a shorter one, or start a new chat with a "
              f"shorter history", file=sys.stderr)
        return None
    print(flush=True)
    return answer, chunk, stopped


def _report_turn(engine, args, gen, chunk, stopped: bool) -> None:
    """After an answer: messages left out of the context, a stop or a cut, and --stats."""
    ctx = engine.target.cfg.context_length
    result = None if stopped or chunk is None else chunk.result
    if result is not None and result.left_out and engine.tokenizer.chat_template:
        print(f"chat: the earliest {result.left_out} message(s) no longer fit the model's context ({ctx} tokens) "
              f"and were left out of this turn", file=sys.stderr)
    if stopped:
        print("chat: stopped; the answer so far is kept in the conversation", file=sys.stderr)
    elif result is not None:
        note = cut_note(result, gen, ctx)
        if note:
            print(f"chat: {note}", file=sys.stderr)
    if args.stats and chunk is not None:
        stats = result.stats if result is not None else chunk.stats
        print(json.dumps({**stats.as_dict(),
                          "finish_reason": "interrupted" if stopped else result.finish_reason}), file=sys.stderr)
