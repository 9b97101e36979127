"""Speculative vs plain beam search on the shipped pair: the same text, fewer target passes.

On this small pair (6-layer target, 2-layer draft, both in memory) a draft pass costs about a third of a target
pass, so fewer target passes do not make it faster here: speculation pays where a target pass is expensive (a
larger or streamed target, README "Where it stands"). adaptive=True, the default of SpeculativeConfig, the CLI and
the app, times both ways and drafts only while that pays; the last row of each K shows it ("speculative" drafts on
every pass: adaptive=False).
"""
import time
from pathlib import Path

from specbeam_edge import Engine, SpeculativeConfig

PAIR = Path(__file__).resolve().parents[1] / "models" / "ende"

engine = Engine(PAIR / "target", draft=PAIR / "draft")
prompt = engine.tokenizer.format_prompt("Click the Save button to store the document.")
rows = (("plain", None),
        ("speculative", SpeculativeConfig(adaptive=False, drafter="best_first", budget=48, max_depth=6)),
        ("adaptive", SpeculativeConfig(drafter="best_first", budget=48, max_depth=6, adaptive=True)))
for K in (1, 4):
    texts = set()
    for name, spec in rows:
        t0 = time.perf_counter()
        [res] = engine.generate(prompt, num_beams=K, speculative=spec)
        s = res.stats
        texts.add(res.text)
        print(f"K={K} {name:12s} {time.perf_counter() - t0:6.3f}s  target passes {s.target_passes:3d}  "
              f"beam steps per pass {s.beam_steps_per_pass:.2f}\t{res.text}")
    assert len(texts) == 1, texts     # exact: speculation never changes the output
