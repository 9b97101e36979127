"""Terminology constraints (lexically constrained beam search, dynamic beam allocation): every finished hypothesis
contains each constraint; scores are the hypotheses' own log-probs; speculative == plain (the constraint state
is a function of the tokens, so the replay computes plain search's); batched == alone; bad input is refused."""
import itertools

import numpy as np
import pytest

from helpers import assert_same_hypotheses
from specbeam_edge import Engine, SpeculativeConfig
from specbeam_edge.decoding.constraints import ConstrainedBeamSearch, Constraints, parse
from specbeam_edge.decoding.tree import TokenTree
from test_encdec import SOURCES, encdec  # noqa: F401 (fixture)

V = 12


def contains(seq, phrase) -> bool:
    n = len(phrase)
    return any(tuple(seq[i:i + n]) == tuple(phrase) for i in range(len(seq) - n + 1))


def random_runs(c: Constraints, seed: int, high: int, longest: int, n: int = 300):
    """n random token sequences (tokens 2..high-1) and the state each one ends in."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        seq = rng.integers(2, high, size=rng.integers(1, longest)).tolist()
        s = c.start
        for t in seq:
            s = c.advance(s, t)
        yield seq, s


def test_state_follows_the_tokens():
    """The incremental state equals what the sequence says: a constraint is met iff one of its alternatives
    occurs in it; the partial matches are exactly the phrase prefixes the sequence ends with."""
    c = Constraints([[[3, 4, 3]], [[5], [6, 7]], [[3, 3, 4]]])
    for seq, s in random_runs(c, seed=0, high=8, longest=14):
        for ci, alts in enumerate(c.phrases):
            assert bool(s.met >> ci & 1) == any(contains(seq, a) for a in alts), (seq, ci, s)
        want = {(ci, ai, k) for ci, alts in enumerate(c.phrases) if not s.met >> ci & 1
                for ai, a in enumerate(alts) for k in range(1, len(a)) if tuple(seq[-k:]) == a[:k]}
        assert set(s.partial) == want, (seq, s)
    # banks count constraint tokens: units are the shortest alternative's length
    assert c.units == [3, 1, 3] and c.total_units == 7
    s = c.start
    for t in [3, 4]:
        s = c.advance(s, t)
    assert c.bank(s) == 2                       # [3, 4] of [3, 4, 3]; [3] of [3, 3, 4] counts less
    assert set(c.next_tokens(s)) == {3, 5, 6}   # extend [3, 4, 3]; start [5], [6, 7] or [3, 3, 4]


def ends(seq, alts) -> int:
    """Positions where one of the alternatives ends (an occurrence, however many alternatives end there)."""
    return sum(any(tuple(seq[max(0, i + 1 - len(a)):i + 1]) == a for a in alts) for i in range(len(seq)))


def test_counts_and_the_rules_a_candidate_may_not_break():
    """Counted constraints: `exact` ones count every occurrence, others stop counting once met; a state breaks
    the rules when an exact one appeared more often than needed, or one appeared more often than its
    prerequisite (`after`); a constraint is open (proposed, its progress counted) only while it may appear."""
    c = Constraints([[[3, 4]], [[5]], [[6, 7], [7]]], need=[2, 1, 1], exact=[True, True, False], after=[None, 0, None])
    for seq, s in random_runs(c, seed=1, high=9, longest=16):
        full = [ends(seq, alts) for alts in c.phrases]
        assert s.counts == (full[0], full[1], min(full[2], 1)), (seq, s)
        assert s.met == sum(1 << i for i in range(3) if s.counts[i] >= c.need[i])
        assert c.violates(s) == (full[0] > 2 or full[1] > 1 or full[1] > full[0]), (seq, s)
        assert c.open(s, 1) == (full[1] < 1 and full[1] < full[0])
        assert (5 in c.next_tokens(s)) == c.open(s, 1)


def bigram_table(seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2.0, size=(V, V)).astype(np.float32)
    return logits - np.log(np.exp(logits).sum(1, keepdims=True)).astype(np.float32)


def run_search(table, constraints, K=4, max_new=10, **kw):
    tree = TokenTree()
    start = tree.add_chain([1])[-1]
    bs = ConstrainedBeamSearch(tree, start, num_beams=K, prompt_len=1, max_new_tokens=max_new, eos_token_ids=[0],
                               constraints=Constraints(constraints), **kw)
    while not bs.done:
        bs.step(np.stack([table[tree.tokens[n]] for n in bs.running]))
    return bs


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("lp", [1.0, 0.0])
def test_every_hypothesis_meets_its_constraints_and_is_scored_as_it_reads(seed, lp):
    table = bigram_table(seed)
    rng = np.random.default_rng(100 + seed)
    constraints = [[rng.integers(2, V, size=rng.integers(1, 3)).tolist()] for _ in range(rng.integers(1, 3))]
    bs = run_search(table, constraints, length_penalty=lp)
    hyps, met = bs.hypotheses(4), bs.constraints_met(4)
    assert hyps and met[0] and met == sorted(met, reverse=True), (constraints, hyps, met)   # those that met first
    for (toks, score), ok in zip(hyps, met):
        assert ok == all(contains(toks, c[0]) for c in constraints), (constraints, toks)
        assert toks[-1] == 0 if ok and len(toks) < 10 else len(toks) == 10
        path = [1] + toks
        logp = sum(table[a][b] for a, b in zip(path, path[1:]))
        assert score == pytest.approx(logp / len(toks) ** lp, abs=1e-4)
    scores = [s for (_, s), ok in zip(hyps, met) if ok]
    assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize("seed", range(10))
def test_exact_and_ordered_spans_in_every_hypothesis(seed):
    """Spans copied from a source: [2, 3] twice and exactly twice, [4] exactly once and only after [2, 3] has
    appeared more often than it (a closing tag after its opening one)."""
    table = bigram_table(seed)
    tree = TokenTree()
    start = tree.add_chain([1])[-1]
    c = Constraints([[[2, 3]], [[4]]], need=[2, 1], exact=[True, True], after=[None, 0])
    bs = ConstrainedBeamSearch(tree, start, num_beams=4, prompt_len=1, max_new_tokens=12, eos_token_ids=[0],
                               constraints=c)
    while not bs.done:
        bs.step(np.stack([table[tree.tokens[n]] for n in bs.running]))
    hyps, met = bs.hypotheses(4), bs.constraints_met(4)
    assert hyps and met[0]
    for (toks, _), ok in zip(hyps, met):
        # never more often than in the source, never out of order; all of it in every one that met them
        assert ends(toks, [(2, 3)]) <= 2 and toks.count(4) <= 1, toks
        assert 4 not in toks or ends(toks[:toks.index(4)], [(2, 3)]) >= 1, toks
        assert ok == (ends(toks, [(2, 3)]) == 2 and toks.count(4) == 1), toks


def test_alternatives_and_the_length_limit():
    table = bigram_table(3)
    bs = run_search(table, [[[7, 8], [9]]])
    met = bs.constraints_met(4)
    assert met[0] and [contains(t, [7, 8]) or contains(t, [9]) for t, _ in bs.hypotheses(4)] == met
    # a constraint longer than the room left: the hypotheses end at the limit, said to miss it, not dropped
    bs = run_search(table, [[[2, 3, 4, 5, 6]]], max_new=3)
    assert bs.hypotheses(4) and bs.constraints_met(4) == [False] * len(bs.hypotheses(4))


def test_allocation_follows_the_kind_of_constraint():
    """Terms get dynamic beam allocation; copied spans alone (text constraints), which the model mostly writes
    anyway, get one reserved place and plain beam search's order for the rest."""
    ids = lambda x: list(x) if not isinstance(x, str) else [ord(ch) % V for ch in x]   # noqa: E731
    decode = lambda t: "".join(map(chr, t))                                          # noqa: E731
    assert parse([[3, 4], {"text": "ab"}], ids, decode).allocation == "banks"
    assert parse([{"text": "ab"}, {"text": "c", "count": 2}], ids, decode).allocation == "reserve"
    with pytest.raises(TypeError, match="need a tokenizer"):
        parse([{"text": "ab"}], ids)


