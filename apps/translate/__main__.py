"""specbeam-translate: offline batch translation, one output line per input line (CTranslate2-style flags).

    specbeam-translate -i input.en -o output.de --beam_size 4 --resume

Reads stdin or -i, writes stdout or -o; logs, progress and the summary go to stderr. Lines are decoded in
batches; each line is written as soon as it and every line before it are done. On stdout (flushed per line) an
interrupt keeps every line up to the first unfinished one; finished lines after it cannot be written to a
stream without breaking the line alignment, and the message says how many there were. With -o nothing finished
is lost: every finished line is journalled (fsynced) as it completes, an interrupted run continues with --resume
(the journal refuses a changed input, changed settings or changed model files), and the final file is written
through a temporary file (created exclusively in the output's folder) and renamed: byte-identical to an
uninterrupted run, with the old output's permission bits. -o must be a regular file path (not a device, FIFO or
socket: stream through stdout instead) and never the input. A lock (<output>.lock, removed at the end) keeps a
second process off the same output. A UTF-8 BOM is dropped; LF, CRLF and CR all end a line.
--target_prefix FILE forces the start of each line's translation (one prefix a line, an empty line for none; the
output includes it); --alternatives N writes JSON lines instead of text: per input line the N most probable
tokens at the position after the prefix (or at the start), with their log-probs and each one's best translation.
--engine ray spreads the same work over a Ray cluster, one engine per actor, with the same output and resume
guarantee per shard (ray_engine.py).
Exit codes: 0 done, 1 failed (--on_error fail, I/O error while running), 2 usage or unusable input/model,
130 interrupted (SIGINT), 143 terminated (SIGTERM).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import json
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from specbeam_edge.config import DEFAULT_BUDGET, ModelFolderError
from specbeam_edge.flags import (DRAFT_WIDTH_HELP, DefaultsHelp, add_decoding_constraint_args, add_memory_args,
                                 budget_arg, check_prompt_format, check_widths, decoding_constraints, engine_from_args,
                                 finite_float, guard_std_streams, positive_int, speculative_config)

from .journal import Journal, JournalError, OutputLock, Terminated, special_kind
from .ray_engine import add_ray_args

PROG = "specbeam-translate"


class LineError(ValueError):
    pass


class UsageError(ValueError):
    """Bad arguments or unusable input found after parsing: exit code 2, one line. A ValueError so that main
    catches it also when raised by apps.translate.__main__ imported a second time (python -m runs this file as
    __main__; ray_engine imports it by name)."""


_BREAKS = str.maketrans({c: " " for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})


def one_line(text: str) -> str:
    """Output must stay one line per input line, whatever the model emits."""
    return text.translate(_BREAKS)


class _Help(argparse.RawDescriptionHelpFormatter, DefaultsHelp):
    pass


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=_Help)
    ap.add_argument("-i", "--input", default=None, help="input file, one sentence per line (default: stdin)")
    ap.add_argument("-o", "--output", default=None, help="output file (default: stdout)")
    ap.add_argument("--model", default=None,
                    help="target model folder (default: the shipped en->de pair's target, models/ende/target; "
                         "SPECBEAM_MODELS names another models/ folder)")
    ap.add_argument("--draft", default=None,
                    help="draft model folder (speculative beam search; default: the shipped en->de draft, only "
                         "when --model is the default too; without a draft: plain beam search)")
    ap.add_argument("--no_draft", action="store_true",
                    help="no draft model: plain beam search (with --drafter lookup: prompt lookup alone)")
    ap.add_argument("--beam_size", "--num_beams", dest="beam_size", type=positive_int, default=4,
                    help="beam width")
    ap.add_argument("--n_best", type=positive_int, default=1,
                    help="hypotheses written per input line (each on its own line)")
    ap.add_argument("--with_score", action="store_true", help="write 'score ||| text'")
    ap.add_argument("--batch_size", type=positive_int, default=32,
                    help="lines (or tokens, see --batch_type) decoded together")
    ap.add_argument("--batch_type", choices=("examples", "tokens"), default="examples",
                    help="batch_size counts lines, or the tokens held by the batch (prompt + generated)")
    ap.add_argument("--max_decoding_length", type=positive_int, default=200, help="maximum generated tokens per line")
    ap.add_argument("--max_input_length", type=positive_int, default=256,
                    help="source lines longer than this (tokens) are truncated to it, as CTranslate2 does (each one "
                         "reported on stderr)")
    ap.add_argument("--src_lang", default=None,
                    help="source language code of an NLLB/M2M100 model (e.g. eng_Latn, en): put into every source")
    ap.add_argument("--tgt_lang", default=None,
                    help="target language code of an NLLB/M2M100 model (e.g. deu_Latn, de): the forced first token "
                         "(default: the model's forced_bos_token_id)")
    ap.add_argument("--length_penalty", type=finite_float, default=None,
                    help="score = sum logp / length ** this (default: the model's)")
    add_decoding_constraint_args(ap)
    ap.add_argument("--target_prefix", default=None, metavar="FILE",
                    help="the start of each translation, forced (CTranslate2's target_prefix): one prefix a line, "
                         "line k for input line k, an empty line for none; the output line includes it")
    ap.add_argument("--alternatives", type=positive_int, default=None, metavar="N",
                    help="write JSON lines, one object per input line: the N most probable tokens after the target "
                         "prefix (or at the start), each with its text, log-prob and best translation")
    ap.add_argument("--on_error", choices=("skip", "copy", "fail"), default="skip",
                    help="a bad line (invalid UTF-8, over the model's context): write an empty line, copy the "
                         "source, or stop")
    ap.add_argument("--resume", action="store_true",
                    help="continue an interrupted run (needs -o); on a finished output it says so and does nothing")
    ap.add_argument("--eval", default=None, metavar="REF", help="print BLEU and chrF against this reference file")
    s = ap.add_argument_group("speculation")
    s.add_argument("--drafter", choices=("beam", "best_first", "lookup"), default="beam",
                   help="tree growth policy (lookup = prompt lookup, no draft model needed)")
    s.add_argument("--budget", type=budget_arg, default=DEFAULT_BUDGET,
                   help="draft tree nodes per target pass, or 'auto'")
    s.add_argument("--max_depth", type=positive_int, default=6, help="tree levels below each beam")
    s.add_argument("--always_speculate", action="store_true",
                   help="draft on every pass; by default the tool measures both ways and drafts only while it pays "
                        "(the translations are the same)")
    s.add_argument("--max_branch_width", type=positive_int, default=4, help="children per expanded draft node")
    s.add_argument("--draft_width", type=positive_int, default=None, help=DRAFT_WIDTH_HELP)
    s.add_argument("--with_lookup", action="store_true",
                   help="also put prompt-lookup spans (copied names, numbers, markup) into the draft model's tree, "
                        "the budget split by measured acceptance")
    s.add_argument("--min_path_prob", type=float, default=0.0,
                   help="stop a draft branch once the draft's probability of its path from the beam falls below this "
                        "(0: grow every level up to --max_depth)")
    ap.add_argument("--threads", type=positive_int, default=None, help="onnxruntime intra-op threads")
    ap.add_argument("--stats", action="store_true", help="also print the aggregate statistics as JSON to stderr")
    ap.add_argument("-q", "--quiet", action="store_true",
                    help="no progress bar and no summary line (the bar is shown only when stderr is a terminal)")
    add_memory_args(ap)
    add_ray_args(ap)
    return ap


def parse_args(argv):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.resume and not args.output:
        ap.error("--resume needs -o/--output (the journal lives next to the output file)")
    if args.n_best > args.beam_size:
        ap.error(f"--n_best ({args.n_best}) cannot exceed --beam_size ({args.beam_size})")
    if args.engine == "ray" and not (args.input and args.output):
        ap.error("--engine ray needs -i (a file, a folder or a glob) and -o (where the shards and outputs go)")
    if args.engine == "ray" and args.eval:
        ap.error("--eval reads one output; with --engine ray run it on the local engine, or score the output apart")
    if args.engine == "ray" and (args.target_prefix or args.alternatives):
        ap.error("--target_prefix and --alternatives run on the local engine (--engine local)")
    if args.alternatives:
        for flag, used in (("--n_best", args.n_best > 1), ("--with_score", args.with_score), ("--eval", args.eval)):
            if used:
                ap.error(f"--alternatives writes JSON lines (each alternative with its score); {flag} is for text "
                         f"output")
    return args


def generation_overrides(args) -> dict:
    """This tool's flags -> GenerationConfig overrides (the rest come from the model's defaults)."""
    out = dict(num_beams=args.beam_size, num_return_sequences=args.n_best, max_new_tokens=args.max_decoding_length)
    if args.length_penalty is not None:
        out["length_penalty"] = args.length_penalty
    return {**out, **decoding_constraints(args)}


def resolve_models(args) -> None:
    """The shipped pair is the default only as a pair: its draft applies only to its own target. Another
    --model without --draft runs plain beam search; --drafter lookup needs no draft model (none is loaded)."""
    from specbeam_edge.shipped import shipped

    if getattr(args, "models_resolved", False):
        return
    if args.model is None:
        args.model = str(shipped("ende", "target"))
        if args.draft is None and not args.no_draft and args.drafter != "lookup":
            args.draft = str(shipped("ende", "draft"))
    if args.no_draft or args.drafter == "lookup":
        args.draft = None
    args.models_resolved = True


def speculation(args):
    """The speculative settings: None (plain beam search) without a draft model, unless --drafter lookup."""
    if args.draft is None and args.drafter != "lookup":
        return None
    return speculative_config(drafter=args.drafter, budget=args.budget, max_depth=args.max_depth,
                              max_branch_width=args.max_branch_width, draft_width=args.draft_width,
                              min_path_prob=args.min_path_prob, always_speculate=args.always_speculate,
                              with_lookup=args.with_lookup)


# -- input and output ---------------------------------------------------------------------------------------
def read_input(args) -> bytes:
    if args.input is None:
        if sys.stdin is None:
            raise UsageError("stdin is closed; pass -i FILE")
        try:
            return sys.stdin.buffer.read()
        except OSError as e:
            raise UsageError(f"cannot read stdin ({e.strerror or e}); pass -i FILE") from None
    path = Path(args.input)
    if path.is_dir():
        raise UsageError(f"input {path} is a directory; pass a text file, one sentence per line")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise UsageError(f"cannot read input {path}: {e.strerror}") from None


BOM = b"\xef\xbb\xbf"


def split_lines(raw: bytes) -> list[bytes]:
    """Lines as `wc -l` counts them, with universal newlines: LF, CRLF and a lone CR (old Mac files) each end a
    line and never reach the model; a UTF-8 byte order mark before line 1 is dropped."""
    if raw.startswith(BOM):
        raw = raw[len(BOM):]
    return raw.splitlines()          # bytes.splitlines: \n, \r\n and \r only (U+2028 etc. stay in the line)


def read_prefixes(args, n: int) -> list[str] | None:
    """--target_prefix FILE: one prefix per input line ('' for none), read as the input is (universal newlines,
    a BOM dropped); keeps the raw lines in args.prefix_lines for the journal."""
    if not args.target_prefix:
        return None
    path = Path(args.target_prefix)
    try:
        raw = split_lines(path.read_bytes())
    except OSError as e:
        raise UsageError(f"cannot read --target_prefix {path}: {e.strerror or e}") from None
    if len(raw) != n:
        raise UsageError(f"--target_prefix {path} has {len(raw)} line{'s' * (len(raw) != 1)}, the input has {n}: "
                         f"give one prefix per input line (an empty line for none)")
    out = []
    for k, b in enumerate(raw):
        try:
            out.append(b.decode("utf-8"))
        except UnicodeDecodeError:
            raise UsageError(f"--target_prefix {path}: line {k + 1} is not valid UTF-8") from None
    args.prefix_lines = raw
    return out


def check_output(args) -> None:
    """Fail before the model loads (seconds) rather than after the translation (minutes)."""
    if args.output is None:
        if sys.stdout is None:
            raise UsageError("stdout is closed; pass -o FILE")
        return
    out = Path(args.output)
    if out.is_dir():
        raise UsageError(f"output {out} is a directory; pass a file path")
    kind = special_kind(out)
    if kind:
        raise UsageError(f"output {out} is {kind}, which would be replaced by a regular file; to stream the "
                         f"translation, leave out -o and redirect stdout")
    if not out.parent.is_dir():
        raise UsageError(f"the output's directory {out.parent} does not exist; create it first")
    if getattr(args, "input", None) and same_file(Path(args.input), out):
        raise UsageError(f"output {out} is the input {args.input}: the translation would replace the source; "
                         f"write to another -o")


def same_file(a: Path, b: Path) -> bool:
    """The same file (hard links and symlinks included), or the same path once resolved."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def settings(args, generation) -> dict:
    """What decides the output's bytes (speculation knobs do not: the output is the same), for the journal;
    `generation` is the GenerationConfig the run decodes with."""
    from .fingerprint import folder_sha256

    gen = asdict(generation)
    gen["eos_token_id"] = list(gen["eos_token_id"]) if isinstance(gen["eos_token_id"], tuple) else gen["eos_token_id"]
    # the target folder's files (weights, layer files, encoder, tokenizer, config) by SHA-256: a model replaced
    # between the interrupt and --resume is refused. The draft is left out on purpose: speculation is exact, the
    # output does not depend on it (a resume with another draft, or none, gives the same bytes).
    prefixes = getattr(args, "prefix_lines", None)
    return {"model": str(Path(args.model).resolve()), "model_files": folder_sha256(Path(args.model)),
            "generation": gen, "with_score": args.with_score, "max_input_length": args.max_input_length,
            "on_error": args.on_error,
            **({"languages": [args.src_lang, args.tgt_lang]} if args.src_lang or args.tgt_lang else {}),
            # the prefix file by its lines' SHA-256 (as the input): a changed prefix is a changed setting
            **({"target_prefix": hashlib.sha256(b"\n".join(prefixes)).hexdigest()} if prefixes is not None else {}),
            **({"alternatives": args.alternatives} if getattr(args, "alternatives", None) else {})}


