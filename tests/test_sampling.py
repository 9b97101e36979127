"""Beam sampling and speculative beam sampling (DSBD): exact output distribution (chi-square, with a
power check), width selection vs brute force, refusal of non-sampled drafts, memory-saving mode.

Chi-square: two-sample homogeneity test of the best hypothesis over 20,000 seeded runs per arm; categories
with an expected count below 5 are pooled. The correct rule must give p > 1e-3 (fixed seeds: deterministic in
CI); a deliberately broken rule (no residual update) must give p < 1e-3 on the same test.
"""
import collections
import dataclasses
import itertools

import numpy as np
import pytest

import specbeam_edge.decoding.sampling as sampling
from fake_lm import FakeLM
from helpers import assert_same_hypotheses
from specbeam_edge import Engine, SpeculativeConfig
from specbeam_edge.decoding.sampling import acceptance_count_dist, choose_width, residual, verify_level

RUNS = 20000
P_MIN = 1e-3


def chi2_pvalue(a: collections.Counter, b: collections.Counter) -> float:
    from scipy.stats import chi2

    cats = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    table, other = [], [0, 0]
    for c in cats:
        row = [a.get(c, 0), b.get(c, 0)]
        if (row[0] + row[1]) * min(na, nb) / (na + nb) < 5:
            other[0] += row[0]
            other[1] += row[1]
        else:
            table.append(row)
    if sum(other):
        table.append(other)
    t = np.array(table, float)
    exp = t.sum(1, keepdims=True) * t.sum(0, keepdims=True) / t.sum()
    stat = ((t - exp) ** 2 / exp).sum()
    return float(chi2.sf(stat, df=len(t) - 1))


def outcomes(engine, K, spec, seed0):
    c = collections.Counter()
    for s in range(RUNS):
        [r] = engine.generate([1, 2], num_beams=K, do_sample=True, max_new_tokens=3, seed=seed0 + s,
                              speculative=spec)
        c[tuple(r.hypotheses[0].tokens)] += 1
    return c


@pytest.fixture(scope="module")
def fake():
    target, draft = FakeLM(5, seed=1), FakeLM(5, seed=2, sharpness=1.0)
    return Engine.from_models(target, draft)


@pytest.fixture(scope="module")
def references(fake):
    return {K: outcomes(fake, K, None, 10 ** 6) for K in (1, 2)}


