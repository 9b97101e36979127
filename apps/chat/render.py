"""Answers as Markdown in the transcript, with the characters that came from the draft tree highlighted. Raw HTML
is not interpreted: an answer about code (`List<String>`, `a<b`, `<div>`) shows every character it has.

Draft marks are stored as character spans of the answer's own text, so an answer renders the same after a
restart or a model switch: nothing is re-tokenised at display time.

Fenced code blocks render as code: monospace on a grey background, with a "Copy code" link under each block
(href `copy-code:<position of the block's first line>`; `code_text` reads the block's text back from the
document, so the link needs nothing stored beside it).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from PySide6.QtGui import (QColor, QFontDatabase, QTextBlock, QTextBlockFormat, QTextCharFormat, QTextCursor,
                           QTextDocument, QTextFormat)

DRAFT_COLOUR = QColor("#d8f0d8")
CODE_BACKGROUND = QColor("#eef0f3")
COPY_SCHEME = "copy-code"        # the scheme of a code block's copy link
COPY_TEXT = "Copy code"
CURSOR = "▌"                     # shown at the end of an answer that is still streaming
_FENCE = ("```", "~~~")
_SEPARATORS = "\u2029\u2028\ufffc"   # block/line separators and objects in QTextDocument text: no source char
_ENTITY = re.compile(r"&(#[0-9]{1,7}|#[xX][0-9a-fA-F]{1,6}|[A-Za-z][A-Za-z0-9]{0,31});")
_MD = QTextDocument.MarkdownFeature
# GitHub's dialect (tables, strikethrough, task lists, autolinks) without raw HTML: tags show as text
MARKDOWN = _MD(_MD.MarkdownDialectGitHub.value | _MD.MarkdownNoHTML.value)
_LOOKAHEAD = 200                 # markup skipped between two shown characters (a link's URL) stays below this


def draft_spans(decode: Callable[[list[int]], str], tokens: Sequence[int], flags: Sequence[bool],
                offset: int = 0) -> list[list[int]]:
    """[start, end) character spans of decode(tokens) covered by tokens whose flag is set, shifted by offset.
    flags[i] belongs to tokens[i] (beam step i produced token i of the answer); missing flags count as False."""
    spans, prev = [], 0
    for i in range(len(tokens)):
        end = len(decode(list(tokens[: i + 1])))
        if i < len(flags) and flags[i] and end > prev:
            if spans and spans[-1][1] == offset + prev:
                spans[-1][1] = offset + end
            else:
                spans.append([offset + prev, offset + end])
        prev = max(prev, end)
    return spans


def char_flags(text: str, spans: Sequence[Sequence[int]]) -> list[bool]:
    flags = [False] * len(text)
    for start, end in spans:
        for i in range(max(0, start), min(end, len(text))):
            flags[i] = True
    return flags


def markdown_source(text: str, flags: list[bool]) -> tuple[str, list[bool]]:
    """The Markdown handed to Qt, with one flag per source character. Single newlines outside code fences
    become hard breaks: a model's line-per-item output (code without fences, short lists) keeps its lines
    instead of running together into one paragraph. Outside code, `&` before an entity name gets a backslash
    so that `&amp;` shows as written (raw HTML is switched off in insert_answer: `<div>` and `a<b` show as
    text); code blocks and code spans keep their content verbatim."""
    out, out_flags, in_fence, code_ok = [], [], False, True
    lines = text.split("\n")
    pos = 0
    for n, line in enumerate(lines):
        fence = line.lstrip().startswith(_FENCE)
        indented = bool(line.startswith(("    ", "\t")) and line.strip() and code_ok)   # indented code
        shown, shown_flags = line, flags[pos:pos + len(line)]
        pos += len(line)
        if not (in_fence or fence or indented):
            shown, shown_flags = _escape_entities(shown, shown_flags)
        out.append(shown)
        out_flags += shown_flags
        if fence:
            in_fence = not in_fence
        code_ok = not line.strip() or indented     # indented code starts after a blank line
        if n < len(lines) - 1:
            brk = "\n" if in_fence or indented or not line.strip() else "  \n"
            out.append(brk)
            out_flags += [flags[pos]] * len(brk)
            pos += 1
    return "".join(out), out_flags


def _escape_entities(line: str, flags: list[bool]) -> tuple[str, list[bool]]:
    """`\\&` for every `&` that would start an entity reference, except inside `code spans`."""
    out, out_flags, i = [], [], 0
    while i < len(line):
        if line[i] == "`":
            run = len(line[i:]) - len(line[i:].lstrip("`"))
            close = _closing_ticks(line, i + run, run)
            if close >= 0:                                # a code span: verbatim, ticks included
                out.append(line[i:close + run])
                out_flags += flags[i:close + run]
                i = close + run
                continue
            out.append(line[i:i + run])
            out_flags += flags[i:i + run]
            i += run
            continue
        if line[i] == "&" and _ENTITY.match(line, i):
            out.append("\\")
            out_flags.append(flags[i])
        out.append(line[i])
        out_flags.append(flags[i])
        i += 1
    return "".join(out), out_flags


def _closing_ticks(line: str, start: int, run: int) -> int:
    """Where the run of exactly `run` backticks that closes a code span begins, or -1."""
    i = start
    while True:
        j = line.find("`" * run, i)
        if j < 0:
            return -1
        end = j + run
        if (j == 0 or line[j - 1] != "`") and (end >= len(line) or line[end] != "`"):
            return j
        i = end + len(line[end:]) - len(line[end:].lstrip("`"))


def insert_answer(cursor: QTextCursor, text: str, spans: Sequence[Sequence[int]], highlight: bool) -> None:
    """Insert `text` as Markdown at the cursor and paint the characters inside `spans`."""
    lead = len(text) - len(text.lstrip("\n"))        # an answer that opens with blank lines starts at its text
    source, flags = markdown_source(text[lead:], char_flags(text, spans)[lead:])
    start = cursor.position()
    cursor.insertMarkdown(source, MARKDOWN)
    _keep_first_fence(cursor.document().findBlock(start), start, source)
    end = cursor.position()
    _highlight(cursor, start, end, source, flags, highlight)
    style_code(cursor, start)


def _keep_first_fence(block: QTextBlock, start: int, source: str) -> None:
    """Markdown inserted into a block merges its first line into that block, which keeps its own format: an
    answer that opens with a fenced code block lost its first line's fence (drawn outside the code background,
    not copied). The fence is given back from the source's own first block."""
    if block.position() != start or not source.lstrip(" ").startswith(("```", "~~~")) or is_code(block):
        return          # (text before the answer in its block: not code)
    alone = QTextDocument()
    alone.setMarkdown(source, MARKDOWN)
    if is_code(alone.begin()):
        QTextCursor(block).mergeBlockFormat(alone.begin().blockFormat())