# settings as the flags name them, for a refused --resume ("beam_size: 4 in the journal, 5 now")
LABELS = {"generation.num_beams": "beam_size", "generation.num_return_sequences": "n_best",
          "generation.max_new_tokens": "max_decoding_length", "generation.length_penalty": "length_penalty",
          "languages": "src_lang/tgt_lang", "target_prefix": "target_prefix (the file's contents)"}


class InOrder:
    """Writes each input line's outputs as soon as it and all lines before it are done; flushes per line.
    `pending` holds finished lines waiting behind an unfinished one (a stream cannot take them out of order)."""

    def __init__(self, stream):
        self.stream, self.next, self.pending = stream, 0, {}

    def add(self, i: int, out: list[str]) -> None:
        self.pending[i] = out
        while self.next in self.pending:
            for line in self.pending.pop(self.next):
                self.stream.write(line.encode("utf-8") + b"\n")
            self.stream.flush()
            self.next += 1


# -- the run ------------------------------------------------------------------------------------------------
def report_line(number: int, why: str, where: str = "") -> None:
    """A bad input line on stderr: number counts from 1 in its file (`where`, when there are several)."""
    print(f"{PROG}: {where + ': ' if where else ''}line {number}: {why}", file=sys.stderr)


def truncated(tok, text: str, src: list[int], n: int) -> str:
    """The text of the first n source tokens (CTranslate2's --max_input_length truncates; it never drops)."""
    cut = tok.decode_stable(src[:n])
    while cut and len(tok.encode(cut)) > n:        # re-encoding a prefix can merge differently at its end
        cut = cut[:-1]
    return cut


