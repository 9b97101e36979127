"""The split layout written a tensor at a time (DESIGN section 5): the embedding table and the head in chunks of
rows, each layer's weights read, converted and written to its file before the next is read. What the export holds
at once is one tensor and one chunk (plus the head's int8 codes), whatever the model's depth or vocabulary: a
1.1 GB GGUF held as an fp32 model took 17 GB."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx

from specbeam_edge.embedding_form import TABLE_FILE, side_file, side_keys

from . import graph, resident
from .embedding import OffBlocks, embed_block, embedding_blocks, file_table_chunks, packed_codes, table_chunks
from .families import LayerTensors
from .head import head_weights
from .hf import Arch
from .quant import quantize_columns, rowwise_int8
from .save import INT8W, DataFile, _save, stored_as

ALIGN = 64           # layer files: each tensor 64-byte aligned (offload.LayerStore reads them so)


def _write_file_blocks_table(folder: Path, w, arch: Arch) -> dict | None:
    """weights/embed.bin as the GGUF's own blocks (codes, then weights/embed_scale.bin and, for kinds with an
    offset, weights/embed_offset.bin: fp32 per block), the runtime dequantizing a row as gguf-py does
    (offload.TableRows): the file's values exactly, in 4.5-10 bits a value. None when the file's table is not in
    blocks (nothing left behind)."""
    first = embedding_blocks(w, arch)
    if first is None:
        return None
    path, digest, scales, offsets = folder / TABLE_FILE, hashlib.sha256(), [], []
    try:
        with open(path, "wb") as f:
            for blk in file_table_chunks(w, arch):
                data = memoryview(np.ascontiguousarray(packed_codes(blk)).reshape(-1))
                digest.update(data)
                f.write(data)
                scales.append(blk.scale)
                if blk.offset is not None:
                    offsets.append(blk.offset)
    except OffBlocks:
        path.unlink()
        return None
    entry = {"file": TABLE_FILE, "dtype": "uint8", "shape": [arch.vocab_size, arch.hidden],
             "sha256": digest.hexdigest(), "block": first.block, "bits": first.bits, "zero": first.zero,
             "kind": first.kind}
    entry.update(_side_file(folder, "scale", scales))
    if offsets:
        entry.update(_side_file(folder, "offset", offsets))
    return entry


def _side_file(folder: Path, what: str, parts: list) -> dict:
    """The side file `what` (embedding_form.SIDES: fp32 per block of the table) and its files.embed_table keys:
    the file and its SHA-256, which the runtime checks at load as it checks the table's."""
    data = np.concatenate(parts).astype(np.float32).tobytes()
    (folder / side_file(what)).write_bytes(data)
    name, digest = side_keys(what)
    return {name: side_file(what), digest: hashlib.sha256(data).hexdigest()}


def write_embed_table(folder: Path, w, arch: Arch, precision: str) -> dict:
    """weights/embed.bin: the embedding table row-major, read a few rows a pass by the runtime (offload.TableRows).
    int8: codes with one fp32 scale per block of 32 values in weights/embed_scale.bin (28% of fp32's bytes);
    fp16: half floats (the whole graph's fp16 storage casts them to fp32 the same way); int8w: the fp32 values its
    Cast and Mul give; fp32: the fp32 values the graph's Gather gave (table_chunks). int8 from a GGUF whose
    table is in blocks: the file's own blocks (_write_file_blocks_table)."""
    if precision == "int8":
        entry = _write_file_blocks_table(folder, w, arch)
        if entry is not None:
            return entry
    path = folder / TABLE_FILE
    dtype = {"int8": np.int8, "fp16": np.float16}.get(precision, np.float32)
    digest, scales = hashlib.sha256(), []
    with open(path, "wb") as f:
        for rows, scale in table_chunks(w, arch, precision):
            if precision == "int8w":                        # the fp32 values its Cast and Mul give
                rows = rows.astype(np.float32) * scale[:, None]
            elif scale is not None:
                scales.append(scale)
            data = memoryview(np.ascontiguousarray(rows, dtype).reshape(-1).view(np.uint8))
            digest.update(data)
            f.write(data)
    entry = {"file": TABLE_FILE, "dtype": np.dtype(dtype).name, "shape": [arch.vocab_size, arch.hidden],
             "sha256": digest.hexdigest()}
    if precision == "int8":
        entry.update(_side_file(folder, "scale", scales), block=embed_block(arch.hidden))
    return entry


# the head's tensors written from their arrays to head.onnx.data (int8: codes and scales; fp32: the matrix): in
# the graph they were copied twice (the message and its serialization), 1.6 GB for a 151,936 x 3,584 int8 head
HEAD_DATA = {"int8": ("lm_head.weight.q8", "lm_head.weight.q8scale"), "fp32": ("lm_head.weight",)}


