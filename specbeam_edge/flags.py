"""Command-line pieces shared by every tool (the `specbeam` CLI and the apps): memory flags, speculation
settings, engine construction, default model folders. Tools import this module; it imports no tool."""
from __future__ import annotations

import argparse
import math
import os
import sys

from .config import SpeculativeConfig
from .shipped import models_root

PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}
DEFAULT_MODELS = models_root()   # models/ beside the package, or $SPECBEAM_MODELS (shipped.py)
_UNITS = (("tb", 2**40), ("gb", 2**30), ("mb", 2**20), ("kb", 2**10), ("b", 1))


DRAFT_WIDTH_HELP = ("nodes per draft level W (beam drafter: default max(K, branch, min(4K, budget // 2))); samples "
                    "per level (sample drafter: default max(K, branch))")


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default where it has one (not for switches, 'not set' defaults, or a help text
    that already names its default)."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def guard_std_streams() -> None:
    """A tool started with a standard stream closed (`2>&-`): the descriptor gets /dev/null, so no file the tool
    opens later takes descriptor 0, 1 or 2 (onnxruntime's own logging would write into it), and a closed stderr
    becomes a sink (print(file=None) would otherwise send diagnostics to stdout). sys.stdin/sys.stdout stay None
    so the tools can refuse to read or write them."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            got = os.open(os.devnull, os.O_RDWR)
            if got != fd:            # a lower descriptor was free too: it is handled on its own turn
                os.dup2(got, fd)
                os.close(got)
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")


def check_widths(engine, max_branch_width: int | None, draft_width: int | None) -> None:
    """Tree widths beyond the vocabulary (a TopK k larger than the vocabulary fails deep inside onnxruntime)."""
    vocab = engine.target.cfg.vocab_size
    if engine.draft is not None:
        vocab = min(vocab, engine.draft.cfg.vocab_size)
    for flag, value in (("--max_branch_width", max_branch_width), ("--draft_width", draft_width)):
        if value is not None and value > vocab:
            raise ValueError(f"{flag} {value} is larger than the model's vocabulary ({vocab} tokens); pass at most "
                             f"{vocab}")


def check_prompt_format(engine, model: str) -> None:
    """A prompt_format that str.format cannot fill (an unknown field) as one line naming the file."""
    try:
        engine.tokenizer.format_prompt("x")
    except (KeyError, IndexError, ValueError, AttributeError) as e:
        raise ValueError(f"{model}/tokenizer_config.json: prompt_format {engine.tokenizer.prompt_format!r} cannot "
                         f"be filled ({type(e).__name__}: {e}); its only field is {{source}} (write other braces "
                         f"doubled, {{{{ }}}})") from None


def budget_arg(text: str):
    """--budget: a positive integer or 'auto'."""
    return "auto" if text == "auto" else positive_int(text)


def positive_int(text: str) -> int:
    """An argparse type for counts that must be >= 1 (beam sizes, lengths, batch sizes)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def finite_float(text: str) -> float:
    """An argparse type for floats that must be finite (nan and inf would silently corrupt scores)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def parse_size(text: str | None) -> int | None:
    """'512MB', '1.5GiB', '2e9' -> bytes; inf, nan and negative sizes are refused with the reason."""
    if text is None:
        return None
    t = text.strip().lower().replace("ib", "b")
    mult = 1
    for suffix, m in _UNITS:
        if t.endswith(suffix):
            t, mult = t[: -len(suffix)], m
            break
    try:
        value = float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 512MB, 1.5GiB, 2e9)") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: it must be a finite number >= 0 "
                                         f"(examples: 512MB, 1.5GiB, 2e9)")
    return int(value * mult)


def add_memory_args(ap: argparse.ArgumentParser) -> None:
    m = ap.add_argument_group("memory (split-layout targets)")
    m.add_argument("--max_memory", type=parse_size, default=None,
                   help="budget for the target's weights in memory (e.g. 2GB); other layers are streamed per pass")
    m.add_argument("--host_memory", type=parse_size, default=0,
                   help="streamed layers kept in host memory (GPU providers); the rest stream from disk")
    m.add_argument("--placement", default=None,
                   help="explicit per-layer placement, comma list of resident/host/disk (overrides --max_memory)")
    m.add_argument("--provider", choices=("cpu", "cuda"), default="cpu", help="onnxruntime execution provider")


def engine_from_args(args, model: str, draft: str | None):
    """An Engine from the memory flags of add_memory_args plus --threads."""
    from .generate import Engine

    placement = args.placement.split(",") if args.placement else None
    return Engine(model, draft=draft, threads=args.threads, max_memory=args.max_memory,
                  host_memory=args.host_memory, placement=placement, providers=PROVIDERS[args.provider])


def speculative_config(*, drafter: str, budget, max_depth: int, max_branch_width: int, draft_width: int | None,
                       always_speculate: bool, width_threshold: float = 0.0, min_num_beams: int = 1,
                       single_sequence: bool = False, min_path_prob: float = 0.0,
                       with_lookup: bool = False) -> SpeculativeConfig:
    """The speculation flags every tool shares -> SpeculativeConfig (adaptive unless --always_speculate)."""
    return SpeculativeConfig(drafter=drafter, budget=budget, max_depth=max_depth,
                             max_branch_width=max_branch_width, draft_width=draft_width,
                             width_threshold=width_threshold, min_num_beams=min_num_beams,
                             single_sequence=single_sequence, min_path_prob=min_path_prob,
                             with_lookup=with_lookup, adaptive=not always_speculate)


# GenerationConfig fields both tools take under the same flags (transformers' names; CTranslate2's alias)
DECODING_CONSTRAINTS = ("min_new_tokens", "no_repeat_ngram_size", "repetition_penalty")


def add_decoding_constraint_args(ap) -> None:
    """--min_new_tokens (--min_decoding_length), --no_repeat_ngram_size, --repetition_penalty on a parser or group
    (the default None keeps the model's own setting)."""
    ap.add_argument("--min_new_tokens", "--min_decoding_length", dest="min_new_tokens", type=int, default=None,
                    help="EOS is masked before this many generated tokens (--min_decoding_length is CTranslate2's "
                         "name)")
    ap.add_argument("--no_repeat_ngram_size", type=int, default=None,
                    help="never repeat an n-gram of this size (transformers' semantics; 0: off)")
    ap.add_argument("--repetition_penalty", type=finite_float, default=None,
                    help="penalise tokens already in the sequence (transformers' semantics; 1: off)")


def decoding_constraints(args) -> dict:
    """The decoding-constraint flags that were given, as GenerationConfig overrides."""
    return {k: getattr(args, k) for k in DECODING_CONSTRAINTS if getattr(args, k, None) is not None}
