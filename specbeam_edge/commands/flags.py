"""Command-line pieces shared by every tool (the `specbeam` CLI and the apps): memory flags, speculation
settings, engine construction, default model folders. Tools import this module; it imports no tool."""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from ..config import AHEAD_MIN_PATH_PROB, DEFAULT_BUDGET, SpeculativeConfig
from ..shipped import models_root

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


# the most prompt text a tool reads from stdin or a file in one run: `< /dev/zero` read until memory ran out
MAX_INPUT_BYTES = 64 << 20
_INPUT_CHUNK = 1 << 20


def read_bounded(f, what: str, fix: str, *, line: bool = False, limit: int = MAX_INPUT_BYTES):
    """f's contents (bytes or str, as f gives), or its next line with `line`, read in chunks: more than `limit`
    is refused in one line naming the limit and `fix`, before the rest of an endless stream is read."""
    read = f.readline if line else f.read
    chunks, size = [], 0
    while size <= limit:
        chunk = read(min(_INPUT_CHUNK, limit + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if line and chunk[-1:] in ("\n", b"\n"):
            break
    if size > limit:
        raise ValueError(f"{what} is longer than {limit >> 20} MiB, the most a tool reads at once (an endless "
                         f"stream such as /dev/zero?); {fix}")
    return chunks[0][:0].join(chunks) if chunks else b""


def check_widths(engine, max_branch_width: int | None, draft_width: int | None) -> None:
    """Tree widths beyond the vocabulary (a TopK k larger than the vocabulary fails deep inside onnxruntime)."""
    engine.check_widths(max_branch_width, draft_width, flags=True)


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
                   help="budget for the target's weights in memory (e.g. 2GB); other layers are streamed per pass (the "
                        "draft, the KV cache and the runtime come on top)")
    m.add_argument("--host_memory", type=parse_size, default=0,
                   help="streamed layers kept in host memory (GPU providers); the rest stream from disk")
    m.add_argument("--placement", default=None,
                   help="explicit per-layer placement, comma list of resident/host/disk (overrides --max_memory)")
    m.add_argument("--provider", choices=("cpu", "cuda"), default="cpu", help="onnxruntime execution provider")
    m.add_argument("--prefill_chunk", type=positive_int, default=None,
                   help="a prompt's tokens a pass scores (default 256, 512 when layers stream; llama.cpp's "
                        "--ubatch-size): fewer lower a long prompt's peak memory, the answer is the same")


def streaming_note(engine, max_memory: int | None = None) -> str | None:
    """'N of L layers stream from disk each pass (budget X MB)' when the engine's target streams layers (a
    split-layout target under a memory budget or a placement), else None: what the CLI and the chat app say
    before a pass that reads weights from disk (one can take seconds)."""
    target = getattr(engine, "target", None)
    streamed = target.streamed_layers() if hasattr(target, "streamed_layers") else 0
    if not streamed:
        return None
    total = target.cfg.num_layers
    places = target.runner.placement
    n = total - places.count("resident")
    where = "from disk" if not places.count("host") else "from disk or host memory"
    budget = ""
    if max_memory is not None:      # the budget is the target's weights; say what it leaves out (before: a 400 MB
        draft = getattr(engine, "draft", None)          # budget peaked at 1.25 GB with the coder pair, unsaid)
        extra = f"the draft's {_megabytes(weight_bytes(draft.folder))} MB, " if draft is not None else ""
        budget = (f" (budget {_megabytes(max_memory)} MB for the target's weights; {extra}the KV cache and the "
                  f"runtime come on top)")
    return f"{n} of {total} layers stream {where} each pass{budget}"


def weight_bytes(folder) -> int:
    """The bytes of a model folder's graphs and weights (what a whole-layout model holds in memory)."""
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file() and (
        f.suffix in (".onnx", ".data", ".bin") or f.name.endswith(".onnx.data")))


def _megabytes(nbytes: int) -> str:
    mb = nbytes / 2**20
    return f"{mb:.0f}" if mb >= 10 else f"{mb:.2g}"


class Status:
    """One transient line on stderr while nothing else shows (the model loading, the search before its first text):
    only on a terminal, each shown line replacing the last, erased before anything else prints."""

    def __init__(self, on: bool):
        self.on, self.shown = on, False

    def show(self, text: str) -> None:
        if self.on:
            sys.stderr.write(f"\r\033[K{text}")
            sys.stderr.flush()
            self.shown = True

    def clear(self) -> None:
        if self.shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self.shown = False


def is_terminal(stream) -> bool:
    """Whether a standard stream is a terminal (None: closed)."""
    return stream is not None and stream.isatty()


def end_line(result, gen, context_length: int) -> str:
    """The closing line of an answer: its tokens, speed, tokens a target pass (beam steps with beams: a step
    extends every beam by one token) and why it ended."""
    s = result.stats
    per_pass = "tokens a pass" if gen.num_beams == 1 else "beam steps a pass"
    why = {"stop": "finished (the model's end token)",
           "length": f"cut at --max_new_tokens {gen.max_new_tokens} (a larger one lets it finish)",
           "context": f"cut by the model's context length ({context_length} tokens: prompt and answer fill it)"}
    return (f"{s.generated_tokens} tokens in {s.seconds:.1f} s, {s.tokens_per_second:.1f} tok/s, "
            f"{s.beam_steps_per_pass:.2f} {per_pass}; {why.get(result.finish_reason, 'ended')}")