def write_head(path: Path, arch: Arch, g: dict, precision: str, output: str, reduce_range: bool) -> None:
    """head.onnx (graph.head_model), its lm_head in head.onnx.data for int8 and fp32: the graph is built around
    one-column stand-ins, whose tensors are then replaced by references to the real arrays' bytes."""
    names = HEAD_DATA.get(precision)
    if not names:
        _save(graph.head_model(arch, g, precision, output), path)
        return
    real = g["lm_head"] if isinstance(g["lm_head"], tuple) else (g["lm_head"],)
    stand_in = tuple(a[..., :1] for a in real)
    model = graph.head_model(arch, {**g, "lm_head": stand_in if len(real) > 1 else stand_in[0]}, precision, output)
    if precision == "int8":
        rowwise_int8(model, reduce_range=reduce_range)
    inits = model.graph.initializer
    with DataFile(path.with_name(path.name + ".data")) as data:
        for name, a in zip(names, real):
            i = next(k for k, t in enumerate(inits) if t.name == name)
            inits[i].CopyFrom(data.table(name, a.dtype, a.shape, [a]))
    onnx.save_model(model, str(path))


def write_layers(folder: Path, w, arch: Arch, precision: str, reduce_range: bool, step) -> tuple[list, list, dict]:
    """weights/layer_{i}.bin for every layer, each read, converted and written before the next is read: each
    layer's tensors back to back (64-byte aligned) in the order of graph.layer_weight_names; returns (the shared
    manifest, each file's SHA-256, layer 0's weights as the layer graph's shape sample)."""
    manifest, sums, sample = None, [], {}
    for i in range(arch.layers):
        lw = LayerTensors(w, arch, i)
        entries, off, digest = [], 0, hashlib.sha256()
        with open(folder / "weights" / f"layer_{i}.bin", "wb") as f:
            for name in graph.layer_weight_names(arch):
                t = lw[name]
                if i == 0:      # the layer graph needs shapes only: views of one zero each, no memory
                    sample[name] = np.broadcast_to(np.zeros((), t.dtype), t.shape)
                arrays = [(name, t)]
                if precision in ("int8", "int8w") and name in graph.MATMULS:
                    # 7 bits only where the CPU sums int8 products (int8 compute); int8w computes in fp32
                    q, s = quantize_columns(t, reduce_range and precision == "int8")
                    arrays = [(name, q), (name + ".scale", s)]
                elif precision == "fp16":
                    arrays = [(name, t.astype(np.float16))]
                del t
                for n, a in arrays:
                    a = np.ascontiguousarray(a)
                    pad = b"\0" * ((-off) % ALIGN)
                    off += len(pad)
                    entries.append({"name": n, "dtype": str(a.dtype), "shape": list(a.shape), "offset": off})
                    for part in (pad, memoryview(a.reshape(-1).view(np.uint8))):
                        digest.update(part)
                        f.write(part)
                    off += a.nbytes
                del arrays
        manifest = entries
        sums.append(digest.hexdigest())
        step(f"layer {i + 1}/{arch.layers}")
    return manifest, sums, sample


def write_split(tmp: Path, w, arch: Arch, head: str, ids, precision: str, output: str, attention: str,
                reduce_range: bool, step, kv_cache: str = "fp32") -> tuple[dict, dict]:
    """Every file of the split layout into `tmp`; returns (the config's files entry, its quantization entry)."""
    (tmp / "weights").mkdir()
    files: dict = {"embed_table": write_embed_table(tmp, w, arch, precision)}
    step("write embedding table")
    manifest, sums, sample = write_layers(tmp, w, arch, precision, reduce_range, step)
    layer = graph.layer_model(arch, sample, precision, attention, kv_cache)
    del sample
    quant = None
    if precision == "int8":     # the streamed int8 weights and lm_head compute per-row int8 (quant.py)
        quant = rowwise_int8(layer, reduce_range=reduce_range)
    _save(layer, tmp / "layer.onnx")
    write_head(tmp / "head.onnx", arch, head_weights(w, arch, head, ids, precision, reduce_range), precision,
               output, reduce_range)
    step("write head")
    files.update(layer="layer.onnx", head="head.onnx", layer_weights="weights/layer_{i}.bin",
                 layer_manifest=manifest)
    files["layer_resident"] = resident.write(tmp, onnx.load(tmp / "layer.onnx"), manifest)
    files["layer_sha256"] = sums
    if precision == "int8w":    # int8 weights, fp32 compute (DequantizeLinear + MatMul): CUDA has both
        quant = {**INT8W, "method": "specbeam int8 weight storage: symmetric per output channel; streamed layers "
                 "DequantizeLinear + MatMul each pass, embedding and lm_head folded at load; fp32 compute"}
    return files, quant or stored_as(precision)
