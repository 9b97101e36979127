"""Encoder-decoder translation models (Marian / Opus-MT, M2M100, NLLB) -> an encoder graph and a decoder graph.

The encoder graph runs once per request: source ids + mask -> the cross-attention K/V of every decoder layer.
The decoder graph keeps the decoder-only contract (DESIGN section 4: tree positions, a 4-D additive tree mask
over past + new, self-attention KV in/out concatenated, logits or a top-k head) and takes the request's cross
K/V and source mask as static inputs (config `static_inputs`), shared by every beam and tree node.

Both families are BART-style: learned-free sinusoidal positions, biased projections, LayerNorm. Marian is
post-norm with positions from 0; M2M100 (and NLLB, which uses its class) is pre-norm with final norms and
fairseq positions (pad + 1 + index, pad tokens keep the pad row).

Here: the folder's facts (generation defaults, tokenizers, languages, a shared encoder's probe) and the export;
the checkpoint is read in encdec_weights.py, the graphs built in encdec_graph.py.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from specbeam_edge.contract import all_cross_names, graph_io, graph_sha256, probe_source, static_inputs

from .config_file import copy_tokenizer, write_config
from .encdec_graph import decoder_model, encoder_model
from .encdec_weights import EncDecArch, read_model
from .hf import ExportError, read_json
from .save import GEN_KEYS, ExportProgress, save_precision, staged, stored_as

ARCHITECTURES = {"MarianMTModel": "marian", "M2M100ForConditionalGeneration": "m2m100"}


# HF config.json key of a draft cut from its target with the target's encoder, embedding and cross K/V
# projections frozen: the target decoder layer whose cross K/V each of its decoder layers uses (the runtime then
# skips the draft's encoder pass; specbeam_config.json `encoder_decoder.target_cross_layers`)
TARGET_CROSS_KEY = "specbeam_target_cross_layers"


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
        quant = _write_graphs(tmp, arch, ew, dw, precision, output, attention, reduce_range, prog)
        copy_tokenizer(src, tmp)
        for name, tok in tokenizers.items():
            tok.save(str(tmp / name))
        facts.update(_languages(src, json.loads((tmp / "tokenizer.json").read_text(encoding="utf-8")), arch))
        if "source_tokenizer.json" in tokenizers:
            facts["source_tokenizer"] = "source_tokenizer.json"
        shared = _shared_encoder(src, tmp, arch, facts)
        L = arch.decoder_layers
        files = {"model": "model.onnx", **({} if shared is not None else {"encoder": "encoder.onnx"}),
                 # checked on load (integrity.py), as a decoder-only folder's graph: it had none
                 "sha256": {**graph_sha256(tmp, "model.onnx"),
                            **({} if shared is not None else graph_sha256(tmp, "encoder.onnx"))}}
        kind = {"static_inputs": static_inputs(L),
                "encoder_decoder": {"encoder_layers": arch.encoder_layers, "source_vocab_size": arch.source_vocab_size,
                                    **facts}}
        write_config(tmp, t0, family=family, vocab_size=arch.vocab_size, shape=dict(
            hidden_size=arch.d_model, num_layers=L, num_heads=arch.heads, num_kv_heads=arch.heads,
            head_dim=arch.head_dim, context_length=arch.context_length, bos_token_id=arch.bos_token_id,
            eos_token_ids=arch.eos_token_ids, pad_token_id=arch.pad_token_id), layout="whole", precision=precision,
            quant=quant, compute="fp32", attention=attention, output=output, files=files, kind=kind,
            io=graph_io(output, encoder_decoder=True), generation=defaults, source_name=src.name)
        prog.step("write config")
    return dst


def _write_graphs(tmp: Path, arch: EncDecArch, ew: dict, dw: dict, precision: str, output: str, attention: str,
                  reduce_range: bool, prog) -> dict:
    """encoder.onnx and model.onnx (the decoder) written into `tmp`; returns the config's quantization entry."""
    base = precision if precision in ("fp16", "int8w") else "fp32"
    # the encoder computes in per-row int8 too with -p int8 (each source token its own scale)
    save_precision(encoder_model(arch, ew, dw, base, attention), tmp / "encoder.onnx",
                   precision if precision == "int8" else "fp32", reduce_range=reduce_range)
    prog.step("write encoder.onnx")
    dec = decoder_model(arch, dw, base, output, attention)
    quant = save_precision(dec, tmp / "model.onnx", precision, reduce_range) or stored_as(precision)
    prog.step(f"write model.onnx ({precision})")
    return quant


def _shared_encoder(src: Path, tmp: Path, arch: EncDecArch, facts: dict) -> list | None:
    """A draft that uses its target's encoder (config.json TARGET_CROSS_KEY): its target layers and a probe of
    the encoder go into `facts` and its own encoder is removed from `tmp`; returns the layers (None: no such draft)."""
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
    return shared