CASES = {  # K, spec
    "K2-beam-sampling": (2, SpeculativeConfig(adaptive=False, drafter="sample", max_depth=3, draft_width=3)),
    "K1-tree-sampling": (1, SpeculativeConfig(adaptive=False, drafter="sample", max_depth=3, draft_width=3)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_distribution_equals_reference(fake, references, case):
    K, spec = CASES[case]
    got = outcomes(fake, K, spec, 0)
    p = chi2_pvalue(references[K], got)
    print(f"{case}: chi-square p = {p:.4f} over {RUNS} runs per arm")
    assert p > P_MIN


@pytest.mark.slow
def test_broken_rule_is_detected(fake, references, monkeypatch):
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)        # forget the residual update
    K, spec = CASES["K2-beam-sampling"]
    p = chi2_pvalue(references[K], outcomes(fake, K, spec, 0))
    print(f"broken rule: chi-square p = {p:.2e}")
    assert p < P_MIN


def brute_force_tail(p, q, m):
    """P(A >= k) by enumerating every accept/reject sequence of m tries."""
    probs = np.zeros(m + 1)
    for seq in itertools.product([0, 1], repeat=m):
        pr, cur = 1.0, p
        for acc in seq:
            alpha = float(np.minimum(cur, q).sum())
            pr *= alpha if acc else 1 - alpha
            cur = p if acc else residual(cur, q)
        probs[sum(seq)] += pr
    return np.cumsum(probs[::-1])[::-1]


@pytest.mark.parametrize("seed", range(6))
def test_width_selection_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n, m = 7, 4
    p, q = rng.dirichlet(np.ones(n) * 0.5), rng.dirichlet(np.ones(n) * 0.5)
    tail = brute_force_tail(p, q, m)
    dist = acceptance_count_dist(p, q, m)
    np.testing.assert_allclose(np.cumsum(dist[::-1])[::-1], tail, atol=1e-12)
    for t in (0.3, 0.7, 0.9):
        want = max([k for k in range(m + 1) if tail[k] >= t])
        assert choose_width(p, q, m, t, floor=0, cap=m) == want
        assert choose_width(p, q, m, t, floor=2, cap=3) == min(3, max(2, want))


def test_beam_search_drafts_are_refused(fake):
    with pytest.raises(ValueError, match="not samples"):
        fake.generate([1, 2], num_beams=2, do_sample=True, speculative=SpeculativeConfig(adaptive=False, drafter="beam"))
    with pytest.raises(ValueError, match="not samples"):
        verify_level(np.ones(3) / 3, None, np.array([0]), 1, np.random.default_rng(0))


def test_dynamic_width_and_memory_saving(fake):
    spec = SpeculativeConfig(adaptive=False, drafter="sample", max_depth=3, draft_width=4, width_threshold=0.7, min_num_beams=1)
    widths = collections.Counter()
    for s in range(50):
        [r] = fake.generate([1, 2], num_beams=4, do_sample=True, max_new_tokens=6, seed=s, speculative=spec)
        widths.update(r.stats.widths)
    assert len(widths) > 1 and min(widths) >= 1 and max(widths) <= 4
    single = SpeculativeConfig(adaptive=False, drafter="sample", max_depth=3, draft_width=3, single_sequence=True)
    from specbeam_edge.config import GenerationConfig
    gen = GenerationConfig(num_beams=3, do_sample=True, max_new_tokens=8, seed=5)
    for st, stats in fake.generate_passes([1, 2], gen, single):
        assert len(st.live) <= 1
    [a] = fake.generate([1, 2], generation=gen, speculative=single)
    [b] = fake.generate([1, 2], generation=gen, speculative=single)
    assert_same_hypotheses(a, b)                                        # the seed decides the draws
    # the same seeded run, streamed pass by pass: the final state holds generate's hypotheses and statistics
    assert_same_hypotheses(a, st.hypotheses(1))
    assert (stats.target_passes, stats.draft_tokens_accepted) == (a.stats.target_passes, a.stats.draft_tokens_accepted)
    # the draft's samples are used (some accepted), and another seed draws other samples
    assert a.stats.draft_passes > 0 and a.stats.draft_tokens_accepted > 0, a.stats
    others = {tuple(fake.generate([1, 2], generation=dataclasses.replace(gen, seed=s), speculative=single)[0]
                    .hypotheses[0].tokens) for s in range(6)}
    assert len(others) > 1, others


def test_sampling_on_onnx_models(exported):
    t = exported("llama", std=0.3, seed=3)
    eng = Engine(t, draft=exported("llama", std=0.3, seed=11, layers=1))
    spec = SpeculativeConfig(adaptive=False, drafter="sample", max_depth=4, draft_width=4)
    kw = dict(num_beams=2, do_sample=True, max_new_tokens=12, speculative=spec, raw=True)   # the text as it is
    a = eng.generate("the quick fox", seed=7, **kw)[0]
    b = eng.generate("the quick fox", seed=7, **kw)[0]
    assert_same_hypotheses(a, b)
    # a whole sample: it ends at EOS ("stop") or at max_new_tokens ("length"), its text is its tokens' decoding,
    # and the search took a step per token in fewer target passes than steps (the draft's levels kept)
    h = a.hypotheses[0]
    assert h.tokens[-1] in eng.eos if h.finish_reason == "stop" else (h.finish_reason, len(h.tokens)) == ("length", 12)
    assert h.text == eng.tokenizer.decode(h.tokens) and h.text
    assert len(h.tokens) <= a.stats.beam_steps <= 12 and a.stats.target_passes < a.stats.beam_steps, a.stats
    # batched with other prompts (each request draws from its own seeded generator): the draws it gets alone
    together = eng.generate(["the quick fox", "hello world", "the quick fox"], seed=7, **kw)
    assert max(together[0].stats.batch_sizes) > 1
    assert_same_hypotheses(together[0], a)
    assert_same_hypotheses(together[2], a)
    # other seeds draw other samples
    seeds = {tuple(eng.generate("the quick fox", seed=s, **kw)[0].hypotheses[0].tokens) for s in range(4)}
    assert len(seeds) > 1, seeds
    # the draft's samples are verified and kept: some levels come from the draft, and with the target as its own
    # draft (p = q at the first level of every pass) most of each pass's levels are kept
    assert a.stats.draft_passes > 0 and a.stats.draft_tokens_accepted > 0 and any(a.stats.from_draft), a.stats
    own = Engine(t, draft=t).generate("the quick fox", seed=7, **kw)[0]
    assert own.stats.beam_steps_per_pass > a.stats.beam_steps_per_pass, (own.stats, a.stats)
    assert own.stats.from_draft.count(True) >= 2 * own.stats.target_passes, own.stats
