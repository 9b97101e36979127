"""A small byte-level tokenizer for random-weight models built locally (tests, the synthetic benchmarks):
no download, deterministic."""
from __future__ import annotations

import json
from pathlib import Path

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