def prepare(args, engine, lines: list[bytes], first: int = 0, report=report_line):
    """Validate every line first: returns (items to translate [(index, ids)], fixed outputs {index: lines},
    number of bad lines); bad lines are reported, report(line number, why), and handled by --on_error;
    truncated lines are reported the same way (and translated). `first` is the input line index of lines[0]
    (a shard of a larger input)."""
    tok, ctx = engine.tokenizer, engine.target.cfg.context_length
    items, fixed, bad = [], {}, 0
    for i, b in enumerate(lines):
        try:
            text = b.decode("utf-8")
            if not text.strip():
                fixed[i] = [""] * args.n_best
                continue
            src = tok.encode(text)
            if len(src) > args.max_input_length:
                text = truncated(tok, text, src, args.max_input_length)
                report(first + i + 1, f"{len(src)} tokens, truncated to the first {args.max_input_length} "
                                      f"(--max_input_length)")
            ids = engine.encode(tok.format_prompt(text), src_lang=args.src_lang)
            if len(ids) + 1 >= ctx:
                overhead = len(ids) - len(tok.encode(text))        # the prompt format's own tokens
                raise LineError(f"{len(ids)} prompt tokens, over the model's context {ctx}; pass a smaller "
                                f"--max_input_length (at most {max(1, ctx - 2 - overhead)})")
            items.append((i, ids))
        except (UnicodeDecodeError, LineError) as e:
            bad += 1
            why = "invalid UTF-8" if isinstance(e, UnicodeDecodeError) else str(e)
            report(first + i + 1, why)
            if args.on_error == "fail":
                return None, None, bad
            copy = one_line(b.decode("utf-8", errors="replace")) if args.on_error == "copy" else ""
            fixed[i] = [copy] * args.n_best
    return items, fixed, bad


