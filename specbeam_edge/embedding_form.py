"""The embedding table as a split model folder stores it (files.embed_table in specbeam_config.json): its forms, the
side files each needs, the bytes each file holds, how 4-bit codes share a byte and the values codes stand for. One
record for the exporter that writes the table (export/split.py; the whole graph's GGUF blocks, export/whole.py) and
the runtime that checks the entry (folder_files.check_embed_table) and reads its rows (execution/offload.py); numpy
only, so the runtime loads it without the exporter.

The forms, by the entry's `dtype`: float32 and float16 hold the values; int8 holds codes with one fp32 scale per
`block` values of a row (weights/embed_scale.bin); uint8 holds a GGUF's own blocks: 8-bit codes, or with `bits` 4
two codes a byte (a block's first half in the low nibbles), each value (code - `zero`) x its block's scale, plus
its block's offset where the kind has one (weights/embed_offset.bin)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TABLE_FILE = "weights/embed.bin"


@dataclass(frozen=True)
class Form:
    """One stored form of the table file: a value's bytes (codes: at 8 bits), whether its codes take a scale per
    block (scale_file and block), and whether it is a GGUF's own blocks (bits, zero and an optional offset_file)."""
    bytes: int
    scales: bool = False
    gguf: bool = False


FORMS = {"float32": Form(4), "float16": Form(2), "int8": Form(1, scales=True), "uint8": Form(1, scales=True, gguf=True)}
CODE_BITS = (4, 8)                  # a GGUF form's bits
DEFAULTS = {"bits": 8, "zero": 0}   # what an entry without them means
SIDES = ("scale", "offset")         # side files of fp32 per block of the table, in the order they are written


def side_file(what: str) -> str:
    """The side file `what` (SIDES) in the model folder."""
    return f"weights/embed_{what}.bin"


def side_keys(what: str) -> tuple[str, str]:
    """The entry's keys of the side file `what`: its name and its SHA-256."""
    return f"{what}_file", f"{what}_sha256"


DIGESTS = ("sha256", *(side_keys(what)[1] for what in SIDES))    # hex SHA-256 of the table and its side files


def file_bytes(t: dict, rows: int, cols: int) -> dict[str, int]:
    """{file: the bytes it holds} of every file of the (checked) entry `t` of a [rows, cols] table."""
    want = {t["file"]: rows * cols * FORMS[t["dtype"]].bytes * t.get("bits", DEFAULTS["bits"]) // 8}
    if FORMS[t["dtype"]].scales:
        for what in SIDES:
            key = side_keys(what)[0]
            if key in t:
                want[t[key]] = rows * cols // t["block"] * 4
    return want


def pack4(codes: np.ndarray) -> np.ndarray:
    """4-bit codes [..., block] two a byte [..., block / 2]: the block's first half in the low nibbles."""
    half = codes.shape[-1] // 2
    return codes[..., :half] | (codes[..., half:] << 4)


def unpack4(packed: np.ndarray) -> np.ndarray:
    """The codes [..., block] of pack4's bytes [..., block / 2]."""
    return np.concatenate([packed & np.uint8(15), packed >> np.uint8(4)], axis=-1)


def block_values(codes: np.ndarray, scale: np.ndarray, zero: int = 0, offset: np.ndarray | None = None) -> np.ndarray:
    """The fp32 values [rows, blocks x block] of codes [rows, blocks, block] (unpacked) with one scale [rows, blocks]
    per block: (code - zero) x scale (+ offset [rows, blocks]), as gguf-py dequantizes a file's blocks."""
    v = codes.astype(np.float32)
    if zero:
        v = v - np.float32(zero)
    v = v * scale[..., None]
    if offset is not None:
        v = v + offset[..., None]
    return v.reshape(v.shape[0], -1)
