"""Build ONNX graphs of a decoder (Llama and the families in export/families/) directly from its weights (opset 23 fused ops).

One decoder-layer function serves both layouts: in "whole" the weights are initializers; in "split" they are
graph inputs, so one `layer.onnx` runs every layer with that layer's weight buffers bound (DESIGN section 5).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper as oh, numpy_helper as onh

from specbeam_edge.contract import (HIDDEN, KEY_POSITIONS, LAYER_HIDDEN_OUT, LAYER_PAST, LAYER_PRESENT, LOGITS,
                                     TOPK_INPUT, TOPK_OUTPUTS, past_names, present_names)

from .hf import Arch, Rope

OPSET = 23
MATMULS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")
BIASES = ("q_proj_bias", "k_proj_bias", "v_proj_bias")
FLAGS = ("rope_select", "sliding")
F32 = TensorProto.FLOAT


def layer_weight_names(arch: Arch) -> list[str]:
    """The per-layer tensors (and, for layers that differ, the flags of hf.layer_flags), in storage order."""
    names = list(NORMS) + list(MATMULS) + (list(BIASES) if arch.qkv_bias else [])
    names += ["q_norm", "k_norm"] if arch.qk_norm else []
    names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if arch.sandwich_norms else []
    return names + (list(FLAGS) if arch.heterogeneous else [])


def rope_tables(arch: Arch, inv_freq: np.ndarray, scaling: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [context, rotary_dim / 2] as transformers forms them (fp32 products, torch cos/sin)."""
    import torch

    t = torch.arange(arch.context_length, dtype=torch.int64).float()
    freqs = torch.outer(t, torch.from_numpy(inv_freq))
    return (freqs.cos() * scaling).numpy().astype(np.float32), (freqs.sin() * scaling).numpy().astype(np.float32)


def delta_tables(arch: Arch, rope: Rope) -> tuple[np.ndarray, np.ndarray]:
    """Pure rotations from short-factor to long-factor angles: R(long) = R(long - short) R(short)."""
    t = np.arange(arch.context_length, dtype=np.float64)[:, None]
    d = t * rope.long_inv_freq.astype(np.float64) - t * rope.inv_freq.astype(np.float64)
    return np.cos(d).astype(np.float32), np.sin(d).astype(np.float32)


def needs_key_positions(arch: Arch) -> bool:
    return any(arch.layer_sliding) or any(r.long_inv_freq is not None for r in arch.ropes.values())


class Builder:
    def __init__(self, attention: str = "fp32"):
        self.nodes, self.inits, self.inputs, self.outputs = [], [], [], []
        self.attention = attention          # "fp32", or "fp64": attention computed in double (see _attention)

    def node(self, op, ins, outs, **attrs):
        self.nodes.append(oh.make_node(op, ins, outs, **attrs))
        return outs[0] if len(outs) == 1 else outs

    def init(self, name, array):
        self.inits.append(onh.from_array(np.ascontiguousarray(array), name))
        return name

    def model(self, name):
        g = oh.make_graph(self.nodes, name, self.inputs, self.outputs, self.inits)
        m = oh.make_model(g, opset_imports=[oh.make_opsetid("", OPSET)], ir_version=10)
        m.producer_name = "specbeam-edge export"
        return m


def _vi(name, elem, shape):
    return oh.make_tensor_value_info(name, elem, shape)


def stored_weight(b: Builder, name: str, w: np.ndarray, precision: str, axis: int = 1) -> str:
    """The fp32 tensor `name` of a weight initializer as stored: fp32; fp16 (half, one Cast); int8w for 2-D
    weights (int8 with one scale per output channel: axis 1 of a [in, out] MatMul weight, axis 0 of an
    embedding table; a Cast and a Mul by the scales). onnxruntime folds the Cast/Mul of initializers when it
    loads the graph, so compute is fp32 and a node's logits do not depend on the other nodes in its pass
    (batch-invariant, unlike int8's dynamic activation quantization)."""
    if precision == "fp16":
        b.init(name + ".f16", w.astype(np.float16))
        return b.node("Cast", [name + ".f16"], [name], to=F32)
    if precision == "int8w" and w.ndim == 2:
        q, s = quantize_int8(w if axis == 1 else w.T)
        q, s = (q, s) if axis == 1 else (q.T, s[:, None])
        b.init(name + ".i8", q)
        b.init(name + ".scale", s)
        return b.node("Mul", [b.node("Cast", [name + ".i8"], [name + ".i8f"], to=F32), name + ".scale"], [name])
    return b.init(name, w)