def test_parse_refuses_what_is_not_a_constraint():
    ids = lambda x: list(x) if not isinstance(x, str) else [ord(ch) % V for ch in x]   # noqa: E731
    c = parse([[3, 4], "ab", ([5], "c")], ids)
    assert c.phrases[0] == [(3, 4)] and len(c.phrases[1]) == 2 and (5,) in c.phrases[2]
    assert parse(None, ids) is None and parse([], ids) is None
    with pytest.raises(TypeError, match="constraints must be a list"):
        parse("ab", ids)
    with pytest.raises(TypeError, match="constraint 0"):
        parse([3.5], ids)
    with pytest.raises(ValueError, match="no tokens"):
        parse([[[]]], ids)


PROMPTS = [[3, 17, 33, 8, 99, 41, 7], [250, 12, 9, 77], [5, 6, 7, 5, 6]]


@pytest.fixture(scope="module")
def engines(exported):
    t = exported("llama", std=0.3, seed=3)
    return {"plain": Engine(t), "self": Engine(t, draft=t),
            "other": Engine(t, draft=exported("llama", std=0.3, seed=11, layers=1))}


def _constraints_for(eng, prompt, n=2):
    """Tokens plain search does not produce early: the 6th-best token after the prompt, and a two-token phrase."""
    [plain] = eng.generate(prompt, num_beams=4, max_new_tokens=16)
    seen = set(plain.hypotheses[0].tokens)
    fresh = [t for t in range(20, 200) if t not in seen]
    return [[fresh[0]], [fresh[1], fresh[2]]][:n]


