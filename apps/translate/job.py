"""The translate tool as a library: what the flags decide (Settings, resolved once per run), input and output
checks, line validation, batched translation and the journal's record of the settings. `__main__.py` (the
command line, the local run) and `ray_engine.py` (shards on a Ray cluster) both import it at the top; it imports
neither of them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import stat
import sys
import unicodedata
from dataclasses import asdict, dataclass
from pathlib import Path

from specbeam_edge.config import GenerationConfig, ModelConfig, SpeculativeConfig
from specbeam_edge.flags import (check_prompt_format, check_widths, decoding_constraints, engine_from_args,
                                 speculative_from_args)
from specbeam_edge.markup import emptied, find_spans, markup_constraints, out_of_order, survives
from specbeam_edge.results import Stats
from specbeam_edge.shipped import shipped

from .fingerprint import folder_sha256
from .journal import special_kind

PROG = "specbeam-translate"


class LineError(ValueError):
    pass


class UsageError(ValueError):
    """Bad arguments or unusable input found after parsing: exit code 2, one line."""


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


# -- --jsonl: one JSON object a line in and out ------------------------------------------------------------------
JSONL_KEYS = {"text", "target_prefix", "terms", "id"}


def read_jsonl(lines: list[bytes]) -> tuple[list[bytes], dict[int, str], list, list, list]:
    """--jsonl input, one object a line: {"text": the source, "target_prefix": the start of its translation,
    "terms": [a term, or a list of alternative forms, ...] that must appear, "id": anything, given back}; only
    "text" is required, an empty line is an empty source. Returns the sources (UTF-8, b"" for a bad line), the
    bad lines {index: why}, and per line its prefix ('' for none), terms (None) and id (None). A bad line keeps
    its id when the id itself is usable (JSON, finite numbers, no lone surrogate), so its output names it."""
    texts, bad, prefixes, terms, ids = [], {}, [], [], []
    for i, b in enumerate(lines):
        obj, why, line_id = {}, None, None
        if b.strip():
            try:
                obj = json.loads(b, parse_constant=_no_constant)
                if isinstance(obj, dict):
                    line_id = obj.get("id")
                    if _id_problem(line_id):
                        line_id = None
                why = _jsonl_problem(obj)
            except (UnicodeDecodeError, ValueError) as e:
                why = f"not a JSON object ({e})"
            if why:
                obj = {}
        if why:
            bad[i] = why
        texts.append(obj.get("text", "").encode("utf-8"))
        prefixes.append(obj.get("target_prefix") or "")
        terms.append([tuple(t) if isinstance(t, list) else t for t in obj["terms"]] if obj.get("terms") else None)
        ids.append(line_id)
    return texts, bad, prefixes, terms, ids


def _no_constant(name: str):
    """json.loads takes NaN, Infinity and -Infinity, which are not JSON (and could not be written back)."""
    raise ValueError(f"{name} is not a JSON value")


def _surrogate(text: str) -> bool:
    """A lone surrogate (a JSON \\ud800 escape): no UTF-8 spelling, so no tokenizer and no output can take it."""
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _strings(x):
    if isinstance(x, str):
        yield x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield k
            yield from _strings(v)
    elif isinstance(x, list):
        for v in x:
            yield from _strings(v)


def _id_problem(line_id) -> str | None:
    """Why an "id" cannot be given back as valid JSON: a non-finite number (1e999) or a lone surrogate."""
    stack = [line_id]
    while stack:
        x = stack.pop()
        if isinstance(x, float) and not math.isfinite(x):
            return f"'id' {x!r} is not a finite number (JSON has no NaN or Infinity)"
        if isinstance(x, str) and _surrogate(x):
            return "'id' holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which is not text"
        if isinstance(x, dict):
            stack += list(x.keys()) + list(x.values())
        elif isinstance(x, list):
            stack += x
    return None


def _jsonl_problem(obj) -> str | None:
    if not isinstance(obj, dict):
        return f"a line must be a JSON object, not {type(obj).__name__}"
    unknown = set(obj) - JSONL_KEYS
    if unknown:
        return f"unknown key(s) {', '.join(sorted(unknown))} (known: {', '.join(sorted(JSONL_KEYS))})"
    if not isinstance(obj.get("text"), str):
        return "'text' (a string) is required"
    if not isinstance(obj.get("target_prefix", ""), str):
        return "'target_prefix' must be a string"
    terms = obj.get("terms", [])
    if not isinstance(terms, list) or not all(isinstance(t, str) and t.strip() or isinstance(t, list) and t and all(
            isinstance(a, str) and a.strip() for a in t) for t in terms):
        return "'terms' must be a list of non-empty strings (not only spaces) or lists of them (alternatives)"
    for key in ("text", "target_prefix", "terms"):
        if any(_surrogate(x) for x in _strings(obj.get(key, ""))):
            return f"'{key}' holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which is not text; " \
                   f"fix the line's escapes"
    return _id_problem(obj.get("id"))


def jsonl_line(s: Settings, i: int, translations: list[dict], problems: list[str] = ()) -> str:
    """One output line of --jsonl: {"id" (if given), "translations": [{"text", "score", "constraints_met"}],
    "problems": [...] (if any)}."""
    obj = {"id": s.line_ids[i]} if s.line_ids is not None and s.line_ids[i] is not None else {}
    obj["translations"] = translations
    if problems:
        obj["problems"] = list(problems)
    return json.dumps(obj, ensure_ascii=False, allow_nan=False)


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


# -- input and output ------------------------------------------------------------------------------------------
def read_input(path: str | None) -> bytes:
    """The input's bytes: stdin when path is None."""
    if path is None:
        if sys.stdin is None:
            raise UsageError("stdin is closed; pass -i FILE")
        try:
            mode = os.fstat(sys.stdin.fileno()).st_mode
        except (OSError, ValueError):
            mode = 0
        if (stat.S_ISCHR(mode) and not sys.stdin.isatty() and not _is_null(sys.stdin.fileno())) \
                or stat.S_ISBLK(mode):
            raise UsageError("stdin is a device, not text (e.g. < /dev/zero); pass -i FILE or pipe the text in")
        try:
            return sys.stdin.buffer.read()
        except OSError as e:
            raise UsageError(f"cannot read stdin ({e.strerror or e}); pass -i FILE") from None
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"input {path} is a directory; pass a text file, one sentence per line")
    try:
        return read_file(path, "input")
    except OSError as e:
        raise UsageError(f"cannot read input {path}: {e.strerror}") from None