def alternatives_line(alts) -> str:
    """--alternatives output for one input line: a JSON object (no newline inside)."""
    return json.dumps({"alternatives": [
        {"token": a.token, "token_id": a.token_id, "logprob": round(a.logprob, 6), "text": one_line(a.text),
         "score": round(a.hypothesis.score, 6)} for a in alts]}, ensure_ascii=False)


NO_ALTERNATIVES = json.dumps({"alternatives": []})      # an empty or bad input line in --alternatives mode


def translate(args, engine, todo, on_line, progress, first: int = 0, report=report_line):
    """Decode `todo` [(index, ids)] in batches; on_line(index, outputs) as each line completes. A translation
    that ran into the model's context (not --max_decoding_length) is reported: report(line number, why)."""
    from specbeam_edge.generate import Stats

    ctx = engine.target.cfg.context_length
    total = Stats()
    by_tokens = args.batch_type == "tokens"
    prefixes = getattr(args, "prefixes", None)
    prefix = [prefixes[first + i] or None for i, _ in todo] if prefixes is not None else None
    if args.alternatives:           # one line at a time: its N continuations are the batch
        for k, (i, ids) in enumerate(todo):
            alts = engine.alternatives(ids, prefix[k] if prefix else None, args.alternatives,
                                       speculative=speculation(args), tgt_lang=args.tgt_lang,
                                       max_batch_size=args.batch_size if not by_tokens else args.alternatives,
                                       **generation_overrides(args))
            on_line(i, [alternatives_line(alts)])
            progress.update(1)
        return total
    results = engine.generate_iter([ids for _, ids in todo], speculative=speculation(args), tgt_lang=args.tgt_lang,
                                   max_batch_size=args.batch_size if not by_tokens else max(1, len(todo)),
                                   max_batch_tokens=args.batch_size if by_tokens else None,
                                   target_prefix=prefix, **generation_overrides(args))
    for k, res in results:
        room = ctx - len(todo[k][1])
        if engine.encoder is None and room < args.max_decoding_length and \
                any(len(h.tokens) >= room for h in res.hypotheses):
            report(first + todo[k][0] + 1, f"the translation reached the model's context ({ctx} tokens) after "
                                           f"{room} tokens and may be cut; shorten the line or pass a smaller "
                                           f"--max_input_length")
        hyps = [f"{h.score:.4f} ||| {h.text}" if args.with_score else h.text for h in res.hypotheses]
        on_line(todo[k][0], [one_line(h) for h in hyps])
        total.add(res.stats)
        progress.update(1)
        progress.set_postfix_str(f"{total.generated_tokens} tok", refresh=False)
    return total


