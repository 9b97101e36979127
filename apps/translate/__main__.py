"""specbeam-translate: offline batch translation, one output line per input line (CTranslate2-style flags).

    specbeam-translate -i input.en -o output.de --beam_size 4 --resume

Reads stdin or -i, writes stdout or -o; logs, progress and the summary go to stderr. Lines are decoded in
batches; each line is written as soon as it and every line before it are done. On stdout (flushed per line) an
interrupt keeps every line up to the first unfinished one; finished lines after it cannot be written to a
stream without breaking the line alignment, and the message says how many there were. With -o nothing finished
is lost: every finished line is journalled (fsynced) as it completes, an interrupted run continues with --resume
(the journal refuses a changed input, changed settings or changed model files), and the final file is written
through a temporary file (created exclusively in the output's folder) and renamed: byte-identical to an
uninterrupted run (with --with_score: the texts; the scores to about 1e-4, fp32 sums of passes whose size depends
on the batch), with the old output's permission bits. -o must be a regular file path (not a device, FIFO or
socket: stream through stdout instead) and never the input. A lock (<output>.lock, removed at the end) keeps a
second process off the same output. A UTF-8 BOM is dropped; LF, CRLF and CR all end a line.
--target_prefix FILE forces the start of each line's translation (one prefix a line, an empty line for none; the
output includes it); --alternatives N writes JSON lines instead of text: per input line the N most probable
tokens at the position after the prefix (or at the start), with their log-probs and each one's best translation.
--jsonl reads and writes JSON objects, a line each, with per-line prefix, terms and id (README "Batch translation").
--glossary TSV makes terminology appear: a line whose source contains a glossary term is translated with
lexically constrained beam search, so that one of the term's target forms appears (a line where it could not
fit is reported on stderr, never silently left out; so is, as a warning, a term joined to a neighbouring word,
'3-Arbeitsmappeder': list an inflected or compound form that is right as another target form).
--engine ray spreads the same work over a Ray cluster, one engine per actor, with the same output and resume
guarantee per shard (ray_engine.py).
Exit codes: 0 done, 1 failed (--on_error fail, I/O error while running), 2 usage or unusable input/model,
130 interrupted (SIGINT), 143 terminated (SIGTERM).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

from tqdm import tqdm

from specbeam_edge.commands.cli import ShortErrors
from specbeam_edge.config import ModelFolderError
from specbeam_edge.commands.flags import (DefaultsHelp, add_beam_arg, add_decoding_constraint_args, add_length_penalty_arg,
                                 add_memory_args, add_speculation_args, guard_std_streams, positive_int)
from specbeam_edge.execution.providers import ProviderError

from .files import InOrder, UsageError, check_output, read_file, read_input, read_prefixes, refuse_device, split_lines
from .job import (LABELS, NO_ALTERNATIVES, PROG, Settings, file_settings, journal_settings, jsonl_line, open_engine,
                  prepare, report_line, resolve, summary, translate)
from .journal import (Journal, JournalError, OutputLock, Terminated, finished_as, finished_note, lines_sha256,
                      raise_terminated)
from .jsonl import read_jsonl
from .ray_engine import add_ray_args, run_ray


class _Help(argparse.RawDescriptionHelpFormatter, DefaultsHelp):
    pass


def build_parser() -> argparse.ArgumentParser:
    ap = ShortErrors(prog=PROG, description=__doc__, formatter_class=_Help)
    add_io_args(ap)
    add_decoding_args(ap)
    add_forcing_args(ap)
    add_format_args(ap)
    add_run_args(ap)
    add_engine_args(ap)
    add_memory_args(ap)
    add_ray_args(ap)
    return ap


def add_io_args(ap: argparse.ArgumentParser) -> None:
    """Where the lines come from and go, and the model."""
    ap.add_argument("-i", "--input", default=None, help="input file, one sentence per line (default: stdin)")
    ap.add_argument("-o", "--output", default=None, help="output file (default: stdout)")
    ap.add_argument("--model", default=None,
                    help="target model folder (default: the shipped en->de pair's target, models/ende/target; "
                         "SPECBEAM_MODELS names another models/ folder)")


def add_decoding_args(ap: argparse.ArgumentParser) -> None:
    """Beam search, n-best, batching, lengths and languages."""
    add_beam_arg(ap, 4, first="--beam_size")
    ap.add_argument("--n_best", type=positive_int, default=1,
                    help="hypotheses written per input line (each on its own line)")
    ap.add_argument("--with_score", action="store_true",
                    help="write 'score ||| text' (the score: sum of log-probs over length ** length_penalty; stable "
                         "to about 1e-4 across batch sizes, resumes and speculation, the text exactly)")
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
    add_length_penalty_arg(ap)
    add_decoding_constraint_args(ap)


def add_forcing_args(ap: argparse.ArgumentParser) -> None:
    """What each translation must hold: a target prefix, glossary terms, markup copied verbatim."""
    ap.add_argument("--target_prefix", default=None, metavar="FILE",
                    help="the start of each translation, forced (CTranslate2's target_prefix): one prefix a line, "
                         "line k for input line k, an empty line for none; the output line includes it")
    ap.add_argument("--glossary", default=None, metavar="TSV",
                    help="terminology that must appear: 'source term<TAB>target term[<TAB>another form...]' a line; "
                         "a line whose source contains a source term (as a whole word) is translated with "
                         "constrained beam search so that one of its target forms appears (beam size >= 2); a "
                         "term joined to a neighbouring word is reported")
    ap.add_argument("--glossary_case", choices=("insensitive", "sensitive"), default="insensitive",
                    help="how source terms are matched in the source lines")
    ap.add_argument("--keep_markup", action=argparse.BooleanOptionalAction, default=None,
                    help="copy placeholders (%%s, {0}), tags, URLs, e-mail addresses, `code` and & accelerators "
                         "verbatim: each as often as in the source, a closing tag after its opening tag (default: "
                         "on with --beam_size 2 or more; a line where one could not be kept is reported)")
    ap.add_argument("--markup_pattern", action="append", default=None, metavar="REGEX",
                    help="another kind of span to copy verbatim (a regular expression; may be repeated)")


def add_format_args(ap: argparse.ArgumentParser) -> None:
    """JSON lines in and out, or the alternatives at one position instead of translations."""
    ap.add_argument("--jsonl", action="store_true",
                    help='JSON lines in and out: each input line {"text": ..., "target_prefix": ..., "terms": [...], '
                         '"id": ...} (only text required), each output line {"id", "translations": [{"text", '
                         '"score", "constraints_met"}, ... n_best], "problems": [...]}')
    ap.add_argument("--alternatives", type=positive_int, default=None, metavar="N",
                    help="write JSON lines, one object per input line: the N most probable tokens after the target "
                         "prefix (or at the start), each with its text, log-prob and best translation")


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """Bad lines, resume and scoring."""
    ap.add_argument("--on_error", choices=("skip", "copy", "fail"), default="skip",
                    help="a bad line (invalid UTF-8, over the model's context): write an empty line, copy the "
                         "source, or stop")
    ap.add_argument("--resume", action="store_true",
                    help="continue an interrupted run (needs -o); on a finished output it says so and does nothing, "
                         "or refuses it when that run had other input or settings")
    ap.add_argument("--eval", default=None, metavar="REF", help="print BLEU and chrF against this reference file")


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """Speculation, threads and what is printed on stderr."""
    add_speculation_args(ap, sampling=False,
                         draft_help="draft model folder (speculative beam search; default: the shipped en->de draft, "
                                    "only when --model is the default too; without a draft: plain beam search)")
    ap.add_argument("--threads", type=positive_int, default=None, help="onnxruntime intra-op threads")
    ap.add_argument("--stats", action="store_true", help="also print the aggregate statistics as JSON to stderr")
    ap.add_argument("-q", "--quiet", action="store_true",
                    help="no progress bar and no summary line (the bar is shown only when stderr is a terminal)")


def parse_args(argv):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.resume and not args.output:
        ap.error("--resume needs -o/--output (the journal lives next to the output file)")
    if args.n_best > args.num_beams:
        ap.error(f"--n_best ({args.n_best}) cannot exceed --beam_size ({args.num_beams})")
    if args.engine == "ray" and not (args.input and args.output):
        ap.error("--engine ray needs -i (a file, a folder or a glob) and -o (where the shards and outputs go)")
    if args.engine == "ray" and args.eval:
        ap.error("--eval reads one output; with --engine ray run it on the local engine, or score the output apart")
    if args.engine == "ray" and (args.target_prefix or args.alternatives):
        ap.error("--target_prefix and --alternatives run on the local engine (--engine local)")
    if args.glossary and args.num_beams < 2:
        ap.error("--glossary needs beam search: --beam_size 2 or more (4 or more is better)")
    if args.keep_markup and args.num_beams < 2:
        ap.error("--keep_markup needs beam search: --beam_size 2 or more (or --no-keep_markup)")
    if (args.glossary or args.keep_markup) and args.alternatives:
        ap.error("--alternatives ranks the model's own next tokens; --glossary and --keep_markup are for "
                 "translations")
    for rx in args.markup_pattern or ():
        try:
            re.compile(rx)
        except re.error as e:
            ap.error(f"--markup_pattern {rx!r} is not a regular expression ({e})")
    if args.jsonl:
        for flag, used in (("--target_prefix", args.target_prefix), ("--with_score", args.with_score),
                           ("--alternatives", args.alternatives), ("--eval", args.eval),
                           ("--engine ray", args.engine == "ray")):
            if used:
                ap.error(f"--jsonl carries prefixes and scores in its lines; {flag} is for text input and output")
    if args.alternatives:
        for flag, used in (("--n_best", args.n_best > 1), ("--with_score", args.with_score), ("--eval", args.eval)):
            if used:
                ap.error(f"--alternatives writes JSON lines (each alternative with its score); {flag} is for text "
                         f"output")
    return args


def run(args, writer: InOrder | None) -> int:
    """The run of the flags; `writer` takes the lines in order when the output is stdout."""
    s = resolve(args)
    if args.engine == "ray":
        return run_ray(args, s)
    check_output(args.output, args.input)
    if args.eval:                   # before the translation, not after it
        refuse_device(args.eval, "--eval")
    lines = split_lines(read_input(args.input))
    s = s.with_prefixes(*read_prefixes(args.target_prefix, len(lines)))
    sources, known_bad = lines, None
    if args.jsonl:                  # the sources, prefixes, terms and ids come from the lines
        sources, known_bad, prefixes, terms, ids = read_jsonl(lines)
        s = dataclasses.replace(s, jsonl=True, prefixes=tuple(prefixes), line_terms=tuple(terms), line_ids=tuple(ids))
    with OutputLock(Path(args.output)) if args.output else contextlib.nullcontext():
        if args.resume and finished(Path(args.output), len(lines) * (1 if args.jsonl else args.n_best)):
            check_finished(args, s, lines)
            return 0
        return run_locked(args, s, lines, writer, sources, known_bad)


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
    return True


def check_finished(args, s: Settings, lines: list[bytes]) -> None:
    """A finished output is taken as done by --resume only when the run that finished it had this input and these
    settings (its record in the cache folder: journal.finished_as); without a record, by its line count."""
    output = Path(args.output)
    recorded = finished_as(output, lines_sha256(lines), file_settings(s), LABELS)
    print(f"{PROG}: {finished_note(output, recorded)}", file=sys.stderr)


def run_locked(args, s: Settings, lines: list[bytes], writer: InOrder | None, sources: list[bytes] | None = None,
               known_bad: dict | None = None) -> int:
    """lines: the input (its hash keys the journal); sources: what is translated (the texts of --jsonl lines)."""
    engine = open_engine(args, s)
    sources = lines if sources is None else sources
    items, fixed, bad = prepared(args, s, engine, sources, known_bad)
    if items is None:
        print(f"{PROG}: stopping (--on_error fail)", file=sys.stderr)
        return 1
    journal = open_journal(args, s, engine, lines, fixed, writer)
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

    stats = translate_todo(args, s, engine, len(lines), todo, on_line, writer is not None, sources)
    if journal:
        journal.done.update(fixed)
        journal.finish(Path(args.output), len(lines), file_settings(s))
    if bad:
        print(f"{PROG}: {bad} bad line(s) handled by --on_error {args.on_error}", file=sys.stderr)
    if not args.quiet:      # lines of this run: every input line but those resumed (as the Ray engine counts)
        print(summary(stats, len(lines) - resumed, stats.seconds), file=sys.stderr)
    if args.stats:
        print(json.dumps(stats.as_dict()), file=sys.stderr)
    return evaluate(args, outputs, len(lines)) if args.eval else 0


def prepared(args, s: Settings, engine, sources: list[bytes], known_bad: dict | None):
    """prepare's (items, fixed outputs, bad count), the fixed outputs in the run's output format; items None when
    a bad line stops the run (--on_error fail)."""
    why: dict[int, list[str]] = {}

    def report(n, reason):
        why.setdefault(n - 1, []).append(reason)
        report_line(n, reason)
    items, fixed, bad = prepare(s, engine, sources, report=report, known_bad=known_bad)
    if items is None:
        return items, fixed, bad
    if args.alternatives:           # JSON lines: an empty or bad line has no alternatives
        fixed = {i: [NO_ALTERNATIVES] for i in fixed}
    if s.jsonl:                     # an empty line: no translation; a bad one: its copy (--on_error copy) or none
        fixed = {i: [jsonl_line(s, i, [{"text": t} for t in out[:1] if t], why.get(i, []))]
                 for i, out in fixed.items()}
    return items, fixed, bad


def open_journal(args, s: Settings, engine, lines: list[bytes], fixed: dict, writer: InOrder | None):
    """-o's journal (its notes said), or None for stdout, where the fixed outputs are written at once."""
    if not args.output:
        for i, out in fixed.items():
            writer.add(i, out)
        return None
    journal = Journal(Path(args.output), lines_sha256(lines),
                      journal_settings(s, engine.generation_config(**s.generation)), args.resume, labels=LABELS)
    for note in journal.notes:
        print(f"{PROG}: {note}", file=sys.stderr)
    return journal