def weight_value(b: Builder, arch: Arch, i: int, key: str, w: np.ndarray | None, precision: str, as_input: bool):
    """Return the name of an fp32 tensor holding weight `key` of layer i (initializer or input, maybe cast)."""
    base = f"layers.{i}.{key}" if not as_input else key
    if precision == "int8w" and not as_input:
        return stored_weight(b, base, w, precision)
    if precision == "fp16" or (precision == "int8" and key not in MATMULS):
        stored = TensorProto.FLOAT16 if precision == "fp16" else F32
    else:
        stored = F32
    if precision in ("int8", "int8w") and key in MATMULS:     # (int8w: streamed layers of the split layout)
        if as_input:
            b.inputs.append(_vi(base, TensorProto.INT8, list(w.shape) if w is not None else None))
            b.inputs.append(_vi(base + ".scale", F32, [w.shape[1]] if w is not None else None))
        else:
            q, s = quantize_int8(w)
            b.init(base, q)
            b.init(base + ".scale", s)
        return b.node("DequantizeLinear", [base, base + ".scale"], [base + ".f32"], axis=1)
    if as_input:
        b.inputs.append(_vi(base, stored, list(w.shape) if w is not None else None))
    else:
        b.init(base, w.astype(np.float16) if stored == TensorProto.FLOAT16 else w)
    if stored == TensorProto.FLOAT16:
        return b.node("Cast", [base], [base + ".f32"], to=F32)
    return base


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel int8 for a [in, out] matrix."""
    scale = np.maximum(np.abs(w).max(axis=0), 1e-8) / 127.0
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32)


def _rms(b: Builder, arch: Arch, x: str, w: str, out: str) -> str:
    return b.node("RMSNormalization", [x, w], [out], axis=-1, epsilon=arch.rms_eps)


def _head_norm(b: Builder, arch: Arch, x: str, w: str, heads: int, p: str) -> str:
    """RMSNorm over each head's head_dim slice of x [B, S, heads * head_dim] (Qwen3/Gemma 3 q/k norms)."""
    shape = b.init(p + "heads_shape", np.array([0, 0, heads, arch.head_dim], np.int64))
    flat = b.init(p + "flat_shape", np.array([0, 0, heads * arch.head_dim], np.int64))
    r = b.node("Reshape", [x, shape], [p + "r"])
    return b.node("Reshape", [_rms(b, arch, r, w, p + "n"), flat], [p + "out"])


def _rotate(b: Builder, arch: Arch, x: str, kind: str | None, heads: int, p: str) -> str:
    if kind is None:
        return x
    return b.node("RotaryEmbedding", [x, f"cos_{kind}", f"sin_{kind}", "position_ids"], [p + kind],
                  num_heads=heads, rotary_embedding_dim=arch.rotary_dim)


def _select(b: Builder, choices: list[str], select: str, p: str) -> str:
    """sum_j select[j] * choices[j] for a one-hot `select`: exactly the chosen tensor (x*1 = x, x*0 = 0)."""
    acc = None
    for j, c in enumerate(choices):
        idx = b.init(f"{p}idx{j}", np.array([j], np.int64))
        term = b.node("Mul", [c, b.node("Gather", [select, idx], [f"{p}s{j}"], axis=0)], [f"{p}t{j}"])
        acc = term if acc is None else b.node("Add", [acc, term], [f"{p}acc{j}"])
    return acc


