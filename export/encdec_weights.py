"""An encoder-decoder checkpoint (Marian / Opus-MT, M2M100, NLLB) as export/encdec.py exports it: its shape
(EncDecArch, from config.json) and its weights as fp32 arrays, read through transformers' own model class
(Marian's position tables are not in the checkpoint)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .hf import ExportError, check_layer_count, checkpoint_names, load_config, quiet_transformers

MATMULS = ("q", "k", "v", "o", "ck", "cv", "cq", "co", "fc1", "fc2")
_ACTIVATIONS = {"swish": "silu", "silu": "silu", "relu": "relu", "gelu": "gelu"}


@dataclass(frozen=True)
class EncDecArch:
    family: str
    vocab_size: int            # the target (decoder) vocabulary
    source_vocab_size: int
    d_model: int
    encoder_layers: int
    decoder_layers: int
    heads: int
    head_dim: int
    activation: str
    pre_norm: bool             # M2M100: norms before each block and a final norm per stack
    pos_offset: int            # row of position 0 in the sinusoidal table (M2M100: pad + 1)
    pos_pad: int | None        # M2M100: pad tokens of the source take the pad row
    context_length: int
    embed_scale: float
    ln_eps: float
    decoder_start_token_id: int
    pad_token_id: int
    eos_token_ids: list
    bos_token_id: int | None


def _arch(cfg, family: str) -> EncDecArch:
    act = _ACTIVATIONS.get(cfg.activation_function)
    if act is None:
        raise ExportError(f"{family}: activation_function {cfg.activation_function!r} is not supported "
                          f"({', '.join(_ACTIVATIONS)} are)")
    if cfg.encoder_attention_heads != cfg.decoder_attention_heads:
        raise ExportError(f"{family}: encoder and decoder head counts differ ({cfg.encoder_attention_heads} vs "
                          f"{cfg.decoder_attention_heads})")
    eos = cfg.eos_token_id
    m2m = family == "m2m100"
    return EncDecArch(
        family=family, vocab_size=int(getattr(cfg, "decoder_vocab_size", None) or cfg.vocab_size),
        source_vocab_size=int(cfg.vocab_size), d_model=cfg.d_model, encoder_layers=cfg.encoder_layers,
        decoder_layers=cfg.decoder_layers, heads=cfg.decoder_attention_heads,
        head_dim=cfg.d_model // cfg.decoder_attention_heads, activation=act, pre_norm=m2m,
        pos_offset=cfg.pad_token_id + 1 if m2m else 0, pos_pad=cfg.pad_token_id if m2m else None,
        context_length=int(cfg.max_position_embeddings),
        embed_scale=float(cfg.d_model ** 0.5) if cfg.scale_embedding else 1.0, ln_eps=1e-5,
        decoder_start_token_id=int(cfg.decoder_start_token_id), pad_token_id=int(cfg.pad_token_id),
        eos_token_ids=[] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos]),
        bos_token_id=cfg.bos_token_id)


# -- weights (read through transformers' own model class: Marian's position tables are not in the checkpoint) --
def _np(t) -> np.ndarray:
    return t.detach().float().numpy().astype(np.float32)


def _attn(m, p: str) -> dict:
    return {p + "q": _np(m.q_proj.weight).T, p + "q_b": _np(m.q_proj.bias),
            p + "k": _np(m.k_proj.weight).T, p + "k_b": _np(m.k_proj.bias),
            p + "v": _np(m.v_proj.weight).T, p + "v_b": _np(m.v_proj.bias),
            p + "o": _np(m.out_proj.weight).T, p + "o_b": _np(m.out_proj.bias)}


def _ln(m, name: str) -> dict:
    return {name: _np(m.weight), name + "_b": _np(m.bias)}


def _layer(layer, cross: bool) -> dict:
    w = {**_attn(layer.self_attn, ""), **_ln(layer.self_attn_layer_norm, "ln1"), **_ln(layer.final_layer_norm, "ln3"),
         "fc1": _np(layer.fc1.weight).T, "fc1_b": _np(layer.fc1.bias),
         "fc2": _np(layer.fc2.weight).T, "fc2_b": _np(layer.fc2.bias)}
    if cross:
        w.update(_attn(layer.encoder_attn, "c"), **_ln(layer.encoder_attn_layer_norm, "ln2"))
    return w


def _positions(stack) -> np.ndarray:
    pe = stack.embed_positions
    return _np(pe.weights if hasattr(pe, "weights") else pe.weight)


def read_model(folder: Path, family: str, quiet: bool = False):
    """(arch, encoder weights, decoder weights) of a local HF encoder-decoder folder; quiet: no progress bars."""
    import torch
    import transformers as tf

    cfg = load_config(folder)
    arch = _arch(cfg, family)
    names = dict.fromkeys(checkpoint_names(folder))     # transformers would drop layers config.json leaves out
    if names:
        for side, n in (("encoder", arch.encoder_layers), ("decoder", arch.decoder_layers)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ExportError(f"{folder / 'config.json'}: {side}_layers must be an integer >= 1, got {n!r}")
            check_layer_count(names, n, folder.name, prefix=f"model.{side}.layers.")
    cls = {"marian": tf.MarianMTModel, "m2m100": tf.M2M100ForConditionalGeneration}[family]
    try:
        with torch.no_grad(), quiet_transformers(quiet):
            model = cls.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32).eval()
    except Exception as e:  # transformers raises many types for unreadable weights
        raise ExportError(f"{folder}: transformers cannot load the weights ({str(e).splitlines()[0][:200]})") from None
    enc, dec = model.model.encoder, model.model.decoder
    ew = {"embed": _np(enc.embed_tokens.weight), "pos": _positions(enc),
          "layers": [_layer(layer, False) for layer in enc.layers]}
    dw = {"embed": _np(dec.embed_tokens.weight), "pos": _positions(dec),
          "layers": [_layer(layer, True) for layer in dec.layers],
          "lm_head": _np(model.lm_head.weight).T,
          "final_logits_bias": _np(model.final_logits_bias).reshape(-1) if hasattr(model, "final_logits_bias")
          else None}
    if arch.pre_norm:
        ew.update(_ln(enc.layer_norm, "norm"))
        dw.update(_ln(dec.layer_norm, "norm"))
    return arch, ew, dw
