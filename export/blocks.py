"""int4 that keeps a GGUF's own blocks: weights already on a llama.cpp block grid run as MatMulNBits unchanged.

transformers dequantizes a GGUF's Q4_0 / Q4_1 / Q8_0 tensors to fp32 (gguf-py: `d * q`, `d * q + m` with fp16
`d` and `m` per block of 32 along the input axis), and `-p int4` used to re-quantize those values with
onnxruntime's round-to-nearest quantizer: a second rounding on top of the file's, which moved a 4-bit weight by
up to half a step (SmolLM2-135M's int4 export agreed with llama.cpp on 0 of 12 greedy answers). Here each block's
codes and scales are recovered from the dequantized values and checked bit for bit (`d * q (+ m)` in fp32 must
give back every value), and the MatMul becomes

    q4_0:  MatMulNBits(x; codes, d)                      # bits 4, zero point 8:  w = d (q - 8)
    q8_0:  MatMulNBits(x; codes + 128, d)                # bits 8, zero point 128: w = d q
    q4_1:  MatMulNBits(x; codes, d, zero point 0) + BlockSums(x) @ m
                                                          # w = d q + m; BlockSums(x): x summed per block of 32

so the weights are exactly the file's, and the arithmetic is llama.cpp's kind: accuracy level 4 quantizes the
activations to int8 per block of 32 (per row, so a row's result depends on that row alone) and sums int8 products
exactly. A graph with any weight matrix off every grid (K-quants, fp16/fp32 sources) is left to the
round-to-nearest quantizer (save.py), whole. MatMuls of one activation (q/k/v, gate/up) of the same kind run as
one MatMulNBits over the weights side by side, then Split; an activation's block sums are computed once.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as onh

from .quant import _copy

BLOCK = 32
METHOD = ("specbeam int4 with the source's own blocks (GGUF Q4_0 / Q4_1 / Q8_0 recovered bit for bit from the "
          "dequantized weights): MatMulNBits, accuracy level 4 (int8 activations per block of 32)")


@dataclass
class Blocks:
    """One [K, N] weight matrix as blocks of 32 along K: w[32 b + i, n] = scale[n, b] * (codes[n, b, i] - zp)
    + offset[n, b] (zp: 8 for 4 bits, 128 for 8 bits, 0 for q4_1, which has an offset)."""
    kind: str                  # "q4_0", "q4_1" or "q8_0"
    codes: np.ndarray          # [N, nb, 32] uint8: unsigned codes
    scale: np.ndarray          # [N, nb] fp32
    offset: np.ndarray | None  # [N, nb] fp32: q4_1's block minimum, else None

    @property
    def bits(self) -> int:
        return 8 if self.kind == "q8_0" else 4


def _fp16_near(x: np.ndarray) -> list[np.ndarray]:
    """fp32 arrays of the fp16 values nearest to x and their neighbours (a GGUF block scale is an fp16)."""
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
    return [h.astype(np.float32), np.nextafter(h, np.float16(np.inf)).astype(np.float32),
            np.nextafter(h, np.float16(-np.inf)).astype(np.float32)]


def _fit(v: np.ndarray, candidates, code, rebuild, lo: int, hi: int):
    """Per block, the first candidate scale whose integer codes rebuild every value of the block exactly.
    Returns (scale, q) or None when some block fits no candidate."""
    nblk = v.shape[:2]
    ok = np.zeros(nblk, bool)
    d_out = np.zeros(nblk, np.float32)
    q_out = np.zeros(v.shape, np.int32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for d in candidates:
            dd = d[..., None]
            q = np.where(dd != 0, np.rint(code(v, dd)), 0)
            q = np.nan_to_num(q, nan=lo - 1, posinf=lo - 1, neginf=lo - 1)
            fits = ((q >= lo) & (q <= hi)).all(-1)
            qi = np.clip(q, lo, hi).astype(np.int32)
            fits &= (rebuild(dd, qi.astype(np.float32)) == v).all(-1)
            new = fits & ~ok
            d_out[new], q_out[new] = d[new], qi[new]
            ok |= fits
            if ok.all():
                return d_out, q_out
    return None


def recover(w: np.ndarray) -> Blocks | None:
    """The GGUF block grid `w` [K, N] (fp32, dequantized) lies on, or None (K not a multiple of 32, or no grid
    rebuilds every value bit for bit)."""
    K, N = w.shape
    if K % BLOCK or w.dtype != np.float32:
        return None
    v = np.ascontiguousarray(w.T).reshape(N, K // BLOCK, BLOCK)
    # q4_0 (ggml: the value of largest magnitude gets code 0, so d = -extreme / 8): w = d (q - 8), q in [0, 15]
    ext = np.take_along_axis(v, np.abs(v).argmax(-1)[..., None], -1)[..., 0]
    fit = _fit(v, _fp16_near(-ext / 8), lambda v, d: v / d + 8, lambda d, q: d * (q - 8), 0, 15)
    if fit is not None:
        return Blocks("q4_0", fit[1].astype(np.uint8), fit[0], None)
    # q4_1 (ggml: m = the block's minimum, d = range / 15): w = d q + m, q in [0, 15]
    m = v.min(-1)
    mm = m[..., None]
    fit = _fit(v, _fp16_near((v.max(-1) - m) / 15), lambda v, d: (v - mm) / d,
               lambda d, q: (d * q).astype(np.float32) + mm, 0, 15)
    if fit is not None:
        return Blocks("q4_1", fit[1].astype(np.uint8), fit[0], m.astype(np.float32))
    # q8_0 (ggml: d = max |w| / 127): w = d q, q in [-127, 127]
    fit = _fit(v, _fp16_near(np.abs(v).max(-1) / 127), lambda v, d: v / d, lambda d, q: d * q, -127, 127)
    if fit is not None:
        return Blocks("q8_0", (fit[1] + 128).astype(np.uint8), fit[0], None)
    return None


def _pack(b: Blocks) -> np.ndarray:
    """MatMulNBits' B input [N, nb, 32 * bits / 8]: 4-bit codes two to a byte, the even one in the low nibble."""
    if b.bits == 8:
        return b.codes
    return (b.codes[..., 0::2] | (b.codes[..., 1::2] << 4)).astype(np.uint8)


