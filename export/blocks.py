"""int4 that keeps a GGUF's own blocks: weights on a llama.cpp block grid run as MatMulNBits unchanged.

transformers dequantizes a GGUF's tensors to fp32 (gguf-py), and `-p int4` used to re-quantize those values with
onnxruntime's round-to-nearest quantizer: a second rounding on top of the file's, which moved a 4-bit weight by
up to half a step (SmolLM2-135M's int4 export agreed with llama.cpp on 0 of 12 greedy answers). Here each
block's codes and scales are the file's: read from its bytes (from_ggml: every kind below), or for Q4_0 / Q4_1 /
Q8_0 recovered from the dequantized values and checked bit for bit (`d * q (+ m)` in fp32 must give back every
value). The MatMul becomes

    q4_0:  MatMulNBits(x; codes, d)                      # bits 4, zero point 8:  w = d (q - 8)
    q8_0:  MatMulNBits(x; codes + 128, d)                # bits 8, zero point 128: w = d q
    q5_0:  MatMulNBits(x; codes, d, zero point 16)       # bits 8 (5-bit codes), blocks of 32
    q6_k:  MatMulNBits(x; codes, d sc, zero point 32)    # bits 8 (6-bit codes), blocks of 16: w = d sc (q - 32)
    q4_1, q4_k, q5_1:
           MatMulNBits(x; codes, scale, zero point 0) + BlockSums(x) @ offset
                                                          # w = scale q + offset per block of 32 (q4_k: scale
                                                          # d sc and offset -dmin m of its 6-bit sub-block fields)

so the weights are exactly the file's, and the arithmetic is llama.cpp's kind: accuracy level 4 quantizes the
activations to int8 per block (per row, so a row's result depends on that row alone) and sums int8 products
exactly. A graph with any weight matrix off every grid (fp16/fp32 sources, kinds not listed) is left to the
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
METHOD = ("specbeam int4 with the source's own blocks (GGUF Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 / Q4_K / Q6_K, codes "
          "and scales exactly the file's): MatMulNBits, accuracy level 4 (int8 activations per block)")


# kind: (bits, values a block, zero point). A kind with an offset (q4_1, q4_k, q5_1) takes its codes as they are
# (zero point 0) and adds offset x the activations' block sums.
KINDS = {"q4_0": (4, 32, 8), "q4_1": (4, 32, 0), "q8_0": (8, 32, 128), "q4_k": (4, 32, 0), "q6_k": (8, 16, 32),
         "q5_0": (8, 32, 16), "q5_1": (8, 32, 0)}


@dataclass
class Blocks:
    """One [K, N] weight matrix as blocks along K: w[bs b + i, n] = scale[n, b] * (codes[n, b, i] - zp)
    + offset[n, b], bs and zp by kind (KINDS)."""
    kind: str                  # a key of KINDS
    codes: np.ndarray          # [N, nb, bs] uint8: unsigned codes
    scale: np.ndarray          # [N, nb] fp32
    offset: np.ndarray | None  # [N, nb] fp32: q4_1's block minimum, q4_k's and q5_1's offsets; else None

    @property
    def bits(self) -> int:
        return KINDS[self.kind][0]

    @property
    def block(self) -> int:
        return KINDS[self.kind][1]

    @property
    def zero(self) -> int:
        return KINDS[self.kind][2]

    def rows(self, a: int, z: int) -> "Blocks":
        """Output rows (columns of the [K, N] matrix) a..z."""
        return Blocks(self.kind, self.codes[a:z], self.scale[a:z], None if self.offset is None else self.offset[a:z])

    def equals(self, w: np.ndarray) -> bool:
        """Whether the blocks give the fp32 [K, N] matrix w bit for bit (compared 4,096 columns at a time)."""
        N = self.codes.shape[0]
        return w.shape == (self.codes.shape[1] * self.block, N) and all(
            np.array_equal(self.rows(a, a + 4096).values(), w[:, a:a + 4096]) for a in range(0, N, 4096))

    def values(self) -> np.ndarray:
        """The fp32 [K, N] matrix the blocks hold, computed as gguf-py dequantizes (scale x code, then + offset)."""
        w = self.scale[..., None] * (self.codes.astype(np.float32) - np.float32(self.zero))
        if self.offset is not None:
            w = w + self.offset[..., None]
        return np.ascontiguousarray(w.astype(np.float32, copy=False).reshape(self.codes.shape[0], -1).T)


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


def _f16(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """ggml's 4-bit layout: each run of `width` bytes holds two runs of codes, the low nibbles first."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, width) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, -1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: bit i of the little-endian uint32 is the fifth bit of code i."""
    bits = np.ascontiguousarray(qh).view(np.uint32).reshape(-1, 1) >> np.arange(32, dtype=np.uint32)
    return (bits & np.uint32(1)).astype(np.uint8)


