"""Tiny random Hugging Face models built locally (no downloads) and a byte-level tokenizer for them."""
from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

from export.tiny import VOCAB, make_tokenizer  # noqa: F401  (tests import both from here)


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
    return save_random(model, folder, std=std, eos=eos, vocab=vocab)


def save_random(model, folder: Path, *, std: float, eos, vocab: int = VOCAB):
    """Draw the model's weights from N(0, std), save it as an HF folder (fp32 safetensors, generation config,
    tokenizer); returns the model in eval mode."""
    import torch
    import transformers as tf

    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    model.eval()
    model.save_pretrained(folder)
    tf.GenerationConfig(bos_token_id=0, eos_token_id=eos, pad_token_id=0).save_pretrained(folder)
    make_tokenizer(folder, vocab)
    return model


def _hypotheses(x) -> list[tuple[list[int], float]]:
    """(tokens, score) of each hypothesis of a Result, a list of Hypothesis, a list of Alternative (their best
    hypotheses) or a list of (tokens, score) pairs (BeamSearch.hypotheses)."""
    hyps = x.hypotheses if hasattr(x, "hypotheses") else x
    hyps = [h.hypothesis if hasattr(h, "hypothesis") else h for h in hyps]
    return [(list(h.tokens), h.score) if hasattr(h, "tokens") else (list(h[0]), h[1]) for h in hyps]


def assert_same_hypotheses(a, b, scores: bool = True, atol: float = 1e-5):
    """a and b (Results, or lists of hypotheses: see _hypotheses) hold the same hypotheses in the same order: the
    same tokens, and (scores=True) scores equal within atol (atol=0: exactly equal)."""
    ha, hb = _hypotheses(a), _hypotheses(b)
    assert [t for t, _ in ha] == [t for t, _ in hb], ([t for t, _ in ha], [t for t, _ in hb])
    if scores:
        sa, sb = [s for _, s in ha], [s for _, s in hb]
        if atol == 0:
            assert sa == sb, (sa, sb)
        else:
            np.testing.assert_allclose(sa, sb, atol=atol)


def torch_path_logits(model, paths: list[list[int]]) -> np.ndarray:
    """Reference: the last-position logits of each token path, run causally from scratch (no cache)."""
    import torch

    out = []
    with torch.no_grad():
        for p in paths:
            out.append(model(input_ids=torch.tensor([p])).logits[0, -1].float().numpy())
    return np.stack(out)


WORDS = "the quick brown fox jumps over lazy dog hello world this is a tiny test".split()


def corpus(n: int, seed: int = 0) -> list[str]:
    """n lines of 1-8 words from a tiny fixed vocabulary (inputs for the translate tool's tests)."""
    import random

    r = random.Random(seed)
    return [" ".join(r.choice(WORDS) for _ in range(r.randint(1, 8))) for _ in range(n)]


def translate_args(pair, inp, out=None, *extra, max_len: int = 8) -> list[str]:
    """specbeam-translate's arguments for the tiny pair: -i inp [-o out], short translations, quiet."""
    a = ["-i", str(inp), "--model", pair[0], "--draft", pair[1], "--max_decoding_length", str(max_len), "-q", *extra]
    return a + (["-o", str(out)] if out else [])


def interrupt_after(monkeypatch, n: int):
    """Make Engine.generate_iter raise KeyboardInterrupt (as Ctrl-C) after n results (monkeypatch.undo() restores
    it)."""
    from specbeam_edge.generate import Engine

    real = Engine.generate_iter

    def stopping(self, *a, **kw):
        for k, item in enumerate(real(self, *a, **kw)):
            if k == n:
                raise KeyboardInterrupt
            yield item
    monkeypatch.setattr(Engine, "generate_iter", stopping)


def run_drafter(gen):
    """Run a drafter's generator that needs no model pass (it yields nothing) to its result: the new nodes."""
    try:
        while True:
            call = next(gen)
            raise AssertionError(f"the drafter asked for a pass: {call}")
    except StopIteration as e:
        return e.value


def chat_session_script(ready: str, platform: str | None = None) -> str:
    """A script that runs `specbeam-chat`'s main() as a user does (app.exec()), types a message with QTest, and
    slows the search down so a signal can land mid-answer; it prints `ready` (a Python expression) once the
    answer is under way. platform: the Qt platform it must run on (asserted), e.g. "xcb"."""
    check = f"assert app.platformName() == {platform!r}, app.platformName()\n" if platform else ""
    return textwrap.dedent("""
        import os, sys, time
        from PySide6.QtCore import QTimer, Qt
        from PySide6.QtTest import QTest
        from PySide6.QtWidgets import QApplication
        from specbeam_edge.generate import Engine
        from apps.chat import __main__ as chat_main
        from apps.chat.window import ChatWindow

        real = Engine.generate_passes
        def slow(self, *a, **kw):
            for item in real(self, *a, **kw):
                time.sleep(0.03)
                yield item
        Engine.generate_passes = slow
        app = QApplication(sys.argv[:1])
    """) + check + textwrap.dedent(f"""
        def drive():
            win = next((w for w in app.topLevelWidgets() if isinstance(w, ChatWindow)), None)
            if win is not None and win.gen is None and not win.store.messages(win.current()):
                QTest.keyClicks(win.input, "the quick brown fox")
                QTest.keyClick(win.input, Qt.Key.Key_Return)
            elif win is not None and win.gen is not None and win.partial_steps >= 3:
                print({ready}, flush=True)
                return
            QTimer.singleShot(10, drive)
        QTimer.singleShot(10, drive)
        sys.exit(chat_main.main(sys.argv[1:]))
    """)
