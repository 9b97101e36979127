"""--jsonl input: one JSON object a line ({"text", "target_prefix", "terms", "id"}), each line checked on its own
(a bad line is that line's error, not the run's); the output lines are job.jsonl_line.
"""
from __future__ import annotations

import json
import math


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