@pytest.mark.parametrize("K", [2, 4])
def test_engine_constraints_met_speculative_equals_plain(engines, K):
    kw = dict(num_beams=K, max_new_tokens=16, num_return_sequences=K)
    for prompt in PROMPTS:
        cons = _constraints_for(engines["plain"], prompt)
        [plain] = engines["plain"].generate(prompt, constraints=cons, **kw)
        assert len(plain.hypotheses) == K                 # n_best hypotheses, those that met all first
        met = [h.constraints_met for h in plain.hypotheses]
        assert met[0] and met == sorted(met, reverse=True), plain.hypotheses
        for h in plain.hypotheses:
            assert h.constraints_met == all(contains(h.tokens, c) for c in cons), (cons, h.tokens)
        [unconstrained] = engines["plain"].generate(prompt, **kw)
        assert unconstrained.hypotheses[0].tokens != plain.hypotheses[0].tokens
        assert unconstrained.hypotheses[0].constraints_met is None
        for name, spec in itertools.product(("self", "other"), (
                SpeculativeConfig(adaptive=False, drafter="beam", budget=24, max_depth=4),
                SpeculativeConfig(adaptive=False, drafter="best_first", budget=24, max_depth=4))):
            [fast] = engines[name].generate(prompt, constraints=cons, speculative=spec, **kw)
            assert_same_hypotheses(fast, plain)
            assert [h.constraints_met for h in fast.hypotheses] == [h.constraints_met for h in plain.hypotheses]
        [fast] = engines["self"].generate(prompt, constraints=cons, speculative=SpeculativeConfig(
            adaptive=False, drafter="beam", budget=24, max_depth=4), **kw)
        if K == 2:     # the tree (the draft's and the constraint phrases) covers several constrained steps a pass
            assert fast.stats.beam_steps_per_pass > 1.2, fast.stats


def test_engine_constraints_batched_equal_alone(engines):
    eng = engines["other"]
    cons = [_constraints_for(engines["plain"], p) for p in PROMPTS]
    cons[1] = None                                                    # a request without constraints
    spec = SpeculativeConfig(adaptive=False, drafter="beam", budget=24, max_depth=4)
    for s in (None, spec):
        kw = dict(num_beams=3, max_new_tokens=14, speculative=s)
        together = eng.generate(PROMPTS, constraints=cons, max_batch_size=3, **kw)
        assert max(max(r.stats.batch_sizes) for r in together) > 1
        for p, c, r in zip(PROMPTS, cons, together):
            assert_same_hypotheses(r, eng.generate(p, constraints=c, **kw)[0])
        assert together[1].hypotheses[0].constraints_met is None


def test_text_constraints_and_bad_input(engines, exported):
    eng = engines["plain"]
    [r] = eng.generate("the quick fox", num_beams=4, max_new_tokens=16, constraints=["lazy", ("dog", "cat")])
    assert r.hypotheses[0].constraints_met
    text = r.hypotheses[0].text
    assert "lazy" in text and ("dog" in text or "cat" in text), text
    with pytest.raises(ValueError, match="num_beams >= 2"):
        eng.generate([3, 4], num_beams=1, constraints=[[5]])
    with pytest.raises(ValueError, match="beam search"):
        eng.generate([3, 4], num_beams=2, do_sample=True, constraints=[[5]])
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        eng.generate([3, 4], num_beams=2, constraints=[[10 ** 6]])
    with pytest.raises(ValueError, match="prompt 1"):
        eng.generate([[3, 4], [5, 6]], num_beams=2, constraints=[None, [[10 ** 6]]])
    with pytest.raises(ValueError, match="2 entries for 3 prompts"):
        eng.generate([[3, 4], [5, 6], [7]], num_beams=2, constraints=[None, None])
    topk = Engine(exported("llama", std=0.3, seed=3, output="topk"))
    with pytest.raises(ValueError, match="constraints need the log-probs"):
        topk.generate([3, 4], num_beams=2, constraints=[[5]])


