"""The translate tool as a library: what the flags decide (Settings, resolved once per run) and the journal's
record of it, line validation and batched translation. Its neighbours: files.py (the input, the output checks),
jsonl.py (--jsonl input), glossary.py (--glossary). `__main__.py` (the command line, the local run) and
`ray_engine.py` (shards on a Ray cluster) both import it at the top; it imports neither of them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from specbeam_edge.config import GenerationConfig, ModelConfig, SpeculativeConfig
from specbeam_edge.commands.flags import (check_prompt_format, check_widths, decoding_constraints, engine_from_args,
                                 speculative_from_args)
from specbeam_edge.text.markup import emptied, find_spans, markup_constraints, out_of_order, survives
from specbeam_edge.results import Stats
from specbeam_edge.shipped import shipped

from .fingerprint import folder_sha256
from .glossary import glossary_constraints, joined_terms, read_glossary

PROG = "specbeam-translate"


class LineError(ValueError):
    pass


_BREAKS = str.maketrans({c: " " for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})


def one_line(text: str) -> str:
    """Output must stay one line per input line, whatever the model emits."""
    return text.translate(_BREAKS)


# -- what the flags decide -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    """One run's settings, resolved once from the flags (the Ray workers get a copy): the model pair, the
    generation overrides, the speculative settings and how lines are validated, batched and written."""
    model: str
    draft: str | None
    generation: dict                    # GenerationConfig overrides (the rest are the model's defaults)
    speculative: SpeculativeConfig | None
    n_best: int
    with_score: bool
    max_input_length: int
    on_error: str
    batch_size: int
    batch_type: str
    src_lang: str | None = None
    tgt_lang: str | None = None
    alternatives: int | None = None
    prefixes: tuple[str, ...] | None = None     # per input line ('' for none), from --target_prefix
    prefix_sha256: str | None = None            # of the prefix file's lines, for the journal
    glossary: tuple = ()                        # (source term, target forms) from --glossary
    glossary_case: str = "insensitive"
    glossary_sha256: str | None = None          # of the glossary file and its case setting, for the journal
    keep_markup: bool = False                   # copied spans (placeholders, tags, URLs...) as constraints
    markup_patterns: tuple[str, ...] = ()       # --markup_pattern: more kinds of span
    jsonl: bool = False                         # --jsonl: JSON objects in and out, a line each
    line_terms: tuple | None = None             # per input line: its own constraints ("terms" in --jsonl input)
    line_ids: tuple | None = None               # per input line: its "id" (--jsonl), given back with its output

    def with_prefixes(self, lines: list[bytes] | None, texts: list[str] | None) -> Settings:
        if lines is None:
            return self
        return dataclasses.replace(self, prefixes=tuple(texts),
                                   prefix_sha256=hashlib.sha256(b"\n".join(lines)).hexdigest())

    def with_glossary(self, path: str | None, case: str) -> Settings:
        """--glossary FILE, read once: its terms, and its SHA-256 (with the case setting) for the journal."""
        if not path:
            return self
        raw, terms = read_glossary(path)
        return dataclasses.replace(self, glossary=tuple(terms), glossary_case=case,
                                   glossary_sha256=hashlib.sha256(case.encode() + b"\0" + raw).hexdigest())

    @property
    def constrained(self) -> bool:
        return bool(self.glossary) or self.keep_markup


def line_constraints(s: Settings, lines: list[bytes]) -> tuple[list, list]:
    """Per line: its constraints for Engine.generate (the spans to copy, then the glossary terms; None for none)
    and its spans (for the check of the output)."""
    texts = [b.decode("utf-8", "replace") for b in lines]
    terms = glossary_constraints(s.glossary, texts, s.glossary_case) if s.glossary else [None] * len(texts)
    own = s.line_terms if s.line_terms is not None else [None] * len(texts)
    spans = [find_spans(t, s.markup_patterns) if s.keep_markup else [] for t in texts]
    out = [((markup_constraints(sp, s.markup_patterns) if sp else []) + list(g or []) + list(o or [])) or None
           for sp, g, o in zip(spans, terms, own)]
    return out, spans


def generation_overrides(args) -> dict:
    """This tool's flags -> GenerationConfig overrides (the rest come from the model's defaults)."""
    out = dict(num_beams=args.num_beams, num_return_sequences=args.n_best, max_new_tokens=args.max_decoding_length)
    if args.length_penalty is not None:
        out["length_penalty"] = args.length_penalty
    return {**out, **decoding_constraints(args)}


def resolve(args) -> Settings:
    """The flags -> Settings. The shipped pair is the default only as a pair: its draft applies only to its own
    target. Another --model without --draft runs plain beam search; --drafter lookup needs no draft model (none
    is loaded)."""
    model, draft = args.model, args.draft
    if model is None:
        model = str(shipped("ende", "target"))
        if draft is None and not args.no_draft and args.drafter != "lookup":
            draft = str(shipped("ende", "draft"))
    if args.no_draft or args.drafter == "lookup":
        draft = None
    return Settings(model=model, draft=draft, generation=generation_overrides(args),
                    speculative=speculative_from_args(args, draft=draft),
                    n_best=args.n_best, with_score=args.with_score, max_input_length=args.max_input_length,
                    on_error=args.on_error, batch_size=args.batch_size, batch_type=args.batch_type,
                    src_lang=args.src_lang, tgt_lang=args.tgt_lang, alternatives=args.alternatives,
                    keep_markup=keep_markup(args), markup_patterns=tuple(args.markup_pattern or ())
                    ).with_glossary(args.glossary, args.glossary_case)


def keep_markup(args) -> bool:
    """--keep_markup: on by default for beam search (the constraints need beams), off with --alternatives."""
    if args.keep_markup is None:
        return args.num_beams >= 2 and not args.alternatives
    return args.keep_markup


def open_engine(args, s: Settings):
    """The engine of the flags (threads, memory, provider), checked against the settings: generation settings
    valid for the model, tree widths within the vocabulary, a prompt format that can be filled."""
    engine = engine_from_args(args, s.model, s.draft)
    engine.generation_config(**s.generation)       # bad settings fail before any work
    if s.speculative is not None:
        check_widths(engine, s.speculative.max_branch_width, s.speculative.draft_width)
    check_prompt_format(engine, s.model)
    return engine


def journal_settings(s: Settings, generation) -> dict:
    """What decides the output's bytes (speculation knobs do not: the output is the same), for the journal;
    `generation` is the GenerationConfig the run decodes with."""
    gen = asdict(generation)
    gen["eos_token_id"] = list(gen["eos_token_id"]) if isinstance(gen["eos_token_id"], tuple) else gen["eos_token_id"]
    # the target folder's files (weights, layer files, encoder, tokenizer, config) by SHA-256: a model replaced
    # between the interrupt and --resume is refused. The draft is left out on purpose: speculation is exact, the
    # output does not depend on it (a resume with another draft, or none, gives the same bytes).
    return {"model": str(Path(s.model).resolve()), "model_files": folder_sha256(Path(s.model)),
            "generation": gen, "with_score": s.with_score, "max_input_length": s.max_input_length,
            "on_error": s.on_error,
            **({"languages": [s.src_lang, s.tgt_lang]} if s.src_lang or s.tgt_lang else {}),
            # the prefix file by its lines' SHA-256 (as the input): a changed prefix is a changed setting
            **({"target_prefix": s.prefix_sha256} if s.prefix_sha256 is not None else {}),
            **({"glossary": s.glossary_sha256} if s.glossary_sha256 is not None else {}),
            **({"keep_markup": list(s.markup_patterns)} if s.keep_markup else {}),
            **({"jsonl": True} if s.jsonl else {}),
            **({"alternatives": s.alternatives} if s.alternatives else {})}


def file_settings(s: Settings) -> dict:
    """journal_settings from the flags and the model folder alone (no model loaded): the Ray driver's manifest
    and the record of finished runs (journal.remember_finished)."""
    return journal_settings(s, GenerationConfig.from_dict(dict(ModelConfig.load(s.model).generation), **s.generation))


# settings as the flags name them, for a refused --resume ("beam_size: 4 in the journal, 5 now")
LABELS = {"generation.num_beams": "beam_size", "generation.num_return_sequences": "n_best",
          "generation.max_new_tokens": "max_decoding_length", "generation.length_penalty": "length_penalty",
          "generation.min_new_tokens": "min_decoding_length", "generation.no_repeat_ngram_size": "no_repeat_ngram_size",
          "generation.repetition_penalty": "repetition_penalty",
          "languages": "src_lang/tgt_lang", "target_prefix": "target_prefix (the file's contents)",
          "glossary": "glossary (the file's contents or --glossary_case)",
          "keep_markup": "keep_markup (--keep_markup / --markup_pattern)"}


# -- validating and translating lines ----------------------------------------------------------------------------
def report_line(number: int, why: str, where: str = "") -> None:
    """A bad input line on stderr: number counts from 1 in its file (`where`, when there are several)."""
    print(f"{PROG}: {where + ': ' if where else ''}line {number}: {why}", file=sys.stderr)


def truncated(tok, text: str, src: list[int], n: int) -> str:
    """The text of the first n source tokens (CTranslate2's --max_input_length truncates; it never drops)."""
    cut = tok.decode_stable(src[:n])
    while cut and len(tok.encode(cut)) > n:        # re-encoding a prefix can merge differently at its end
        cut = cut[:-1]
    return cut


def prepare(s: Settings, engine, lines: list[bytes], first: int = 0, report=report_line, known_bad=None):
    """Validate every line first: returns (items to translate [(index, ids)], fixed outputs {index: lines},
    number of bad lines); bad lines are reported, report(line number, why), and handled by --on_error;
    truncated lines are reported the same way (and translated). `first` is the input line index of lines[0]
    (a shard of a larger input). known_bad: {index: why} of lines found bad before (--jsonl)."""
    tok, ctx = engine.tokenizer, engine.target.cfg.context_length
    items, fixed, bad = [], {}, 0
    for i, b in enumerate(lines):
        try:
            if known_bad and i in known_bad:
                raise LineError(known_bad[i])
            text = b.decode("utf-8")
            if not text.strip():
                fixed[i] = [""] * s.n_best
                continue
            src = tok.encode(text)
            if len(src) > s.max_input_length:
                text = truncated(tok, text, src, s.max_input_length)
                report(first + i + 1, f"{len(src)} tokens, truncated to the first {s.max_input_length} "
                                      f"(--max_input_length)")
            ids = engine.encode(tok.format_prompt(text), src_lang=s.src_lang)
            if len(ids) + 1 >= ctx:
                overhead = len(ids) - len(tok.encode(text))        # the prompt format's own tokens
                raise LineError(f"{len(ids)} prompt tokens, over the model's context {ctx}; pass a smaller "
                                f"--max_input_length (at most {max(1, ctx - 2 - overhead)})")
            prefix = s.prefixes[first + i] if s.prefixes is not None else None
            if prefix:                      # this line's target prefix, checked here: a bad one is this line's
                lead = engine.decoder_start(ids, s.tgt_lang)
                try:
                    n = len(engine.prefix_ids(prefix))
                except ValueError as e:
                    raise LineError(f"target prefix: {e}") from None
                if len(lead) + n >= ctx:
                    raise LineError(f"the target prefix has {n} tokens; after the {len(lead)} of the prompt that is "
                                    f"over the model's context {ctx}: shorten it")
            items.append((i, ids))
        except (UnicodeDecodeError, LineError) as e:
            bad += 1
            why = "invalid UTF-8" if isinstance(e, UnicodeDecodeError) else str(e)
            report(first + i + 1, why)
            if s.on_error == "fail":
                return None, None, bad
            copy = one_line(b.decode("utf-8", errors="replace")) if s.on_error == "copy" else ""
            fixed[i] = [copy] * s.n_best
    return items, fixed, bad


def alternatives_line(alts) -> str:
    """--alternatives output for one input line: a JSON object (no newline inside)."""
    return json.dumps({"alternatives": [
        {"token": a.token, "token_id": a.token_id, "logprob": round(a.logprob, 6), "text": one_line(a.text),
         "score": round(a.hypothesis.score, 6)} for a in alts]}, ensure_ascii=False)


NO_ALTERNATIVES = json.dumps({"alternatives": []})      # an empty or bad input line in --alternatives mode


def jsonl_line(s: Settings, i: int, translations: list[dict], problems: list[str] = ()) -> str:
    """One output line of --jsonl: {"id" (if given), "translations": [{"text", "score", "constraints_met"}],
    "problems": [...] (if any)}."""
    obj = {"id": s.line_ids[i]} if s.line_ids is not None and s.line_ids[i] is not None else {}
    obj["translations"] = translations
    if problems:
        obj["problems"] = list(problems)
    return json.dumps(obj, ensure_ascii=False, allow_nan=False)


def translate(s: Settings, engine, todo, on_line, progress, first: int = 0, report=report_line,
              lines: list[bytes] | None = None) -> Stats:
    """Decode `todo` [(index, ids)] in batches; on_line(index, outputs) as each line completes. A translation
    that ran into the model's context (not --max_decoding_length) is reported: report(line number, why).
    lines: the source lines `todo` indexes (for glossary terms and spans to copy). A line whose constraints did
    not all fit is translated again without them and reported; a copied span that did not survive is reported, and
    so is a term joined to the neighbouring word (joined_terms), as each line ends."""
    prefix = [s.prefixes[first + i] or None for i, _ in todo] if s.prefixes is not None else None
    run = _Decoding(s, engine, on_line, progress, first, report, lines)
    if s.alternatives:           # one line at a time: its N continuations are the batch
        run.alternatives(todo, prefix)
        return run.total
    run.limit = s.generation["max_new_tokens"]
    terms = run.terms
    for k, res in run.batches(todo, prefix, [terms[i] for i, _ in todo] if terms else None):
        if res.hypotheses[0].constraints_met is False:
            run.unfit(todo, k, res, prefix)
            continue
        run.done(todo, k, res)
    return run.total


class _Decoding:
    """One translate() call: the engine's batches, each line's problems (on stderr, and kept for its --jsonl
    output), its output lines and the running Stats."""

    def __init__(self, s: Settings, engine, on_line, progress, first: int, report, lines: list[bytes] | None):
        self.s, self.engine, self.on_line, self.progress = s, engine, on_line, progress
        self.first, self.report, self.lines = first, report, lines
        self.ctx = engine.target.cfg.context_length
        self.total = Stats()
        self.by_tokens = s.batch_type == "tokens"
        self.terms, self.spans = line_constraints(s, lines) if s.constrained and lines is not None else (None, None)
        self.said: dict[int, list[str]] = {}

    def alternatives(self, todo, prefix) -> None:
        s = self.s
        for k, (i, ids) in enumerate(todo):
            alts = self.engine.alternatives(ids, prefix[k] if prefix else None, s.alternatives,
                                            speculative=s.speculative, tgt_lang=s.tgt_lang,
                                            max_batch_size=s.batch_size if not self.by_tokens else s.alternatives,
                                            **s.generation)
            self.on_line(i, [alternatives_line(alts)])
            self.progress.update(1)

    def batches(self, items, prefixes, constraints):
        s, by_tokens = self.s, self.by_tokens
        return self.engine.generate_iter([ids for _, ids in items], speculative=s.speculative, tgt_lang=s.tgt_lang,
                                         max_batch_size=s.batch_size if not by_tokens else max(1, len(items)),
                                         max_batch_tokens=s.batch_size if by_tokens else None,
                                         target_prefix=prefixes, constraints=constraints, **s.generation)

    def say(self, i, why):            # a line's problem: on stderr, and in its --jsonl output
        self.said.setdefault(i, []).append(why)
        self.report(self.first + i + 1, why)

    def unfit(self, todo, k, res, prefix) -> None:
        """todo[k]'s constraints did not all fit: reported, and the line translated again without them."""
        i = todo[k][0]
        what = [c["text"] if isinstance(c, dict) else c if isinstance(c, str) else c[0] for c in self.terms[i]
                if not isinstance(c, dict) or "text" in c]
        self.say(i, f"{' / '.join(map(repr, what))} did not all fit in --max_decoding_length {self.limit}: "
                    f"translated without the glossary and markup constraints")
        self.total.add(res.stats)
        # the best translation without constraints (never a broken one, never none), at once: at the end of
        # the run it held back every later line on stdout, and an interrupt lost them (issue 49 item 8)
        for j, again in self.batches([todo[k]], [prefix[k]] if prefix else None, None):
            self.done([todo[k]], j, again)

    def done(self, items, k, res) -> None:
        i = items[k][0]
        self.check(i, len(items[k][1]), res)
        self.write(i, res)
        self.total.add(res.stats)
        self.progress.update(1)
        self.progress.set_postfix_str(f"{self.total.generated_tokens} tok", refresh=False)

    def check(self, i: int, n_ids: int, res) -> None:
        """Line i's problems, said: a cut at the model's context, n-best that missed constraints, markup not
        kept, a term joined to its neighbour."""
        s, ctx, spans, terms, best = self.s, self.ctx, self.spans, self.terms, res.hypotheses[0]
        room = ctx - n_ids
        if self.engine.encoder is None and room < self.limit and any(len(h.tokens) >= room for h in res.hypotheses):
            self.say(i, f"the translation reached the model's context ({ctx} tokens) after {room} tokens and may "
                        f"be cut; shorten the line or pass a smaller --max_input_length")
        short = [str(n + 1) for n, h in enumerate(res.hypotheses) if h.constraints_met is False]
        if short:                                   # the best met them all, these n-best did not
            self.say(i, f"n-best hypotheses {', '.join(short)} do not hold every glossary term and span (the "
                        f"length limit came first)")
        odd = out_of_order(spans[i]) if spans and spans[i] else []
        if odd:
            self.say(i, f"the source closes {', '.join(f'</{n}>' for n in odd)} before opening it: copied in the "
                        f"source's order, without the rule that a closing tag follows its opening tag")
        if spans and spans[i] and best.constraints_met is not False:
            problems = survives(spans[i], best.text, s.markup_patterns)
            problems += emptied(self.lines[i].decode("utf-8", "replace"), best.text, s.markup_patterns)
            if problems:
                self.say(i, "markup not kept: " + "; ".join(problems))
        if terms and terms[i] and best.constraints_met:
            for why in joined_terms(terms[i], best.text):
                self.say(i, why)

    def write(self, i: int, res) -> None:
        s = self.s
        if s.jsonl:
            self.on_line(i, [jsonl_line(s, self.first + i, [
                {"text": h.text, "score": round(h.score, 6) if math.isfinite(h.score) else None,
                 **({"constraints_met": h.constraints_met} if h.constraints_met is not None else {})}
                for h in res.hypotheses], self.said.get(i, []))])
        else:
            hyps = [f"{h.score:.4f} ||| {h.text}" if s.with_score else h.text for h in res.hypotheses]
            self.on_line(i, [one_line(h) for h in hyps])


def summary(stats, lines: int, seconds: float) -> str:
    tok = stats.generated_tokens
    return (f"{PROG}: {lines} lines, {tok} tokens in {seconds:.1f} s ({lines / max(seconds, 1e-9):.2f} lines/s, "
            f"{tok / max(seconds, 1e-9):.1f} tok/s); {stats.target_passes} target passes, "
            f"{stats.beam_steps_per_pass:.2f} beam steps per pass")
