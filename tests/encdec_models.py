"""Tiny random-weight encoder-decoder models built locally (no download): a Marian (Opus-MT shape: post-norm,
swish, sinusoidal positions from 0, final_logits_bias, decoder start = pad, pad banned by bad_words_ids), an
M2M100 (pre-norm, relu, fairseq positions) and an NLLB-style M2M100 (language-code tokens, forced BOS)."""
from __future__ import annotations

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


def make_encdec_model(folder: Path, kind: str = "marian", *, seed: int = 0, std: float = 0.3, **overrides):
    """Save a random-weight `kind` ('marian', 'm2m100', 'nllb') model (fp32 safetensors) with a tokenizer and a
    generation config; returns the torch model."""
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
    make_tokenizer(folder, VOCAB)
    return model