def _rope_and_mask(b: Builder, arch: Arch, i: int, q: str, k: str, W: dict, dynamic: bool, p: str):
    """Rotate q, k as layer i's kind wants and pick its mask. In the split layout of a model whose layers differ,
    the shared graph computes every kind and selects with the layer's flags (`rope_select`, `sliding`)."""
    if not dynamic:
        kind = arch.layer_rope[i]
        mask = "sliding_mask" if arch.layer_sliding[i] else "attention_mask"
        return _rotate(b, arch, q, kind, arch.heads, p + "q_"), _rotate(b, arch, k, kind, arch.kv_heads, p + "k_"), mask
    kinds = arch.rope_kinds + [None]
    q = _select(b, [_rotate(b, arch, q, kd, arch.heads, p + "q_") for kd in kinds], W["rope_select"], p + "qsel.")
    k = _select(b, [_rotate(b, arch, k, kd, arch.kv_heads, p + "k_") for kd in kinds], W["rope_select"], p + "ksel.")
    if not any(arch.layer_sliding):
        return q, k, "attention_mask"
    half = b.init(p + "half", np.array(0.5, np.float32))
    is_sliding = b.node("Greater", [W["sliding"], half], [p + "is_sliding"])
    return q, k, b.node("Where", [is_sliding, "sliding_mask", "attention_mask"], [p + "mask"])


def _long_rope_attention(b: Builder, arch: Arch, kind: str, proj: dict, q_short: str, k_short: str, a_short: str,
                         mask: str, past_k: str, past_v: str, attrs: dict, p: str) -> str:
    """LongRoPE as transformers' generate runs it: once a sequence is longer than original_max it recomputes the
    whole cache with the long factors (Phi3 prepare_inputs_for_generation), so a query at position >=
    original_max sees every key, its own path included, long-rotated; shorter ones see them short-rotated. The
    cache keeps short-rotated keys; for the long queries the graph re-rotates the past keys by the angle
    difference and attends a second time. Query rows then pick their variant."""
    if arch.qk_norm:
        raise NotImplementedError("LongRoPE with q/k norms")
    q = _rotate(b, arch, proj["q_proj"], kind + "_long", arch.heads, p + "ql_")
    k = _rotate(b, arch, proj["k_proj"], kind + "_long", arch.kv_heads, p + "kl_")
    zero = b.init(p + "zero", np.array([0], np.int64))
    n_past = b.node("Shape", [past_k], [p + "n_past"], start=2, end=3)
    past_pos = b.node("Slice", [KEY_POSITIONS, zero, n_past, b.init(p + "one", np.array([1], np.int64))],
                      [p + "past_pos"])
    # every cached key as its own length-1 sequence ([B*N, kv_heads, 1, D], positions [B*N, 1]): the op refuses a
    # sequence longer than its tables (context_length rows), and a cache can hold more slots than that (dead
    # draft nodes, K diverging beams) while every position stays inside; the rotation is per element, so the
    # result is the same
    per_key = b.node("Reshape", [b.node("Transpose", [past_k], [p + "pk_t"], perm=[0, 2, 1, 3]),
                                 b.init(p + "per_key", np.array([-1, arch.kv_heads, 1, arch.head_dim], np.int64))],
                     [p + "pk_keys"])
    key_pos = b.node("Reshape", [past_pos, b.init(p + "key_pos", np.array([-1, 1], np.int64))], [p + "pk_pos"])
    rotated = b.node("RotaryEmbedding", [per_key, f"cos_{kind}_delta", f"sin_{kind}_delta", key_pos],
                     [p + "pk_rot"], rotary_embedding_dim=arch.rotary_dim)
    back = b.node("Concat", [b.node("Shape", [past_k], [p + "pk_shape"], start=0, end=1),
                             b.init(p + "pk_rest", np.array([-1, arch.kv_heads, arch.head_dim], np.int64))],
                  [p + "pk_back"], axis=0)
    past_long = b.node("Transpose", [b.node("Reshape", [rotated, back], [p + "pk_bnhd"])], [p + "past_k_long"],
                       perm=[0, 2, 1, 3])
    a_long = _attention(b, arch, [q, k, proj["v_proj"], mask, past_long, past_v],
                        [p + "attn_long", p + "pk_long", p + "pv_long"], attrs)[0]
    orig = b.init(p + "orig", np.array(arch.ropes[kind].original_max, np.int64))
    is_long = b.node("Unsqueeze", [b.node("GreaterOrEqual", ["position_ids", orig], [p + "ge"]),
                                   b.init(p + "ax", np.array([2], np.int64))], [p + "is_long"])
    return b.node("Where", [is_long, a_long, a_short], [p + "attn_sel"])