def summary(stats, lines: int, seconds: float) -> str:
    tok = stats.generated_tokens
    return (f"{PROG}: {lines} lines, {tok} tokens in {seconds:.1f} s ({lines / max(seconds, 1e-9):.2f} lines/s, "
            f"{tok / max(seconds, 1e-9):.1f} tok/s); {stats.target_passes} target passes, "
            f"{stats.beam_steps_per_pass:.2f} beam steps per pass")


def run(args) -> int:
    resolve_models(args)
    if args.engine == "ray":
        from .ray_engine import run_ray
        return run_ray(args)
    check_output(args)
    lines = split_lines(read_input(args))
    args.prefixes = read_prefixes(args, len(lines))
    with OutputLock(Path(args.output)) if args.output else contextlib.nullcontext():
        if args.resume and finished(Path(args.output), len(lines) * args.n_best):
            return 0
        return run_locked(args, lines)


def finished(output: Path, n_out: int) -> bool:
    """--resume on an output whose run finished (no journal left): True after saying so; a file that is not
    this input's finished output (another line count) is refused rather than taken as done."""
    journal = output.with_name(output.name + ".journal")
    if journal.exists() or not output.exists():
        return False
    with open(output, "rb") as f:
        have = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    if have != n_out:
        raise UsageError(f"{output} exists without a journal and holds {have} lines, not the {n_out} of a "
                         f"finished run on this input; delete it (or drop --resume) to translate again")
    print(f"{PROG}: {output} is complete (its run finished); nothing to do", file=sys.stderr)
    return True


