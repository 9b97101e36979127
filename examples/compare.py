"""Speculative vs plain beam search on the same model: identical text, fewer target passes."""
import time
from pathlib import Path

from specbeam_edge import Engine, SpeculativeConfig

PAIR = Path(__file__).resolve().parents[1] / "models" / "ende"

engine = Engine(PAIR / "target", draft=PAIR / "draft")
prompt = engine.tokenizer.format_prompt("Choose Format - Cells and click the Numbers tab.")
for name, spec in (("plain", None), ("speculative", SpeculativeConfig(budget=48, max_depth=6))):
    t0 = time.perf_counter()
    [res] = engine.generate(prompt, num_beams=4, speculative=spec)
    s = res.stats
    print(f"{name:12s} {time.perf_counter() - t0:6.3f}s  passes {s.target_passes:3d}  "
          f"steps/pass {s.beam_steps_per_pass:.2f}\t{res.text}")
