"""The embedding table's stored forms (the split layout's file form is recorded in specbeam_edge/embedding_form.py):
the table read from the checkpoint a chunk of rows at a time as each precision stores it (table_chunks), or in a
GGUF's own blocks (file_table_chunks), which both layouts write; int8 codes with a scale per block of 32 (the int8
precision's table; quantize, dequantize, and the graph's per-token lookup), a GGUF's own blocks looked up and
dequantized in the graph (blocks_lookup), and the fp32 table a whole graph stands for, read back from its
initializers (embedding_values)."""
from __future__ import annotations

import numpy as np
from onnx import helper as oh, numpy_helper as onh

from specbeam_edge.embedding_form import block_values, pack4, unpack4

from . import graph
from .builder import F32, Builder
from .hf import Arch, embed_rows
from .quant import row_chunks

EMBED = "model.embed_tokens.weight"


def table_chunks(w, arch: Arch, precision: str):
    """The embedding table as `precision` stores it, a chunk of rows at a time: (values, scales or None). int8:
    codes with a scale per block of 32 (quantize_embed_rows); int8w: codes with a scale per row
    (graph.stored_weight's form); fp16, fp32: the rows as half or single floats."""
    for a, z in row_chunks(arch.vocab_size):
        rows = embed_rows(w, arch, a, z)
        if precision == "int8":
            yield quantize_embed_rows(rows)
        elif precision == "int8w":
            q, scale = graph.quantize_int8(rows.T)           # per row of the table: symmetric, 127 steps
            yield q.T, scale
        else:
            yield rows.astype(np.float16 if precision == "fp16" else np.float32, copy=False), None


class OffBlocks(Exception):
    """The file's embedding blocks do not give transformers' values (the caller writes the table otherwise)."""


def embedding_blocks(w, arch: Arch):
    """The first row of the embedding table in the GGUF's own blocks (export.blocks.Blocks: its kind), or None for
    a table the file stores otherwise or one the family scales (Gemma)."""
    return None if arch.embed_scale != 1.0 else w.blocks(EMBED, 0, 1)


def file_table_chunks(w, arch: Arch):
    """The embedding table in the file's own blocks a chunk of rows at a time, each chunk checked bit for bit
    against the values transformers looks up (embed_rows); raises OffBlocks where they differ."""
    for a, z in row_chunks(arch.vocab_size):
        blk = w.blocks(EMBED, a, z)
        if not np.array_equal(blk.values().T, embed_rows(w, arch, a, z)):
            raise OffBlocks
        yield blk


def packed_codes(blk) -> np.ndarray:
    """A table chunk's codes as stored: [rows, blocks, bs] uint8, or for 4-bit kinds two codes a byte [rows,
    blocks, bs / 2] (embedding_form.pack4)."""
    return pack4(blk.codes) if blk.bits == 4 else blk.codes


def embed_block(hidden: int) -> int:
    """The int8 embedding's block: 32 values a scale (as llama.cpp's Q8_0) where the width allows, else a row."""
    return 32 if hidden % 32 == 0 else hidden