def _attention(b: Builder, arch: Arch, ins: list[str], outs: list[str], attrs: dict) -> list[str]:
    """Attention over q, k, v [B, S, heads * head_dim], the additive mask [B, 1, S, T] and the past [B, kv_heads,
    P, head_dim]; outputs (attention [B, S, heads * head_dim], present key, present value).

    "fp32": onnxruntime's fused Attention op. "fp64" (DESIGN "Layout-exact attention"): the same arithmetic from
    primitive ops with the softmax's sum and the weighted sum of values in double. Why: in fp32 those two sums over
    a row's columns round, in the last bits, according to where the masked (dead) columns sit among the live ones,
    which a tree pass and a plain step lay out differently; per-row int8 activations turn such a bit into whole
    quantization steps (5-9% of the largest logit on SmolLM2-135M, measured). Scores (q . k over head_dim) and exp
    are per element, so fp32 gives them bit for bit; the double sums round back to the same fp32 value whatever
    the layout."""
    if b.attention != "fp64":
        return b.node("Attention", ins, outs, **attrs)
    q, k, v, mask, past_k, past_v = ins
    out, present_k, present_v = outs
    H, KV, D = arch.heads, arch.kv_heads, arch.head_dim
    G = H // KV
    F64 = TensorProto.DOUBLE
    c = lambda name, values: b.init(f"{out}.{name}", np.array(values, np.int64))

    def heads(x, n, name):               # [B, S, n * D] -> [B, n, S, D]
        return b.node("Transpose", [b.node("Reshape", [x, c(name + "_shape", [0, 0, n, D])], [f"{out}.{name}_r"])],
                      [f"{out}.{name}_t"], perm=[0, 2, 1, 3])
    b.node("Concat", [past_k, heads(k, KV, "k")], [present_k], axis=2)
    b.node("Concat", [past_v, heads(v, KV, "v")], [present_v], axis=2)
    # queries grouped by their KV head: [B, S, KV, G, D] -> [B, KV, G, S, D] -> [B, KV, G * S, D]
    q5 = b.node("Transpose", [b.node("Reshape", [q, c("q_shape", [0, 0, KV, G, D])], [f"{out}.q_r"])],
                [f"{out}.q_t"], perm=[0, 2, 3, 1, 4])
    shape5 = b.node("Shape", [q5], [f"{out}.q5_shape"])
    qg = b.node("Reshape", [q5, c("qg_shape", [0, KV, -1, D])], [f"{out}.qg"])
    kt = b.node("Transpose", [present_k], [f"{out}.kt"], perm=[0, 1, 3, 2])
    scores = b.node("MatMul", [qg, kt], [f"{out}.scores"])                      # [B, KV, G * S, T]
    shape4 = b.node("Shape", [scores], [f"{out}.shape4"])
    scale = attrs.get("scale", 1.0 / np.sqrt(D))
    scores = b.node("Mul", [scores, b.init(f"{out}.scale", np.array(scale, np.float32))], [f"{out}.scaled"])
    if "softcap" in attrs:
        cap = b.init(f"{out}.softcap", np.array(attrs["softcap"], np.float32))
        t = b.node("Tanh", [b.node("Div", [scores, cap], [f"{out}.cap_in"])], [f"{out}.cap_t"])
        scores = b.node("Mul", [t, cap], [f"{out}.capped"])
    # [B, KV, G, S, T] + mask [B, 1, 1, S, T]
    t_dim = b.node("Shape", [scores], [f"{out}.t_dim"], start=3, end=4)         # (after the soft cap: same)
    s5 = b.node("Concat", [b.node("Slice", [shape5, c("s0", [0]), c("s4", [4])], [f"{out}.lead"]), t_dim],
                [f"{out}.s5"], axis=0)
    scores = b.node("Add", [b.node("Reshape", [scores, s5], [f"{out}.scores5"]),
                            b.node("Unsqueeze", [mask, c("ax1", [1])], [f"{out}.mask5"])], [f"{out}.masked"])
    top = b.node("ReduceMax", [scores, c("ax_last", [-1])], [f"{out}.max"], keepdims=1)
    e = b.node("Exp", [b.node("Sub", [scores, top], [f"{out}.shifted"])], [f"{out}.exp"])
    e64 = b.node("Cast", [e], [f"{out}.exp64"], to=F64)
    total = b.node("ReduceSum", [e64, c("ax_sum", [-1])], [f"{out}.sum64"], keepdims=1)
    p = b.node("Div", [e64, total], [f"{out}.p64"])
    pg = b.node("Reshape", [p, shape4], [f"{out}.pg"])
    v64 = b.node("Cast", [present_v], [f"{out}.v64"], to=F64)
    a = b.node("Cast", [b.node("MatMul", [pg, v64], [f"{out}.pv64"])], [f"{out}.pv"], to=F32)   # [B, KV, G*S, D]
    a = b.node("Reshape", [a, shape5], [f"{out}.a5"])                            # [B, KV, G, S, D]
    a = b.node("Transpose", [a], [f"{out}.a_t"], perm=[0, 3, 1, 2, 4])           # [B, S, KV, G, D]
    b.node("Reshape", [a, c("a_shape", [0, 0, H * D])], [out])
    return [out, present_k, present_v]


