"""The shipped text pair (English prose + code): loads, round-trips held-out text, compatible draft, golden
greedy continuations, speculative == plain."""
import json
from pathlib import Path

import pytest

from specbeam_edge import Engine, ModelFolderError, SpeculativeConfig
from specbeam_edge.text.tokenizer import Tokenizer
from helpers import plain

PAIR = Path(__file__).resolve().parents[1] / "models" / "text"
GOLDEN = Path(__file__).with_name("golden_text.json")
PROMPTS = ["The for statement in Python", "To open a file for reading, use", "A dictionary maps"]


@pytest.fixture(scope="module")
def engine():
    return Engine(PAIR / "target", draft=PAIR / "draft")


def test_round_trip_and_compatibility(engine):
    tok = Tokenizer(PAIR / "target")
    for line in (PAIR / "test_sample.txt").read_text("utf-8").splitlines():
        assert tok.decode(tok.encode(line)) == line
    with pytest.raises(ModelFolderError, match="tokenizer"):      # the en->de draft has another tokenizer
        Engine(PAIR / "target", draft=PAIR.parent / "ende" / "draft")


def test_golden_greedy(engine):
    got = {p: engine.generate(engine.tokenizer.format_prompt(p), num_beams=1, max_new_tokens=24)[0].text
           for p in PROMPTS}
    if not GOLDEN.exists():
        GOLDEN.write_text(json.dumps(got, indent=1, ensure_ascii=False) + "\n")
        pytest.fail(f"wrote {GOLDEN.name}; review and commit it")
    assert got == json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("K", [1, 4])
def test_speculative_equals_plain(engine, K):
    prompts = [engine.tokenizer.format_prompt(l[:120]) for l in
               (PAIR / "test_sample.txt").read_text("utf-8").splitlines()[:4]]
    for spec in (SpeculativeConfig(adaptive=False), SpeculativeConfig(adaptive=False, drafter="lookup", budget=16)):
        ref = plain(engine, prompts, num_beams=K, max_new_tokens=48)
        fast = engine.generate(prompts, num_beams=K, max_new_tokens=48, speculative=spec)
        assert [r.hypotheses[0].tokens for r in ref] == [r.hypotheses[0].tokens for r in fast]