def _highlight(cursor: QTextCursor, start: int, end: int, source: str, flags: list[bool], highlight: bool) -> None:
    if not highlight or not any(flags):
        return
    cursor.setPosition(start)
    cursor.setPosition(end, QTextCursor.MoveMode.KeepAnchor)
    shown = cursor.selectedText()
    fmt = QTextCharFormat()
    fmt.setBackground(DRAFT_COLOUR)
    for a, b in _runs(_align(shown, source, flags)):
        cursor.setPosition(start + a)
        cursor.setPosition(start + b, QTextCursor.MoveMode.KeepAnchor)
        cursor.mergeCharFormat(fmt)
    cursor.setPosition(end)


def _align(shown: str, source: str, flags: list[bool]) -> list[bool]:
    """Flags of the shown characters: Markdown drops markup but keeps the order of the text, so each shown
    character is the next equal character of the source (separators have none)."""
    out, p = [], 0
    for ch in shown:
        j = -1 if ch in _SEPARATORS else source.find(ch, p, p + _LOOKAHEAD)
        if j < 0:
            out.append(False)
            continue
        out.append(flags[j])
        p = j + 1
    return out


def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, f in enumerate(flags + [False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            runs.append((start, i))
            start = None
    return runs


def is_code(block: QTextBlock) -> bool:
    """A line of a fenced code block (Qt's Markdown reader marks each with its fence)."""
    return block.isValid() and block.blockFormat().hasProperty(QTextFormat.Property.BlockCodeFence)


def style_code(cursor: QTextCursor, start: int) -> None:
    """From `start` to the cursor: each code block's lines get the code background and a monospace font, and a
    "Copy code" link goes in a line of its own under the block. The cursor ends after the last of them."""
    doc = cursor.document()
    end = QTextCursor(doc)                     # moves with what is inserted before it
    end.setPosition(cursor.position())
    mono = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
    code_chars = QTextCharFormat()
    code_chars.setFontFamilies([mono.family(), "monospace"])
    code_chars.setFontFixedPitch(True)
    code_lines = QTextBlockFormat()
    code_lines.setBackground(CODE_BACKGROUND)
    block = doc.findBlock(start)
    while block.isValid() and block.position() < end.position():
        if not is_code(block):
            block = block.next()
            continue
        first = block.position()
        last = block
        while is_code(last.next()) and last.next().position() < end.position():
            last = last.next()
        c = QTextCursor(doc)
        c.setPosition(first)
        c.setPosition(last.position() + last.length() - 1, QTextCursor.MoveMode.KeepAnchor)
        c.mergeBlockFormat(code_lines)
        c.mergeCharFormat(code_chars)
        c.setPosition(last.position() + last.length() - 1)
        c.insertBlock(QTextBlockFormat(), QTextCharFormat())
        link = QTextCharFormat()
        link.setAnchor(True)
        link.setAnchorHref(f"{COPY_SCHEME}:{first}")
        link.setForeground(QColor("#2060c0"))
        link.setFontUnderline(True)
        c.insertText(COPY_TEXT, link)
        c.setCharFormat(QTextCharFormat())
        block = c.block().next()
    cursor.setPosition(end.position())
    cursor.setCharFormat(QTextCharFormat())    # what is typed next is no link


def code_text(doc: QTextDocument, position: int, strip: str = CURSOR) -> str:
    """The text of the code block whose first line starts at `position` (a copy link's href), without the
    streaming cursor."""
    block = doc.findBlock(position)
    lines = []
    while is_code(block):
        lines.append(block.text())
        block = block.next()
    return "\n".join(lines).replace(strip, "")
