"""The whole layout written a piece at a time: the inputs and embedding, each decoder layer, then the head are built
as graph pieces one after another; each piece's MatMul weights are quantized within it (quant.rowwise_int8,
blocks.gguf_int4, or onnxruntime's round-to-nearest MatMulNBits quantizer, which all rewrite a weight's MatMul
alone) and its tensors are appended to `model.onnx.data` before the next piece is read. The graph file keeps only
the nodes and the tensors' places, so what the export holds at once is one piece, not the model (the 0.5B
draft's int4 export took 12.5 GB whole)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper as oh

from specbeam_edge.contract import past_names, present_names

from . import graph, save
from .attention import _common_inputs
from .blocks import Blocks, block_counts, gguf_int4
from .families import LayerTensors
from .builder import F32, OPSET, Builder
from .embedding import _int8_rows_embedding, blocks_lookup
from .hf import Arch, final_norm
from .quant import row_chunks, rowwise_int8
from .save import DataFile
from .split import OffBlocks, embedding_blocks, file_table_chunks, head_weights, packed_codes, table_chunks

# precisions whose quantization rewrites each weight's MatMul on its own; the others (int8dyn's per-tensor
# activation scales, fp16 compute's graph-wide conversion) keep the in-memory path (core.py)
STREAMED = ("fp32", "fp16", "int8w", "int8", "int4")


class _OffGrid(Exception):
    """A piece's weights lie on no GGUF block grid after earlier pieces' did: the export starts again with
    round-to-nearest for every piece, as the whole graph's quantizer decided before (blocks.gguf_int4)."""


class _Quantizer:
    """Quantizes piece after piece as the whole graph's quantizer would; `entry` is the config's quantization."""

    def __init__(self, precision: str, block_size: int, reduce_range: bool, force_rtn: bool):
        self.precision, self.block_size, self.reduce_range = precision, block_size, reduce_range
        self.mode = "rtn" if force_rtn or block_size != 32 else None      # int4: None until a piece decides
        self.entry = None

    def __call__(self, piece: onnx.ModelProto, known=None) -> onnx.ModelProto:
        """known: the piece's weights' own GGUF blocks by initializer name, a callable giving them (int4 only)."""
        if not any(n.op_type == "MatMul" for n in piece.graph.node):
            return piece
        if self.precision == "int8":
            q = rowwise_int8(piece, reduce_range=self.reduce_range)
            self.entry = {**q, "matmuls": (self.entry or {}).get("matmuls", 0) + q["matmuls"]}
        elif self.precision == "int4":
            return self._int4(piece, known)
        return piece

    def _int4(self, piece, known):
        if self.mode != "rtn":
            blocks, trusted = known() if known else (None, False)
            q = gguf_int4(piece, blocks, trusted)
            if q is None and self.mode == "grid":
                raise _OffGrid
            if q is not None:
                self.mode = "grid"
                blocks = dict((self.entry or {}).get("blocks", {}))
                for k, v in q["blocks"].items():
                    blocks[k] = blocks.get(k, 0) + v
                self.entry = {**q, **block_counts(blocks)}
                return piece
            self.mode = "rtn"
        piece, self.entry = save.rtn_int4(piece, self.block_size)
        return piece


