"""Encoder-decoder translation models (Marian / Opus-MT, M2M100, NLLB) -> an encoder graph and a decoder graph.

The encoder graph runs once per request: source ids + mask -> the cross-attention K/V of every decoder layer.
The decoder graph keeps the decoder-only contract (DESIGN section 4: tree positions, a 4-D additive tree mask
over past + new, self-attention KV in/out concatenated, logits or a top-k head) and takes the request's cross
K/V and source mask as static inputs (config `static_inputs`), shared by every beam and tree node.

Both families are BART-style: learned-free sinusoidal positions, biased projections, LayerNorm. Marian is
post-norm with positions from 0; M2M100 (and NLLB, which uses its class) is pre-norm with final norms and
fairseq positions (pad + 1 + index, pad tokens keep the pad row).
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from specbeam_edge.contract import (CONFIG_FILE, ENCODER_HIDDEN, FORMAT_VERSION, LOGITS, MASK_VALUE, SOURCE_MASK,
                                     all_cross_names, cross_names, graph_io, past_names, present_names, probe_source,
                                     static_inputs)

from .graph import Builder, _vi, add_topk, stored_weight
from .hf import ExportError, check_layer_count, checkpoint_names, load_config, quiet_transformers, read_json
from .safety import file_sha256
from .save import GEN_KEYS, INT8W, INVARIANT, ExportProgress, save_precision, staged

ARCHITECTURES = {"MarianMTModel": "marian", "M2M100ForConditionalGeneration": "m2m100"}
F32, I64 = TensorProto.FLOAT, TensorProto.INT64
MATMULS = ("q", "k", "v", "o", "ck", "cv", "cq", "co", "fc1", "fc2")
_ACTIVATIONS = {"swish": "silu", "silu": "silu", "relu": "relu", "gelu": "gelu"}


# HF config.json key of a draft cut from its target with the target's encoder, embedding and cross K/V
# projections frozen: the target decoder layer whose cross K/V each of its decoder layers uses (the runtime then
# skips the draft's encoder pass; specbeam_config.json `encoder_decoder.target_cross_layers`)
TARGET_CROSS_KEY = "specbeam_target_cross_layers"


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


def family_of(folder: Path) -> str | None:
    """'marian' / 'm2m100' when the folder's config names an encoder-decoder architecture we export."""
    p = folder / "config.json"
    if not p.is_file():
        return None
    try:
        archs = json.loads(p.read_text()).get("architectures") or []
    except (json.JSONDecodeError, AttributeError):
        return None
    return next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)


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
    if b.attention == "fp64":      # the sums over columns in double: layout-exact (graph._attention)
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


def _generation(src: Path, arch: EncDecArch) -> tuple[dict, dict]:
    """(search defaults, decoding facts) from generation_config.json. transformers' max_length counts the decoder
    start token, so it becomes max_new_tokens = max_length - 1 unless max_new_tokens is given."""

    p = src / "generation_config.json"
    # without generation_config.json transformers derives one from config.json (Marian: forced EOS, pad banned)
    gen = read_json(p) if p.is_file() else read_json(src / "config.json")
    defaults = {k: gen[k] for k in GEN_KEYS if k in gen}
    if "max_new_tokens" not in defaults and isinstance(gen.get("max_length"), int) and gen["max_length"] > 1:
        defaults["max_new_tokens"] = gen["max_length"] - 1
    bad = gen.get("bad_words_ids") or []
    if any(not isinstance(w, list) or len(w) != 1 for w in bad):
        raise ExportError(f"{p}: bad_words_ids with multi-token words are not supported (single tokens are)")
    facts = {"decoder_start_token_id": int(gen.get("decoder_start_token_id", arch.decoder_start_token_id)),
             "forced_bos_token_id": gen.get("forced_bos_token_id"),
             "forced_eos_token_id": gen.get("forced_eos_token_id"),
             "suppressed_token_ids": sorted({int(w[0]) for w in bad})}
    return defaults, facts


def _tokenizers(src: Path, family: str) -> dict:
    """tokenizer.json (and Marian's source_tokenizer.json) converted from SentencePiece files, or {} when the
    folder has a tokenizer.json. A folder with separate Marian vocabularies needs the SentencePiece files: one
    tokenizer.json cannot serve both sides."""
    from .encdec_tokenizer import convert

    tcfg = src / "tokenizer_config.json"
    separate = bool(read_json(tcfg, {}).get("separate_vocabs"))
    if separate and (src / "tokenizer.json").is_file():
        raise ExportError(f"{src}: separate source/target vocabularies (separate_vocabs) with one tokenizer.json; "
                          f"remove it so that source.spm/target.spm/vocab.json/target_vocab.json are converted")
    return convert(src, family)


def _languages(src: Path, tokenizer: dict, arch: EncDecArch) -> dict:
    """NLLB/M2M100 language codes (code -> token id) and where the source's code goes: before the text
    (transformers' default) or after its EOS (NLLB `legacy_behaviour`)."""
    from .encdec_tokenizer import language_codes

    codes = language_codes(tokenizer)
    bad = {c: i for c, i in codes.items() if not 0 <= i < arch.vocab_size}
    if bad:
        raise ExportError(f"{src}: language tokens outside the model's vocabulary ({arch.vocab_size}): {bad}")
    if not codes:
        return {}
    p = src / "tokenizer_config.json"
    legacy = bool(read_json(p, {}).get("legacy_behaviour"))
    return {"language_codes": codes, "source_language": "suffix" if legacy else "prefix"}


