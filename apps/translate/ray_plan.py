"""The plan of an --engine ray run, made before the cluster starts: the input files (a file, a folder or a glob;
each real file once, the run's own files never), where each output goes (refusing one that would replace an
input), the shards every file is cut into and the input's digest that keys the manifest.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from .files import UsageError, check_output

PART_DIGITS = 6


@dataclass(frozen=True)
class Shard:
    index: int          # its record key in the manifest and its part file's number
    file: int           # index into the job's input files
    first: int          # input line index (in its file) of its first line
    count: int

    @property
    def part(self) -> str:
        return f"part-{self.index:0{PART_DIGITS}d}"


def _has_magic(text: str) -> bool:
    return any(c in text for c in "*?[")


def own_files(output: Path | None) -> list[str]:
    """Real paths of what a run on -o writes (the output, its shard folder, lock, pid file and journal): never
    read as input, also when -o lies inside the input folder."""
    if output is None:
        return []
    return [os.path.realpath(output.with_name(output.name + suffix))
            for suffix in ("", ".shards", ".lock", ".lock.pid", ".journal")]


def _under(real: str, folder: str) -> bool:
    return real == folder or real.startswith(folder.rstrip(os.sep) + os.sep)


def _is_own(path: Path, own: list[str]) -> bool:
    real = os.path.realpath(path)
    return any(_under(real, o) for o in own)


def _own_below(root: Path, own: list[str]) -> list[str]:
    """The run's own paths that can hold inputs' siblings: an -o folder that holds the input root itself is
    not excluded as a whole (output_paths refuses any output that would replace an input)."""
    real = os.path.realpath(root)
    return [o for o in own if not _under(real, o)]


def input_files(spec: str, output: Path | None = None) -> tuple[list[tuple[Path, str]], bool]:
    """(path, name relative to the input root) of every input file, and whether -o is a folder (a folder or a
    glob input) rather than a file (a file input). Each real file is listed once (a symlink loop or a second
    link to a file is not translated twice; `**` does not descend into symlinked folders), and the run's own
    files on `output` are never inputs."""
    path = Path(spec)
    own = own_files(output)
    if path.is_file():
        return [(path, path.name)], False
    if path.is_dir():
        if output is not None and os.path.realpath(output) == os.path.realpath(path):
            raise UsageError(f"-o {output} is the input folder: the outputs would replace their inputs; write to "
                             f"another folder")
        files = [p for p in sorted(path.rglob("*")) if p.is_file()
                 and not any(part.startswith(".") for part in p.relative_to(path).parts)]
        own = _own_below(path, own)
        files = _unique(p for p in files if not _is_own(p, own))
        if not files:
            raise UsageError(f"input folder {path} holds no files")
        return [(p, p.relative_to(path).as_posix()) for p in files], True
    if not _has_magic(spec):
        raise UsageError(f"input {spec} does not exist; pass a file, a folder or a glob")
    prefix = _prefix(path.parts)
    rest = path.parts[len(prefix):]
    if ".." in rest:
        raise UsageError(f"input glob {spec}: '..' after a wildcard could leave the input folder (and put outputs "
                         f"outside -o); name the folder before the first wildcard instead")
    root = Path(*prefix) if prefix else Path(".")
    hidden_ok = any(part.startswith(".") for part in rest)
    files = [p for p in sorted(root.glob(str(Path(*rest)))) if p.is_file()
             and (hidden_ok or not any(part.startswith(".") for part in p.relative_to(root).parts))]
    own = _own_below(root, own)
    files = _unique(p for p in files if not _is_own(p, own))
    if not files:
        raise UsageError(f"no input file matches {spec}")
    return [(p, p.relative_to(root).as_posix()) for p in files], True


def _unique(paths) -> list[Path]:
    """The first path to each real file (sorted order in, sorted order out)."""
    seen, out = set(), []
    for p in paths:
        real = os.path.realpath(p)
        if real not in seen:
            seen.add(real)
            out.append(p)
    return out


def _prefix(parts: tuple[str, ...]) -> list[str]:
    """The folders of a glob before its first wildcard: outputs keep the paths below them."""
    out = []
    for p in parts[:-1]:
        if _has_magic(p):
            break
        out.append(p)
    return out


def output_paths(output: Path, files: list[tuple[Path, str]], folder: bool) -> list[Path]:
    """Where each input file's output goes; fails before any work if -o cannot take them (a special file, a
    file where a folder is needed, or an output that is one of the inputs)."""
    if not folder:
        check_output(str(output), str(files[0][0]))
        return [output]
    if output.exists() and not output.is_dir():
        raise UsageError(f"output {output} is a file; with a folder or glob input, -o is a folder")
    if not output.parent.is_dir():
        raise UsageError(f"the output's directory {output.parent} does not exist; create it first")
    outs = [output / name for _, name in files]
    inputs = {os.path.realpath(p): p for p, _ in files}
    for out in outs:
        if os.path.realpath(out) in inputs:
            raise UsageError(f"output {out} would replace the input {inputs[os.path.realpath(out)]}; write to "
                             f"another -o")
    return outs

def plan(counts: list[int], shard_lines: int) -> list[Shard]:
    """Shards in input order: every file cut into runs of shard_lines lines (a shard never spans two files)."""
    shards = []
    for f, n in enumerate(counts):
        for first in range(0, n, shard_lines):
            shards.append(Shard(len(shards), f, first, min(shard_lines, n - first)))
    return shards


def input_sha256(names: list[str], raws: list[bytes]) -> str:
    h = hashlib.sha256()
    for name, raw in zip(names, raws):
        h.update(f"{name}\0{hashlib.sha256(raw).hexdigest()}\0".encode())
    return h.hexdigest()