def _embedding(b: Builder, data: DataFile, w, arch: Arch, precision: str) -> None:
    """The embedding lookup, its table written to the data file a chunk of rows at a time as whole_model stores it
    (table_chunks): int8 codes with a scale per block of 32 (int8), int8 codes times a scale a row (int8w),
    half or single floats."""
    V, H = arch.vocab_size, arch.hidden
    if precision in ("int4", "int8") and _blocks_embedding(b, data, w, arch):
        return
    scales = []

    def values():
        for rows, scale in table_chunks(w, arch, precision):
            if scale is not None:
                scales.append(scale)
            yield rows
    if precision == "int8":
        b.inits.append(data.table("embed.weight.i8", np.int8, (V, H), values()))
        b.init("embed.weight.blockscale", np.concatenate(scales))
        _int8_rows_embedding(b, None, H)
        return
    if precision == "int8w":                       # graph.stored_weight's form
        b.inits.append(data.table("embed.weight.i8", np.int8, (V, H), values()))
        b.init("embed.weight.scale", np.concatenate(scales)[:, None])
        emb = b.node("Mul", [b.node("Cast", ["embed.weight.i8"], ["embed.weight.i8f"], to=F32),
                             "embed.weight.scale"], ["embed.weight"])
    else:
        emb = "embed.weight" if precision != "fp16" else "embed.weight.f16"
        b.inits.append(data.table(emb, np.float16 if precision == "fp16" else np.float32, (V, H), values()))
        if precision == "fp16":
            emb = b.node("Cast", [emb], ["embed.weight"], to=F32)
    b.node("Gather", [emb, "input_ids"], ["h0"], axis=0)


def _blocks_embedding(b: Builder, data: DataFile, w, arch: Arch) -> bool:
    """int4 and int8 from a GGUF: the embedding table in the file's own blocks (codes, fp32 scales, offsets or a zero
    point), looked up and dequantized per token in the graph exactly as gguf-py dequantizes the file (so the
    table is the file's, at 6-10 bits a value instead of fp32's 32). 4-bit codes are stored two to a byte (the
    block's first half in the low nibbles). False (nothing written) when the file's table is not in blocks."""
    first = embedding_blocks(w, arch)
    if first is None:
        return False
    bits, bs, zero = first.bits, first.block, first.zero
    nb, V, half = arch.hidden // bs, arch.vocab_size, bs // 2
    scales, offsets = [], []

    def codes():
        for blk in file_table_chunks(w, arch):
            scales.append(blk.scale)
            if blk.offset is not None:
                offsets.append(blk.offset)
            yield packed_codes(blk)
    try:
        b.inits.append(data.table("embed.codes", np.uint8, (V, nb, half if bits == 4 else bs), codes()))
    except OffBlocks:      # (the chunks written so far stay in the data file, unreferenced)
        return False
    b.init("embed.bscale", np.concatenate(scales)[..., None])
    if bits == 4:
        b.init("embed.low_mask", np.array(15, np.uint8))
        b.init("embed.shift", np.array(4, np.uint8))
    if zero:
        b.init("embed.bzero", np.array(zero, np.float32))
    if offsets:
        b.init("embed.boffset", np.concatenate(offsets)[..., None])
    b.init("embed.flat", np.array([0, 0, arch.hidden], np.int64))
    b.nodes.extend(blocks_lookup("input_ids", "h0", bits == 4, bool(zero), bool(offsets)))
    return True


def _head_blocks(w, head: str, ids):
    """The head matrix's own GGUF blocks (its rows `ids` for a head of some tokens), each chunk of rows checked bit
    for bit against the tensor's values; None when the file stores it otherwise or the values differ."""
    b = w.blocks(head)
    if b is None:
        return None
    if not all(b.rows(a, z).equals(np.asarray(w.rows(head, a, z), np.float32).T)
               for a, z in row_chunks(b.codes.shape[0])):
        return None
    if ids is not None and len(ids) < b.codes.shape[0]:
        b = Blocks(b.kind, b.codes[ids], b.scale[ids], None if b.offset is None else b.offset[ids])
    return b


def _piece(b: Builder) -> onnx.ModelProto:
    return oh.make_model(oh.make_graph(b.nodes, "piece", [], [], b.inits),
                         opset_imports=[oh.make_opsetid("", OPSET)], ir_version=10)


def write_whole(tmp: Path, w, arch: Arch, head: str, head_ids, precision: str, output: str, attention: str,
                block_size: int, reduce_range: bool, step, force_rtn: bool = False) -> dict | None:
    """model.onnx and model.onnx.data into `tmp`; returns the config's quantization entry (None: as stored)."""
    try:
        return _write(tmp, w, arch, head, head_ids, precision, output, attention, block_size, reduce_range, step,
                      force_rtn)
    except _OffGrid:
        step("some weights lie on no GGUF block grid: quantizing every weight round-to-nearest")
        return _write(tmp, w, arch, head, head_ids, precision, output, attention, block_size, reduce_range, step,
                      True)