def test_encoder_decoder_constraints(encdec):  # noqa: F811
    target, _ = encdec("m2m100")
    other, _ = encdec("m2m100", seed=11, decoder_layers=1, encoder_layers=1)
    plain_eng, fast_eng = Engine(target), Engine(target, draft=other)
    spec = SpeculativeConfig(adaptive=False, drafter="beam", budget=16, max_depth=3)
    for src in SOURCES["m2m100"]:
        kw = dict(num_beams=4, max_new_tokens=10, num_return_sequences=2)
        cons = [[[31, 32]], [[40], [41]]]
        [plain] = plain_eng.generate(src, constraints=cons, **kw)
        assert plain.hypotheses[0].constraints_met
        for h in plain.hypotheses:
            assert h.constraints_met == (contains(h.tokens, [31, 32]) and (40 in h.tokens or 41 in h.tokens))
        [fast] = fast_eng.generate(src, constraints=cons, speculative=spec, **kw)
        assert_same_hypotheses(fast, plain)


def test_bad_constraints_are_one_line_errors_about_the_constraint(engines):
    """Issue 50 rows 12, 13, 14, 17, 22. Before: ("Datei", 5), [1.5], [-1], [True], ["Datei", ["Fenster"]] got
    messages about "a target prefix"; an "after" pointing at a {"no_other_spans"} item was an IndexError, a bad
    no_other_spans pattern a re.error; "after" counted the no_other_spans item, so it pointed at the wrong
    constraint (itself); {"exact": "no"} was taken as True; [[EOS]] was "met" by ending the hypothesis; " " was
    accepted; a lone surrogate was a TypeError from the tokenizer. Now each is a ValueError/TypeError naming the
    constraint."""
    eng = engines["plain"]
    kw = dict(num_beams=2, max_new_tokens=4)
    bad = [([("the", 5)], "constraint 0: alternative 5 is neither"),
           ([[1.5]], "constraint 0: alternative 1.5"),
           ([[99999]], "constraint 0: token 99999 at position 0 is outside"),
           ([[-1]], "constraint 0: token -1"),
           ([[True]], "constraint 0: alternative True"),
           ([["the", ["fox"]]], "constraint 0: alternative \\['fox'\\]"),
           ([{"text": "</b>", "after": 1}, {"no_other_spans": []}], "constraint 0: after must be the index of another"),
           ([{"no_other_spans": ["("]}], "constraint 0: no_other_spans pattern '\\(' is not a regular expression"),
           ([{"text": "<b>", "exact": "no"}], "constraint 0: exact must be true or false"),
           ([[0]], "constraint 0: \\[0\\] holds the end-of-sequence token 0"),
           ([" "], "constraint 0: ' ' is only spaces"),
           ([{"text": " "}], "constraint 0: 'text' must be a non-empty string, not only spaces"),
           (["Dat\ud800ei"], "constraint 0: 'Dat\\\\ud800ei' holds a lone surrogate")]
    for cons, msg in bad:
        with pytest.raises((TypeError, ValueError), match=msg):
            eng.generate("the fox", constraints=cons, **kw)
    with pytest.raises(ValueError, match="the prompt holds a lone surrogate"):
        eng.generate("Open the \udcff file.", **kw)
    with pytest.raises(ValueError, match="the target prefix holds a lone surrogate"):
        eng.generate("the fox", target_prefix="a\ud800", **kw)
    # "after" names the caller's index: the no_other_spans item before it is no constraint of its own
    c = parse([{"no_other_spans": []}, {"text": "<b>"}, {"text": "</b>", "after": 1}], eng.prefix_ids, eng._decode)
    assert c.after == [None, 0]


def test_a_target_prefix_counts_for_the_constraints(engines):
    """Issue 50 row 6: a target prefix that already held a glossary term got the term forced a second time (a
    degenerate tail), and a prefix with a copied span got it doubled: constraints counted only the tokens after
    the prefix. The output includes the prefix, so its tokens count: a constraint it meets changes nothing."""
    eng = engines["plain"]
    kw = dict(num_beams=4, max_new_tokens=10)
    prompt, prefix = PROMPTS[0], [40, 41, 42]
    [free] = eng.generate(prompt, target_prefix=prefix, **kw)
    assert not contains(free.hypotheses[0].tokens[3:], [41])
    [met] = eng.generate(prompt, target_prefix=prefix, constraints=[[41], [41, 42]], **kw)
    assert met.hypotheses[0].constraints_met is True
    assert_same_hypotheses(met, free)
    c = parse([{"phrase": [41], "count": 1, "exact": True}], eng.prefix_ids, eng._decode)
    [exact] = eng.generate(prompt, target_prefix=prefix, constraints=[{"phrase": [41], "exact": True}], **kw)
    assert not contains(exact.hypotheses[0].tokens[3:], [41]) and c.exact == [True]
