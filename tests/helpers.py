"""Tiny random Hugging Face models built locally (no downloads) and a byte-level tokenizer for them."""
from __future__ import annotations

import os
import textwrap
from contextlib import contextmanager
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
    # num_beams 4 of its own, as a translation folder has: export/tiny.py gives every test model a chat template, and
    # a chat folder naming no beams is searched greedily (prompting.CHAT_DEFAULTS), which turned the beam-search
    # tests that use the default into greedy ones; tests of the chat defaults drop it (chat_defaults_folder)
    tf.GenerationConfig(bos_token_id=0, eos_token_id=eos, pad_token_id=0, num_beams=4).save_pretrained(folder)
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


def plain(engine, prompts, **kw):
    """engine.generate(prompts, **kw) as plain beam search (speculative=None), asserting that no draft pass ran and
    no step came from a tree: an engine holding a draft speculates by default, so a baseline that did not say
    otherwise compared speculation with speculation. Returns generate's list of Results."""
    assert "speculative" not in kw and "drafter" not in kw, "plain() runs without speculation"
    results = engine.generate(prompts, speculative=None, **kw)
    for r in results:
        s = r.stats
        assert s.draft_passes == 0 and s.draft_tokens_proposed == 0 and not any(s.from_draft), (
            f"the plain baseline speculated: {s.draft_passes} draft passes, {s.draft_tokens_proposed} tokens drafted")
    return results


# speculative == plain may differ where the plain run's candidates tie: a tree pass and a small pass round
# differently in the last bit. Every such difference is recorded here (test, step, rank, gap) and counted per test.
TIES: list[tuple[str, int, int, float]] = []
MAX_TIES_PER_TEST = 2


def tie_tolerance(value: float) -> float:
    """The engine's own invariance tolerance (relative to the largest logit; invariance.TOLERANCE) applied to a
    cumulative log-prob: relative to its size, never below the tolerance itself."""
    from specbeam_edge.execution.invariance import TOLERANCE

    return TOLERANCE * max(1.0, abs(value))


@contextmanager
def beam_steps():
    """Record every beam step of the (one) search run inside: a list with, per step, (M, ranked candidates): the
    number of candidates the step chooses from (1 for greedy search) and those M and the next one (which a
    rounding difference could let in), best first, as (token path from the root, cumulative log-prob)."""
    from specbeam_edge.decoding.beam import NEG, BeamRows, BeamSearch
    from specbeam_edge.decoding.constraints import ConstrainedBeamSearch

    steps, searches = [], set()

    def spy_on(cls):
        real = cls.step

        def step(self, rows):
            searches.add(id(self))
            x = self.process(rows if isinstance(rows, BeamRows) else BeamRows(rows))
            M = 1 if self.num_beams == 1 else self.n_candidates
            vals, idx = x.top(self.scores, M + 1)
            paths = [tuple(self.tree.path(n)) for n in self.running]
            ranked = [(paths[i // x.vocab] + (int(i % x.vocab),), float(v))
                      for i, v in zip(idx, vals) if v > NEG / 2]
            steps.append((M if isinstance(self, ConstrainedBeamSearch) else _deciding(self, ranked, M), ranked))
            return real(self, rows)
        return real, step
    saved = {cls: spy_on(cls) for cls in (BeamSearch, ConstrainedBeamSearch)}
    for cls, (_, spy) in saved.items():
        cls.step = spy
    try:
        yield steps
    finally:
        for cls, (real, _) in saved.items():
            cls.step = real
    assert len(searches) <= 1, "beam_steps records one request's search"


def _deciding(bs, ranked: list, M: int) -> int:
    """How many of a (plain) beam step's best M candidates decide it: beam search keeps the first K that do not
    stop (EOS, or the length limit) as its beams and the stopping ones among the first K as hypotheses, so the
    ranks after both are not read; greedy search reads the best alone. (A constrained search ranks its own way:
    the caller takes all M.)"""
    K = bs.num_beams
    if K == 1:
        return 1
    if bs.cur_len + 1 >= bs.max_length:      # every candidate stops: the search ends with the first K
        return K
    going = 0
    for r, (path, _) in enumerate(ranked[:M]):
        going += path[-1] not in bs.eos
        if r + 1 >= K and going >= K:
            return r + 1
    return M


def _parting(a: list, b: list):
    """The first (step, rank) where two runs' recorded steps (beam_steps) part within the M candidates a step
    chooses from, or None; on the way, the candidates they share must have equal log-probs within the tie
    tolerance."""
    for t, ((M, ca), (_, cb)) in enumerate(zip(a, b)):
        for r, ((pa, va), (pb, vb)) in enumerate(zip(ca[:M], cb[:M])):
            if pa != pb:
                return t, r
            assert abs(va - vb) <= tie_tolerance(va), f"step {t} rank {r}: log-prob {va} (plain) vs {vb}"
        if len(ca[:M]) != len(cb[:M]):
            return t, min(len(ca), len(cb), M)
    return None if len(a) == len(b) else (min(len(a), len(b)), 0)


def speculative_equals_plain(engine, prompt, speculative, **kw):
    """Run one prompt plainly (plain()) and with `speculative`, and assert they are the same search: every beam
    step ranks the same candidates with the same log-probs (within tie_tolerance), and so the same hypotheses.
    The runs may part only at a step and rank where the plain run's own candidates tie within that tolerance
    (the speculative run's candidate there is plain's next one and scored the same); after such a step the
    outputs may differ. Each such difference is recorded in TIES and a test may have MAX_TIES_PER_TEST.
    Returns (plain Result, speculative Result)."""
    with beam_steps() as a:
        [ref] = plain(engine, prompt, **kw)
    with beam_steps() as b:
        [fast] = engine.generate(prompt, speculative=speculative, **kw)
    assert len(a) == ref.stats.beam_steps and len(b) == fast.stats.beam_steps, "a beam step went unrecorded"
    part = _parting(a, b)
    if part is None:
        assert_same_hypotheses(ref, fast, atol=tie_tolerance(max((abs(h.score) for h in ref.hypotheses), default=0)))
        return ref, fast
    t, r = part
    ca, cb = a[t][1] if t < len(a) else [], b[t][1] if t < len(b) else []
    where = f"the runs part at step {t} rank {r}"
    assert r < len(ca) and r < len(cb), f"{where}: one of them has no candidate there"
    plain_values = dict(ca)
    assert cb[r][0] in plain_values, f"{where}: the speculative run's candidate is not among plain's {len(ca)}"
    gap = abs(ca[r][1] - plain_values[cb[r][0]])
    assert gap <= tie_tolerance(ca[r][1]), f"{where}, where plain's log-probs do not tie: gap {gap:.3g}"
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    TIES.append((test, t, r, gap))
    used = sum(1 for x in TIES if x[0] == test)
    assert used <= MAX_TIES_PER_TEST, f"{used} differences at ties in {test} (at most {MAX_TIES_PER_TEST})"
    return ref, fast


def chat_defaults_folder(folder, dest: Path) -> Path:
    """A copy of an exported test folder whose generation settings name no num_beams and no max_new_tokens: a chat
    model as fetched ones are, which gets prompting.CHAT_DEFAULTS."""
    import json
    import shutil

    shutil.copytree(folder, dest)
    cfg_path = Path(dest) / "specbeam_config.json"
    cfg = json.loads(cfg_path.read_text())
    for k in ("num_beams", "max_new_tokens"):
        cfg.get("generation", {}).pop(k, None)
    cfg_path.write_text(json.dumps(cfg, indent=1))
    return Path(dest)