def _mlp(b: Builder, arch: Arch, h: str, W: dict, p: str) -> str:
    g = b.node("MatMul", [h, W["gate_proj"]], [p + "gate"])
    u = b.node("MatMul", [h, W["up_proj"]], [p + "up"])
    if arch.activation == "gelu_tanh":
        a = b.node("Gelu", [g], [p + "gelu"], approximate="tanh")
    else:
        a = b.node("Mul", [g, b.node("Sigmoid", [g], [p + "sig"])], [p + "silu"])
    return b.node("MatMul", [b.node("Mul", [a, u], [p + "au"]), W["down_proj"]], [p + "down"])


def decoder_layer(b: Builder, arch: Arch, i: int, x: str, weights: dict | None, precision: str, as_input: bool,
                  past_k: str, past_v: str, present_k: str, present_v: str) -> str:
    """Emit one pre-norm decoder layer on hidden state `x` [B, S, H]; returns the output hidden name.
    Family features (q/k norms, sandwich norms, partial/absent/per-kind rope, windows, soft-capping, GeGLU)
    come from `arch`."""
    names = [n for n in layer_weight_names(arch) if as_input or n not in FLAGS]   # whole: layer kinds are static
    W = {k: weight_value(b, arch, i, k, None if weights is None else weights[k], precision, as_input)
         for k in names}
    p = f"l{i}."
    h = _rms(b, arch, x, W["input_layernorm"], p + "h")
    proj = {}
    for k in ("q_proj", "k_proj", "v_proj"):
        proj[k] = b.node("MatMul", [h, W[k]], [p + k])
        if arch.qkv_bias:
            proj[k] = b.node("Add", [proj[k], W[k + "_bias"]], [p + k + "_b"])
    q, k = proj["q_proj"], proj["k_proj"]
    if arch.qk_norm:
        q = _head_norm(b, arch, q, W["q_norm"], arch.heads, p + "qn.")
        k = _head_norm(b, arch, k, W["k_norm"], arch.kv_heads, p + "kn.")
    q, k, mask = _rope_and_mask(b, arch, i, q, k, W, as_input and arch.heterogeneous, p)
    attrs = {"q_num_heads": arch.heads, "kv_num_heads": arch.kv_heads}
    if arch.attn_scale is not None:
        attrs["scale"] = float(arch.attn_scale)
    if arch.attn_softcap:
        attrs["softcap"] = float(arch.attn_softcap)
    a = _attention(b, arch, [q, k, proj["v_proj"], mask, past_k, past_v], [p + "attn", present_k, present_v],
                   attrs)[0]
    kind = arch.layer_rope[i]
    if kind is not None and arch.ropes[kind].long_inv_freq is not None:
        a = _long_rope_attention(b, arch, kind, proj, q, k, a, mask, past_k, past_v, attrs, p)
    o = b.node("MatMul", [a, W["o_proj"]], [p + "o"])
    if arch.sandwich_norms:
        o = _rms(b, arch, o, W["post_attention_layernorm"], p + "o_n")
        x = b.node("Add", [x, o], [p + "x1"])
        d = _mlp(b, arch, _rms(b, arch, x, W["pre_feedforward_layernorm"], p + "h2"), W, p)
        d = _rms(b, arch, d, W["post_feedforward_layernorm"], p + "down_n")
    else:
        x = b.node("Add", [x, o], [p + "x1"])
        d = _mlp(b, arch, _rms(b, arch, x, W["post_attention_layernorm"], p + "h2"), W, p)
    return b.node("Add", [x, d], [p + "out"])


