"""Tiny random-weight encoder-decoder models built locally (no download): a Marian (Opus-MT shape: post-norm,
swish, sinusoidal positions from 0, final_logits_bias, decoder start = pad, pad banned by bad_words_ids), an
M2M100 (pre-norm, relu, fairseq positions) and an NLLB-style M2M100 (language-code tokens, forced BOS)."""
from __future__ import annotations

import json
from pathlib import Path

from helpers import VOCAB, make_tokenizer

PAD = VOCAB - 1            # Opus-MT: pad is the last id and the decoder start token
LANGS = {"eng_Latn": VOCAB - 4, "deu_Latn": VOCAB - 3, "fra_Latn": VOCAB - 2}
BASE = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)


def _config(kind: str, **overrides):
    import transformers as tf

    if kind == "marian":
        kw = dict(BASE, pad_token_id=PAD, eos_token_id=0, decoder_start_token_id=PAD, bos_token_id=None,
                  activation_function="swish", scale_embedding=True, share_encoder_decoder_embeddings=True)
        return tf.MarianConfig(**{**kw, **overrides}), tf.MarianMTModel, dict(bad_words_ids=[[PAD]])
    # M2M100 / NLLB: pad 1, eos 2 (also the decoder start), bos 0
    kw = dict(BASE, pad_token_id=1, eos_token_id=2, bos_token_id=0, decoder_start_token_id=2,
              activation_function="relu", scale_embedding=True)
    gen = dict(forced_bos_token_id=LANGS["deu_Latn"]) if kind == "nllb" else {}
    return tf.M2M100Config(**{**kw, **overrides}), tf.M2M100ForConditionalGeneration, gen


def make_encdec_model(folder: Path, kind: str = "marian", *, seed: int = 0, std: float = 0.3, spm: bool = False,
                      **overrides):
    """Save a random-weight `kind` ('marian', 'm2m100', 'nllb') model (fp32 safetensors) with a tokenizer and a
    generation config; returns the torch model. The tokenizer: a byte-level tokenizer.json (NLLB: with the
    language codes of LANGS as special tokens), or with spm the SentencePiece files the real models ship
    (Marian, M2M100; converted at export)."""
    import torch
    import transformers as tf

    cfg, cls, gen = _config(kind, **overrides)
    cfg.architectures = [cls.__name__]
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_positions" not in name:
                p.normal_(0, std)
        if hasattr(model, "final_logits_bias"):
            model.final_logits_bias.normal_(0, std)
    model.eval()
    model.save_pretrained(folder)
    # the in-memory model generates with the saved generation config, as one loaded from the folder would
    model.generation_config = tf.GenerationConfig(
        eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id, decoder_start_token_id=cfg.decoder_start_token_id,
        forced_eos_token_id=getattr(cfg, "forced_eos_token_id", None), **gen)
    model.generation_config.save_pretrained(folder)
    if spm:
        if kind == "marian":
            write_marian_spm(folder, separate=not cfg.share_encoder_decoder_embeddings)
        else:
            write_m2m100_spm(folder)
    elif kind == "nllb":
        from tokenizers import Tokenizer

        make_tokenizer(folder, min(LANGS.values()))
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tok.add_special_tokens(list(LANGS))
        assert [tok.token_to_id(c) for c in LANGS] == list(LANGS.values())
        tok.save(str(folder / "tokenizer.json"))
    else:
        make_tokenizer(folder, VOCAB)
    return model


# -- SentencePiece tokenizers as Opus-MT and M2M100 ship them (no tokenizer.json) ---------------------------
EN = ["the quick brown fox jumps over the lazy dog", "hello world, this is a small test with 42 numbers",
      "names like Zoe and code such as x = 3 stay the same", "translation models read sentences and write them",
      "she sells sea shells by the sea shore", "a tiny tokenizer for tests of the converter"]
DE = ["der schnelle braune Fuchs springt über den faulen Hund", "hallo Welt, das ist ein kleiner Test mit 42 Zahlen",
      "Namen wie Zoe und Code wie x = 3 bleiben gleich", "Übersetzungsmodelle lesen Sätze und schreiben sie",
      "sie verkauft Muscheln am Meeresufer", "ein winziger Tokenizer für Tests des Konverters"]
TEXTS = ["the quick brown fox", "hello world, 42 numbers!", "Zoe sells shells  by the   sea", "über den Hund",
         "x = 3 </s> and <unk> stay", "unseen: qwzj ÆØÅ", " leading space", ""]


def _spm(lines: list[str], model_type: str, size: int) -> bytes:
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines * 20), model_writer=buf, vocab_size=size,
                                   model_type=model_type, hard_vocab_limit=False, minloglevel=2,
                                   character_coverage=1.0)
    return buf.getvalue()


def _pieces(proto: bytes) -> list[str]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=proto)
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if not (sp.is_control(i) or sp.is_unknown(i))]


def write_marian_spm(folder: Path, *, vocab: int = VOCAB, separate: bool = False, codes: tuple = ()) -> dict:
    """Opus-MT files: source.spm (English), target.spm (German), vocab.json (</s> 0, <unk> 1, the pieces of
    both models, unused fillers, <pad> last = vocab - 1) or, separate, vocab.json + target_vocab.json. Returns
    the vocabularies."""
    folder.mkdir(parents=True, exist_ok=True)
    src, tgt = _spm(EN, "unigram", 120), _spm(DE, "unigram", 120)
    (folder / "source.spm").write_bytes(src)
    (folder / "target.spm").write_bytes(tgt)

    def vocab_of(pieces):
        words = list(dict.fromkeys(["</s>", "<unk>", *codes, *pieces]))
        assert len(words) < vocab, len(words)
        words += [f"<unused{i}>" for i in range(vocab - 1 - len(words))] + ["<pad>"]
        return {w: i for i, w in enumerate(words)}

    vocabs = {"vocab.json": vocab_of(_pieces(src) + ([] if separate else _pieces(tgt)))}
    if separate:
        vocabs["target_vocab.json"] = vocab_of(_pieces(tgt))
    for name, v in vocabs.items():
        (folder / name).write_text(json.dumps(v, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "MarianTokenizer", "separate_vocabs": separate, "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": "<pad>", "source_lang": "en", "target_lang": "de"}))
    return vocabs


def write_m2m100_spm(folder: Path) -> dict:
    """M2M100 files: sentencepiece.bpe.model (BPE), vocab.json (fairseq: <s> 0, <pad> 1, </s> 2, <unk> 3, then
    the pieces); the wmt21 language tokens follow (ids len(vocab.json) + i). Returns vocab.json."""
    folder.mkdir(parents=True, exist_ok=True)
    proto = _spm(EN + DE, "bpe", 150)
    (folder / "sentencepiece.bpe.model").write_bytes(proto)
    words = list(dict.fromkeys(["<s>", "<pad>", "</s>", "<unk>", *_pieces(proto)]))
    vocab = {w: i for i, w in enumerate(words)}
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "M2M100Tokenizer", "language_codes": "wmt21", "num_madeup_words": 8, "src_lang": "en",
        "tgt_lang": "de", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "sep_token": "</s>"}))
    return vocab