def engine_from_args(args, model: str, draft: str | None):
    """An Engine from the memory flags of add_memory_args plus --threads. (The engine's module loads here, not with
    the flags: parsing them, and --help, need no onnxruntime.)"""
    from ..generate import Engine

    # the Engine puts every session of the process on one thread pool of --threads threads (shared_pool)
    placement = args.placement.split(",") if args.placement else None
    return Engine(model, draft=draft, threads=args.threads, max_memory=args.max_memory,
                  host_memory=args.host_memory, placement=placement, providers=PROVIDERS[args.provider],
                  prefill_chunk=args.prefill_chunk)


def speculative_config(*, drafter: str, budget, max_depth: int, max_branch_width: int, draft_width: int | None,
                       always_speculate: bool, width_threshold: float = 0.0, min_num_beams: int = 1,
                       single_sequence: bool = False, min_path_prob: float = 0.0,
                       with_lookup: bool = False) -> SpeculativeConfig:
    """The one place a tool's speculation settings become a SpeculativeConfig (adaptive unless always_speculate):
    the flags of add_speculation_args (speculative_from_args) and the chat app's settings panel."""
    return SpeculativeConfig(drafter=drafter, budget=budget, max_depth=max_depth,
                             max_branch_width=max_branch_width, draft_width=draft_width,
                             width_threshold=width_threshold, min_num_beams=min_num_beams,
                             single_sequence=single_sequence, min_path_prob=min_path_prob,
                             with_lookup=with_lookup, adaptive=not always_speculate)


def add_beam_arg(ap, default: int | None, first: str = "--num_beams") -> None:
    """The beam width, under both tools' names (--num_beams is transformers', --beam_size CTranslate2's; `first`
    is the one a tool's help and errors name)."""
    names = [first] + [f for f in ("--num_beams", "--beam_size") if f != first]
    ap.add_argument(*names, dest="num_beams", type=positive_int, default=default,
                    help="beam width K (1 = greedy; --num_beams and --beam_size are one flag)"
                         + ("" if default is not None else " (default: the model's)"))


def add_length_penalty_arg(ap) -> None:
    ap.add_argument("--length_penalty", type=finite_float, default=None,
                    help="score = sum logp / length ** this (default: the model's)")


def add_speculation_args(ap: argparse.ArgumentParser, *, draft_help: str, sampling: bool) -> None:
    """The speculation flags of every tool (`specbeam generate/chat`, `specbeam-translate`); sampling=True adds the
    draft beam-sampling drafter and DSBD's width flags (the translate tool decodes by beam search only)."""
    s = ap.add_argument_group("speculation")
    s.add_argument("--draft", default=None, help=draft_help)
    s.add_argument("--no_draft", action="store_true",
                   help="no draft model: plain search even where a default draft exists (with --drafter lookup: "
                        "prompt lookup alone)")
    drafters = ("beam", "best_first", "sample", "lookup", "ahead") if sampling else \
        ("beam", "best_first", "lookup", "ahead")
    s.add_argument("--drafter", choices=drafters, default=None,
                   help="tree growth: draft beam search (AtSpeed; the default), best-first by draft log-prob "
                        "(SpecExec), " + ("draft beam sampling (the only one for --do_sample; the default then), "
                                          if sampling else "") +
                        "prompt lookup (n-gram continuations; needs no draft model), or the target's own "
                        "lookahead head (`ahead`: a model that has one, e.g. a fetched smollm2; no draft model)")
    s.add_argument("--budget", type=budget_arg, default=DEFAULT_BUDGET,
                   help="draft tree nodes per target pass, or 'auto' (chosen from the measured pass-cost curve)")
    s.add_argument("--max_depth", type=positive_int, default=6, help="tree levels below each beam")
    s.add_argument("--always_speculate", action="store_true",
                   help="draft on every pass; by default the engine measures both ways and drafts only while it "
                        "pays (the output is the same)")
    s.add_argument("--max_branch_width", type=positive_int, default=4, help="children per expanded draft node")
    s.add_argument("--draft_width", type=positive_int, default=None, help=DRAFT_WIDTH_HELP)
    s.add_argument("--with_lookup", action="store_true",
                   help="also put prompt-lookup spans (copied names, numbers, markup) into the draft model's tree, "
                        "the budget split by measured acceptance")
    s.add_argument("--min_path_prob", type=finite_float, default=None,
                   help="stop a draft branch once the draft's probability of its path from the beam falls below this "
                        f"(default 0: grow every level up to --max_depth; {AHEAD_MIN_PATH_PROB} for a fetched "
                        f"model's lookahead head)")
    if sampling:
        s.add_argument("--width_threshold", type=finite_float, default=0.0,
                       help="DSBD dynamic width: largest k with P(#accepted >= k) >= this (0: fixed width)")
        s.add_argument("--min_num_beams", type=positive_int, default=1, help="DSBD width floor")
        s.add_argument("--single_sequence", action="store_true", help="DSBD memory-saving mode")


def speculative_from_args(args, *, draft: str | None, sample: bool = False) -> SpeculativeConfig | None:
    """The flags of add_speculation_args -> SpeculativeConfig, or None (plain search) without a draft model
    (`draft`, as the tool resolved it) unless --drafter lookup or ahead (no draft model), or with --no_draft and
    another drafter."""
    if args.drafter not in ("lookup", "ahead") and (args.no_draft or draft is None):
        return None
    return speculative_config(drafter=args.drafter or ("sample" if sample else "beam"), budget=args.budget,
                              max_depth=args.max_depth, max_branch_width=args.max_branch_width,
                              draft_width=args.draft_width, always_speculate=args.always_speculate,
                              width_threshold=getattr(args, "width_threshold", 0.0),
                              min_num_beams=getattr(args, "min_num_beams", 1),
                              single_sequence=getattr(args, "single_sequence", False),
                              min_path_prob=args.min_path_prob or 0.0, with_lookup=args.with_lookup)


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
