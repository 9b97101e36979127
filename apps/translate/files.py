"""The translate tool's files: the input (stdin or -i) and the files flags name (--target_prefix, --eval, the
glossary) read with devices refused, universal newlines and a BOM dropped; -o checked before any work; the lines
written to stdout in input order (InOrder). UsageError: an unusable argument or file, exit code 2.
"""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from .journal import special_kind


class UsageError(ValueError):
    """Bad arguments or unusable input found after parsing: exit code 2, one line."""


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
