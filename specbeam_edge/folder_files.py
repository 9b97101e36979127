"""The files a model folder's config names, checked on load (config.ModelConfig.load): `files.*` entries, split
layer files, the embedding table, checksums, and that every name stays inside the folder. A damaged or hostile
entry is one line naming the file, the key and the fix (ModelFolderError), never a traceback or seconds of work."""
from __future__ import annotations

import os
from pathlib import Path

from .embedding_form import CODE_BITS, DEFAULTS, DIGESTS, FORMS, SIDES, file_bytes, side_keys


class ModelFolderError(ValueError):
    """A model folder that cannot be used; the message names the folder and the problem."""


def short(value, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters: a message quotes what it found, never a megabyte of it."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def few(names, limit: int = 4) -> str:
    """The first `limit` names, then how many more: a listing in a message stays one short line."""
    names = list(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(map(str, names[:limit])) + more


def inside(folder: Path, name: str, what: str | None = None, config: Path | None = None) -> Path:
    """folder / name, refused unless it stays inside the folder with links followed: an absolute or ../ name in
    the config, or a file linked from elsewhere, made the runtime read files outside the model folder."""
    folder = Path(folder)
    root = folder.resolve()
    target = (root / name).resolve()
    if target == root or target.is_relative_to(root):
        return folder / name
    if Path(name).is_absolute() or ".." in Path(name).parts:
        what = f"{what} is {short(name, 200)}," if what else f"{short(name, 200)} is"
        raise ModelFolderError(f"{config or folder}: {what} outside the model folder; name a file inside the folder "
                               f"(re-export the model)")
    raise ModelFolderError(f"{folder / name} links outside the model folder (to {short(str(target), 200)}); put a "
                           f"copy of the file in the folder instead of a link")


# files.* entries that name one file each, and those that hold {key: file name}
_FILE_KEYS = ("model", "embed", "layer", "head", "encoder", "layer_weights")
_NESTED_FILE_KEYS = {"embed_table": ("file", *(side_keys(what)[0] for what in SIDES)),
                     "layer_resident": ("graph", "tables")}


def check_file_names(files: dict, path: Path) -> dict[str, str]:
    """Every file name files.* holds is a non-empty string ({name: its key} for messages): an int or a list
    failed as a traceback deep in the loader."""
    named = [(k, files[k]) for k in _FILE_KEYS if k in files]
    named += [(f"{k}.{sub}", files[k][sub]) for k, subs in _NESTED_FILE_KEYS.items()
              if isinstance(files.get(k), dict) for sub in subs if sub in files[k]]
    for key, name in named:
        if not isinstance(name, str) or not name:
            raise ModelFolderError(f"{path}: files.{key} must be a file name in the model folder (a string), got "
                                   f"{short(name)}; re-export the model")
    return {name: f"files.{key}" for key, name in named}


def check_layer_count(cfg, path: Path) -> None:      # cfg: the config.ModelConfig being loaded
    """num_layers within what the folder holds, before any per-layer list is built: a count of a million took
    seconds and wrote a 14 MB error. files.layer_weights must name each layer's file by "{i}"."""
    template = cfg.files["layer_weights"]
    try:
        first = template.format(i=0) if "{i}" in template else None
    except (AttributeError, TypeError, IndexError, KeyError, ValueError):
        first = None
    if first is None:
        raise ModelFolderError(f"{path}: files.layer_weights must be a file name with {{i}} for the layer number "
                               f"(e.g. weights/layer_{{i}}.bin), got {short(template)}; re-export the model")
    parent = (cfg.folder / first).parent
    held = sum(1 for _ in os.scandir(parent)) if parent.is_dir() else 0
    if cfg.num_layers > held:
        raise ModelFolderError(f"{path}: num_layers is {cfg.num_layers}, but {parent} holds {held} files; set it "
                               f"to the model's layer count or re-export the model")


def check_manifest(manifest, path: Path) -> None:
    """files.layer_manifest: [{name, dtype, shape, offset}...], the tensor layout every layer file shares."""
    keys = {"name", "dtype", "shape", "offset"}
    if not isinstance(manifest, list) or not manifest or not all(isinstance(m, dict) and keys <= m.keys()
                                                                  for m in manifest):
        raise ModelFolderError(f"{path}: files.layer_manifest must be a non-empty list of {{name, dtype, shape, "
                               f"offset}} objects; re-export the model")


def check_embed_table(cfg, path: Path) -> None:      # cfg: the config.ModelConfig being loaded
    """files.embed_table (its forms: embedding_form.py): {file, dtype (float32 | float16 | int8 | uint8), shape
    [vocab_size, hidden_size]} (int8: and scale_file, one float32 per `block` values of a row; uint8, a GGUF's own
    blocks: scale_file, `block`, `bits` 4 or 8, an integer `zero` and an optional offset_file of float32 per block),
    and files of exactly that many bytes (a truncated or replaced table fails here, by name, not as wrong text); its
    optional sha256, scale_sha256 and offset_sha256 are hex digests."""
    t = cfg.files["embed_table"]
    form = FORMS.get(t.get("dtype")) if isinstance(t, dict) else None
    ok = (form is not None and isinstance(t.get("file"), str) and t.get("shape") == [cfg.vocab_size, cfg.hidden_size]
          and (not form.scales or (isinstance(t.get("scale_file"), str) and type(t.get("block")) is int
                                   and t["block"] > 0 and cfg.hidden_size % t["block"] == 0))
          and (not form.gguf or (t.get("bits", DEFAULTS["bits"]) in CODE_BITS
                                 and type(t.get("zero", DEFAULTS["zero"])) is int
                                 and isinstance(t.get("offset_file", ""), str))))
    if not ok:
        raise ModelFolderError(f"{path}: files.embed_table must be {{file, dtype float32|float16|int8|uint8 (int8 and "
                               f"uint8 with a scale_file and a block dividing {cfg.hidden_size}; uint8 with bits 4 "
                               f"or 8), shape [{cfg.vocab_size}, {cfg.hidden_size}]}}; re-export the model")
    for key in DIGESTS:     # checked on load (offload.embedding_table)
        if key in t and not _is_digest(t[key]):
            raise ModelFolderError(f"{path}: files.embed_table.{key} must be a hex SHA-256 digest, got "
                                   f"{short(t[key])}; re-export the model")
    for name, size in file_bytes(t, cfg.vocab_size, cfg.hidden_size).items():
        got = (cfg.folder / name).stat().st_size
        if got != size:
            raise ModelFolderError(f"{cfg.folder / name}: {got} bytes, the embedding table needs {size} (truncated "
                                   f"or replaced after export); restore it or re-export the model")


def check_graph_sums(sums, folder: Path, path: Path) -> None:
    """files.sha256 (optional; exports before it lack it): {file in the folder: hex SHA-256} of a whole graph
    and its tensors' file, checked on load (integrity.py)."""
    if sums is None:
        return
    if not isinstance(sums, dict) or not all(isinstance(n, str) and _is_digest(h) for n, h in sums.items()):
        raise ModelFolderError(f"{path}: files.sha256 must map file names to hex SHA-256 digests; re-export the "
                               f"model")
    for name in sums:
        if not inside(folder, name, "files.sha256 entry", path).is_file():
            raise ModelFolderError(f"{folder}: missing file {short(name, 200)} (files.sha256 names it)")


def _is_digest(h) -> bool:
    return isinstance(h, str) and len(h) == 64 and all(c in "0123456789abcdef" for c in h)


def check_checksums(sums, num_layers: int, path: Path) -> None:
    """files.layer_sha256 (optional; older exports lack it): one hex SHA-256 per layer weight file."""
    if sums is None:
        return
    if not isinstance(sums, list) or len(sums) != num_layers or not all(
            isinstance(h, str) and len(h) == 64 and all(c in "0123456789abcdef" for c in h) for h in sums):
        raise ModelFolderError(f"{path}: files.layer_sha256 must list {num_layers} hex SHA-256 digests (one per "
                               f"layer file); re-export the model")