def open_engine(args):
    """The engine of the flags, with the flags checked against it (tree widths within the vocabulary)."""
    engine = engine_from_args(args, args.model, args.draft)
    engine.generation_config(**generation_overrides(args))       # bad settings fail before any work
    if speculation(args) is not None:
        check_widths(engine, args.max_branch_width, args.draft_width)
    check_prompt_format(engine, args.model)
    return engine


def run_locked(args, lines: list[bytes]) -> int:
    from tqdm import tqdm

    engine = open_engine(args)
    items, fixed, bad = prepare(args, engine, lines)
    if items is None:
        print(f"{PROG}: stopping (--on_error fail)", file=sys.stderr)
        return 1
    if args.alternatives:           # JSON lines: an empty or bad line has no alternatives
        fixed = {i: [NO_ALTERNATIVES] for i in fixed}
    journal = writer = None
    if args.output:
        journal = Journal(Path(args.output), hashlib.sha256(b"\n".join(lines)).hexdigest(),
                          settings(args, engine.generation_config(**generation_overrides(args))), args.resume,
                          labels=LABELS)
        for note in journal.notes:
            print(f"{PROG}: {note}", file=sys.stderr)
    else:
        writer = args.stdout_writer = InOrder(sys.stdout.buffer)
        for i, out in fixed.items():
            writer.add(i, out)
    todo = [it for it in items if not journal or it[0] not in journal.done]
    resumed = len(items) - len(todo)
    if resumed:
        print(f"{PROG}: resuming, {resumed} lines already done", file=sys.stderr)
    outputs: dict[int, list[str]] = dict(fixed) if writer else journal.done

    def on_line(i, out):
        if journal:
            journal.add(i, out)
        else:
            outputs[i] = out
            writer.add(i, out)

    t0 = time.time()
    # no bar while translations print to the same terminal (it would break into their lines), nor into a file
    # or pipe (tqdm's disable=None: a redirected log gets no carriage-return updates); the summary stays
    progress = tqdm(total=len(lines), initial=len(lines) - len(todo), unit="line", file=sys.stderr,
                    disable=True if args.quiet or (writer is not None and sys.stdout.isatty()) else None,
                    dynamic_ncols=True)
    try:
        stats = translate(args, engine, todo, on_line, progress)
    finally:
        progress.close()
    stats.seconds = time.time() - t0
    if journal:
        journal.done.update(fixed)
        journal.finish(Path(args.output), len(lines))
    if bad:
        print(f"{PROG}: {bad} bad line(s) handled by --on_error {args.on_error}", file=sys.stderr)
    if not args.quiet:      # lines of this run: every input line but those resumed (as the Ray engine counts)
        print(summary(stats, len(lines) - resumed, stats.seconds), file=sys.stderr)
    if args.stats:
        print(json.dumps(stats.as_dict()), file=sys.stderr)
    return evaluate(args, outputs, len(lines)) if args.eval else 0