def _decode(blocks: np.ndarray, kind: str):
    """ggml blocks (uint8 [n, bytes]) -> (codes [n, sub, bs] uint8, scale [n, sub] fp32, offset or None), the
    layouts gguf-py's dequantizers read (gguf.quants): scale and offset are the products it forms in fp32."""
    n = blocks.shape[0]
    if kind == "q4_k":              # 256 values: d, dmin (fp16), 8 x (6-bit scale, 6-bit min), 128 bytes of codes
        d, dmin, sm, qs = _f16(blocks[:, :2]), _f16(blocks[:, 2:4]), blocks[:, 4:16], blocks[:, 16:]
        sm = sm.reshape(n, 3, 4)
        a, b, c = sm[:, 0], sm[:, 1], sm[:, 2]
        sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], -1).astype(np.float32)
        mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], -1).astype(np.float32)
        return _nibbles(qs, 32).reshape(n, 8, 32), d * sc, -(dmin * mn)
    if kind == "q6_k":              # 256 values: 128 bytes low nibbles, 64 bytes high pairs, 16 int8 scales, d
        ql, qh, sc, d = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208], _f16(blocks[:, 208:210])
        low = _nibbles(ql, 64).reshape(n, -1, 32)
        high = (qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
        q = low | (high.reshape(n, -1, 32) << np.uint8(4))
        return q.reshape(n, 16, 16), d * sc.view(np.int8).astype(np.float32), None
    if kind in ("q5_0", "q5_1"):    # 32 values: d (, m), 4 bytes of fifth bits, 16 bytes of nibbles
        d, m = _f16(blocks[:, :2]), (_f16(blocks[:, 2:4]) if kind == "q5_1" else None)
        at = 4 if kind == "q5_1" else 2
        q = _nibbles(blocks[:, at + 4:], 16) | (_high_bits(blocks[:, at:at + 4]) << np.uint8(4))
        return q.reshape(n, 1, 32), d, m
    if kind in ("q4_0", "q4_1"):    # 32 values: d (, m), 16 bytes of nibbles
        d, m = _f16(blocks[:, :2]), (_f16(blocks[:, 2:4]) if kind == "q4_1" else None)
        return _nibbles(blocks[:, 4 if m is not None else 2:], 16).reshape(n, 1, 32), d, m
    if kind == "q8_0":              # 32 values: d, 32 int8 codes (stored + 128: unsigned)
        q = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q.reshape(n, 1, 32), _f16(blocks[:, :2]), None
    raise ValueError(kind)


BYTES = {"q4_0": (18, 32), "q4_1": (20, 32), "q8_0": (34, 32), "q4_k": (144, 256), "q6_k": (210, 256),
         "q5_0": (22, 32), "q5_1": (24, 32)}


def block_counts(kinds: dict[str, int]) -> dict:
    """The quantization entry's counts for MatMuls by kind: blocks, matmuls, the widest codes, the smallest block."""
    return {"bits": max(KINDS[k][0] for k in kinds), "block_size": min(KINDS[k][1] for k in kinds),
            "blocks": dict(sorted(kinds.items())), "matmuls": sum(kinds.values())}


def from_ggml(raw: np.ndarray, kind: str) -> Blocks:
    """A GGUF tensor's stored rows (uint8 [N, row bytes]: N output rows of K values in `kind`'s blocks) as Blocks
    of the [K, N] MatMul weight, the codes and scales exactly the file's."""
    size, per = BYTES[kind]
    N = raw.shape[0]
    codes, scale, offset = _decode(np.ascontiguousarray(raw).reshape(-1, size), kind)
    nb = raw.shape[1] // size * per // KINDS[kind][1]
    reshape = lambda a: None if a is None else np.ascontiguousarray(a, np.float32).reshape(N, nb)  # noqa: E731
    return Blocks(kind, codes.reshape(N, nb, -1), reshape(scale), reshape(offset))


def _pack(b: Blocks) -> np.ndarray:
    """MatMulNBits' B input [N, nb, 32 * bits / 8]: 4-bit codes two to a byte, the even one in the low nibble."""
    if b.bits == 8:
        return b.codes
    return (b.codes[..., 0::2] | (b.codes[..., 1::2] << 4)).astype(np.uint8)


def _concat(parts: list[Blocks]) -> Blocks:
    off = [p.offset for p in parts]
    return Blocks(parts[0].kind, np.concatenate([p.codes for p in parts]), np.concatenate([p.scale for p in parts]),
                  None if off[0] is None else np.concatenate(off))


def gguf_int4(model: onnx.ModelProto, known: dict[str, Blocks] | None = None, trusted: bool = False) -> dict | None:
    """Rewrite the decoder graph `model` in place when every MatMul with constant 2-D fp32 weights lies on a GGUF
    block grid (activations of rank 3, [batch, rows, K]); returns the config's "quantization" entry, or None
    with `model` untouched. known: weights' blocks read from the file itself (from_ggml; K-quants and Q5 cannot
    be recovered from the values), by initializer name, each checked against its initializer's values unless
    `trusted` (the caller checked them: its initializers may then be shapes without data)."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    consumers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    recovered = _recover_weights(g, inits, known, trusted)
    if not recovered:
        return None
    out = _NBits()
    dropped = out.rewrite(g, inits, consumers, recovered)
    del g.node[:]
    g.node.extend(out.nodes)
    kept = [_copy(t) for t in g.initializer if t.name not in dropped]
    del g.initializer[:]
    g.initializer.extend(kept + out.inits + out.consts)
    if not any(i.domain == "com.microsoft" for i in model.opset_import):
        model.opset_import.append(oh.make_opsetid("com.microsoft", 1))
    return {"method": METHOD, "accuracy_level": 4, **block_counts(out.kinds),
            "ops": "MatMulNBits (every weight MatMul incl. lm_head; q4_1, q4_k and q5_1 add their block offsets as a small fp32 "
                   "MatMul of the activations' block sums); embeddings, attention and norms as exported"}


def _weight(n, inits: dict) -> bool:
    """Whether node n is a MatMul by a constant 2-D fp32 weight."""
    t = inits.get(n.input[1]) if n.op_type == "MatMul" else None
    return t is not None and t.data_type == TensorProto.FLOAT and len(t.dims) == 2


def _recover_weights(g: onnx.GraphProto, inits: dict, known: dict[str, Blocks] | None,
                     trusted: bool) -> dict[str, Blocks] | None:
    """The blocks of every weight MatMul's weight, by initializer name (the file's, checked, or recovered from
    the values); None when one lies on no grid."""
    recovered: dict[str, Blocks] = {}
    for n in g.node:
        if _weight(n, inits) and n.input[1] not in recovered:
            t = inits[n.input[1]]
            b = (known or {}).get(n.input[1])
            if b is not None and (b.codes.shape[0] != t.dims[1] or b.codes.shape[1] * b.block != t.dims[0]):
                b = None
            if b is None or not trusted:
                w = onh.to_array(t)
                if b is None or not b.equals(w):      # the file's blocks must give these very values
                    b = recover(w)
            if b is None:
                return None
            recovered[n.input[1]] = b
    return recovered


class _NBits:
    """The rewritten graph's nodes and new initializers, collected in order, and the MatMuls of each kind."""

    def __init__(self):
        self.nodes, self.inits, self.sums, self.kinds = [], [], {}, {}
        self.consts = [onh.from_array(np.array([0, 0, -1, BLOCK], np.int64), "gguf4.block_shape"),
                       onh.from_array(np.array([-1], np.int64), "gguf4.last")]

    def rewrite(self, g: onnx.GraphProto, inits: dict, consumers: dict, recovered: dict[str, Blocks]) -> set:
        """Every node of `g`, its weight MatMuls as MatMulNBits; returns the weight initializers no longer read."""
        # one activation's MatMuls of one kind, each weight used once: one MatMulNBits, then Split
        groups: dict[tuple, list] = {}
        for n in g.node:
            if _weight(n, inits) and len(consumers[n.input[1]]) == 1:
                groups.setdefault((n.input[0], recovered[n.input[1]].kind), []).append(n)
        group_of = {m.output[0]: grp for grp in groups.values() if len(grp) > 1 for m in grp}
        dropped = set()
        for n in g.node:
            grp = group_of.get(n.output[0])
            if grp is not None:
                if n.output[0] == grp[0].output[0]:
                    self.merged(n.input[0], grp, recovered)
                    dropped.update(m.input[1] for m in grp)
                continue
            if _weight(n, inits):
                self.emit(n.input[0], recovered[n.input[1]], n.output[0], n.output[0])   # a shared weight: a copy each
                if all(_weight(c, inits) for c in consumers[n.input[1]]):
                    dropped.add(n.input[1])
                continue
            self.nodes.append(_copy(n))
        return dropped

    def merged(self, x: str, grp: list, recovered: dict[str, Blocks]) -> None:
        """One MatMulNBits over the group's weights side by side, then a Split into the group's outputs."""
        parts = [recovered[m.input[1]] for m in grp]
        name = grp[0].input[1] + ".merged"
        self.emit(x, _concat(parts), name, name + ".out", len(grp))
        self.inits.append(onh.from_array(np.array([p.codes.shape[0] for p in parts], np.int64), name + ".split"))
        self.nodes.append(oh.make_node("Split", [name + ".out", name + ".split"], [m.output[0] for m in grp], axis=-1))

    def block_sums(self, x: str) -> str:
        """The activation x's sums over each block of 32 (computed once an activation)."""
        if x not in self.sums:
            self.nodes.extend([oh.make_node("Reshape", [x, "gguf4.block_shape"], [x + ".blocks"]),
                               oh.make_node("ReduceSum", [x + ".blocks", "gguf4.last"], [x + ".bsum"], keepdims=0)])
            self.sums[x] = x + ".bsum"
        return self.sums[x]

    def emit(self, x: str, b: Blocks, name: str, out: str, matmuls: int = 1) -> None:
        """out = x @ the weight of blocks b: a MatMulNBits (plus the offsets times x's block sums)."""
        N, nb, bs = b.codes.shape
        self.inits.extend([onh.from_array(_pack(b), name + ".nbits"),
                           onh.from_array(b.scale.reshape(-1), name + ".nbits_scale")])
        ins = [x, name + ".nbits", name + ".nbits_scale"]
        if b.zero != 1 << (b.bits - 1):   # MatMulNBits' default zero point is the middle code: others are given
            per_byte = 8 // b.bits
            zp = np.full(N * -(-nb // per_byte), b.zero * (17 if per_byte == 2 else 1), np.uint8)
            self.inits.append(onh.from_array(zp, name + ".nbits_zp"))
            ins.append(name + ".nbits_zp")
        y = out + ".nb" if b.offset is not None else out
        self.nodes.append(oh.make_node("MatMulNBits", ins, [y], domain="com.microsoft", K=nb * bs, N=N, bits=b.bits,
                                       block_size=bs, accuracy_level=4))
        if b.offset is not None:   # offsets (block size 32 in every kind that has them) times the block sums
            self.inits.append(onh.from_array(np.ascontiguousarray(b.offset.T), name + ".nbits_offset"))  # [nb, N]
            self.nodes.extend([oh.make_node("MatMul", [self.block_sums(x), name + ".nbits_offset"], [out + ".off"]),
                               oh.make_node("Add", [y, out + ".off"], [out])])
        self.kinds[b.kind] = self.kinds.get(b.kind, 0) + matmuls
