"""Encoder-decoder models (Marian, M2M100, NLLB): the encoder pass and the static decoder inputs of a request.

The decoder is an ordinary `OnnxCausalLM` whose graph also takes the request's cross-attention K/V and source
mask (config `static_inputs`); `TreeCache(static=...)` feeds them to every pass. The encoder runs once per
request, batched over the requests about to start (`EncoderQueue`), so a long file never holds every line's
cross K/V at once.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..decoding.beam import BeamRows
from ..config import ModelFolderError, inside
from ..contract import ENCODER_INPUTS, SOURCE_MASK, all_cross_names, cross_names
from .model import OnnxCausalLM
from .sessions import _session


def is_encoder_decoder(model) -> bool:
    return "encoder_decoder" in getattr(model.cfg, "raw", {})


def _text_only_tokenizer(path: Path):
    """A source-side tokenizer that never turns text into a control token: special tokens are not split out of
    the text, and a SentencePiece (Unigram) vocabulary's control pieces (</s>, <unk>, <pad>) get spellings no
    text has, as SentencePiece itself never emits them for input text (the converted vocabulary keeps them as
    pieces: "the </s> fox" encoded to an EOS in the middle of the source)."""
    import json

    from tokenizers import Tokenizer

    raw = json.loads(path.read_text(encoding="utf-8"))
    model = raw.get("model") or {}
    if model.get("type") == "Unigram":
        for t in raw.get("added_tokens") or []:
            if t.get("special") and 0 <= t["id"] < len(model["vocab"]):
                model["vocab"][t["id"]][0] = f"\uffff{t['id']}\uffff"
    tok = Tokenizer.from_str(json.dumps(raw))
    tok.encode_special_tokens = True
    return tok


class Encoder:
    """The encoder graph of an encoder-decoder folder and its decoding facts (decoder start, forced BOS/EOS,
    suppressed tokens), read from specbeam_config.json `encoder_decoder`."""

    def __init__(self, decoder: OnnxCausalLM, *, threads: int | None = None, providers=None, spin: bool = True):
        cfg, folder = decoder.cfg, Path(decoder.folder)
        facts = cfg.raw["encoder_decoder"]
        path = folder / "specbeam_config.json"
        try:
            self.decoder_start = int(facts["decoder_start_token_id"])
            self.forced_bos = facts.get("forced_bos_token_id")
            self.forced_eos = facts.get("forced_eos_token_id")
            self.suppressed = [int(t) for t in facts.get("suppressed_token_ids", [])]
            name = cfg.files["encoder"]
        except (KeyError, TypeError, ValueError) as e:
            if facts.get("target_cross_layers") is not None and "encoder" not in cfg.files:
                raise ModelFolderError(f"{folder} has no encoder: it is a draft that reads its target's "
                                       f"(target_cross_layers); run it as the draft of that target") from None
            raise ModelFolderError(f"{path}: encoder_decoder/files.encoder incomplete ({e}); re-export the model") \
                from None
        if not inside(folder, name, "files.encoder", path).is_file():
            raise ModelFolderError(f"{folder}: missing file {name}")
        self.language_codes = {str(c): int(i) for c, i in (facts.get("language_codes") or {}).items()}
        self.source_language = facts.get("source_language", "prefix")
        self.eos = list(cfg.eos_token_ids)
        self.source_tokenizer = None
        if facts.get("source_tokenizer"):       # Marian: the source side has its own SentencePiece model
            if not isinstance(facts["source_tokenizer"], str):
                raise ModelFolderError(f"{path}: encoder_decoder.source_tokenizer must be a file name in the model "
                                       f"folder; re-export the model")
            source = inside(folder, facts["source_tokenizer"], "encoder_decoder.source_tokenizer", path)
            try:
                self.source_tokenizer = _text_only_tokenizer(source)
            except Exception as e:  # tokenizers raises its own exception types
                raise ModelFolderError(f"{source}: cannot be read ({e})") from None
        self.sess = _session(folder / name, threads, providers, spin)
        self.pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.context_length = cfg.context_length
        self.out_names = all_cross_names(cfg.num_layers)
        got = {o.name for o in self.sess.get_outputs()}
        want_in = set(ENCODER_INPUTS)
        if {i.name for i in self.sess.get_inputs()} != want_in or not set(self.out_names) <= got:
            raise ModelFolderError(f"{folder / name}: encoder graph I/O does not match specbeam_config.json "
                                   f"(inputs {sorted(want_in)}, outputs {self.out_names[:2]}...); re-export")
        missing = set(decoder.static_inputs) ^ ({SOURCE_MASK} | set(self.out_names))
        if missing:
            raise ModelFolderError(f"{path}: static_inputs do not match the encoder outputs ({sorted(missing)})")

    def language_id(self, code: str, which: str) -> int:
        """The token id of language `code` (which: 'src_lang' / 'tgt_lang', for the message)."""
        if not self.language_codes:
            raise ValueError(f"{which}={code!r}: this model has no language codes (src_lang/tgt_lang are for "
                             f"NLLB/M2M100 exports)")
        if code not in self.language_codes:
            raise ValueError(f"unknown {which} {code!r}; this model's language codes: "
                             f"{', '.join(sorted(self.language_codes))}")
        return self.language_codes[code]

    def source_ids(self, text: str, tokenizer, src_lang: str | None) -> list[int]:
        """A text source as the model's tokenizer builds it: the source-side tokenizer's ids (or `tokenizer`'s),
        then EOS; with language codes the source language's code before the text (or, NLLB legacy, after EOS)."""
        ids = (self.source_tokenizer.encode(text, add_special_tokens=False).ids if self.source_tokenizer
               else tokenizer.encode(text)) + self.eos[:1]
        if src_lang is None:
            if self.language_codes:
                raise ValueError(f"this model translates between languages: pass src_lang (one of "
                                 f"{', '.join(sorted(self.language_codes))})")
            return ids
        code = self.language_id(src_lang, "src_lang")
        return ids + [code] if self.source_language == "suffix" else [code] + ids

    def decoder_prompt(self, forced_bos: int | None = None) -> list[int]:
        """The decoder's start: the decoder start token, then the forced BOS (an NLLB/M2M100 target language)."""
        bos = self.forced_bos if forced_bos is None else forced_bos
        return [self.decoder_start] + ([int(bos)] if bos is not None else [])

    def encode(self, sources: list[list[int]]) -> list[dict]:
        """One encoder run over right-padded sources; per request its static decoder inputs,
        name -> (array with batch axis 1, pad axis), cut to its own source length."""
        for s in sources:
            if not s:
                raise ValueError("the source is empty")
            if len(s) > self.context_length:
                raise ValueError(f"the source has {len(s)} tokens; the encoder's context length is "
                                 f"{self.context_length}")
        S = max(len(s) for s in sources)
        ids = np.full((len(sources), S), self.pad, np.int64)
        mask = np.zeros((len(sources), S), np.int64)
        for b, s in enumerate(sources):
            ids[b, :len(s)], mask[b, :len(s)] = s, 1
        outs = self.sess.run(self.out_names, {"input_ids": ids, "attention_mask": mask})
        statics = []
        for b, s in enumerate(sources):
            n = len(s)
            st = {SOURCE_MASK: (np.ones((1, n), np.float32), 1)}
            st.update({name: (np.ascontiguousarray(o[b:b + 1, :, :n]), 2) for name, o in zip(self.out_names, outs)})
            statics.append(st)
        return statics


# largest relative difference between a shared-encoder draft's fingerprint and its target's cross K/V: storing
# the same weights as fp16 moves it by ~1e-3, int8w by up to 2.3e-2 (tiny random models; 7.9e-3 on the 6+6 x 384
# pair); drafts trained for another target differed by 1.15 to 3.5
PROBE_LIMIT = 0.1


def shared_cross_layers(target_encoder: Encoder, draft_model: OnnxCausalLM, target_model: OnnxCausalLM) -> list[int] | None:
    """A draft cut from its target with the target's encoder, embedding and cross K/V projections kept as they
    were (models/train.py --freeze_encoder) declares, per decoder layer, the target layer whose cross K/V it
    uses (`encoder_decoder.target_cross_layers`), and ships no encoder: the runtime feeds it the target's cross
    K/V. Checked once at load against the fingerprint the export took from the draft's encoder
    (`target_cross_probe`): a draft trained for another target is refused, not run slowly.
    None when the draft declares nothing (it has its own encoder)."""
    facts = draft_model.cfg.raw["encoder_decoder"]
    layers = facts.get("target_cross_layers")
    if layers is None:
        return None
    path = Path(draft_model.folder) / "specbeam_config.json"
    n_t, n_d = target_model.cfg.num_layers, draft_model.cfg.num_layers
    if (not isinstance(layers, list) or len(layers) != n_d
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)):
        raise ModelFolderError(f"{path}: encoder_decoder.target_cross_layers must list one target decoder layer "
                               f"(an integer >= 0) per draft decoder layer ({n_d}), got {layers!r}")
    if max(layers) >= n_t:
        raise ModelFolderError(f"{path}: the draft reads the cross K/V of target decoder layers {layers}, but "
                               f"{target_model.folder} has {n_t}: it was trained for another target")
    want, got = ((m.cfg.num_kv_heads, m.cfg.head_dim) for m in (target_model, draft_model))
    if got != want:
        raise ModelFolderError(f"{path}: target_cross_layers needs the target's cross K/V shape (heads, head_dim) "
                               f"{want}; the draft's is {got}")
    probe = facts.get("target_cross_probe")
    try:
        source, pos, dims, values = (probe[k] for k in ("source", "positions", "dims", "values"))
        source, pos, dims = [int(x) for x in source], list(pos), list(dims)
        wanted = [(np.asarray(values[dn], np.float32), tn)
                  for j, i in enumerate(layers) for dn, tn in zip(cross_names(j), cross_names(i))]
    except (TypeError, KeyError, IndexError, ValueError) as e:
        raise ModelFolderError(f"{path}: encoder_decoder.target_cross_probe missing or malformed ({e!r}); re-export "
                               f"the draft") from None
    try:
        [t] = target_encoder.encode([source])
        got = [t[tn][0][0][:, pos][:, :, dims].reshape(-1) for _, tn in wanted]
        worst = float(np.max([np.abs(a - b).max() / (np.abs(b).max() + 1e-6) for (a, _), b in zip(wanted, got)]))
    except Exception as e:  # onnxruntime's own errors (ids outside the vocabulary), shapes that do not match
        raise ModelFolderError(f"{path}: {target_model.folder}'s encoder cannot reproduce the draft's encoder "
                               f"fingerprint ({str(e).splitlines()[0][:160]}): it was trained for another "
                               f"target") from None
    if not worst <= PROBE_LIMIT:     # (NaN fails too)
        raise ModelFolderError(f"{path}: the draft declares it uses the target's encoder (target_cross_layers "
                               f"{layers}), but its cross K/V differ from {target_model.folder}'s by {worst:.3g} "
                               f"(relative): it was trained for another target")
    return list(layers)


