"""The whole layout's one writer: model.onnx and model.onnx.data, written a piece at a time where every weight's
quantization is its own, else built whole in memory (`write` picks).

A piece at a time (STREAMED precisions with fp32 compute): the inputs and embedding, each decoder layer, then the
head are built as graph pieces one after another; each piece's MatMul weights are quantized within it
(quant.rowwise_int8, blocks.gguf_int4, or onnxruntime's round-to-nearest MatMulNBits quantizer, which all rewrite
a weight's MatMul alone) and its tensors are appended to `model.onnx.data` before the next piece is read. The graph
file keeps only the nodes and the tensors' places, so what the export holds at once is one piece, not the model
(the 0.5B draft's int4 export took 12.5 GB whole).

In memory (`_in_memory`): the fp32 graph built whole for the rewrites that need all of it, int8dyn's
quantize_dynamic (one activation scale per tensor) and fp16 compute's graph-wide conversion (`_to_fp16`)."""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper as oh

from specbeam_edge.contract import graph_sha256, past_names, present_names

from . import graph, save
from .attention import _common_inputs
from .blocks import BLOCK, block_counts, gguf_int4
from .builder import F32, OPSET, Builder
from .embedding import (OffBlocks, _int8_rows_embedding, blocks_lookup, embedding_blocks, file_table_chunks,
                        packed_codes, table_chunks)
from .families import LayerTensors, layer_weights
from .head import head_blocks, head_weights
from .hf import Arch, final_norm, global_weights
from .quant import rowwise_int8
from .save import INT8W, DataFile, save_precision, stored_as

# precisions whose quantization rewrites each weight's MatMul on its own; the others (int8dyn's per-tensor
# activation scales) and fp16 compute's graph-wide conversion take the in-memory path
STREAMED = ("fp32", "fp16", "int8w", "int8", "int4")


def write(tmp: Path, w, arch: Arch, head: str, head_ids, precision: str, output: str, attention: str,
          block_size: int, reduce_range: bool, compute: str, int4_weights: str, prog,
          kv_cache: str = "fp32") -> tuple[dict, dict | None]:
    """model.onnx and its tensors into `tmp`; returns (the config's files entry, its quantization entry).
    int4_weights "rtn", or int4 blocks other than a GGUF's (BLOCK), quantize every matrix round-to-nearest;
    otherwise the file's own blocks where every piece's weights lie on them (_Quantizer)."""
    if precision in STREAMED and compute == "fp32":
        quant = _streamed(tmp, w, arch, head, head_ids, precision, output, attention, block_size, reduce_range,
                          prog.step, int4_weights == "rtn" or block_size != BLOCK, kv_cache)
        # fp32 and fp16 record null here, {"method": "none"} elsewhere: the runtime reads both as stored weights
        quant = quant or (INT8W if precision == "int8w" else None)
    else:
        quant = _in_memory(tmp, w, arch, head_ids, precision, output, attention, reduce_range, compute, prog,
                           kv_cache)
        quant = quant or stored_as(precision)
    # the runtime checks the graph against its SHA-256 on load (integrity.py)
    return {"model": "model.onnx", "sha256": graph_sha256(tmp, "model.onnx")}, quant


class _OffGrid(Exception):
    """A piece's weights lie on no GGUF block grid after earlier pieces' did: the export starts again with
    round-to-nearest for every piece, as the whole graph's quantizer decided before (blocks.gguf_int4)."""


class _Quantizer:
    """Quantizes piece after piece as the whole graph's quantizer would; `entry` is the config's quantization."""

    def __init__(self, precision: str, block_size: int, reduce_range: bool, rtn: bool):
        self.precision, self.block_size, self.reduce_range = precision, block_size, reduce_range
        self.mode = "rtn" if rtn else None      # int4: None until a piece decides
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
        _int8_rows_embedding(b, H)
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


def _piece(b: Builder) -> onnx.ModelProto:
    return oh.make_model(oh.make_graph(b.nodes, "piece", [], [], b.inits),
                         opset_imports=[oh.make_opsetid("", OPSET)], ir_version=10)


