"""--glossary: the TSV file read (read_glossary), its terms found in each source line as whole words
(glossary_constraints, the constraints of constrained beam search), and the check of a translation for a term
joined to a neighbouring word (joined_terms).
"""
from __future__ import annotations

import re
import unicodedata

from .files import UsageError, _utf8, read_file, split_lines


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