def evaluate(args, outputs: dict[int, list[str]], n: int) -> int:
    try:
        import sacrebleu
    except ImportError:
        print(f"{PROG}: --eval needs sacrebleu (pip install sacrebleu)", file=sys.stderr)
        return 2
    hyp = [outputs[i][0] for i in range(n)]
    if args.with_score:
        hyp = [h.split(" ||| ", 1)[-1] for h in hyp]
    try:
        ref = [line.decode("utf-8") for line in split_lines(Path(args.eval).read_bytes())]
    except (OSError, UnicodeDecodeError) as e:
        print(f"{PROG}: --eval: cannot read {args.eval} ({getattr(e, 'strerror', None) or e})", file=sys.stderr)
        return 2
    if len(ref) != len(hyp):
        print(f"{PROG}: --eval: {len(ref)} reference lines for {len(hyp)} outputs", file=sys.stderr)
        return 2
    bleu = sacrebleu.corpus_bleu(hyp, [ref])
    chrf = sacrebleu.corpus_chrf(hyp, [ref])
    print(f"BLEU {bleu.score:.2f}  chrF {chrf.score:.2f}", file=sys.stderr)
    return 0


def _terminate(signum, frame):
    raise Terminated()


def unwritten(args) -> str:
    """On an interrupt with stdout as the output: the finished lines that could not be written."""
    writer = getattr(args, "stdout_writer", None)
    if writer is None or not writer.pending:
        return ""
    n = len(writer.pending)
    return (f"; line {writer.next + 1} was not finished, so {n} finished later line(s) could not be written "
            f"(stdout is a stream and keeps the lines in order): pass -o FILE to keep every finished line and "
            f"continue with --resume")


def main(argv=None) -> int:
    """Every failure ends as one line on stderr and an exit code (see the module docstring)."""
    from specbeam_edge.providers import ProviderError

    guard_std_streams()
    args = parse_args(argv)
    old = signal.signal(signal.SIGTERM, _terminate)
    done_hint = "; finished lines are kept: rerun with --resume to continue" if args.output else ""
    try:
        return run(args)
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted{done_hint}{unwritten(args)}", file=sys.stderr)
        return 130
    except Terminated:
        print(f"\n{PROG}: terminated{done_hint}{unwritten(args)}", file=sys.stderr)
        return 143
    except (UsageError, JournalError, ModelFolderError, ProviderError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:         # the reader went away (e.g. `| head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # so the exit-time flush stays quiet
        return 141
    except OSError as e:
        where = f" ({e.filename})" if e.filename else ""
        print(f"{PROG}: error: {e.strerror or e}{where}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, old)


if __name__ == "__main__":
    sys.exit(main())
