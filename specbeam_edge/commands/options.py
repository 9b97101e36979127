"""What `specbeam generate` and `specbeam chat` share: the search flags and the configs they make, the model a
command runs (a fetched name, a folder, the shipped pair) and the engine it opens, and the notes on stderr about
streamed layers and cut answers."""
from __future__ import annotations

import argparse
import os
import sys

from ..config import AHEAD_MIN_PATH_PROB, ModelFolderError, SpeculativeConfig
from ..fetch import FetchError, default_ahead, default_draft, fetched, resolve_model
from ..shipped import ENV as SHIPPED_ENV
from ..shipped import shipped
from ..text.prompting import CHAT_MAX_NEW_TOKENS, has_chat_template
from .flags import (add_beam_arg, add_decoding_constraint_args, add_length_penalty_arg,
                    add_memory_args, add_speculation_args, check_prompt_format, check_widths, decoding_constraints,
                    engine_from_args, finite_float, positive_int, speculative_from_args, streaming_note)


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
                and num_beams_of(args) == 1):
            # else, for greedy search, its target's own lookahead head, drafting on every pass: measured 1.16x
            # plain where adaptive speculation gave 0.95-1.03x (a pass's steps vary more than its probes see);
            # K > 1 gains nothing from it (it guesses after the best next token only); only the guesses the
            # head believes (config.AHEAD_MIN_PATH_PROB, unless --min_path_prob is given)
            args.drafter, args.always_speculate = "ahead", True
            if args.min_path_prob is None:
                args.min_path_prob = AHEAD_MIN_PATH_PROB
    spec = speculative_from_args(args, draft=args.draft, sample=sample)
    return {k: v for k, v in overrides.items() if v is not None}, spec


def num_beams_of(args) -> int:
    """The search's beam width: --num_beams, else the model folder's generation default."""
    if args.num_beams is not None:
        return args.num_beams
    from ..config import GenerationConfig, ModelConfig

    try:
        return GenerationConfig.from_dict(ModelConfig.load(resolve_model(args.model)).generation).num_beams
    except (ModelFolderError, FetchError, ValueError):
        return GenerationConfig().num_beams


def cut_note(result, gen, context_length: int, flag: str = "--max_new_tokens") -> str | None:
    """One line saying that an answer was cut, and by what (None when it ended on its own)."""
    reason = result.finish_reason
    if reason == "length":
        return f"the answer was cut at {flag} {gen.max_new_tokens}; pass a larger {flag} to let it finish"
    if reason == "context":
        return (f"the answer was cut by the model's context length ({context_length} tokens): the prompt and "
                f"answer fill it")
    return None


def model_folder(args) -> str:
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
    model = model_folder(args)
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


def loading_line(args) -> str:
    """'specbeam: loading MODEL (with the draft DRAFT)...' in the names the user knows (a folder's own name)."""
    name = lambda m: m if os.path.sep not in str(m) else os.path.basename(os.path.normpath(m))  # noqa: E731
    draft = "" if args.no_draft or not args.draft else f" with the draft {name(args.draft)}"
    return f"specbeam: loading {name(args.model) if args.model else 'the shipped en->de pair'}{draft}..."


def chat_defaults(args) -> None:
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
        folder = model_folder(args)
        generation = ModelConfig.load(folder).generation
    except (ModelFolderError, FetchError, ValueError):
        return          # open_engine reports the folder's problem
    if "num_beams" not in generation and (args.cmd == "chat" or has_chat_template(folder)):
        args.num_beams = 1
