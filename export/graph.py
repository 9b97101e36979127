"""Build ONNX graphs of a decoder (Llama and the families in export/families/) directly from its weights (opset 23 fused ops).

One decoder-layer function serves both layouts: in "whole" the weights are initializers; in "split" they are
graph inputs, so one `layer.onnx` runs every layer with that layer's weight buffers bound (DESIGN section 5).
Here: weight storage, the decoder layer, the head and the whole / embed / layer / head models; rope, masks and
attention are in attention.py, the embedding table's stored forms in embedding.py.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from specbeam_edge.contract import (HEAD_FROM, HIDDEN, LAYER_HIDDEN_OUT, LAYER_PAST, LAYER_PRESENT, LOGITS,
                                     TOPK_INPUT, TOPK_OUTPUTS, past_names, present_names)

from .attention import _attention, _common_inputs, _long_rope_attention, _rope_and_mask
from .builder import F32, Builder, _vi
from .hf import Arch

MATMULS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")
BIASES = ("q_proj_bias", "k_proj_bias", "v_proj_bias")
FLAGS = ("rope_select", "sliding")


def layer_weight_names(arch: Arch) -> list[str]:
    """The per-layer tensors (and, for layers that differ, the flags of hf.layer_flags), in storage order."""
    names = list(NORMS) + list(MATMULS) + (list(BIASES) if arch.qkv_bias else [])
    names += ["q_norm", "k_norm"] if arch.qk_norm else []
    names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if arch.sandwich_norms else []
    return names + (list(FLAGS) if arch.heterogeneous else [])


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


def _head(b: Builder, arch: Arch, x: str, norm, lm_head, output: str, precision: str, head_ids=None,
          rows_from: bool = False):
    """Final norm, lm_head, soft cap, and the outputs `output` asks for. head_ids (int64 [S] or None): the
    vocabulary ids of a subset head's rows. rows_from (a whole graph): the head runs on the rows from the
    HEAD_FROM input on (the split layout's runtime slices its head graph's input itself)."""
    ids = None if head_ids is None else b.init("head_token_ids", np.asarray(head_ids, np.int64))
    if rows_from:     # an input with a default (an initializer of its name): callers that do not feed it get 0
        b.inputs.append(_vi(HEAD_FROM, TensorProto.INT64, [1]))
        b.init(HEAD_FROM, np.array([0], np.int64))
        end = b.init("head_rows_end", np.array([2**62], np.int64))
        axis = b.init("head_rows_axis", np.array([1], np.int64))
        x = b.node("Slice", [x, HEAD_FROM, end, axis], ["head_rows"])
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
    """A layer's KV inputs and outputs, in the cache's type (b.kv)."""
    for name in past_names:
        b.inputs.append(_vi(name, b.kv, ["batch", arch.kv_heads, "n_past", arch.head_dim]))
    for name in present_names:
        b.outputs.append(_vi(name, b.kv, ["batch", arch.kv_heads, "n_total", arch.head_dim]))


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


def whole_model(arch: Arch, g: dict, layers: list[dict], precision: str, output: str,
                attention: str = "fp32", kv_cache: str = "fp32") -> onnx.ModelProto:
    """Precision here is the storage of weights in the graph: fp32, fp16 or int8w (int8/int4 are applied
    afterwards by onnxruntime's quantizers on the fp32 graph). attention: "fp32" or "fp64" (attention._attention);
    kv_cache: the KV cache's type, "fp32" or "fp16" (Builder.kv)."""
    b = Builder(attention, kv_cache)
    _common_inputs(b, arch, with_ids=True)
    emb, norm, head = _global_inits(b, g, precision)
    x = b.node("Gather", [emb, "input_ids"], ["h0"], axis=0)
    for i, w in enumerate(layers):
        (pk, pv), (ok, ov) = past_names(i), present_names(i)
        _kv_io(b, arch, i, (pk, pv), (ok, ov))
        x = decoder_layer(b, arch, i, x, w, precision, False, pk, pv, ok, ov)
    _head(b, arch, x, norm, head, output, precision, g.get("head_ids"), rows_from=True)
    return b.model("specbeam_whole")


def layer_model(arch: Arch, sample: dict, precision: str, attention: str = "fp32",
                kv_cache: str = "fp32") -> onnx.ModelProto:
    """The shared decoder-layer graph; its weights are inputs named as in `layer_weight_names`."""
    b = Builder(attention, kv_cache)
    b.inputs.append(_vi(HIDDEN, F32, ["batch", "n_new", arch.hidden]))
    _common_inputs(b, arch, with_ids=False)
    b.inputs += [_vi(n, b.kv, ["batch", arch.kv_heads, "n_past", arch.head_dim]) for n in LAYER_PAST]
    x = decoder_layer(b, arch, 0, HIDDEN, sample, precision, True, *LAYER_PAST, *LAYER_PRESENT)
    b.node("Identity", [x], [LAYER_HIDDEN_OUT])
    b.outputs += [_vi(LAYER_HIDDEN_OUT, F32, ["batch", "n_new", arch.hidden]),
                  *[_vi(n, b.kv, ["batch", arch.kv_heads, "n_total", arch.head_dim]) for n in LAYER_PRESENT]]
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
