"""Stream an answer: text appears as soon as every live beam agrees on it."""
import sys
from pathlib import Path

from specbeam_edge import Engine, SpeculativeConfig

PAIR = Path(__file__).resolve().parents[1] / "models" / "ende"

engine = Engine(PAIR / "target", draft=PAIR / "draft")
prompt = engine.tokenizer.format_prompt(sys.argv[1] if len(sys.argv) > 1 else "Insert a new row above the cursor.")
for chunk in engine.stream(prompt, num_beams=4, speculative=SpeculativeConfig()):
    print(chunk.text, end="", flush=True)
print()
print(f"[{chunk.result.stats.tokens_per_second:.0f} tokens/s, time to first token "
      f"{1000 * chunk.result.stats.time_to_first_token:.1f} ms]", file=sys.stderr)