def cross_probe(encoder: Path, layers: int, eos: int, head_dim: int) -> dict:
    """A fingerprint of an encoder's cross K/V: the source, the sampled positions and head dims, and each cross
    tensor's values there (all heads). A draft that shares its target's encoder ships this instead of the
    encoder: the runtime compares it with the target's cross K/V of the same source at load."""
    import onnxruntime as ort

    source = probe_source(17, eos)
    sess = ort.InferenceSession(str(encoder), providers=["CPUExecutionProvider"])
    names = all_cross_names(layers)
    outs = sess.run(names, {"input_ids": np.array([source], np.int64),
                            "attention_mask": np.ones((1, len(source)), np.int64)})
    pos, dims = list(range(0, len(source), 4)), list(range(0, head_dim, 16))
    return {"source": source, "positions": pos, "dims": dims,
            "values": {n: [round(float(v), 5) for v in o[0][:, pos][:, :, dims].reshape(-1)]
                       for n, o in zip(names, outs)}}


def export_encdec(src: Path, dst: Path, family: str, *, precision: str, layout: str, output: str, overwrite: bool,
                  quiet: bool, reduce_range: bool = True, attention: str = "fp32") -> Path:
    """Write the model folder of an encoder-decoder: encoder.onnx + model.onnx (the decoder) + config."""

    if layout != "whole":
        raise ExportError("encoder-decoder models export with layout 'whole' (static cross K/V inputs need it)")
    if precision not in ("fp32", "fp16", "int8w", "int8", "int8dyn"):
        raise ExportError(f"encoder-decoder models export as fp32, fp16, int8w, int8 or int8dyn, not {precision!r}")
    t0 = time.time()
    prog = ExportProgress(4, quiet)
    tokenizers = _tokenizers(src, family)
    arch, ew, dw = read_model(src, family, quiet)
    prog.step("read weights")
    defaults, facts = _generation(src, arch)
    with staged(dst, prog) as tmp:
        base = precision if precision in ("fp16", "int8w") else "fp32"
        quant = INT8W if precision == "int8w" else {"method": "none", "storage": precision}
        # the encoder computes in per-row int8 too with -p int8 (each source token its own scale)
        save_precision(encoder_model(arch, ew, dw, base, attention), tmp / "encoder.onnx",
                       precision if precision == "int8" else "fp32", reduce_range=reduce_range)
        prog.step("write encoder.onnx")
        dec = decoder_model(arch, dw, base, output, attention)
        quant = save_precision(dec, tmp / "model.onnx", precision, 32, reduce_range) or quant
        prog.step(f"write model.onnx ({precision})")
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (src / f).is_file():
                shutil.copy2(src / f, tmp / f)
        for name, tok in tokenizers.items():
            tok.save(str(tmp / name))
        facts.update(_languages(src, json.loads((tmp / "tokenizer.json").read_text(encoding="utf-8")), arch))
        if "source_tokenizer.json" in tokenizers:
            facts["source_tokenizer"] = "source_tokenizer.json"
        L = arch.decoder_layers
        shared = json.loads((src / "config.json").read_text(encoding="utf-8")).get(TARGET_CROSS_KEY)
        if shared is not None:      # a draft trained on its target's frozen encoder (models/train.py --freeze_encoder)
            if (not isinstance(shared, list) or len(shared) != L
                    or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in shared)):
                raise ExportError(f"{src / 'config.json'}: {TARGET_CROSS_KEY} must list one target layer (an integer "
                                  f">= 0) per decoder layer ({L}), got {shared!r}")
            facts["target_cross_layers"] = shared
            # its encoder is the target's: ship a fingerprint to check that against, not a second copy
            facts["target_cross_probe"] = cross_probe(tmp / "encoder.onnx", L, (arch.eos_token_ids or [0])[0],
                                                         arch.head_dim)
            for f in ("encoder.onnx", "encoder.onnx.data"):    # (the second: a graph past 2 GB)
                (tmp / f).unlink(missing_ok=True)
        cfg = {
            "format_version": FORMAT_VERSION, "family": family, "vocab_size": arch.vocab_size,
            "tokenizer_sha256": file_sha256(tmp / "tokenizer.json"),
            "hidden_size": arch.d_model, "num_layers": L, "num_heads": arch.heads, "num_kv_heads": arch.heads,
            "head_dim": arch.head_dim, "context_length": arch.context_length, "bos_token_id": arch.bos_token_id,
            "eos_token_ids": arch.eos_token_ids, "pad_token_id": arch.pad_token_id, "layout": "whole",
            "precision": precision, "quantization": quant, "compute_dtype": "float32",
            "attention_dtype": "float64" if attention == "fp64" else "float32",
            "batch_invariant": INVARIANT[precision], "mask": "additive_float32", "mask_value": MASK_VALUE,
            "present": "concat", "output": output,
            "files": {"model": "model.onnx", **({} if shared is not None else {"encoder": "encoder.onnx"})},
            "static_inputs": static_inputs(L),
            "encoder_decoder": {"encoder_layers": arch.encoder_layers, "source_vocab_size": arch.source_vocab_size,
                                **facts},
            "io": graph_io(output, encoder_decoder=True),
            "generation": defaults,
            "source": {"folder_name": src.name, "export_seconds": round(time.time() - t0, 2)},
        }
        (tmp / CONFIG_FILE).write_text(json.dumps(cfg, indent=2))
        prog.step("write config")
    return dst
