"""One small module per model family: which transformers config fields become which graph features
(`features`), and how the family's checkpoint tensors map onto the shared decoder layer (`layer_tensors`).
The graph itself is built once, in export/graph.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..hf import (Arch, ExportError, _check_sizes, _eos_list, expected_layer_shapes, layer_flags, load_config,
                  read_json, rope_for)
from . import gemma, llama, phi3, qwen3, smollm3

_MODULES = (llama, qwen3, smollm3, phi3, gemma)


def supported() -> list[str]:
    return [a for m in _MODULES for a in m.ARCHITECTURES]


def family_for(architectures: list[str]):
    """The module for the first architecture of the config that a family module declares (None if none)."""
    return next((m for a in architectures for m in _MODULES if a in m.ARCHITECTURES), None)


def family_for_name(name: str):
    return next(m for m in _MODULES if name in m.ARCHITECTURES.values())


# -- a checkpoint read through its family -----------------------------------------------------------------
def read_arch(folder: Path) -> Arch:
    cfg = load_config(folder)
    archs = list(getattr(cfg, "architectures", None) or [])
    fam = family_for(archs)
    if fam is None:
        raise ExportError(f"{folder}: architecture {archs or cfg.model_type} is not supported "
                          f"(supported: {', '.join(supported())})")
    gen = read_json(folder / "generation_config.json", {})
    _check_sizes(cfg, folder)
    name, feats = fam.features(cfg)
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    layers = int(cfg.num_hidden_layers)
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * layers)
    window = getattr(cfg, "sliding_window", None) if "sliding_attention" in types else None
    base = dict(
        family=name, vocab_size=int(cfg.vocab_size), hidden=int(cfg.hidden_size), layers=layers, heads=heads,
        kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads), head_dim=head_dim,
        intermediate=int(cfg.intermediate_size), rms_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
        context_length=int(getattr(cfg, "max_position_embeddings", 2048)),
        qkv_bias=bool(getattr(cfg, "attention_bias", False)), tied=bool(cfg.tie_word_embeddings),
        bos_token_id=gen.get("bos_token_id", cfg.bos_token_id),
        eos_token_ids=_eos_list(gen.get("eos_token_id", cfg.eos_token_id)),
        pad_token_id=gen.get("pad_token_id", cfg.pad_token_id),
        layer_rope=("global",) * layers,
        layer_sliding=tuple(t == "sliding_attention" for t in types),
        sliding_window=int(window) if window else None,
    )
    base.update(feats)
    if "ropes" not in base:     # one rope for all layers, unless the family has kinds (Gemma 3)
        base["ropes"] = {"global": rope_for(cfg, dict(cfg.rope_parameters), head_dim)}
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ExportError(f"{folder / 'config.json'}: layer types {sorted(unknown)} are not supported")
    rotary = {r.inv_freq.size * 2 for r in base["ropes"].values()}
    if len(rotary) != 1:
        raise ExportError(f"{folder / 'config.json'}: rope kinds with different rotary dims {sorted(rotary)}")
    base["rotary_dim"] = rotary.pop()
    return Arch(**base)


class LayerTensors:
    """Decoder layer i's fp32 weights by graph key, each read, checked against the config and made MatMul-ready
    ([in, out]) when asked for: a 7B layer is 0.9 GB in fp32, so the split exporter holds one tensor of it at a
    time. Every tensor's presence is checked up front."""

    def __init__(self, w, arch: Arch, i: int):
        self.p, self.arch, self.i = f"model.layers.{i}.", arch, i
        self.w = family_for_name(arch.family).layer_tensors(w, arch, self.p)
        self.names = {}
        for name, shape in expected_layer_shapes(arch).items():
            if self.p + name not in self.w:
                raise ExportError(f"weight {self.p + name} is missing from the checkpoint")
            key = name.replace("self_attn.", "").replace("mlp.", "").replace(".weight", "").replace(".bias", "_bias")
            self.names[key] = (name, shape)

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self.names:
            return layer_flags(self.arch, self.i)[key]
        name, shape = self.names[key]
        t = np.asarray(self.w[self.p + name], dtype=np.float32)
        if tuple(t.shape) != shape:
            raise ExportError(f"weight {self.p + name} has shape {tuple(t.shape)} but config.json implies {shape}")
        if key.endswith("norm") and self.arch.norm_offset:
            t = t + np.float32(self.arch.norm_offset)     # the same fp32 sum transformers forms at run time
        return t.T.copy() if t.ndim == 2 else t

    def keys(self) -> list[str]:
        return list(self.names) + (list(layer_flags(self.arch, self.i)) if self.arch.heterogeneous else [])

    def blocks(self, key: str):
        """Weight `key`'s own GGUF blocks (hf.Tensors.blocks), or None (not a GGUF matrix, or a family that
        assembles it from several tensors)."""
        read = getattr(self.w, "blocks", None)
        return None if read is None or key not in self.names else read(self.p + self.names[key][0])


def layer_weights(w: dict[str, np.ndarray], arch: Arch, i: int) -> dict[str, np.ndarray]:
    """fp32 weights of decoder layer i, MatMul-ready ([in, out]); checks every shape against the config."""
    lt = LayerTensors(w, arch, i)
    return {k: lt[k] for k in lt.keys()}
