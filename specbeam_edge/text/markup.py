"""Spans a translation must copy verbatim (placeholders, markup, URLs, code), found in a source text, and the
constraints that make them survive: each span appears in the output as often as in the source, never more, and a
closing tag never before its opening tag (DESIGN "Placeholders and markup").

    spans = find_spans('Delete %s from <b>%d</b> files?')       # ['%s', '<b>', '%d', '</b>']
    engine.generate(src, constraints=markup_constraints(spans))

The default kinds are listed in PATTERNS (in the order they are tried at a position); `extra` patterns (regular
expressions) add kinds of one's own.
"""
from __future__ import annotations

import functools
import re
from collections import Counter

# kind -> regular expression; tried in this order at each position (a URL before an e-mail address, a tag
# before an entity); a span is the whole match. Each pattern fails within a bounded number of steps from a
# start, or at the next character that cannot continue it, so finding spans is linear in the text (an e-mail's
# unbounded local part made a 300 KB 'a.a.a...' line quadratic: minutes; `\s+[^<>]*?` after a tag name and
# printf's unbounded flags and width too)
PATTERNS: dict[str, str] = {
    "url": r"\b(?:https?|ftp)://[^\s<>\"'`]*[^\s<>\"'`.,;:!?)\]}]",
    "email": r"\b[\w.+-]{1,64}@[\w-]+(?:\.[\w-]+)+\b",     # a local part has at most 64 characters (RFC 5321)
    "tag": r"</?[A-Za-z][\w:.-]*(?:\s[^<>]*?)?/?>",
    "code": r"`[^`\n]+`",
    "printf": r"%(?:\d{1,9}\$)?[-+#0']{0,8}(?:\d{1,9}|\*)?(?:\.(?:\d{1,9}|\*))?(?:hh|h|ll|l|L|q|j|z|t)?"
              r"[diouxXeEfFgGaAcsp]",
    "positional": r"%\d+\b",                        # Qt / Windows: %1
    "brace": r"\{[\w.:!\[\]-]*\}",                 # {0}, {name}, {}, {0:d}
    "entity": r"&(?:[A-Za-z]+|#\d+|#x[0-9A-Fa-f]+);",
    "accelerator": r"&(?=\w)",                     # the & of a keyboard accelerator (&File)
}


@functools.lru_cache(maxsize=32)
def _compile(extra: tuple[str, ...] = ()) -> re.Pattern:
    kinds = list(PATTERNS.values()) + list(extra)
    return re.compile("|".join(f"(?:{p})" for p in kinds))


def find_spans(text: str, extra=()) -> list[str]:
    """The spans of `text` to copy verbatim, in order (non-overlapping, leftmost first; at one position the
    first kind of PATTERNS that matches, then the extra patterns). Called for every candidate of a constrained
    step (the no-other-spans rule): the joined pattern is compiled once per set of extra patterns."""
    return [m.group(0) for m in _compile(tuple(extra)).finditer(text) if m.group(0)]


def find_span_matches(text: str, extra=()) -> list[re.Match]:
    """find_spans' matches (with their positions)."""
    return [m for m in _compile(tuple(extra)).finditer(text) if m.group(0)]


def _tag_name(span: str) -> tuple[str, bool] | None:
    """(name, closing) of an opening or closing tag; None for anything else (a self-closing tag included)."""
    m = re.fullmatch(r"<(/?)([A-Za-z][\w:.-]*)(?:\s[^<>]*?)?(/?)>", span)
    if not m or m.group(3):
        return None
    return m.group(2), bool(m.group(1))


def markup_constraints(spans: list[str], extra=()) -> list[dict]:
    """The spans as constraint specs for Engine.generate(constraints=): one per distinct span, matched on the
    output text, needed as often as it occurs and exactly that often, a closing tag never more often than its
    opening tag (the first opening tag of that name in the spans) so far; and no other span (of PATTERNS and
    `extra`) in the output: a model that learned to translate metavariables writes `<Datei>` for `<file>`."""
    counts = Counter(spans)
    order = list(counts)
    tags = [_tag_name(span) for span in order]
    opening = {}                                  # tag name -> index of its first opening tag
    odd = set(out_of_order(spans))                # the source closes these before it opens them: no order rule
    for j, tag in enumerate(tags):
        if tag and not tag[1] and tag[0] not in odd:
            opening.setdefault(tag[0], j)
    out = []
    for span, tag in zip(order, tags):
        spec = {"text": span, "count": counts[span], "exact": True}
        if tag and tag[1] and tag[0] in opening:
            spec["after"] = opening[tag[0]]
        out.append(spec)
    return out + [{"no_other_spans": list(extra)}]


def out_of_order(spans: list[str]) -> list[str]:
    """Tag names the spans close before (or more often than) they open them ('Click </b>here<b>'): a copy in
    the source's order cannot keep a closing tag after its opening tag, so no such rule is made for them (the
    search looped looking for an order the source does not have)."""
    depth: Counter = Counter()
    bad = []
    for s in spans:
        tag = _tag_name(s)
        if tag:
            depth[tag[0]] += -1 if tag[1] else 1
            if depth[tag[0]] < 0 and tag[0] not in bad:
                bad.append(tag[0])
    return bad


def survives(source_spans: list[str], output: str, extra=()) -> list[str]:
    """What is wrong with the output's copy of the source's spans (empty: every span appears as often as in the
    source, no other span appears, and each closing tag comes after an opening tag of its name): one message per
    problem."""
    found = find_spans(output, extra)
    got = Counter(found)
    want = Counter(source_spans)
    problems = [f"{s!r} {got[s]} time{'s' * (got[s] != 1)} instead of {n}" for s, n in want.items() if got[s] != n]
    problems += [f"{s!r} is not in the source" for s in got if s not in want]
    depth: Counter = Counter()
    odd = set(out_of_order(source_spans))
    for s in found:
        tag = _tag_name(s)
        if tag and s in want and tag[0] not in odd:
            depth[tag[0]] += -1 if tag[1] else 1
            if depth[tag[0]] < 0:
                problems.append(f"{s!r} before its opening tag")
                depth[tag[0]] = 0
    return problems


def _contents(text: str, extra=()) -> list[tuple[str, str, str]]:
    """(opening tag, closing tag, the text between them, stripped) of each tag pair whose opening and closing
    spans follow each other in `text` (`<b>OK</b>`, not nested pairs)."""
    ms = find_span_matches(text, extra)
    out = []
    for a, b in zip(ms, ms[1:]):
        ta, tb = _tag_name(a.group(0)), _tag_name(b.group(0))
        if ta and tb and ta[0] == tb[0] and not ta[1] and tb[1]:
            out.append((a.group(0), b.group(0), text[a.end():b.start()].strip()))
    return out


def emptied(source: str, output: str, extra=()) -> list[str]:
    """Tag pairs that hold text in the source and nothing in the output ('Click <b>OK</b> ...' translated with
    '<b></b>': every span was kept, so `survives` saw nothing, but the words inside were lost): one message each."""
    full = {(a, b) for a, b, text in _contents(source, extra) if text}
    return [f"{a}...{b} is empty (the source has text inside)" for a, b, text in _contents(output, extra)
            if not text and (a, b) in full]