def quantize_embed_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Table rows [n, H] as int8 codes [n, H] and one fp32 scale per block of embed_block(H) values [n, H / block]
    (symmetric, 127 steps); a row's value is code x its block's scale, in fp32. Blocks of 32 keep an outlier
    from coarsening its whole row: random-weight Gemma 3's logits moved 8.3% of the largest with a scale a row."""
    n, H = rows.shape
    blk = rows.reshape(n, H // embed_block(H), embed_block(H))
    scale = (np.maximum(np.abs(blk).max(axis=-1), 1e-8) / 127.0).astype(np.float32)
    q = np.clip(np.rint(blk / scale[..., None]), -127, 127).astype(np.int8)
    return q.reshape(n, H), scale


def dequantize_embed(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The fp32 table that codes [n, H] and block scales [n, H / block] stand for (quantize_embed_rows)."""
    return block_values(q.reshape(*scale.shape, -1), scale).reshape(q.shape)


def blocks_lookup(ids: str, out: str, packed: bool, zero: bool, offset: bool) -> list:
    """Nodes giving `out` [B, S, H]: the embedding rows of `ids` from a table in a GGUF's own blocks (export/whole.py
    writes its initializers: embed.codes [V, blocks, bs or bs / 2 packed], embed.bscale and embed.boffset [V,
    blocks, 1], embed.bzero, embed.low_mask, embed.shift, embed.flat), each value (code - zero) x scale (+ offset)
    in fp32, as gguf-py dequantizes the file. The lookahead head looks its tokens up with the same nodes."""
    p = out + "."
    nodes = [oh.make_node("Gather", ["embed.codes", ids], [p + "codes"], axis=0)]
    rows = p + "codes"
    if packed:              # two codes a byte: the block's first half in the low nibbles
        nodes += [oh.make_node("BitwiseAnd", [rows, "embed.low_mask"], [p + "lo"]),
                  oh.make_node("BitShift", [rows, "embed.shift"], [p + "hi"], direction="RIGHT"),
                  oh.make_node("Concat", [p + "lo", p + "hi"], [p + "unpacked"], axis=-1)]
        rows = p + "unpacked"
    nodes.append(oh.make_node("Cast", [rows], [p + "codesf"], to=F32))
    v = p + "codesf"
    if zero:
        nodes.append(oh.make_node("Sub", [v, "embed.bzero"], [p + "centred"]))
        v = p + "centred"
    nodes += [oh.make_node("Gather", ["embed.bscale", ids], [p + "bscale"], axis=0),
              oh.make_node("Mul", [v, p + "bscale"], [p + "scaled"])]
    v = p + "scaled"
    if offset:
        nodes += [oh.make_node("Gather", ["embed.boffset", ids], [p + "boffset"], axis=0),
                  oh.make_node("Add", [v, p + "boffset"], [p + "offset"])]
        v = p + "offset"
    return nodes + [oh.make_node("Reshape", [v, "embed.flat"], [out])]


def embedding_values(initializers, base_dir: str | None = None) -> np.ndarray | None:
    """The fp32 embedding table a whole graph looks tokens up in, from its initializers (TensorProtos; base_dir:
    where their external data lies): `embed.weight`, or the int8 codes and block scales as the graph computes
    them. None when the graph holds neither."""
    names = ("embed.weight", "embed.weight.i8", "embed.weight.blockscale", "embed.codes", "embed.bscale",
             "embed.bzero", "embed.boffset", "embed.low_mask")
    t = {i.name: i for i in initializers if i.name in names}
    read = lambda name: onh.to_array(t[name], base_dir)     # noqa: E731
    if "embed.weight" in t:
        return read("embed.weight").astype(np.float32)
    if {"embed.weight.i8", "embed.weight.blockscale"} <= t.keys():
        return dequantize_embed(read("embed.weight.i8"), read("embed.weight.blockscale"))
    if {"embed.codes", "embed.bscale"} <= t.keys():          # a GGUF's own blocks (export/whole.py)
        codes = read("embed.codes")
        if "embed.low_mask" in t:              # 4-bit codes, two a byte (blocks_lookup unpacks them with it)
            codes = unpack4(codes)
        return block_values(codes, read("embed.bscale")[..., 0], read("embed.bzero") if "embed.bzero" in t else 0,
                            read("embed.boffset")[..., 0] if "embed.boffset" in t else None)
    return None


def _int8_rows_embedding(b: Builder, hidden: int) -> str:
    """The embedding as int8 codes with a scale a block (quantize_embed_rows), looked up and scaled per token: the
    split layout's int8 table (export/split.py, offload.TableRows) computes the same fp32 products from its file.
    The caller adds the initializers embed.weight.i8 and embed.weight.blockscale (export/whole.py)."""
    blocks = b.init("embed.blocks", np.array([0, 0, hidden // embed_block(hidden), embed_block(hidden)], np.int64))
    rows = b.node("Cast", [b.node("Gather", ["embed.weight.i8", "input_ids"], ["h0.i8"], axis=0)],
                  ["h0.codes"], to=F32)
    rows = b.node("Reshape", [rows, blocks], ["h0.blocks"])
    scale = b.node("Gather", ["embed.weight.blockscale", "input_ids"], ["h0.scale"], axis=0)
    scale = b.node("Unsqueeze", [scale, b.init("embed.last_axis", np.array([-1], np.int64))], ["h0.scale1"])
    flat = b.init("embed.flat", np.array([0, 0, hidden], np.int64))
    return b.node("Reshape", [b.node("Mul", [rows, scale], ["h0.scaled"]), flat], ["h0"])