def _common_inputs(b: Builder, arch: Arch, with_ids: bool):
    """Token inputs, the rope tables of every kind, and (for sliding-window layers) key_position_ids and the
    sliding mask: the tree mask AND query_position - key_position < window (transformers'
    `kv_idx > q_idx - sliding_window`), so the window follows each node's own path in the tree."""
    if with_ids:
        b.inputs.append(_vi("input_ids", TensorProto.INT64, ["batch", "n_new"]))
    b.inputs.append(_vi("position_ids", TensorProto.INT64, ["batch", "n_new"]))
    b.inputs.append(_vi("attention_mask", F32, ["batch", 1, "n_new", "n_total"]))
    for kind in arch.rope_kinds:
        r = arch.ropes[kind]
        for name, inv in ((kind, r.inv_freq), (kind + "_long", r.long_inv_freq)):
            if inv is not None:
                cos, sin = rope_tables(arch, inv, r.attention_scaling)
                b.init(f"cos_{name}", cos)
                b.init(f"sin_{name}", sin)
        if r.long_inv_freq is not None:
            cos, sin = delta_tables(arch, r)
            b.init(f"cos_{kind}_delta", cos)
            b.init(f"sin_{kind}_delta", sin)
    if needs_key_positions(arch):
        b.inputs.append(_vi(KEY_POSITIONS, TensorProto.INT64, ["batch", "n_total"]))
    if any(arch.layer_sliding):
        qpos = b.node("Unsqueeze", ["position_ids", b.init("axes_q", np.array([1, 3], np.int64))], ["q_pos"])
        kpos = b.node("Unsqueeze", [KEY_POSITIONS, b.init("axes_k", np.array([1, 2], np.int64))], ["k_pos"])
        dist = b.node("Sub", [qpos, kpos], ["q_minus_k"])                   # [B, 1, n_new, n_total]
        inside = b.node("Less", [dist, b.init("window", np.array(arch.sliding_window, np.int64))], ["in_window"])
        floor = b.init("mask_floor", np.array(np.finfo(np.float32).min, np.float32))
        b.node("Where", [inside, "attention_mask", floor], ["sliding_mask"])


def add_topk(b: Builder, logits: str, head_ids: str | None = None) -> None:
    """The top-k head over `logits` [B, n_new, V]: the `topk` input, LogSoftmax, TopK (sorted, best first).
    head_ids: the vocabulary id of each logit column when the head scores a token subset (TopK's column
    numbers are mapped through it)."""
    logprobs, top_ids = TOPK_OUTPUTS
    b.inputs.append(_vi(TOPK_INPUT, TensorProto.INT64, [1]))
    lp = b.node("LogSoftmax", [logits], ["head_logprobs"], axis=-1)
    ids = top_ids if head_ids is None else "topk_columns"
    b.node("TopK", [lp, TOPK_INPUT], [logprobs, ids], axis=-1, largest=1, sorted=1)
    if head_ids is not None:
        b.node("Gather", [head_ids, ids], [top_ids], axis=0)
    b.outputs += [_vi(logprobs, F32, ["batch", "n_new", "k"]),
                  _vi(top_ids, TensorProto.INT64, ["batch", "n_new", "k"])]


def _full_logits(b: Builder, arch: Arch, sub: str, head_ids: str) -> str:
    """A subset head's logits [B, n_new, S] spread over the vocabulary: -inf for every token it does not score
    (a draft gives them probability 0; the target still scores every token)."""
    shape = b.node("Shape", [sub], ["sub_shape"])
    lead = b.node("Slice", [shape, b.init("lead_start", np.array([0], np.int64)),
                            b.init("lead_end", np.array([2], np.int64))], ["lead_shape"])
    full = b.node("Concat", [lead, b.init("vocab_dim", np.array([arch.vocab_size], np.int64))], ["full_shape"], axis=0)
    fill = b.node("ConstantOfShape", [full], ["full_fill"],
                  value=onnx.helper.make_tensor("v", F32, [1], [float("-inf")]))
    where = b.node("Expand", [head_ids, shape], ["head_columns"])
    return b.node("ScatterElements", [fill, where, sub], [LOGITS], axis=2)