def _is_null(f) -> bool:
    """/dev/null (an empty input, not an endless one)."""
    try:
        st, null = os.stat(f), os.stat(os.devnull)
    except (OSError, ValueError):
        return False
    return (st.st_rdev, st.st_ino, st.st_dev) == (null.st_rdev, null.st_ino, null.st_dev)


def refuse_device(path, what: str) -> None:
    kind = special_kind(Path(path))
    if kind in ("a character device", "a block device", "a socket") and _is_null(path):
        return
    if kind in ("a character device", "a block device", "a socket"):
        raise UsageError(f"{what} {path} is {kind}, not a text file; pass a regular file (or pipe the text "
                         f"through stdin)")


def read_file(path, what: str) -> bytes:
    """A file's bytes; a device or socket is refused before reading (/dev/zero or /dev/urandom as an input read
    until memory ran out): one line naming the flag and the fix. A FIFO is read (process substitution)."""
    refuse_device(path, what)
    with open(path, "rb") as f:
        return f.read()


BOM = b"\xef\xbb\xbf"


def split_lines(raw: bytes) -> list[bytes]:
    """Lines as `wc -l` counts them, with universal newlines: LF, CRLF and a lone CR (old Mac files) each end a
    line and never reach the model; a UTF-8 byte order mark before line 1 is dropped."""
    if raw.startswith(BOM):
        raw = raw[len(BOM):]
    return raw.splitlines()          # bytes.splitlines: \n, \r\n and \r only (U+2028 etc. stay in the line)


