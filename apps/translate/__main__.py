"""specbeam-translate: offline batch translation, one output line per input line (CTranslate2-style flags).

    specbeam-translate -i input.en -o output.de --beam_size 4 --resume

Reads stdin or -i, writes stdout or -o; logs and progress go to stderr. With -o, results are journalled
(flushed and fsynced per batch) so an interrupted run continues with --resume, and the final file is written
through a temporary file and renamed: byte-identical to an uninterrupted run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from specbeam_edge.cli import DEFAULT_MODELS, add_memory_args, budget_arg, configs, engine_from_args
from specbeam_edge.config import ModelFolderError


class LineError(ValueError):
    pass


_BREAKS = str.maketrans({c: " " for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})


def one_line(text: str) -> str:
    """Output must stay one line per input line, whatever the model emits."""
    return text.translate(_BREAKS)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="specbeam-translate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-i", "--input", default=None, help="input file, one sentence per line (default: stdin)")
    ap.add_argument("-o", "--output", default=None, help="output file (default: stdout)")
    ap.add_argument("--model", default=str(DEFAULT_MODELS / "ende" / "target"), help="target model folder")
    ap.add_argument("--draft", default=str(DEFAULT_MODELS / "ende" / "draft"),
                    help="draft model folder (speculative beam search); --no_draft for plain beam search")
    ap.add_argument("--no_draft", action="store_true", help="plain beam search")
    ap.add_argument("--beam_size", type=int, default=4, help="beam width")
    ap.add_argument("--n_best", type=int, default=1, help="hypotheses written per input line (each on its own line)")
    ap.add_argument("--with_score", action="store_true", help="write 'score ||| text'")
    ap.add_argument("--batch_size", type=int, default=32, help="examples (or tokens) per batch")
    ap.add_argument("--batch_type", choices=("examples", "tokens"), default="examples",
                    help="batch_size counts examples or source tokens")
    ap.add_argument("--max_decoding_length", type=int, default=200, help="maximum generated tokens per line")
    ap.add_argument("--max_input_length", type=int, default=256, help="longer source lines (tokens) are errors")
    ap.add_argument("--length_penalty", type=float, default=None, help="score = sum logp / length ** this")
    ap.add_argument("--on_error", choices=("skip", "copy", "fail"), default="skip",
                    help="a bad line (invalid UTF-8, too long): write an empty line, copy the source, or stop")
    ap.add_argument("--resume", action="store_true", help="continue an interrupted run (needs -o)")
    ap.add_argument("--eval", default=None, metavar="REF", help="print BLEU and chrF against this reference file")
    s = ap.add_argument_group("speculation")
    s.add_argument("--drafter", choices=("beam", "best_first", "lookup"), default=None,
                   help="tree growth policy (default beam; lookup = prompt lookup, no draft model needed)")
    s.add_argument("--budget", type=budget_arg, default=48, help="draft tree nodes per target pass, or 'auto'")
    s.add_argument("--max_depth", type=int, default=6, help="tree levels below each beam")
    s.add_argument("--always_speculate", action="store_true",
                   help="draft on every pass; by default the tool measures both ways and drafts only while it pays "
                        "(the translations are the same)")
    s.add_argument("--max_branch_width", type=int, default=4, help="children per expanded draft node")
    s.add_argument("--draft_width", type=int, default=None, help="draft beam width W (default max(K, branch))")
    ap.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    ap.add_argument("--stats", action="store_true", help="print aggregate statistics (JSON) to stderr")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    add_memory_args(ap)
    args = ap.parse_args(argv)
    if args.resume and not args.output:
        ap.error("--resume needs -o/--output (the journal lives next to the output file)")
    if args.n_best > args.beam_size:
        ap.error(f"--n_best ({args.n_best}) cannot exceed --beam_size ({args.beam_size})")
    return args


class Journal:
    """Append-only record of finished lines: one JSON object per line, fsynced per batch."""

    def __init__(self, output: Path, resume: bool, meta: dict):
        self.path = output.with_name(output.name + ".journal")
        self.done: dict[int, list[str]] = {}
        if self.path.exists():
            if not resume:
                raise SystemExit(f"specbeam-translate: {self.path} exists from an interrupted run; "
                                 f"pass --resume to continue it, or delete it")
            lines = self.path.read_bytes().split(b"\n")
            head = json.loads(lines[0])
            if head != meta:
                raise SystemExit(f"specbeam-translate: {self.path} was written with other settings {head}; "
                                 f"delete it to start over")
            for raw in lines[1:]:
                try:
                    rec = json.loads(raw)
                    self.done[rec["i"]] = rec["out"]
                except (ValueError, KeyError):
                    break  # a torn last record from a crash: that line is redone
            self.f = open(self.path, "r+b")
            valid = b"\n".join(lines[:1 + len(self.done)]) + b"\n"
            self.f.truncate(len(valid))
            self.f.seek(len(valid))
        else:
            self.f = open(self.path, "wb")
            self.f.write(json.dumps(meta).encode() + b"\n")

    def add(self, items: list[tuple[int, list[str]]]):
        for i, out in items:
            self.f.write(json.dumps({"i": i, "out": out}, ensure_ascii=False).encode() + b"\n")
            self.done[i] = out
        self.f.flush()
        os.fsync(self.f.fileno())

    def finish(self, output: Path, n: int):
        tmp = output.with_name(output.name + ".tmp")
        with open(tmp, "wb") as f:
            for i in range(n):
                for line in self.done[i]:
                    f.write(line.encode("utf-8") + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, output)
        self.f.close()
        self.path.unlink()


def batches(items, size: int, by_tokens: bool):
    """Group (index, ids) items, sorted by length inside a window of 8 batches; yields lists of items."""
    window = max(1, size) * 8 if not by_tokens else 256
    for w in range(0, len(items), window):
        chunk = sorted(items[w:w + window], key=lambda it: len(it[1]))
        cur, cur_tokens = [], 0
        for it in chunk:
            n = len(it[1]) if by_tokens else 1
            if cur and cur_tokens + n > size:
                yield cur
                cur, cur_tokens = [], 0
            cur.append(it)
            cur_tokens += n
        if cur:
            yield cur


def progress(done, total, tokens, t0, quiet):
    if quiet:
        return
    el = time.time() - t0
    rate = tokens / el if el > 0 else 0.0
    eta = (total - done) * el / done if done else 0.0
    bar = "#" * int(30 * done / max(1, total))
    print(f"\r[{bar:<30}] {done}/{total} lines  {rate:6.1f} tok/s  ETA {eta:5.0f}s", end="", file=sys.stderr,
          flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    from specbeam_edge.generate import Stats

    raw = Path(args.input).read_bytes() if args.input else sys.stdin.buffer.read()
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    try:
        draft = None if args.no_draft else args.draft
        engine = engine_from_args(args, args.model, draft)
    except (ModelFolderError, ValueError) as e:
        print(f"specbeam-translate: error: {e}", file=sys.stderr)
        return 2
    args.num_beams = args.beam_size
    args.min_new_tokens = None
    args.early_stopping = None
    args.num_return_sequences = args.n_best
    args.max_new_tokens = args.max_decoding_length
    overrides, spec = configs(args)
    tok = engine.tokenizer

    # validate every line first: bad lines are reported with their numbers and handled by --on_error
    items, fixed, bad = [], {}, 0
    for i, b in enumerate(lines):
        try:
            text = b.decode("utf-8")
            ids = engine.encode(tok.format_prompt(text))
            n_src = len(tok.encode(text))
            if n_src > args.max_input_length:
                raise LineError(f"{n_src} tokens, over --max_input_length {args.max_input_length}")
            if len(ids) + 1 >= engine.target.cfg.context_length:
                raise LineError(f"{len(ids)} prompt tokens, over the model's context {engine.target.cfg.context_length}")
            if not text.strip():
                fixed[i] = [""] * args.n_best
                continue
            items.append((i, ids))
        except (UnicodeDecodeError, LineError) as e:
            bad += 1
            why = "invalid UTF-8" if isinstance(e, UnicodeDecodeError) else str(e)
            print(f"specbeam-translate: line {i + 1}: {why}", file=sys.stderr)
            if args.on_error == "fail":
                print(f"specbeam-translate: stopping (--on_error fail)", file=sys.stderr)
                return 1
            copy = one_line(b.decode("utf-8", errors="replace")) if args.on_error == "copy" else ""
            fixed[i] = [copy] * args.n_best

    meta = {"input_lines": len(lines), "model": str(args.model), "draft": str(draft), "beam_size": args.beam_size,
            "n_best": args.n_best, "with_score": args.with_score, "overrides": overrides,
            "spec": None if spec is None else asdict(spec)}
    journal = Journal(Path(args.output), args.resume, meta) if args.output else None
    if journal:
        todo = [it for it in items if it[0] not in journal.done]
        if len(todo) < len(items):
            print(f"specbeam-translate: resuming, {len(items) - len(todo)} lines already done", file=sys.stderr)
    else:
        todo = items
    total = Stats()
    results: dict[int, list[str]] = dict(fixed)
    t0, done = time.time(), len(lines) - len(todo)
    try:
        for batch in batches(todo, args.batch_size, args.batch_type == "tokens"):
            out = engine.generate([ids for _, ids in batch], speculative=spec, **overrides)
            recs = []
            for (i, _), res in zip(batch, out):
                hyps = [f"{h.score:.4f} ||| {h.text}" if args.with_score else h.text for h in res.hypotheses]
                hyps = [one_line(h) for h in hyps]
                recs.append((i, hyps))
                total.add(res.stats)
            done += len(batch)
            if journal:
                journal.add(recs)
            else:
                results.update(recs)
            progress(done, len(lines), total.generated_tokens, t0, args.quiet)
    except KeyboardInterrupt:
        print("\nspecbeam-translate: interrupted" + ("; rerun with --resume to continue" if journal else ""),
              file=sys.stderr)
        return 130
    if not args.quiet:
        print(file=sys.stderr)
    if journal:
        journal.add([(i, v) for i, v in fixed.items() if i not in journal.done])
        journal.finish(Path(args.output), len(lines))
    else:
        for i in range(len(lines)):
            for line in results[i]:
                sys.stdout.write(line + "\n")
        sys.stdout.flush()
    total.seconds = time.time() - t0
    if bad:
        print(f"specbeam-translate: {bad} bad line(s) handled by --on_error {args.on_error}", file=sys.stderr)
    if args.stats:
        print(json.dumps(total.as_dict()), file=sys.stderr)
    if args.eval:
        return evaluate(args, lines, results if not journal else None)
    return 0


def evaluate(args, lines, results) -> int:
    try:
        import sacrebleu
    except ImportError:
        print("specbeam-translate: --eval needs sacrebleu (pip install sacrebleu)", file=sys.stderr)
        return 2
    if results is None:
        hyp = Path(args.output).read_text("utf-8").splitlines()
    else:
        hyp = [results[i][0] for i in range(len(lines))]
    if args.n_best > 1:
        hyp = hyp[:: args.n_best]
    if args.with_score:
        hyp = [h.split(" ||| ", 1)[-1] for h in hyp]
    ref = Path(args.eval).read_text("utf-8").splitlines()
    if len(ref) != len(hyp):
        print(f"specbeam-translate: --eval: {len(ref)} reference lines for {len(hyp)} outputs", file=sys.stderr)
        return 2
    bleu = sacrebleu.corpus_bleu(hyp, [ref])
    chrf = sacrebleu.corpus_chrf(hyp, [ref])
    print(f"BLEU {bleu.score:.2f}  chrF {chrf.score:.2f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
