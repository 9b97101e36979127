"""The two graphs of an encoder-decoder export (export/encdec.py): the encoder (source ids + mask -> every decoder
layer's cross-attention K/V) and the decoder (the decoder-only contract plus the request's cross K/V and source
mask as static inputs), built from the pieces of a BART-style stack: biased projections, LayerNorm pre- or
post-norm, sinusoidal positions, attention in fp32 or with its sums in double."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from specbeam_edge.contract import (ENCODER_HIDDEN, LOGITS, MASK_VALUE, SOURCE_MASK, cross_names, past_names,
                                     present_names)

from .builder import Builder, _vi
from .encdec_weights import EncDecArch
from .graph import add_topk, stored_weight

F32, I64 = TensorProto.FLOAT, TensorProto.INT64


# -- graph pieces ------------------------------------------------------------------------------------------
def _w(b: Builder, name: str, a: np.ndarray, precision: str, axis: int = 1) -> str:
    """A weight initializer as fp32: 2-D weights as stored (graph.stored_weight: fp16 or int8w, folded at
    load), vectors fp32. axis: the output-channel axis (0 for an embedding table)."""
    if a.ndim == 2:
        return stored_weight(b, name, a, precision, axis)
    return b.init(name, a)


def _linear(b: Builder, x: str, W: dict, key: str, p: str) -> str:
    return b.node("Add", [b.node("MatMul", [x, W[key]], [p + key + ".mm"]), W[key + "_b"]], [p + key + ".out"])


def _norm(b: Builder, arch: EncDecArch, x: str, W: dict, key: str, p: str) -> str:
    return b.node("LayerNormalization", [x, W[key], W[key + "_b"]], [p + key + ".out"], axis=-1,
                  epsilon=arch.ln_eps)


def _split_heads(b: Builder, arch: EncDecArch, x: str, p: str) -> str:
    """[B, T, D] -> [B, heads, T, head_dim]."""
    shape = b.init(p + "hshape", np.array([0, 0, arch.heads, arch.head_dim], np.int64))
    return b.node("Transpose", [b.node("Reshape", [x, shape], [p + "r"])], [p + "t"], perm=[0, 2, 1, 3])


def _attend(b: Builder, arch: EncDecArch, q: str, k: str, v: str, mask: str, p: str) -> str:
    """softmax(q k^T / sqrt(d) + mask) v over [B, heads, *, head_dim]; returns [B, T, D]."""
    scale = b.init(p + "scale", np.array(arch.head_dim ** -0.5, np.float32))
    qs = b.node("Mul", [q, scale], [p + "qs"])        # transformers scales q before the product
    s = b.node("MatMul", [qs, b.node("Transpose", [k], [p + "kt"], perm=[0, 1, 3, 2])], [p + "scores"])
    masked = b.node("Add", [s, mask], [p + "masked"])
    if b.attention == "fp64":      # the sums over columns in double: layout-exact (attention._attention)
        a = b.node("Softmax", [b.node("Cast", [masked], [p + "masked64"], to=TensorProto.DOUBLE)], [p + "probs64"],
                   axis=-1)
        ctx = b.node("Cast", [b.node("MatMul", [a, b.node("Cast", [v], [p + "v64"], to=TensorProto.DOUBLE)],
                                     [p + "ctx64"])], [p + "ctx"], to=F32)
    else:
        a = b.node("Softmax", [masked], [p + "probs"], axis=-1)
        ctx = b.node("MatMul", [a, v], [p + "ctx"])
    o = b.node("Transpose", [ctx], [p + "ctx_t"], perm=[0, 2, 1, 3])
    flat = b.init(p + "flat", np.array([0, 0, arch.d_model], np.int64))
    return b.node("Reshape", [o, flat], [p + "ctx_flat"])


def _act(b: Builder, arch: EncDecArch, x: str, p: str) -> str:
    if arch.activation == "silu":
        return b.node("Mul", [x, b.node("Sigmoid", [x], [p + "sig"])], [p + "silu"])
    if arch.activation == "relu":
        return b.node("Relu", [x], [p + "relu"])
    return b.node("Gelu", [x], [p + "gelu"])


def _block(b: Builder, arch: EncDecArch, x: str, W: dict, ln: str, p: str, body) -> str:
    """x + body(norm(x)) (pre-norm) or norm(x + body(x)) (post-norm)."""
    if arch.pre_norm:
        return b.node("Add", [x, body(_norm(b, arch, x, W, ln, p))], [p + ln + ".res"])
    return _norm(b, arch, b.node("Add", [x, body(x)], [p + ln + ".res"]), W, ln, p)


def _ffn(b: Builder, arch: EncDecArch, W: dict, p: str):
    return lambda h: _linear(b, _act(b, arch, _linear(b, h, W, "fc1", p), p), W, "fc2", p)


def _weights(b: Builder, w: dict, p: str, precision: str) -> dict:
    return {k: _w(b, p + k, a, precision) for k, a in w.items()}


def _embed(b: Builder, arch: EncDecArch, ids: str, pos: str, table: np.ndarray, pos_table: np.ndarray,
           precision: str, p: str) -> str:
    emb = _w(b, p + "embed", table, precision, axis=0)
    x = b.node("Gather", [emb, ids], [p + "tok"], axis=0)
    if arch.embed_scale != 1.0:
        x = b.node("Mul", [x, b.init(p + "escale", np.array(arch.embed_scale, np.float32))], [p + "tok_s"])
    pe = b.node("Gather", [b.init(p + "pos_table", pos_table), pos], [p + "pos"], axis=0)
    return b.node("Add", [x, pe], [p + "h0"])


def _source_mask_add(b: Builder, mask: str, p: str) -> str:
    """1/0 source mask [B, S] (any numeric type) -> additive [B, 1, 1, S]: 0 kept, float32 min masked."""
    m = b.node("Cast", [mask], [p + "m_f"], to=F32)
    one = b.init(p + "one", np.array(1.0, np.float32))
    neg = b.init(p + "neg", np.array(MASK_VALUE, np.float32))
    add = b.node("Mul", [b.node("Sub", [one, m], [p + "inv"]), neg], [p + "add"])
    return b.node("Unsqueeze", [add, b.init(p + "axes", np.array([1, 2], np.int64))], [p + "add4"])


# -- the two graphs ----------------------------------------------------------------------------------------
def encoder_model(arch: EncDecArch, ew: dict, dw: dict, precision: str, attention: str = "fp32") -> onnx.ModelProto:
    """input_ids, attention_mask [B, S] -> encoder_hidden_states [B, S, D] and cross_key/value.{i}
    [B, heads, S, head_dim] for every decoder layer (its cross K/V projections applied once)."""
    b = Builder(attention)
    b.inputs += [_vi("input_ids", I64, ["batch", "src_len"]), _vi("attention_mask", I64, ["batch", "src_len"])]
    if arch.pos_pad is None:       # Marian: 0, 1, 2, ... whatever the token
        zero, one = b.init("e.zero", np.array(0, np.int64)), b.init("e.one", np.array(1, np.int64))
        ones = b.node("Add", [b.node("Mul", ["input_ids", zero], ["e.zeros"]), one], ["e.ones"])
        cum = b.node("CumSum", [ones, one], ["e.count"])
        pos = b.node("Sub", [cum, one], ["e.pos"])
    else:                          # fairseq: pad + 1 + index among non-pad tokens; pad tokens take the pad row
        ne = b.node("Cast", [b.node("Not", [b.node("Equal", ["input_ids", b.init("e.pad", np.array(arch.pos_pad,
                                                                                                   np.int64))],
                                                   ["e.is_pad"])], ["e.not_pad"])], ["e.keep"], to=I64)
        cum = b.node("CumSum", [ne, b.init("e.axis", np.array(1, np.int64))], ["e.cum"])
        pos = b.node("Add", [b.node("Mul", [cum, ne], ["e.cum_m"]), b.init("e.pad2", np.array(arch.pos_pad,
                                                                                               np.int64))], ["e.pos"])
    x = _embed(b, arch, "input_ids", pos, ew["embed"], ew["pos"], precision, "enc.")
    mask = _source_mask_add(b, "attention_mask", "e.mask.")
    for i, lw in enumerate(ew["layers"]):
        p = f"enc{i}."
        W = _weights(b, lw, p, precision)

        def self_attn(h, W=W, p=p):
            q, k, v = (_split_heads(b, arch, _linear(b, h, W, n, p), p + n + ".") for n in ("q", "k", "v"))
            return _linear(b, _attend(b, arch, q, k, v, mask, p + "sa."), W, "o", p)

        x = _block(b, arch, x, W, "ln1", p, self_attn)
        x = _block(b, arch, x, W, "ln3", p, _ffn(b, arch, W, p))
    if arch.pre_norm:
        x = _norm(b, arch, x, _weights(b, {k: ew[k] for k in ("norm", "norm_b")}, "enc.", precision), "norm", "enc.")
    b.node("Identity", [x], [ENCODER_HIDDEN])
    b.outputs.append(_vi(ENCODER_HIDDEN, F32, ["batch", "src_len", arch.d_model]))
    for i, lw in enumerate(dw["layers"]):
        p = f"x{i}."
        W = _weights(b, {k: lw[k] for k in ("ck", "ck_b", "cv", "cv_b")}, p, precision)
        kn, vn = cross_names(i)
        for key, name in (("ck", kn), ("cv", vn)):
            b.node("Identity", [_split_heads(b, arch, _linear(b, x, W, key, p), p + key + ".")], [name])
            b.outputs.append(_vi(name, F32, ["batch", arch.heads, "src_len", arch.head_dim]))
    return b.model("specbeam_encoder")


def decoder_model(arch: EncDecArch, dw: dict, precision: str, output: str, attention: str = "fp32") -> onnx.ModelProto:
    """The decoder over a token tree: the decoder-only contract plus static cross K/V and source mask."""
    b = Builder(attention)
    b.inputs += [_vi("input_ids", I64, ["batch", "n_new"]), _vi("position_ids", I64, ["batch", "n_new"]),
                 _vi("attention_mask", F32, ["batch", 1, "n_new", "n_total"]),
                 _vi(SOURCE_MASK, F32, ["batch", "src_len"])]
    pos = b.node("Add", ["position_ids", b.init("d.off", np.array(arch.pos_offset, np.int64))], ["d.pos"])
    x = _embed(b, arch, "input_ids", pos, dw["embed"], dw["pos"], precision, "dec.")
    cmask = _source_mask_add(b, SOURCE_MASK, "d.cmask.")
    for i, lw in enumerate(dw["layers"]):
        p = f"dec{i}."
        # the cross K/V projections ran in the encoder graph
        W = _weights(b, {k: a for k, a in lw.items() if k[:2] not in ("ck", "cv")}, p, precision)
        (pk, pv), (ok, ov) = past_names(i), present_names(i)
        ck, cv = cross_names(i)
        for n in (pk, pv):
            b.inputs.append(_vi(n, F32, ["batch", arch.heads, "n_past", arch.head_dim]))
        for n in (ck, cv):
            b.inputs.append(_vi(n, F32, ["batch", arch.heads, "src_len", arch.head_dim]))
        for n in (ok, ov):
            b.outputs.append(_vi(n, F32, ["batch", arch.heads, "n_total", arch.head_dim]))

        def self_attn(h, W=W, p=p, pk=pk, pv=pv, ok=ok, ov=ov):
            q, k, v = (_split_heads(b, arch, _linear(b, h, W, n, p), p + n + ".") for n in ("q", "k", "v"))
            k_all = b.node("Concat", [pk, k], [ok], axis=2)
            v_all = b.node("Concat", [pv, v], [ov], axis=2)
            return _linear(b, _attend(b, arch, q, k_all, v_all, "attention_mask", p + "sa."), W, "o", p)

        def cross_attn(h, W=W, p=p, ck=ck, cv=cv):
            q = _split_heads(b, arch, _linear(b, h, W, "cq", p), p + "cq.")
            return _linear(b, _attend(b, arch, q, ck, cv, cmask, p + "ca."), W, "co", p)

        x = _block(b, arch, x, W, "ln1", p, self_attn)
        x = _block(b, arch, x, W, "ln2", p, cross_attn)
        x = _block(b, arch, x, W, "ln3", p, _ffn(b, arch, W, p))
    if arch.pre_norm:
        x = _norm(b, arch, x, _weights(b, {k: dw[k] for k in ("norm", "norm_b")}, "dec.", precision), "norm", "dec.")
    head = _w(b, "lm_head.weight", dw["lm_head"], precision)
    logits = b.node("MatMul", [x, head], ["head_mm"])
    if dw["final_logits_bias"] is not None:        # Marian
        logits = b.node("Add", [logits, b.init("final_logits_bias", dw["final_logits_bias"])], ["head_biased"])
    if output != "logits":
        add_topk(b, logits)
    if output != "topk":
        b.node("Identity", [logits], [LOGITS])
        b.outputs.append(_vi(LOGITS, F32, ["batch", "n_new", arch.vocab_size]))
    return b.model("specbeam_decoder")