def _head(b: Builder, arch: Arch, x: str, norm, lm_head, output: str, precision: str, head_ids=None):
    """Final norm, lm_head, soft cap, and the outputs `output` asks for. head_ids (int64 [S] or None): the
    vocabulary ids of a subset head's rows."""
    ids = None if head_ids is None else b.init("head_token_ids", np.asarray(head_ids, np.int64))
    h = b.node("RMSNormalization", [x, norm], ["final_h"], axis=-1, epsilon=arch.rms_eps)
    direct = output != "topk" and ids is None     # the MatMul (or cap) writes the `logits` output itself
    logits = b.node("MatMul", [h, lm_head], [LOGITS if direct and not arch.final_softcap else "head_logits"])
    if arch.final_softcap:
        cap = b.init("final_softcap", np.array(arch.final_softcap, np.float32))
        t = b.node("Tanh", [b.node("Div", [logits, cap], ["capped_in"])], ["capped_tanh"])
        logits = b.node("Mul", [t, cap], [LOGITS if direct else "capped_logits"])
    if output != "logits":
        add_topk(b, logits, ids)
    if output != "topk":
        if ids is not None:
            _full_logits(b, arch, logits, ids)
        b.outputs.append(_vi(LOGITS, F32, ["batch", "n_new", arch.vocab_size]))


def _kv_io(b: Builder, arch: Arch, i: int, past_names, present_names):
    for name in past_names:
        b.inputs.append(_vi(name, F32, ["batch", arch.kv_heads, "n_past", arch.head_dim]))
    for name in present_names:
        b.outputs.append(_vi(name, F32, ["batch", arch.kv_heads, "n_total", arch.head_dim]))


def _global_inits(b: Builder, g: dict, precision: str) -> tuple[str, str, str]:
    """Embedding, final norm, lm_head as stored (stored_weight; int8/int4 quantize the graph afterwards)."""
    emb = stored_weight(b, "embed.weight", g["embed"], precision, axis=0)
    head = stored_weight(b, "lm_head.weight", g["lm_head"], precision, axis=1)
    return emb, b.init("norm.weight", g["norm"]), head


def head_weight(b: Builder, lm_head, precision: str) -> str:
    """lm_head as stored: the fp32 [hidden, S] matrix (stored_weight), or int8 codes and per-column scales (int8
    [hidden, S], fp32 [S]) behind a DequantizeLinear that quant.rowwise_int8 turns into its MatMulInteger."""
    if not isinstance(lm_head, tuple):
        return stored_weight(b, "lm_head.weight", lm_head, precision, axis=1)
    q, s = lm_head
    return b.node("DequantizeLinear", [b.init("lm_head.weight.q8", q), b.init("lm_head.weight.q8scale", s)],
                  ["lm_head.weight"], axis=1)


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
    return (q.astype(np.float32).reshape(*scale.shape, -1) * scale[..., None]).reshape(q.shape)


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
        codes, scale = read("embed.codes"), read("embed.bscale")
        if "embed.low_mask" in t:              # 4-bit codes, two a byte (blocks_lookup unpacks them with it)
            codes = np.concatenate([codes & 15, codes >> 4], -1)
        v = codes.astype(np.float32)
        if "embed.bzero" in t:
            v = v - read("embed.bzero")
        v = v * scale
        if "embed.boffset" in t:
            v = v + read("embed.boffset")
        return v.reshape(v.shape[0], -1)
    return None


