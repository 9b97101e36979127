"""int8 compute with one activation scale per row: batch-invariant quantized MatMuls (DESIGN "Quantized targets" point 1).

Every weight MatMul `y = x @ W` (W an fp32 [K, N] initializer, or the int8 weights of a split layer behind a
DequantizeLinear) becomes

    s_x = max(|x|, last axis) / 127                       # [..., 1]: one scale per row (per scored node)
    x_q = uint8(round(x / s_x) + 128)                     # zero point 128: MatMulInteger's fast u8 x s8 kernel
    y   = float(MatMulInteger(x_q, W_q, 128)) * s_x * s_W # W_q int8 [K, N], s_W [N]: symmetric, per column

A row's result depends on that row alone, so a node's logits in a tree pass equal those of its path scored
alone (up to the fp32 parts of the graph: attention and norms), unlike onnxruntime's quantize_dynamic, whose
DynamicQuantizeLinear takes one scale for the whole tensor. Activations that feed several MatMuls (q/k/v,
gate/up) are quantized once.

Accumulation: MatMulInteger accumulates in int32. On CPUs with VNNI (vpdpbusd) u8 x s8 products go straight
into int32. Without VNNI, onnxruntime's AVX2 u8 x s8 kernel adds pairs of products in int16 (vpmaddubsw), which
saturates once |a0 w0 + a1 w1| > 32767 (255 x 127 x 2 = 64,770 can occur): measured on an AVX2-only CPU, a
MatMul's result was 17% of its largest value off, the exported families' logits 20-33%. So weights are stored in
7 bits by default (`reduce_range=True`, [-64, 64]: at most 255 x 64 x 2 = 32,640), which never saturates on any
x86 CPU, at about twice the weight rounding error (same MatMul: 0.96%); `export --full_range` keeps 8 bits for
machines known to have VNNI, and the engine warns when such a graph is loaded on a CPU whose kernel saturates
(specbeam_edge/execution/invariance.py, `int8_sums_saturate`). Invariance holds either way: saturation is per row.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as onh

METHOD = "specbeam per-row int8: u8 activations (one symmetric scale per row, zero point 128) x s8 weights " \
         "(symmetric per output column), MatMulInteger accumulating in int32"


ROWS = 4096      # rows a chunk where the exporter works through a matrix or table in parts


def row_chunks(n: int, rows: int = ROWS):
    """(start, stop) of each chunk of `rows` rows of an n-row array."""
    for start in range(0, n, rows):
        yield start, min(n, start + rows)


def quantize_columns(w: np.ndarray, reduce_range: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-column int8 of a [K, N] matrix: (q int8 [K, N], scale fp32 [N]). Worked a chunk of
    rows at a time (the same values): whole, its temporaries were 4x the matrix (a 7B FFN matrix is 272 MB)."""
    qmax = 64.0 if reduce_range else 127.0
    peak = np.zeros(w.shape[1], w.dtype)
    for a, z in row_chunks(w.shape[0]):
        np.maximum(peak, np.abs(w[a:z]).max(axis=0), out=peak)
    scale = (np.maximum(peak, 1e-12) / qmax).astype(np.float32)
    q = np.empty(w.shape, np.int8)
    for a, z in row_chunks(w.shape[0]):
        q[a:z] = np.clip(np.rint(w[a:z] / scale), -qmax, qmax)
    return q, scale


def _copy(message):
    out = type(message)()
    out.CopyFrom(message)
    return out


def rowwise_int8(model: onnx.ModelProto, *, reduce_range: bool = True) -> dict:
    """Rewrite `model` in place: every MatMul with constant 2-D fp32 weights, or with int8 weights behind a
    DequantizeLinear (axis 1), computes in per-row int8. Returns the config's "quantization" entry."""
    g = model.graph
    r = _RowInt8(g, reduce_range)
    r.rewrite(g)
    nodes = [n for n in r.nodes if not (n.op_type == "DequantizeLinear" and n.output[0] in r.dropped)]
    del g.node[:]
    g.node.extend(nodes)
    for i in reversed([i for i, t in enumerate(g.initializer) if t.name in r.dropped]):
        del g.initializer[i]          # in place: a copy of the kept ones would double a 233 MB head for a moment
    g.initializer.extend(r.inits + (_row_constants() if r.count else []))
    return {"method": METHOD, "weight_type": "int8", "per_channel": True, "activations": "uint8 per row",
            "reduce_range": reduce_range, "matmuls": r.count,
            "ops": "MatMulInteger (every weight MatMul incl. lm_head); embeddings, attention and norms fp32"}


def _row_constants() -> list:
    """The constants every per-row quantization reads (axes, the scale's floor, 127, the offset and zero point)."""
    return [onh.from_array(np.array([-1], np.int64), "rowq.axes"),
            onh.from_array(np.float32(1e-30), "rowq.tiny"), onh.from_array(np.float32(127), "rowq.127"),
            onh.from_array(np.float32(128), "rowq.128"), onh.from_array(np.uint8(128), "rowq.zp")]


