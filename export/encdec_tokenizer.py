"""Tokenizers of encoder-decoder folders that ship SentencePiece files only (Opus-MT / Marian, M2M100), converted to
`tokenizers` JSON at export time so the runtime stays on `tokenizers`.

Both slow transformers tokenizers segment with SentencePiece and then look each piece up in their own
`vocab.json` (a piece missing there is <unk>): the model's ids are not the SentencePiece ids. So the converted
model keeps SentencePiece's normalizer, pre-tokenizer and decoder (transformers' `SpmConverter` builds them from
the model proto) and SentencePiece's segmentation (its Unigram scores, or its BPE merges ranked by score), with
the vocabulary of `vocab.json`:

- Marian: the source side segments with `source.spm`, the target side with `target.spm`; one vocabulary
  (`vocab.json`) or two (`target_vocab.json` for the target, `separate_vocabs`). `tokenizer.json` is the target
  side (decoding, draft pairing) and `source_tokenizer.json` the source side (encoding; the config names it in
  `encoder_decoder.source_tokenizer`).
- M2M100: one `sentencepiece.bpe.model` and `vocab.json` for both sides, the language tokens `__xx__` after the
  vocabulary (ids len(vocab) + i, as `M2M100Tokenizer` numbers them).

Folders with a `tokenizer.json` (NLLB ships one) are used as they are.
"""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

from .hf import ExportError

# language codes as tokens: NLLB (eng_Latn), M2M100 (__en__), multilingual Opus-MT targets (>>fra<<)
NLLB_CODE = re.compile(r"^[a-z]{3}_[A-Z][a-z]{3}$")
M2M_CODE = re.compile(r"^__([a-z]{2,3}(?:_[A-Za-z]+)?)__$")
MARIAN_CODE = re.compile(r"^>>[a-zA-Z_]+<<$")


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ExportError(f"{path}: cannot be read as JSON ({e})") from None


def _token(tcfg: dict, key: str, default: str) -> str:
    """A special token from tokenizer_config.json: a string or a serialized AddedToken ({"content": ...})."""
    v = tcfg.get(key)
    return str(v.get("content") or default) if isinstance(v, dict) else str(v or default)


def _proto(path: Path):
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    try:
        m.ParseFromString(path.read_bytes())
    except Exception as e:  # protobuf raises DecodeError and others
        raise ExportError(f"{path}: not a SentencePiece model ({e})") from None
    if m.trainer_spec.model_type not in (1, 2):
        raise ExportError(f"{path}: SentencePiece model type {m.trainer_spec.model_type} is not supported "
                          f"(Unigram and BPE are)")
    return m


def _pipeline(proto):
    """SentencePiece's normalizer, pre-tokenizer and decoder as transformers builds them (legacy: every chunk
    between special tokens gets the dummy prefix, as the slow tokenizers encode each chunk on its own)."""
    from transformers.convert_slow_tokenizer import SpmConverter

    own = [(p.piece, p.score) for p in proto.pieces]
    tok = SpmConverter.build_tokenizer_from_spm_proto(proto, own if proto.trainer_spec.model_type == 1
                                                      else {p: i for i, (p, _) in enumerate(own)}, legacy=True)
    return tok.normalizer, tok.pre_tokenizer, tok.decoder


def _vocab_list(vocab: dict) -> list[str]:
    """vocab.json (piece -> id) as a list by id; ids must be 0..n-1."""
    by_id = {int(i): p for p, i in vocab.items()}
    if sorted(by_id) != list(range(len(by_id))):
        raise ExportError(f"vocab.json ids are not 0..{len(by_id) - 1} without gaps")
    return [by_id[i] for i in range(len(by_id))]


