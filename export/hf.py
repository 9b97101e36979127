"""Read a local Hugging Face causal-LM folder without torch: config, weights (safetensors), rope tables."""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SUPPORTED = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64, "I64": np.int64}


class ExportError(ValueError):
    """A model folder that cannot be exported; the message names the problem."""


@dataclass(frozen=True)
class Arch:
    family: str
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rms_eps: float
    context_length: int
    qkv_bias: bool
    tied: bool
    inv_freq: np.ndarray          # [head_dim // 2]
    attention_scaling: float
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None
    rope: dict


def _rope_params(cfg: dict) -> tuple[float, dict]:
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    merged = {**params, **scaling}
    merged.setdefault("rope_type", merged.get("type", "default"))
    return float(theta), merged


def inv_freq_for(cfg: dict, head_dim: int) -> tuple[np.ndarray, float, dict]:
    theta, rope = _rope_params(cfg)
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float64) / head_dim))
    kind = rope["rope_type"]
    if kind == "default":
        pass
    elif kind == "linear":
        inv = inv / float(rope["factor"])
    elif kind == "llama3":
        factor = float(rope["factor"])
        lo, hi = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old = float(rope["original_max_position_embeddings"])
        lo_wl, hi_wl = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > lo_wl, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < hi_wl) & ~(wavelen > lo_wl)
        inv = np.where(medium, smoothed, scaled)
    else:
        raise ExportError(f"rope type {kind!r} is not supported (supported: default, linear, llama3)")
    return inv.astype(np.float32), 1.0, {"rope_theta": theta, **rope}


def read_arch(folder: Path) -> Arch:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ExportError(f"{folder}: no config.json; this is not a Hugging Face model folder")
    cfg = json.loads(cfg_path.read_text())
    archs = cfg.get("architectures") or []
    fam = next((SUPPORTED[a] for a in archs if a in SUPPORTED), None)
    if fam is None:
        raise ExportError(f"{folder}: architecture {archs or cfg.get('model_type')} is not supported "
                          f"(supported: {', '.join(SUPPORTED)})")
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    inv, scaling, rope = inv_freq_for(cfg, head_dim)
    ctx = int(cfg.get("max_position_embeddings", 2048))
    if fam == "mistral" and cfg.get("sliding_window"):
        ctx = min(ctx, int(cfg["sliding_window"]))  # beyond the window the full mask would be wrong
    gen = {}
    if (folder / "generation_config.json").is_file():
        gen = json.loads((folder / "generation_config.json").read_text())
    eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return Arch(
        family=fam, vocab_size=int(cfg["vocab_size"]), hidden=int(cfg["hidden_size"]),
        layers=int(cfg["num_hidden_layers"]), heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
        intermediate=int(cfg["intermediate_size"]), rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        context_length=ctx, qkv_bias=bool(cfg.get("attention_bias", fam == "qwen2")),
        tied=bool(cfg.get("tie_word_embeddings", False)), inv_freq=inv, attention_scaling=scaling,
        bos_token_id=gen.get("bos_token_id", cfg.get("bos_token_id")), eos_token_ids=[int(e) for e in eos],
        pad_token_id=gen.get("pad_token_id", cfg.get("pad_token_id")), rope=rope,
    )


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Parse one .safetensors file (8-byte header size, JSON header, raw data); bf16 becomes fp32."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    header = json.loads(bytes(data[8:8 + n]))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ExportError(f"{path.name}: tensor {name} has unsupported dtype {info['dtype']}")
        a, b = info["data_offsets"]
        raw = np.frombuffer(data[8 + n + a:8 + n + b], dtype=_DTYPES[info["dtype"]]).reshape(info["shape"])
        if info["dtype"] == "BF16":
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        out[name] = raw
    return out


def read_weights(folder: Path) -> dict[str, np.ndarray]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ExportError(f"{folder}: no *.safetensors weight files (only safetensors checkpoints are supported)")
    weights: dict[str, np.ndarray] = {}
    for f in files:
        weights.update(_read_safetensors(f))
    return weights


def layer_weights(w: dict[str, np.ndarray], arch: Arch, i: int) -> dict[str, np.ndarray]:
    """fp32 weights of decoder layer i, MatMul-ready ([in, out]); checks every shape against the config."""
    p = f"model.layers.{i}."
    H, hd, nh, nkv, I = arch.hidden, arch.head_dim, arch.heads, arch.kv_heads, arch.intermediate
    expect = {
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (nh * hd, H), "self_attn.k_proj.weight": (nkv * hd, H),
        "self_attn.v_proj.weight": (nkv * hd, H), "self_attn.o_proj.weight": (H, nh * hd),
        "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
    }
    if arch.qkv_bias:
        expect.update({"self_attn.q_proj.bias": (nh * hd,), "self_attn.k_proj.bias": (nkv * hd,),
                       "self_attn.v_proj.bias": (nkv * hd,)})
    out = {}
    for name, shape in expect.items():
        if p + name not in w:
            raise ExportError(f"weight {p + name} is missing from the checkpoint")
        t = np.asarray(w[p + name], dtype=np.float32)
        if tuple(t.shape) != shape:
            raise ExportError(f"weight {p + name} has shape {tuple(t.shape)} but config.json implies {shape}")
        key = name.replace("self_attn.", "").replace("mlp.", "").replace(".weight", "").replace(".bias", "_bias")
        out[key] = t.T.copy() if t.ndim == 2 else t
    return out


def global_weights(w: dict[str, np.ndarray], arch: Arch) -> dict[str, np.ndarray]:
    emb = w.get("model.embed_tokens.weight")
    if emb is None:
        raise ExportError("weight model.embed_tokens.weight is missing from the checkpoint")
    if tuple(emb.shape) != (arch.vocab_size, arch.hidden):
        raise ExportError(f"model.embed_tokens.weight has shape {tuple(emb.shape)} but config.json implies "
                          f"{(arch.vocab_size, arch.hidden)}")
    head = w.get("lm_head.weight", emb if arch.tied else None)
    if head is None:
        raise ExportError("weight lm_head.weight is missing and tie_word_embeddings is false")
    if "model.norm.weight" not in w:
        raise ExportError("weight model.norm.weight is missing from the checkpoint")
    return {"embed": np.asarray(emb, np.float32), "norm": np.asarray(w["model.norm.weight"], np.float32),
            "lm_head": np.asarray(head, np.float32).T.copy()}
