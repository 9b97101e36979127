"""Tiny random Hugging Face models built locally (no downloads) and a byte-level tokenizer for them."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

VOCAB = 320


def make_tokenizer(folder: Path, vocab: int = VOCAB) -> None:
    """A byte-level BPE over a small fixed text, padded with dummy merges up to `vocab` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|de|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = ["the quick brown fox jumps over the lazy dog " * 3, "Der schnelle braune Fuchs springt " * 3,
            "hello world, this is a tiny tokenizer for tests."] * 20
    tok.train_from_iterator(text, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}"}))


def make_hf_model(folder: Path, family: str = "llama", *, layers: int = 2, hidden: int = 64, heads: int = 4,
                  kv_heads: int = 2, vocab: int = VOCAB, seed: int = 0, rope_scaling: dict | None = None,
                  tied: bool | None = None, std: float = 0.08, eos: int | list = 0):
    """Save a random-weight HF causal LM (fp32 safetensors) plus tokenizer; returns the torch model."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
              num_key_value_heads=kv_heads, intermediate_size=hidden * 3, max_position_embeddings=256,
              bos_token_id=0, eos_token_id=eos, pad_token_id=0, rms_norm_eps=1e-5)
    if family == "llama":
        cfg = tf.LlamaConfig(**kw, tie_word_embeddings=bool(tied), rope_scaling=rope_scaling)
        model = tf.LlamaForCausalLM(cfg)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**kw, tie_word_embeddings=True if tied is None else tied)
        model = tf.Qwen2ForCausalLM(cfg)
    elif family == "mistral":
        cfg = tf.MistralConfig(**kw, sliding_window=None, tie_word_embeddings=bool(tied))
        model = tf.MistralForCausalLM(cfg)
    else:
        raise ValueError(family)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    model.eval()
    model.save_pretrained(folder)
    tf.GenerationConfig(bos_token_id=0, eos_token_id=eos, pad_token_id=0).save_pretrained(folder)
    make_tokenizer(folder, vocab)
    return model


def torch_path_logits(model, paths: list[list[int]]) -> np.ndarray:
    """Reference: the last-position logits of each token path, run causally from scratch (no cache)."""
    import torch

    out = []
    with torch.no_grad():
        for p in paths:
            out.append(model(input_ids=torch.tensor([p])).logits[0, -1].float().numpy())
    return np.stack(out)