def read_prefixes(path: str | None, n: int) -> tuple[list[bytes] | None, list[str] | None]:
    """--target_prefix FILE: (its raw lines, for the journal; their texts), one per input line ('' for none),
    read as the input is (universal newlines, a BOM dropped); (None, None) without the flag."""
    if not path:
        return None, None
    path = Path(path)
    try:
        raw = split_lines(read_file(path, "--target_prefix"))
    except OSError as e:
        raise UsageError(f"cannot read --target_prefix {path}: {e.strerror or e}") from None
    if len(raw) != n:
        raise UsageError(f"--target_prefix {path} has {len(raw)} line{'s' * (len(raw) != 1)}, the input has {n}: "
                         f"give one prefix per input line (an empty line for none)")
    texts = [_utf8(b) for b in raw]
    if None in texts:
        raise UsageError(f"--target_prefix {path}: line {texts.index(None) + 1} is not valid UTF-8")
    return raw, texts


def read_glossary(path: str) -> tuple[bytes, list[tuple[str, tuple[str, ...]]]]:
    """--glossary FILE (UTF-8, tab-separated): `source term<TAB>target term[<TAB>another target form ...]` a line;
    empty lines and lines starting with '#' are skipped. Returns (the file's bytes, [(source, targets)])."""
    try:
        raw = read_file(path, "--glossary")
    except OSError as e:
        raise UsageError(f"cannot read --glossary {path}: {e.strerror or e}") from None
    terms = []
    for k, line in enumerate(split_lines(raw), 1):
        text = _utf8(line)
        if text is None:
            raise UsageError(f"--glossary {path}: line {k} is not valid UTF-8")
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        cells = [c.strip() for c in text.split("\t")]
        if len(cells) < 2 or not cells[0] or not all(cells[1:]):
            raise UsageError(f"--glossary {path}: line {k} is not 'source term<TAB>target term' (tab-separated, "
                             f"no empty cell): {text[:60]!r}")
        terms.append((cells[0], tuple(dict.fromkeys(cells[1:]))))
    return raw, terms


def glossary_constraints(terms, sources: list[str], case: str) -> list[list[tuple[str, ...]] | None]:
    """Per source line, the target forms of every glossary term it contains as a whole word (not inside a longer
    word; case-insensitive unless case == 'sensitive'): each term one constraint, its target forms alternatives.
    Longest match first: a term found only inside a longer term's match ('menu' in 'context menu') is not
    forced besides it; rows with the same source term are one constraint whose forms are alternatives."""
    flags = 0 if case == "sensitive" else re.IGNORECASE
    merged: dict[str, list[str]] = {}
    for src, targets in terms:
        merged.setdefault(src if case == "sensitive" else src.casefold(), [src, []])[1].extend(targets)
    found = sorted(((re.compile(r"(?<!\w)" + re.escape(src) + r"(?!\w)", flags), tuple(dict.fromkeys(targets)), k)
                    for k, (src, targets) in enumerate(merged.values())), key=lambda f: -len(f[0].pattern))
    out = []
    for text in sources:
        taken: list[tuple[int, int]] = []          # character ranges of the longer terms matched so far
        hits = []
        for rx, targets, k in found:
            spans = [m.span() for m in rx.finditer(text)]
            free = [sp for sp in spans if not any(a < sp[1] and sp[0] < b for a, b in taken)]
            if free:
                hits.append((k, targets))
                taken += free
        out.append([tuple(t) for t in dict.fromkeys(t for _, t in sorted(hits))] or None)   # in the file's order
    return out


# scripts written without spaces between words: there a term always touches its neighbours (no check)
_UNSPACED = ((0x0E00, 0x0EFF), (0x0F00, 0x0FFF), (0x1000, 0x109F), (0x1780, 0x17FF), (0x3040, 0x30FF),
             (0x31F0, 0x31FF), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0xFF66, 0xFF9F),
             (0x20000, 0x3FFFF))       # Thai, Lao, Tibetan, Myanmar, Khmer, kana, CJK ideographs


def _glues(a: str, b: str) -> bool:
    """Whether two adjacent characters are parts of one word: both letters, digits or combining marks, and
    neither of a script written without spaces."""
    return all((c.isalnum() or unicodedata.category(c).startswith("M"))
               and not any(lo <= ord(c) <= hi for lo, hi in _UNSPACED) for c in (a, b))


