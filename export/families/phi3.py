"""Phi-3 / Phi-3.5 / Phi-4-mini: fused qkv and gate_up projections, partial rotary (the rope tables cover
the leading dims), LongRoPE (short factors below original_max_position_embeddings, long ones from there on),
and a window on every layer when the config has one."""
from collections import ChainMap

import numpy as np

ARCHITECTURES = {"Phi3ForCausalLM": "phi3"}


def features(cfg) -> tuple[str, dict]:
    feats = {}
    if cfg.sliding_window:
        # Phi3 masks every layer with the window when it is set (Phi-3-mini: 2047)
        feats.update(layer_sliding=(True,) * cfg.num_hidden_layers, sliding_window=int(cfg.sliding_window))
    return "phi3", feats


def layer_tensors(w: dict, arch, prefix: str) -> dict:
    """Split `qkv_proj` (q, k, v rows in that order) and `gate_up_proj` (gate rows, then up rows)."""
    qkv, gu = w.get(prefix + "self_attn.qkv_proj.weight"), w.get(prefix + "mlp.gate_up_proj.weight")
    if qkv is None or gu is None:
        return w                        # the shape check then names the missing tensor
    nq, nkv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    out = ChainMap({}, w)           # the split tensors over the checkpoint's, without reading the others
    if qkv.shape[0] == nq + 2 * nkv:
        out[prefix + "self_attn.q_proj.weight"] = np.asarray(qkv[:nq])
        out[prefix + "self_attn.k_proj.weight"] = np.asarray(qkv[nq:nq + nkv])
        out[prefix + "self_attn.v_proj.weight"] = np.asarray(qkv[nq + nkv:])
    if gu.shape[0] == 2 * arch.intermediate:
        out[prefix + "mlp.gate_proj.weight"] = np.asarray(gu[:arch.intermediate])
        out[prefix + "mlp.up_proj.weight"] = np.asarray(gu[arch.intermediate:])
    return out