def _concat(parts: list[Blocks]) -> Blocks:
    off = [p.offset for p in parts]
    return Blocks(parts[0].kind, np.concatenate([p.codes for p in parts]), np.concatenate([p.scale for p in parts]),
                  None if off[0] is None else np.concatenate(off))


def gguf_int4(model: onnx.ModelProto) -> dict | None:
    """Rewrite the decoder graph `model` in place when every MatMul with constant 2-D fp32 weights lies on a GGUF
    block grid (activations of rank 3, [batch, rows, K]); returns the config's "quantization" entry, or None
    with `model` untouched."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    consumers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def weight(n) -> bool:
        t = inits.get(n.input[1]) if n.op_type == "MatMul" else None
        return t is not None and t.data_type == TensorProto.FLOAT and len(t.dims) == 2

    recovered: dict[str, Blocks] = {}
    for n in g.node:
        if weight(n) and n.input[1] not in recovered:
            b = recover(onh.to_array(inits[n.input[1]]))
            if b is None:
                return None
            recovered[n.input[1]] = b
    if not recovered:
        return None
    # one activation's MatMuls of one kind, each weight used once: one MatMulNBits, then Split
    groups: dict[tuple, list] = {}
    for n in g.node:
        if weight(n) and len(consumers[n.input[1]]) == 1:
            groups.setdefault((n.input[0], recovered[n.input[1]].kind), []).append(n)
    group_of = {m.output[0]: grp for grp in groups.values() if len(grp) > 1 for m in grp}
    nodes, new_inits, sums, kinds = [], [], {}, {}
    consts = [onh.from_array(np.array([0, 0, -1, BLOCK], np.int64), "gguf4.block_shape"),
              onh.from_array(np.array([-1], np.int64), "gguf4.last")]

    def block_sums(x: str) -> str:
        if x not in sums:
            nodes.extend([oh.make_node("Reshape", [x, "gguf4.block_shape"], [x + ".blocks"]),
                          oh.make_node("ReduceSum", [x + ".blocks", "gguf4.last"], [x + ".bsum"], keepdims=0)])
            sums[x] = x + ".bsum"
        return sums[x]

    def emit(x: str, b: Blocks, name: str, out: str, matmuls: int = 1):
        N, nb, _ = b.codes.shape
        new_inits.extend([onh.from_array(_pack(b), name + ".nbits"),
                          onh.from_array(b.scale.reshape(-1), name + ".nbits_scale")])
        ins = [x, name + ".nbits", name + ".nbits_scale"]
        if b.offset is not None:   # q4_1: codes taken as they are (zero point 0); the offsets added below
            new_inits.append(onh.from_array(np.zeros(N * ((nb + 1) // 2), np.uint8), name + ".nbits_zp"))
            ins.append(name + ".nbits_zp")
        y = out + ".nb" if b.offset is not None else out
        nodes.append(oh.make_node("MatMulNBits", ins, [y], domain="com.microsoft", K=nb * BLOCK, N=N, bits=b.bits,
                                  block_size=BLOCK, accuracy_level=4))
        if b.offset is not None:
            new_inits.append(onh.from_array(np.ascontiguousarray(b.offset.T), name + ".nbits_offset"))  # [nb, N]
            nodes.extend([oh.make_node("MatMul", [block_sums(x), name + ".nbits_offset"], [out + ".off"]),
                          oh.make_node("Add", [y, out + ".off"], [out])])
        kinds[b.kind] = kinds.get(b.kind, 0) + matmuls

    dropped = set()
    for n in g.node:
        grp = group_of.get(n.output[0])
        if grp is not None:
            if n.output[0] != grp[0].output[0]:
                continue
            parts = [recovered[m.input[1]] for m in grp]
            name = grp[0].input[1] + ".merged"
            emit(n.input[0], _concat(parts), name, name + ".out", len(grp))
            new_inits.append(onh.from_array(np.array([p.codes.shape[0] for p in parts], np.int64), name + ".split"))
            nodes.append(oh.make_node("Split", [name + ".out", name + ".split"], [m.output[0] for m in grp], axis=-1))
            dropped.update(m.input[1] for m in grp)
            continue
        if weight(n):
            emit(n.input[0], recovered[n.input[1]], n.output[0], n.output[0])   # a shared weight: a copy each
            if all(weight(c) for c in consumers[n.input[1]]):
                dropped.add(n.input[1])
            continue
        nodes.append(_copy(n))
    del g.node[:]
    g.node.extend(nodes)
    kept = [_copy(t) for t in g.initializer if t.name not in dropped]
    del g.initializer[:]
    g.initializer.extend(kept + new_inits + consts)
    if not any(i.domain == "com.microsoft" for i in model.opset_import):
        model.opset_import.append(oh.make_opsetid("com.microsoft", 1))
    return {"method": METHOD, "bits": 4, "block_size": BLOCK, "accuracy_level": 4,
            "blocks": dict(sorted(kinds.items())), "matmuls": sum(kinds.values()),
            "ops": "MatMulNBits (every weight MatMul incl. lm_head; q4_1 adds its block offsets as a small fp32 "
                   "MatMul of the activations' block sums); embeddings, attention and norms as exported"}