def _int8_rows_embedding(b: Builder, table: np.ndarray | None, hidden: int) -> str:
    """The embedding as int8 codes with a scale a block (quantize_embed_rows), looked up and scaled per token: the
    split layout's int8 table (export/split.py, offload.TableRows) computes the same fp32 products from its file.
    table None: the caller adds the initializers embed.weight.i8 and embed.weight.blockscale itself."""
    if table is not None:
        q, s = quantize_embed_rows(table)
        b.init("embed.weight.i8", q)
        b.init("embed.weight.blockscale", s)
    blocks = b.init("embed.blocks", np.array([0, 0, hidden // embed_block(hidden), embed_block(hidden)], np.int64))
    rows = b.node("Cast", [b.node("Gather", ["embed.weight.i8", "input_ids"], ["h0.i8"], axis=0)],
                  ["h0.codes"], to=F32)
    rows = b.node("Reshape", [rows, blocks], ["h0.blocks"])
    scale = b.node("Gather", ["embed.weight.blockscale", "input_ids"], ["h0.scale"], axis=0)
    scale = b.node("Unsqueeze", [scale, b.init("embed.last_axis", np.array([-1], np.int64))], ["h0.scale1"])
    flat = b.init("embed.flat", np.array([0, 0, hidden], np.int64))
    return b.node("Reshape", [b.node("Mul", [rows, scale], ["h0.scaled"]), flat], ["h0"])


def whole_model(arch: Arch, g: dict, layers: list[dict], precision: str, output: str,
                attention: str = "fp32", int8_embedding: bool = False) -> onnx.ModelProto:
    """Precision here is the storage of weights in the graph: fp32, fp16 or int8w (int8/int4 are applied
    afterwards by onnxruntime's quantizers on the fp32 graph). attention: "fp32" or "fp64" (_attention).
    int8_embedding: the table as int8 rows (the int8 precision's, as its split layout stores it)."""
    b = Builder(attention)
    _common_inputs(b, arch, with_ids=True)
    if int8_embedding:
        x = _int8_rows_embedding(b, g["embed"], arch.hidden)
        norm = b.init("norm.weight", g["norm"])
        head = stored_weight(b, "lm_head.weight", g["lm_head"], precision, axis=1)
    else:
        emb, norm, head = _global_inits(b, g, precision)
        x = b.node("Gather", [emb, "input_ids"], ["h0"], axis=0)
    for i, w in enumerate(layers):
        (pk, pv), (ok, ov) = past_names(i), present_names(i)
        _kv_io(b, arch, i, (pk, pv), (ok, ov))
        x = decoder_layer(b, arch, i, x, w, precision, False, pk, pv, ok, ov)
    _head(b, arch, x, norm, head, output, precision, g.get("head_ids"))
    return b.model("specbeam_whole")


def embed_model(arch: Arch, g: dict, precision: str) -> onnx.ModelProto:
    b = Builder()
    b.inputs.append(_vi("input_ids", TensorProto.INT64, ["batch", "n_new"]))
    emb, _, _ = _global_inits(b, {**g, "lm_head": g["lm_head"][:, :1]}, precision)
    b.node("Gather", [emb, "input_ids"], [HIDDEN], axis=0)
    b.outputs.append(_vi(HIDDEN, F32, ["batch", "n_new", arch.hidden]))
    b.inits = [t for t in b.inits if not t.name.startswith("lm_head")]
    b.nodes = [n for n in b.nodes if not n.output[0].startswith("lm_head")]
    return b.model("specbeam_embed")


def layer_model(arch: Arch, sample: dict, precision: str, attention: str = "fp32") -> onnx.ModelProto:
    """The shared decoder-layer graph; its weights are inputs named as in `layer_weight_names`."""
    b = Builder(attention)
    b.inputs.append(_vi(HIDDEN, F32, ["batch", "n_new", arch.hidden]))
    _common_inputs(b, arch, with_ids=False)
    b.inputs += [_vi(n, F32, ["batch", arch.kv_heads, "n_past", arch.head_dim]) for n in LAYER_PAST]
    x = decoder_layer(b, arch, 0, HIDDEN, sample, precision, True, *LAYER_PAST, *LAYER_PRESENT)
    b.node("Identity", [x], [LAYER_HIDDEN_OUT])
    b.outputs += [_vi(LAYER_HIDDEN_OUT, F32, ["batch", "n_new", arch.hidden]),
                  *[_vi(n, F32, ["batch", arch.kv_heads, "n_total", arch.head_dim]) for n in LAYER_PRESENT]]
    return b.model("specbeam_layer")


def head_model(arch: Arch, g: dict, precision: str, output: str) -> onnx.ModelProto:
    """The split layout's head. g["lm_head"]: the fp32 [hidden, S] matrix, or for int8 its per-column codes and
    scales (int8 [hidden, S], fp32 [S]), behind a DequantizeLinear that quant.rowwise_int8 turns into its
    MatMulInteger."""
    b = Builder()
    b.inputs.append(_vi(HIDDEN, F32, ["batch", "n_new", arch.hidden]))
    norm = b.init("norm.weight", g["norm"])
    _head(b, arch, HIDDEN, norm, head_weight(b, g["lm_head"], precision), output, precision, g.get("head_ids"))
    return b.model("specbeam_head")