def translate_todo(args, s: Settings, engine, n: int, todo, on_line, to_stdout: bool, sources: list[bytes]):
    """The lines still to do, with a progress bar over all n; their Stats, timed."""
    t0 = time.time()
    # no bar while translations print to the same terminal (it would break into their lines), nor into a file
    # or pipe (tqdm's disable=None: a redirected log gets no carriage-return updates); the summary stays
    progress = tqdm(total=n, initial=n - len(todo), unit="line", file=sys.stderr,
                    disable=True if args.quiet or (to_stdout and sys.stdout.isatty()) else None,
                    dynamic_ncols=True)
    try:
        stats = translate(s, engine, todo, on_line, progress, lines=sources)
    finally:
        progress.close()
    stats.seconds = time.time() - t0
    return stats


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
        ref = [line.decode("utf-8") for line in split_lines(read_file(args.eval, "--eval"))]
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
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


def kept(args, writer: InOrder | None) -> str:
    """On an interrupt: how many lines were kept (written to stdout in order, or recorded in -o's journal) and
    how to go on."""
    if writer is not None:
        return f"; {writer.next} line(s) written"
    if not args.output:
        return ""
    try:
        records = Path(args.output + ".journal").read_bytes().count(b"\n") - 1     # the header is one line
    except OSError:                 # stopped before the journal was started
        return "; finished lines are kept: rerun with --resume to continue"
    return f"; {max(records, 0)} finished line(s) kept in {args.output}.journal: rerun with --resume to continue"


def unwritten(writer: InOrder | None) -> str:
    """On an interrupt with stdout as the output: the finished lines that could not be written."""
    if writer is None or not writer.pending:
        return ""
    n = len(writer.pending)
    return (f"; line {writer.next + 1} was not finished, so {n} finished later line(s) could not be written "
            f"(stdout is a stream and keeps the lines in order): pass -o FILE to keep every finished line and "
            f"continue with --resume")


def main(argv=None) -> int:
    """Every failure ends as one line on stderr and an exit code (see the module docstring)."""
    guard_std_streams()
    args = parse_args(argv)
    writer = None if args.output or args.engine == "ray" else InOrder(sys.stdout.buffer)
    old = {sig: signal.signal(sig, raise_terminated) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return run(args, writer)
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted{kept(args, writer)}{unwritten(writer)}", file=sys.stderr)
        return 130
    except Terminated:
        print(f"\n{PROG}: terminated{kept(args, writer)}{unwritten(writer)}", file=sys.stderr)
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
        for sig, handler in old.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
