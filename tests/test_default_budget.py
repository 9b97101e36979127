"""A draft tree left at the default budget grows to one node a beam when more beams are asked (before: 81 beams with
a draft loaded were refused, "budget (80) must be >= num_beams", though no budget was set); a budget the caller
set stays a refusal, and past MAX_BUDGET the refusal says how to search with that many beams."""
import pytest

from specbeam_edge import Engine, SpeculativeConfig
from specbeam_edge.config import DEFAULT_BUDGET, MAX_BUDGET


@pytest.fixture(scope="module")
def engine(pair):
    return Engine(pair[0], draft=pair[1])


def test_more_beams_than_the_default_budget_speculate_exactly(engine):
    K = DEFAULT_BUDGET + 20
    assert engine.speculative_for(SpeculativeConfig(), K).budget == K
    assert engine.speculative_for(SpeculativeConfig(), 4).budget == DEFAULT_BUDGET
    [plain] = engine.generate("hello", num_beams=K, max_new_tokens=3, speculative=None)
    [default] = engine.generate("hello", num_beams=K, max_new_tokens=3)         # the tools' default: adaptive
    [drafted] = engine.generate("hello", num_beams=K, max_new_tokens=3, speculative=SpeculativeConfig(adaptive=False))
    assert drafted.stats.draft_passes > 0 and plain.stats.draft_passes == 0
    for r in (default, drafted):
        assert [h.tokens for h in r.hypotheses] == [h.tokens for h in plain.hypotheses]


def test_a_budget_the_caller_set_is_kept(engine):
    with pytest.raises(ValueError, match=r"budget \(50\) must be >= num_beams \(100\)"):
        engine.generate("hello", num_beams=100, max_new_tokens=3, speculative=SpeculativeConfig(budget=50))


def test_past_the_largest_tree_the_refusal_names_the_way_out():
    with pytest.raises(ValueError, match=f"at most {MAX_BUDGET} nodes: search without a draft"):
        SpeculativeConfig(budget=MAX_BUDGET).check_against(MAX_BUDGET + 1)
