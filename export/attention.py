"""Attention in the decoder graphs: the rope tables (cos/sin of each rope kind, LongRoPE's delta rotations), the
inputs every decoder graph shares (token and position ids, the tree mask, the sliding-window mask), q/k rotation
with per-layer kind selection, the attention itself (onnxruntime's fused op, or in double: layout-exact, with the
fused op as a branch for prompt passes) and
LongRoPE's second pass over long-rotated keys."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from specbeam_edge.contract import KEY_POSITIONS, PROMPT_ATTENTION

from .builder import F32, Builder, _vi
from .hf import Arch, Rope


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
    if b.attention == "fp64":      # an input with a default (an initializer of its name): unfed, attention in double
        b.inputs.append(_vi(PROMPT_ATTENTION, TensorProto.BOOL, [1]))
        b.init(PROMPT_ATTENTION, np.array([False]))
    if needs_key_positions(arch):
        b.inputs.append(_vi(KEY_POSITIONS, TensorProto.INT64, ["batch", "n_total"]))
    if any(arch.layer_sliding):
        qpos = b.node("Unsqueeze", ["position_ids", b.init("axes_q", np.array([1, 3], np.int64))], ["q_pos"])
        kpos = b.node("Unsqueeze", [KEY_POSITIONS, b.init("axes_k", np.array([1, 2], np.int64))], ["k_pos"])
        dist = b.node("Sub", [qpos, kpos], ["q_minus_k"])                   # [B, 1, n_new, n_total]
        inside = b.node("Less", [dist, b.init("window", np.array(arch.sliding_window, np.int64))], ["in_window"])
        floor = b.init("mask_floor", np.array(np.finfo(np.float32).min, np.float32))
        b.node("Where", [inside, "attention_mask", floor], ["sliding_mask"])


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
    wide = past_k if b.kv == F32 else b.node("Cast", [past_k], [p + "pk32"], to=F32)
    per_key = b.node("Reshape", [b.node("Transpose", [wide], [p + "pk_t"], perm=[0, 2, 1, 3]),
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
    if b.kv != F32:          # (rounded to the cache's type again, as a key computed in the pass would be)
        past_long = b.node("Cast", [past_long], [p + "past_k_long16"], to=b.kv)
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
        return _fused(b, arch, ins, outs, attrs)
    # every decoder graph in double declares PROMPT_ATTENTION (_common_inputs): it picks the fused fp32 op for a
    # prompt's unread rows (laid out alike in every mode); the presents are past and new concatenated either way
    fused = [o + ".fused" for o in outs]
    return b.branch(PROMPT_ATTENTION, outs, lambda: _fused(b, arch, ins, fused, attrs),
                    lambda: _attention_fp64(b, arch, ins, [o + ".double" for o in outs], attrs), elem=[F32, b.kv, b.kv])


def _fused(b: Builder, arch: Arch, ins: list[str], outs: list[str], attrs: dict) -> list[str]:
    """onnxruntime's fused Attention op. With a cache in fp16 (b.kv) the cache is concatenated as stored
    (_cache_concat: the new rows rounded to it first, so a key reads the same in the pass that computes it as from
    the cache later) and the op attends over it widened, with no past of its own: no fp32 present to convert."""
    if b.kv == F32:
        return b.node("Attention", ins, outs, **attrs)
    q, k, v, mask, past_k, past_v = ins
    out, present_k, present_v = outs
    H, D = arch.heads, arch.head_dim
    _cache_concat(b, arch, k, v, past_k, past_v, present_k, present_v, out)
    keys, values = (b.node("Cast", [x], [f"{out}.{n}32"], to=F32) for x, n in ((present_k, "k"), (present_v, "v")))
    shape = b.init(f"{out}.q_heads", np.array([0, 0, H, D], np.int64))
    q4 = b.node("Transpose", [b.node("Reshape", [q, shape], [f"{out}.q_r"])], [f"{out}.q4"], perm=[0, 2, 1, 3])
    four = {a: attrs[a] for a in ("scale", "softcap") if a in attrs}      # head counts are read from 4D inputs
    a4 = b.node("Attention", [q4, keys, values, mask], [f"{out}.a4"], **four)           # [B, H, S, D]
    b.node("Reshape", [b.node("Transpose", [a4], [f"{out}.a_t"], perm=[0, 2, 1, 3]),
                       b.init(f"{out}.a_shape", np.array([0, 0, H * D], np.int64))], [out])
    return [out, present_k, present_v]


def _cache_concat(b: Builder, arch: Arch, k: str, v: str, past_k: str, past_v: str, present_k: str,
                  present_v: str, out: str) -> None:
    """present = past + the new rows' keys and values ([B, S, kv_heads * D] -> [B, kv_heads, S, D]) in the cache's
    type: an fp16 cache is concatenated as it is stored, the new rows rounded to it."""
    def heads(x, name):
        x = b.node("Transpose", [b.node("Reshape", [x, b.init(f"{out}.{name}_shape", np.array(
            [0, 0, arch.kv_heads, arch.head_dim], np.int64))], [f"{out}.{name}_r"])], [f"{out}.{name}_t"],
            perm=[0, 2, 1, 3])
        return x if b.kv == F32 else b.node("Cast", [x], [f"{out}.{name}16"], to=b.kv)
    b.node("Concat", [past_k, heads(k, "k")], [present_k], axis=2)
    b.node("Concat", [past_v, heads(v, "v")], [present_v], axis=2)
    return present_k, present_v


def _attention_fp64(b: Builder, arch: Arch, ins: list[str], outs: list[str], attrs: dict) -> list[str]:
    """_attention's "fp64" form: primitive ops, the softmax's sum and the weighted sum of values in double."""
    q, k, v, mask, past_k, past_v = ins
    out, present_k, present_v = outs
    H, KV, D = arch.heads, arch.kv_heads, arch.head_dim
    G = H // KV
    F64 = TensorProto.DOUBLE
    c = lambda name, values: b.init(f"{out}.{name}", np.array(values, np.int64))

    _cache_concat(b, arch, k, v, past_k, past_v, present_k, present_v, out)    # (widened for the arithmetic)
    keys = present_k if b.kv == F32 else b.node("Cast", [present_k], [f"{out}.k32"], to=F32)
    # queries grouped by their KV head: [B, S, KV, G, D] -> [B, KV, G, S, D] -> [B, KV, G * S, D]
    q5 = b.node("Transpose", [b.node("Reshape", [q, c("q_shape", [0, 0, KV, G, D])], [f"{out}.q_r"])],
                [f"{out}.q_t"], perm=[0, 2, 3, 1, 4])
    shape5 = b.node("Shape", [q5], [f"{out}.q5_shape"])
    qg = b.node("Reshape", [q5, c("qg_shape", [0, KV, -1, D])], [f"{out}.qg"])
    kt = b.node("Transpose", [keys], [f"{out}.kt"], perm=[0, 1, 3, 2])
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
