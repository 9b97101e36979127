"""Translate a list of English sentences to German with the shipped pair (exact speculative beam search)."""
from pathlib import Path

from specbeam_edge import Engine, SpeculativeConfig

PAIR = Path(__file__).resolve().parents[1] / "models" / "ende"

engine = Engine(PAIR / "target", draft=PAIR / "draft")
sentences = ["Click the Save button.", "The file could not be opened.", "Select a cell range in the sheet."]
prompts = [engine.tokenizer.format_prompt(s) for s in sentences]
for src, res in zip(sentences, engine.generate(prompts, num_beams=4, speculative=SpeculativeConfig())):
    print(f"{src}\t{res.text}\t(beam steps per target pass {res.stats.beam_steps_per_pass:.2f})")