def joined_terms(constraints, output: str) -> list[str]:
    """Per term of `constraints` (glossary and --jsonl terms; markup specs are skipped) that appears in `output`
    joined to a neighbouring word, one warning: a letter or digit right before or after an occurrence, as in
    '3-Arbeitsmappeder' for 'Arbeitsmappe', where forcing the term damaged the words around it. The check is
    on both sides: a glossary term matches its source as a whole word (glossary_constraints), so a joined copy
    is not the source's shape (a --jsonl term has no source term to compare: the same check). Inflected and
    compound forms are joined too ('Dialogfensters'), hence a warning, the line is kept; an occurrence inside a
    whole-word occurrence of another of the term's forms is not reported (list 'Dialogfensters' as a form)."""
    out = []
    for c in constraints or ():
        forms = [f for f in ((c,) if isinstance(c, str) else c if isinstance(c, (tuple, list)) else ())
                 if isinstance(f, str) and f.strip()]
        hits = [(k, k + len(f)) for f in forms for k in _occurrences(output, f)]
        whole = [(a, b) for a, b in hits if not (a > 0 and _glues(output[a - 1], output[a]))
                 and not (b < len(output) and _glues(output[b - 1], output[b]))]
        glued = [_word_around(output, a, b) for a, b in hits
                 if not any(x <= a and b <= y for x, y in whole)]
        if glued:
            words = ", ".join(map(repr, dict.fromkeys(glued)))
            out.append(f"term {forms[0]!r} is joined to the neighbouring text ({words}); check the line (if that "
                       f"form is right, list it as another target form of the term)")
    return out


def _occurrences(text: str, sub: str) -> list[int]:
    out, k = [], text.find(sub)
    while k >= 0:
        out.append(k)
        k = text.find(sub, k + 1)
    return out


def _word_around(text: str, a: int, b: int, most: int = 12) -> str:
    """The whitespace-delimited text around text[a:b], with at most `most` characters either side of it."""
    left, right = a, b
    while left > max(0, a - most) and not text[left - 1].isspace():
        left -= 1
    while right < min(len(text), b + most) and not text[right].isspace():
        right += 1
    return text[left:right]


def _utf8(b: bytes) -> str | None:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return None


def check_output(output: str | None, input: str | None = None) -> None:
    """Fail before the model loads (seconds) rather than after the translation (minutes)."""
    if output is None:
        if sys.stdout is None:
            raise UsageError("stdout is closed; pass -o FILE")
        return
    out = Path(output)
    if out.is_dir():
        raise UsageError(f"output {out} is a directory; pass a file path")
    kind = special_kind(out)
    if kind:
        raise UsageError(f"output {out} is {kind}, which would be replaced by a regular file; to stream the "
                         f"translation, leave out -o and redirect stdout")
    if not out.parent.is_dir():
        raise UsageError(f"the output's directory {out.parent} does not exist; create it first")
    if input and same_file(Path(input), out):
        raise UsageError(f"output {out} is the input {input}: the translation would replace the source; "
                         f"write to another -o")