def shared_statics(target_statics: dict, layers: list[int]) -> dict:
    """The draft's static decoder inputs taken from the target's (see shared_cross_layers)."""
    out = {SOURCE_MASK: target_statics[SOURCE_MASK]}
    for j, i in enumerate(layers):
        out.update({dn: target_statics[tn] for dn, tn in zip(cross_names(j), cross_names(i))})
    return out


class EncoderQueue:
    """Encodes requests' sources on demand, `batch` at a time in request order: the scheduler starts requests
    in order, so asking for request i encodes it with the next ones about to join (one encoder run for them)."""

    def __init__(self, encoder: Encoder, sources: list[list[int]], batch: int):
        self.encoder, self.sources, self.batch = encoder, sources, max(1, batch)
        self.done: dict[int, dict] = {}
        self.taken: set[int] = set()

    def get(self, i: int) -> dict:
        """Request i's static inputs (each request takes them once)."""
        if i not in self.done:
            idx = [j for j in range(i, min(len(self.sources), i + self.batch))
                   if j not in self.done and j not in self.taken]
            for j, st in zip(idx, self.encoder.encode([self.sources[j] for j in idx])):
                self.done[j] = st
        self.taken.add(i)
        return self.done.pop(i)


def logits_processor(suppressed: list[int], forced_eos: int | None, max_length: int):
    """transformers' NoBadWords (single-token words) and ForcedEOS processors on log-probs at cur_len (beam
    search's BeamRows, or a sampling search's dense [K, V] array, returned as it came): banned tokens get -inf; at
    the last step (cur_len == max_length - 1) only the forced EOS survives, with 0."""
    ban = np.array(sorted(set(suppressed)), np.int64)

    def process(logp, cur_len: int):
        rows = logp if isinstance(logp, BeamRows) else BeamRows(logp)
        if forced_eos is not None and cur_len == max_length - 1:
            rows = rows.force(forced_eos)
        elif ban.size:
            rows = rows.ban(ban)
        return rows if isinstance(logp, BeamRows) else rows.dense()
    return process

