"""Build ONNX graphs of a Llama-family decoder directly from its weights (opset 23 fused ops).

One decoder-layer function serves both layouts: in "whole" the weights are initializers; in "split" they are
graph inputs, so one `layer.onnx` runs every layer with that layer's weight buffers bound (DESIGN section 5).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper as oh, numpy_helper as onh

from .hf import Arch

OPSET = 23
MATMULS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")
BIASES = ("q_proj_bias", "k_proj_bias", "v_proj_bias")
F32 = TensorProto.FLOAT


def layer_weight_names(arch: Arch) -> list[str]:
    return list(NORMS) + list(MATMULS) + (list(BIASES) if arch.qkv_bias else [])


def rope_tables(arch: Arch) -> tuple[np.ndarray, np.ndarray]:
    t = np.arange(arch.context_length, dtype=np.float32)
    freqs = np.outer(t, arch.inv_freq.astype(np.float32))          # [ctx, hd/2]
    return ((np.cos(freqs) * arch.attention_scaling).astype(np.float32),
            (np.sin(freqs) * arch.attention_scaling).astype(np.float32))


class Builder:
    def __init__(self):
        self.nodes, self.inits, self.inputs, self.outputs = [], [], [], []

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


def weight_value(b: Builder, arch: Arch, i: int, key: str, w: np.ndarray | None, precision: str, as_input: bool):
    """Return the name of an fp32 tensor holding weight `key` of layer i (initializer or input, maybe cast)."""
    base = f"layers.{i}.{key}" if not as_input else key
    if precision == "fp16" or (precision == "int8" and key not in MATMULS):
        stored = TensorProto.FLOAT16 if precision == "fp16" else F32
    else:
        stored = F32
    if precision == "int8" and key in MATMULS:
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


def decoder_layer(b: Builder, arch: Arch, i: int, x: str, weights: dict | None, precision: str, as_input: bool,
                  past_k: str, past_v: str, present_k: str, present_v: str) -> str:
    """Emit one pre-norm Llama decoder layer on hidden state `x` [B, S, H]; returns the output hidden name."""
    W = {k: weight_value(b, arch, i, k, None if weights is None else weights[k], precision, as_input)
         for k in layer_weight_names(arch)} if weights is not None else None
    p = f"l{i}."
    h = b.node("RMSNormalization", [x, W["input_layernorm"]], [p + "h"], axis=-1, epsilon=arch.rms_eps)
    proj = {}
    for k in ("q_proj", "k_proj", "v_proj"):
        proj[k] = b.node("MatMul", [h, W[k]], [p + k])
        if arch.qkv_bias:
            proj[k] = b.node("Add", [proj[k], W[k + "_bias"]], [p + k + "_b"])
    q = b.node("RotaryEmbedding", [proj["q_proj"], "cos_cache", "sin_cache", "position_ids"], [p + "q_rot"],
               num_heads=arch.heads)
    k = b.node("RotaryEmbedding", [proj["k_proj"], "cos_cache", "sin_cache", "position_ids"], [p + "k_rot"],
               num_heads=arch.kv_heads)
    a = b.node("Attention", [q, k, proj["v_proj"], "attention_mask", past_k, past_v],
               [p + "attn", present_k, present_v], q_num_heads=arch.heads, kv_num_heads=arch.kv_heads)[0]
    o = b.node("MatMul", [a, W["o_proj"]], [p + "o"])
    x = b.node("Add", [x, o], [p + "x1"])
    h2 = b.node("RMSNormalization", [x, W["post_attention_layernorm"]], [p + "h2"], axis=-1, epsilon=arch.rms_eps)
    g = b.node("MatMul", [h2, W["gate_proj"]], [p + "gate"])
    u = b.node("MatMul", [h2, W["up_proj"]], [p + "up"])
    s = b.node("Mul", [g, b.node("Sigmoid", [g], [p + "sig"])], [p + "silu"])
    d = b.node("MatMul", [b.node("Mul", [s, u], [p + "su"]), W["down_proj"]], [p + "down"])
    return b.node("Add", [x, d], [p + "out"])


def _common_inputs(b: Builder, arch: Arch, with_ids: bool):
    if with_ids:
        b.inputs.append(_vi("input_ids", TensorProto.INT64, ["batch", "n_new"]))
    b.inputs.append(_vi("position_ids", TensorProto.INT64, ["batch", "n_new"]))
    b.inputs.append(_vi("attention_mask", F32, ["batch", 1, "n_new", "n_total"]))
    cos, sin = rope_tables(arch)
    b.init("cos_cache", cos)
    b.init("sin_cache", sin)


def _head(b: Builder, arch: Arch, x: str, norm, lm_head, output: str, precision: str):
    h = b.node("RMSNormalization", [x, norm], ["final_h"], axis=-1, epsilon=arch.rms_eps)
    if output == "topk":
        b.inputs.append(_vi("topk", TensorProto.INT64, [1]))
        logits = b.node("MatMul", [h, lm_head], ["head_logits"])
        lp = b.node("LogSoftmax", [logits], ["head_logprobs"], axis=-1)
        b.node("TopK", [lp, "topk"], ["topk_logprobs", "topk_ids"], axis=-1, largest=1, sorted=1)
        b.outputs += [_vi("topk_logprobs", F32, ["batch", "n_new", "k"]),
                      _vi("topk_ids", TensorProto.INT64, ["batch", "n_new", "k"])]
    else:
        b.node("MatMul", [h, lm_head], ["logits"])
        b.outputs.append(_vi("logits", F32, ["batch", "n_new", arch.vocab_size]))


def _kv_io(b: Builder, arch: Arch, i: int, past_names, present_names):
    for name in past_names:
        b.inputs.append(_vi(name, F32, ["batch", arch.kv_heads, "n_past", arch.head_dim]))
    for name in present_names:
        b.outputs.append(_vi(name, F32, ["batch", arch.kv_heads, "n_total", arch.head_dim]))


def kv_names(i: int):
    return (f"past_key_values.{i}.key", f"past_key_values.{i}.value", f"present.{i}.key", f"present.{i}.value")


def _global_inits(b: Builder, g: dict, precision: str) -> tuple[str, str, str]:
    """Embedding (fp32 Gather, or fp16 + Cast), final norm, lm_head (MatMul-ready; quantized later if asked)."""
    if precision == "fp16":
        b.init("embed.weight.f16", g["embed"].astype(np.float16))
        emb = b.node("Cast", ["embed.weight.f16"], ["embed.weight"], to=F32)
        b.init("lm_head.weight.f16", g["lm_head"].astype(np.float16))
        head = b.node("Cast", ["lm_head.weight.f16"], ["lm_head.weight"], to=F32)
    else:
        emb = b.init("embed.weight", g["embed"])
        head = b.init("lm_head.weight", g["lm_head"])
    return emb, b.init("norm.weight", g["norm"]), head


def whole_model(arch: Arch, g: dict, layers: list[dict], precision: str, output: str) -> onnx.ModelProto:
    """Precision here is the storage of weights in the graph: fp32 or fp16 (int8/int4 are applied afterwards
    by onnxruntime's quantizers on the fp32 graph)."""
    b = Builder()
    _common_inputs(b, arch, with_ids=True)
    emb, norm, head = _global_inits(b, g, precision)
    x = b.node("Gather", [emb, "input_ids"], ["h0"], axis=0)
    for i, w in enumerate(layers):
        pk, pv, ok, ov = kv_names(i)
        _kv_io(b, arch, i, (pk, pv), (ok, ov))
        x = decoder_layer(b, arch, i, x, w, precision, False, pk, pv, ok, ov)
    _head(b, arch, x, norm, head, output, precision)
    return b.model("specbeam_whole")


def embed_model(arch: Arch, g: dict, precision: str) -> onnx.ModelProto:
    b = Builder()
    b.inputs.append(_vi("input_ids", TensorProto.INT64, ["batch", "n_new"]))
    emb, _, _ = _global_inits(b, {**g, "lm_head": g["lm_head"][:, :1]}, precision)
    b.node("Gather", [emb, "input_ids"], ["hidden"], axis=0)
    b.outputs.append(_vi("hidden", F32, ["batch", "n_new", arch.hidden]))
    b.inits = [t for t in b.inits if not t.name.startswith("lm_head")]
    b.nodes = [n for n in b.nodes if not n.output[0].startswith("lm_head")]
    return b.model("specbeam_embed")


def layer_model(arch: Arch, sample: dict, precision: str) -> onnx.ModelProto:
    """The shared decoder-layer graph; its weights are inputs named as in `layer_weight_names`."""
    b = Builder()
    b.inputs.append(_vi("hidden", F32, ["batch", "n_new", arch.hidden]))
    _common_inputs(b, arch, with_ids=False)
    b.inputs.append(_vi("past_key", F32, ["batch", arch.kv_heads, "n_past", arch.head_dim]))
    b.inputs.append(_vi("past_value", F32, ["batch", arch.kv_heads, "n_past", arch.head_dim]))
    x = decoder_layer(b, arch, 0, "hidden", sample, precision, True, "past_key", "past_value",
                      "present_key", "present_value")
    b.node("Identity", [x], ["hidden_out"])
    b.outputs += [_vi("hidden_out", F32, ["batch", "n_new", arch.hidden]),
                  _vi("present_key", F32, ["batch", arch.kv_heads, "n_total", arch.head_dim]),
                  _vi("present_value", F32, ["batch", arch.kv_heads, "n_total", arch.head_dim])]
    return b.model("specbeam_layer")


def head_model(arch: Arch, g: dict, precision: str, output: str) -> onnx.ModelProto:
    b = Builder()
    b.inputs.append(_vi("hidden", F32, ["batch", "n_new", arch.hidden]))
    _, norm, head = _global_inits(b, {**g, "embed": g["embed"][:1]}, precision)
    b.inits = [t for t in b.inits if not t.name.startswith("embed")]
    b.nodes = [n for n in b.nodes if not n.output[0].startswith("embed")]
    _head(b, arch, "hidden", norm, head, output, precision)
    return b.model("specbeam_head")