def _streamed(tmp: Path, w, arch: Arch, head: str, head_ids, precision: str, output: str, attention: str,
              block_size: int, reduce_range: bool, step, rtn: bool, kv_cache: str) -> dict | None:
    """model.onnx and model.onnx.data into `tmp` a piece at a time; returns the config's quantization entry (None:
    as stored)."""
    try:
        return _write(tmp, w, arch, head, head_ids, precision, output, attention, block_size, reduce_range, step,
                      rtn, kv_cache)
    except _OffGrid:
        step("some weights lie on no GGUF block grid: quantizing every weight round-to-nearest")
        return _write(tmp, w, arch, head, head_ids, precision, output, attention, block_size, reduce_range, step,
                      True, kv_cache)


def _write(tmp, w, arch, head, head_ids, precision, output, attention, block_size, reduce_range, step, rtn,
           kv_cache):
    store = "fp32" if precision in ("int8", "int4") else precision        # as whole_model stores weights
    quantize = _Quantizer(precision, block_size, reduce_range, rtn)
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
        b = Builder(attention, kv_cache)           # inputs, rope tables and the embedding
        _common_inputs(b, arch, with_ids=True)
        _embedding(b, data, w, arch, precision)
        add(b)
        step("embedding")
        x = "h0"
        for i in range(arch.layers):
            b = Builder(attention, kv_cache)
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
    known = head_blocks(w, head, head_ids) if precision == "int4" and not rtn else None
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


def _in_memory(tmp: Path, weights, arch: Arch, head_ids, precision: str, output: str, attention: str,
               reduce_range: bool, compute: str, prog, kv_cache: str = "fp32") -> dict | None:
    """model.onnx built whole in memory, for the rewrites that need the whole graph: int8dyn's quantize_dynamic
    (fp32 compute) and fp16 compute's conversion (fp16 weights: core.export passes fp16 compute as precision fp16);
    the graph is built in fp32 either way. Returns the quantization entry (None: as stored)."""
    g = global_weights(weights, arch)
    if head_ids is not None and g["head_ids"] is None:
        g = {**g, "lm_head": np.ascontiguousarray(g["lm_head"][:, head_ids]), "head_ids": head_ids}
    layers = []
    for i in range(arch.layers):
        layers.append(layer_weights(weights, arch, i))
        prog.step(f"read layer {i + 1}/{arch.layers}")
    # fp16 compute's conversion (_to_fp16) turns the whole fp32 graph to fp16, its KV cache included
    model = graph.whole_model(arch, g, layers, "fp32", output, attention, "fp32" if compute == "fp16" else kv_cache)
    del g, layers
    if compute == "fp16":
        model = _to_fp16(model)
    prog.step("build graph")
    quant = save_precision(model, tmp / "model.onnx", precision, reduce_range)
    prog.step(f"write model.onnx ({precision})")
    return quant


def _to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """An fp32 whole graph in fp16 (onnxruntime's converter): initializers, activations and the KV inputs and
    outputs; the tree mask input and the logits / top-k log-probs outputs stay fp32 (Casts at the edge; the
    mask's -3.4e38 becomes -inf, which the softmax treats the same), LogSoftmax and TopK run in fp32."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    keep = ["attention_mask", "logits", "topk_logprobs"]
    names = {*[i.name for i in model.graph.input], *[o.name for o in model.graph.output]}
    # through a file: given a ModelProto the converter's shape inference serializes the whole fp32 graph, which
    # fails past 2 GB; given a path it infers shapes file to file (its types are needed: without them the Casts
    # around the fp32 TopK come out mistyped)
    with tempfile.TemporaryDirectory(prefix="specbeam-fp16-") as tmp:
        path = Path(tmp) / "fp32.onnx"
        save._save(model, path)
        return convert_float_to_float16(str(path), keep_io_types=[n for n in keep if n in names],
                                        op_block_list=["LogSoftmax", "TopK"])