def _write(tmp, w, arch, head, head_ids, precision, output, attention, block_size, reduce_range, step, force_rtn):
    store = "fp32" if precision in ("int8", "int4") else precision        # as whole_model stores weights
    quantize = _Quantizer(precision, block_size, reduce_range, force_rtn)
    data = DataFile(tmp / "model.onnx.data")
    nodes, inits, inputs, outputs, domains, seen = [], [], [], [], set(), set()

    def add(b: Builder, known=None) -> None:
        piece = quantize(_piece(b), known)
        data.spill(piece.graph.initializer)
        # a fresh message of what is left: protobuf frees a message's memory (the weights this piece read, and
        # the quantizer's copies) only with the whole message, which any node kept from it would keep alive
        piece = onnx.ModelProto.FromString(piece.SerializeToString())
        nodes.extend(piece.graph.node)
        for t in piece.graph.initializer:          # constants a rewrite adds to every piece are kept once
            if t.name not in seen:
                seen.add(t.name)
                inits.append(t)
        inputs.extend(b.inputs)
        outputs.extend(b.outputs)
        domains.update(o.domain for o in piece.opset_import if o.domain)
    try:
        b = Builder(attention)                     # inputs, rope tables and the embedding
        _common_inputs(b, arch, with_ids=True)
        _embedding(b, data, w, arch, precision)
        add(b)
        step("embedding")
        x = "h0"
        for i in range(arch.layers):
            b = Builder(attention)
            (pk, pv), (ok, ov) = past_names(i), present_names(i)
            graph._kv_io(b, arch, i, (pk, pv), (ok, ov))
            lw = LayerTensors(w, arch, i)
            x = graph.decoder_layer(b, arch, i, x, {k: lw[k] for k in lw.keys()}, store, False, pk, pv, ok, ov)
            add(b, lambda: ({f"layers.{i}.{k}": lw.blocks(k) for k in graph.MATMULS}, False))
            step(f"layer {i + 1}/{arch.layers}")
        b, lm_head, known = _head_piece(w, arch, head, head_ids, precision, output, attention, reduce_range, store,
                                        quantize.mode == "rtn", x)
        add(b, lambda: ({lm_head: known}, True))
        step("head")
    finally:
        data.close()
    model = oh.make_model(oh.make_graph(nodes, "specbeam_whole", inputs, outputs, inits),
                          opset_imports=[oh.make_opsetid("", OPSET)]
                          + [oh.make_opsetid(d, 1) for d in sorted(domains)], ir_version=10)
    model.producer_name = "specbeam-edge export"
    save._save(model, tmp / "model.onnx")        # (its tensors are in model.onnx.data already)
    return quantize.entry


def _head_piece(w, arch, head, head_ids, precision, output, attention, reduce_range, store, rtn: bool, x: str):
    """The head's piece on hidden state x: final norm, lm_head and the outputs; returns (its Builder, the lm_head
    tensor, the file's blocks of lm_head or None). With the blocks, lm_head is a shape alone."""
    b = Builder(attention)
    known = _head_blocks(w, head, head_ids) if precision == "int4" and not rtn else None
    if known is not None:      # checked against the file's values: the graph needs only the head's shape
        g = {"norm": final_norm(w, arch)}
        lm_head = b.init("lm_head.weight", np.zeros((), np.float32))
        b.inits[-1].dims[:] = [arch.hidden, known.codes.shape[0]]
        b.inits[-1].ClearField("raw_data")
    else:
        g = head_weights(w, arch, head, head_ids, "int8" if precision == "int8" else "fp32", reduce_range)
        lm_head = graph.head_weight(b, g["lm_head"], store)
        del g["lm_head"]
    graph._head(b, arch, x, b.init("norm.weight", g["norm"]), lm_head, output, store, head_ids, rows_from=True)
    return b, lm_head, known