def _build(proto, pieces: list[str], specials: list[str], unk: str):
    """A `tokenizers` Tokenizer over `pieces` (id order) that segments as SentencePiece model `proto`.

    The slow tokenizers look up the surface string of every SentencePiece piece, an unknown character too, in
    vocab.json. So a vocabulary entry the model lacks must never take part in segmentation except as that
    single unknown character: Unigram scores far below every real piece (a multi-character one lower still);
    BPE never merges into it."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import BPE, Unigram

    own = {p.piece: (p.score, i, p.type) for i, p in enumerate(proto.pieces)}
    normal = {p for p, (_, _, t) in own.items() if t in (1, 4)}     # normal and user-defined pieces
    have = set(pieces)
    missing = [p for p in normal if p not in have]
    if missing:
        warnings.warn(f"{len(missing)} SentencePiece pieces are not in the vocabulary (e.g. {missing[:3]}); "
                      f"transformers encodes them as {unk}, the converted tokenizer splits them", stacklevel=3)
    if unk not in have:
        raise ExportError(f"the vocabulary has no unknown token {unk!r}")
    if proto.trainer_spec.model_type == 1:
        model = Unigram([(p, own[p][0] if p in normal else (-1e6 if len(p) == 1 else -1e7)) for p in pieces],
                        unk_id=pieces.index(unk), byte_fallback=proto.trainer_spec.byte_fallback)
    else:
        vocab = {p: i for i, p in enumerate(pieces)}
        ranked = []
        for p in normal & have:
            for k in range(1, len(p)):
                a, b = p[:k], p[k:]
                if a in normal and b in normal and a in vocab and b in vocab:
                    ranked.append((-own[p][0], own[p][1], a, b))
        user = any(own[p][2] == 4 for p in normal)
        model = BPE(vocab=vocab, merges=[(a, b) for _, _, a, b in sorted(ranked)], unk_token=unk, fuse_unk=True,
                    byte_fallback=proto.trainer_spec.byte_fallback, dropout=None, ignore_merges=user)
    tok = Tokenizer(model)
    tok.normalizer, tok.pre_tokenizer, tok.decoder = _pipeline(proto)
    tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in specials])
    return tok


def _marian(src: Path, tcfg: dict) -> dict:
    unk, eos, pad = (_token(tcfg, k, d) for k, d in (("unk_token", "<unk>"), ("eos_token", "</s>"),
                                                      ("pad_token", "<pad>")))
    source = _vocab_list(_json(src / "vocab.json"))
    separate = bool(tcfg.get("separate_vocabs"))
    if separate and not (src / "target_vocab.json").is_file():
        raise ExportError(f"{src}: separate_vocabs is set but target_vocab.json is missing")
    target = _vocab_list(_json(src / "target_vocab.json")) if separate else source

    def specials(vocab):
        return [s for s in dict.fromkeys([eos, unk, pad] + [p for p in vocab if MARIAN_CODE.match(p)]) if s in vocab]

    return {"tokenizer.json": _build(_proto(src / "target.spm"), target, specials(target), unk),
            "source_tokenizer.json": _build(_proto(src / "source.spm"), source, specials(source), unk)}


def _m2m100(src: Path, tcfg: dict) -> dict:
    from transformers.models.m2m_100.tokenization_m2m_100 import FAIRSEQ_LANGUAGE_CODES

    vocab = _vocab_list(_json(src / "vocab.json"))
    which = tcfg.get("language_codes", "m2m100")
    if which not in FAIRSEQ_LANGUAGE_CODES:
        raise ExportError(f"{src}/tokenizer_config.json: language_codes {which!r} is not one of "
                          f"{sorted(FAIRSEQ_LANGUAGE_CODES)}")
    langs = [f"__{c}__" for c in FAIRSEQ_LANGUAGE_CODES[which]]
    madeup = [f"<madeupword{i}>" for i in range(int(tcfg.get("num_madeup_words", 8)))]
    special = [_token(tcfg, k, d) for k, d in (("bos_token", "<s>"), ("pad_token", "<pad>"),
                                               ("eos_token", "</s>"), ("unk_token", "<unk>"))]
    return {"tokenizer.json": _build(_proto(src / "sentencepiece.bpe.model"), vocab + langs + madeup,
                                     [s for s in special if s in vocab] + langs + madeup, special[-1])}


def convert(src: Path, family: str) -> dict:
    """File name -> `tokenizers` Tokenizer for the export folder ({} when `src` has a tokenizer.json)."""
    if (src / "tokenizer.json").is_file():
        return {}
    tcfg = _json(src / "tokenizer_config.json") if (src / "tokenizer_config.json").is_file() else {}
    need = {"marian": ("source.spm", "target.spm", "vocab.json"),
            "m2m100": ("sentencepiece.bpe.model", "vocab.json")}[family]
    lacking = [f for f in need if not (src / f).is_file()]
    if lacking:
        raise ExportError(f"{src}: no tokenizer.json, and the SentencePiece files to convert are incomplete "
                          f"(missing {', '.join(lacking)})")
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        raise ExportError(f"{src}: converting SentencePiece files needs the sentencepiece package "
                          f"(pip install 'specbeam-edge[export]')") from None
    return _marian(src, tcfg) if family == "marian" else _m2m100(src, tcfg)


def language_codes(tokenizer_json: dict) -> dict[str, int]:
    """Language code -> token id from a tokenizer.json's special tokens: NLLB codes (eng_Latn) as they are,
    M2M100's __en__ as en (transformers' src_lang/tgt_lang spelling)."""
    out = {}
    for t in tokenizer_json.get("added_tokens", []):
        c = t.get("content", "")
        if NLLB_CODE.match(c):
            out[c] = int(t["id"])
        elif (m := M2M_CODE.match(c)):
            out[m.group(1)] = int(t["id"])
    return out