def same_file(a: Path, b: Path) -> bool:
    """The same file (hard links and symlinks included), or the same path once resolved."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


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


def translate(s: Settings, engine, todo, on_line, progress, first: int = 0, report=report_line,
              lines: list[bytes] | None = None) -> Stats:
    """Decode `todo` [(index, ids)] in batches; on_line(index, outputs) as each line completes. A translation
    that ran into the model's context (not --max_decoding_length) is reported: report(line number, why).
    lines: the source lines `todo` indexes (for glossary terms and spans to copy). A line whose constraints did
    not all fit is translated again without them and reported; a copied span that did not survive is reported, and
    so is a term joined to the neighbouring word (joined_terms), as each line ends."""
    ctx = engine.target.cfg.context_length
    total = Stats()
    by_tokens = s.batch_type == "tokens"
    prefix = [s.prefixes[first + i] or None for i, _ in todo] if s.prefixes is not None else None
    terms, spans = line_constraints(s, lines) if s.constrained and lines is not None else (None, None)
    if s.alternatives:           # one line at a time: its N continuations are the batch
        for k, (i, ids) in enumerate(todo):
            alts = engine.alternatives(ids, prefix[k] if prefix else None, s.alternatives,
                                       speculative=s.speculative, tgt_lang=s.tgt_lang,
                                       max_batch_size=s.batch_size if not by_tokens else s.alternatives,
                                       **s.generation)
            on_line(i, [alternatives_line(alts)])
            progress.update(1)
        return total

    def run(items, prefixes, constraints):
        return engine.generate_iter([ids for _, ids in items], speculative=s.speculative, tgt_lang=s.tgt_lang,
                                    max_batch_size=s.batch_size if not by_tokens else max(1, len(items)),
                                    max_batch_tokens=s.batch_size if by_tokens else None,
                                    target_prefix=prefixes, constraints=constraints, **s.generation)

    said: dict[int, list[str]] = {}

    def say(i, why):            # a line's problem: on stderr, and in its --jsonl output
        said.setdefault(i, []).append(why)
        report(first + i + 1, why)

    def done(items, k, res):
        i = items[k][0]
        room = ctx - len(items[k][1])
        if engine.encoder is None and room < limit and any(len(h.tokens) >= room for h in res.hypotheses):
            say(i, f"the translation reached the model's context ({ctx} tokens) after {room} tokens and may be "
                   f"cut; shorten the line or pass a smaller --max_input_length")
        short = [str(n + 1) for n, h in enumerate(res.hypotheses) if h.constraints_met is False]
        if short:                                   # the best met them all, these n-best did not
            say(i, f"n-best hypotheses {', '.join(short)} do not hold every glossary term and span (the length "
                   f"limit came first)")
        odd = out_of_order(spans[i]) if spans and spans[i] else []
        if odd:
            say(i, f"the source closes {', '.join(f'</{n}>' for n in odd)} before opening it: copied in the "
                   f"source's order, without the rule that a closing tag follows its opening tag")
        if spans and spans[i] and res.hypotheses[0].constraints_met is not False:
            problems = survives(spans[i], res.hypotheses[0].text, s.markup_patterns)
            problems += emptied(lines[i].decode("utf-8", "replace"), res.hypotheses[0].text, s.markup_patterns)
            if problems:
                say(i, "markup not kept: " + "; ".join(problems))
        if terms and terms[i] and res.hypotheses[0].constraints_met:
            for why in joined_terms(terms[i], res.hypotheses[0].text):
                say(i, why)
        if s.jsonl:
            on_line(i, [jsonl_line(s, first + i, [
                {"text": h.text, "score": round(h.score, 6) if math.isfinite(h.score) else None,
                 **({"constraints_met": h.constraints_met} if h.constraints_met is not None else {})}
                for h in res.hypotheses], said.get(i, []))])
        else:
            hyps = [f"{h.score:.4f} ||| {h.text}" if s.with_score else h.text for h in res.hypotheses]
            on_line(i, [one_line(h) for h in hyps])
        total.add(res.stats)
        progress.update(1)
        progress.set_postfix_str(f"{total.generated_tokens} tok", refresh=False)

    limit = s.generation["max_new_tokens"]
    for k, res in run(todo, prefix, [terms[i] for i, _ in todo] if terms else None):
        if res.hypotheses[0].constraints_met is False:
            i = todo[k][0]
            what = [c["text"] if isinstance(c, dict) else c if isinstance(c, str) else c[0] for c in terms[i]
                    if not isinstance(c, dict) or "text" in c]
            say(i, f"{' / '.join(map(repr, what))} did not all fit in --max_decoding_length {limit}: translated "
                   f"without the glossary and markup constraints")
            total.add(res.stats)
            # the best translation without constraints (never a broken one, never none), at once: at the end of
            # the run it held back every later line on stdout, and an interrupt lost them (issue 49 item 8)
            for j, again in run([todo[k]], [prefix[k]] if prefix else None, None):
                done([todo[k]], j, again)
            continue
        done(todo, k, res)
    return total


def summary(stats, lines: int, seconds: float) -> str:
    tok = stats.generated_tokens
    return (f"{PROG}: {lines} lines, {tok} tokens in {seconds:.1f} s ({lines / max(seconds, 1e-9):.2f} lines/s, "
            f"{tok / max(seconds, 1e-9):.1f} tok/s); {stats.target_passes} target passes, "
            f"{stats.beam_steps_per_pass:.2f} beam steps per pass")