class _RowInt8:
    """One rowwise_int8 rewrite: the graph's nodes re-emitted in order with its weight MatMuls in per-row int8,
    the new initializers, and the weights (and DequantizeLinear outputs) no longer read."""

    def __init__(self, g: onnx.GraphProto, reduce_range: bool):
        self.reduce_range = reduce_range
        self.weights = {t.name: t for t in g.initializer}
        self.producer = {o: n for n in g.node for o in n.output}
        self.consumers: dict[str, list] = {}
        for n in g.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.quantized_x: dict[str, tuple[str, str]] = {}     # activation -> (u8 tensor, row scales)
        self.inits, self.dropped, self.nodes, self.count, self.made = [], set(), [], 0, set()

    def rewrite(self, g: onnx.GraphProto) -> None:
        """Every node of `g` in order: weight MatMuls (alone or merged with their activation's others) in int8."""
        # MatMuls of one activation with constant weights (q/k/v, gate/up) run as one MatMulInteger over the
        # weights side by side, then Split: fewer, larger kernels (per-column scales make this the same arithmetic)
        groups: dict[str, list] = {}
        for n in g.node:
            if n.op_type == "MatMul" and self.float_matrix(n.input[1]) and len(self.consumers[n.input[1]]) == 1:
                groups.setdefault(n.input[0], []).append(n)
        # a merged MatMul's output -> its group (the first member emits the group, the others are skipped)
        group_of = {m.output[0]: grp for grp in groups.values() if len(grp) > 1 for m in grp}
        for n in g.node:
            grp = group_of.get(n.output[0]) if n.op_type == "MatMul" else None
            if grp is not None:
                if n.output[0] == grp[0].output[0]:
                    self.merged(n.input[0], grp)
                continue
            w = self.weights_of(n.input[1]) if n.op_type == "MatMul" else None
            if w is None:
                self.nodes.append(_copy(n))
                continue
            self.emit(n.input[0], w[0], w[1], n.output[0])
            self.count += 1

    def float_matrix(self, name: str) -> bool:
        t = self.weights.get(name)
        return t is not None and t.data_type == TensorProto.FLOAT and len(t.dims) == 2

    def weights_of(self, name: str):
        """(int8 weights, column scales) for the MatMul input `name`, or None when it is not a weight."""
        if self.float_matrix(name):
            if name + ".q8" not in self.made:          # a weight shared by several MatMuls is quantized once
                q, s = quantize_columns(onh.to_array(self.weights[name]), self.reduce_range)
                self.inits.extend([onh.from_array(q, name + ".q8"), onh.from_array(s, name + ".q8scale")])
                self.made.add(name + ".q8")
            if all(n.op_type == "MatMul" and n.input[1] == name for n in self.consumers[name]):
                self.dropped.add(name)
            return name + ".q8", name + ".q8scale"
        p = self.producer.get(name)
        if (p is not None and p.op_type == "DequantizeLinear" and len(p.input) == 2
                and len(self.consumers[name]) == 1 and any(a.name == "axis" and a.i == 1 for a in p.attribute)):
            self.dropped.add(p.output[0])
            return p.input[0], p.input[1]
        return None

    def merged(self, x: str, grp: list) -> None:
        """The group's weights side by side, quantized as one matrix: one MatMulInteger, then a Split."""
        ws = [onh.to_array(self.weights[m.input[1]]) for m in grp]
        q, sc = quantize_columns(np.concatenate(ws, axis=1), self.reduce_range)
        name = grp[0].input[1] + ".merged"
        self.inits.extend([onh.from_array(q, name + ".q8"), onh.from_array(sc, name + ".q8scale"),
                           onh.from_array(np.array([w.shape[1] for w in ws], np.int64), name + ".split")])
        self.dropped.update(m.input[1] for m in grp)
        self.emit(x, name + ".q8", name + ".q8scale", name + ".out")
        self.nodes.append(oh.make_node("Split", [name + ".out", name + ".split"], [m.output[0] for m in grp],
                                       axis=-1))
        self.count += len(grp)

    def quantize_rows(self, x: str, tag: str) -> tuple[str, str]:
        """x as uint8 codes and one scale a row (made once an activation)."""
        if x not in self.quantized_x:
            p = f"{tag}.rowq."
            self.nodes.extend([
                oh.make_node("Abs", [x], [p + "abs"]),
                oh.make_node("ReduceMax", [p + "abs", "rowq.axes"], [p + "max"], keepdims=1),
                oh.make_node("Max", [p + "max", "rowq.tiny"], [p + "max1"]),
                oh.make_node("Div", [p + "max1", "rowq.127"], [p + "scale"]),
                # |x / scale| <= 127, so x / scale + 128 lies in [1, 255]; adding the even 128 before rounding
                # keeps round-half-to-even's choices, and no Clip is needed
                oh.make_node("Div", [x, p + "scale"], [p + "xs"]),
                oh.make_node("Add", [p + "xs", "rowq.128"], [p + "xz"]),
                oh.make_node("Round", [p + "xz"], [p + "xr"]),
                oh.make_node("Cast", [p + "xr"], [p + "q"], to=TensorProto.UINT8)])
            self.quantized_x[x] = (p + "q", p + "scale")
        return self.quantized_x[x]

    def emit(self, x: str, wq: str, ws: str, out: str) -> None:
        """out = x @ the weights wq (scales ws) in per-row int8."""
        xq, xs = self.quantize_rows(x, out)
        self.nodes.extend([
            oh.make_node("MatMulInteger", [xq, wq, "rowq.zp"], [out + ".acc"]),
            oh.make_node("Cast", [out + ".acc"], [out + ".accf"], to=TensorProto.FLOAT),
            oh.make_node("Mul", [out + ".accf", xs], [out + ".rows"]),
            oh.make_node("Mul", [out + ".rows", ws], [out])])
