"""Speculative beam search == plain beam search on the same graph, for any draft and drafter."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specbeam_edge import Engine, SpeculativeConfig
from helpers import assert_same_hypotheses, plain, run_drafter, speculative_equals_plain

PROMPTS = [[3, 17, 33, 8, 99, 41, 7], [250, 12, 9, 77]]
MAX_NEW = 16


@pytest.fixture(scope="module")
def engines(exported):
    target = exported("llama", std=0.3, seed=3)
    same = Engine(target, draft=target)
    # an unrelated random draft: different seed, 1 layer, same vocabulary
    other = Engine(target, draft=exported("llama", std=0.3, seed=11, layers=1))
    return {"same": same, "random": other}


SPECS = [SpeculativeConfig(adaptive=False, drafter="beam", budget=8, max_depth=2),
         SpeculativeConfig(adaptive=False, drafter="beam", budget=32, max_depth=5, max_branch_width=3),
         SpeculativeConfig(adaptive=False, drafter="best_first", budget=12, max_depth=4),
         SpeculativeConfig(adaptive=False, drafter="best_first", budget=48, max_depth=8, max_branch_width=2),
         SpeculativeConfig(adaptive=False, drafter="beam", budget=32, max_depth=5, min_path_prob=0.2),
         SpeculativeConfig(adaptive=False, drafter="best_first", budget=24, max_depth=6, min_path_prob=0.1)]


@pytest.mark.parametrize("draft", ["same", "random"])
@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.drafter}-{s.budget}")
def test_speculative_equals_plain(engines, draft, K, spec):
    eng = engines[draft]
    for prompt in PROMPTS:
        if spec.budget < K:
            continue
        ref, fast = speculative_equals_plain(eng, prompt, spec, num_beams=K, max_new_tokens=MAX_NEW,
                                             num_return_sequences=K)
        assert ref.stats.beam_steps_per_pass == 1.0
        assert fast.stats.beam_steps == ref.stats.beam_steps
        if draft == "same" and spec.drafter == "beam" and spec.min_path_prob == 0 and spec.budget >= K:
            # the draft's own beams are the target's next beams: every pass covers several steps
            assert fast.stats.beam_steps_per_pass > 1.5, fast.stats.beam_steps_per_pass


@pytest.mark.parametrize("drafter", ["beam", "best_first"])
def test_min_path_prob_stops_where_the_draft_is_unsure(engines, drafter):
    """A confidence threshold drafts fewer nodes and passes (it stops branches the draft is unsure of) and
    changes nothing in the output."""
    eng = engines["random"]
    runs = {}
    for tau in (0.0, 0.5):
        spec = SpeculativeConfig(drafter=drafter, budget=32, max_depth=6, min_path_prob=tau, adaptive=False)
        [runs[tau]] = eng.generate(PROMPTS[0], num_beams=2, max_new_tokens=MAX_NEW, speculative=spec)
    loose, tight = runs[0.0].stats, runs[0.5].stats
    assert tight.draft_tokens_proposed < loose.draft_tokens_proposed, (tight, loose)
    assert tight.draft_passes < loose.draft_passes
    assert_same_hypotheses(runs[0.0], runs[0.5], scores=False)
    with pytest.raises(ValueError, match="min_path_prob"):
        SpeculativeConfig(adaptive=False, min_path_prob=1.0)


@pytest.mark.parametrize("K", [1, 2, 4, 8])
@pytest.mark.parametrize("wide", [False, True])
def test_steps_per_pass_reach_depth_when_draft_is_target(engines, K, wide):
    """An oracle draft: every level is accepted, whether the draft's width is K or wider (the extra children
    must not push the draft's own K beams out; a beam scored in an earlier pass must still be expanded)."""
    spec = SpeculativeConfig(drafter="beam", budget=128, max_depth=4, draft_width=2 * K if wide else K, adaptive=False)
    [fast] = engines["same"].generate(PROMPTS[0], num_beams=K, max_new_tokens=60, min_new_tokens=60,
                                      speculative=spec)
    # each pass: 1 step on the beams' own scores + up to max_depth covered levels
    assert fast.stats.beam_steps_per_pass >= 0.9 * (spec.max_depth + 1), fast.stats


def test_stats_fields(engines):
    spec = SpeculativeConfig(adaptive=False, budget=16, max_depth=3)
    [r] = engines["random"].generate(PROMPTS[0], num_beams=2, max_new_tokens=8, speculative=spec)
    s = r.stats
    assert s.target_passes >= 1 and s.draft_passes >= 1 and s.draft_tokens_proposed >= s.draft_tokens_accepted
    # the timing fields are each other's (they asserted only > 0): the first token inside the request's time, the
    # rate the answer's tokens over that time, the peak at least what the process holds now
    assert 0 < s.time_to_first_token <= s.seconds
    assert s.tokens_per_second == pytest.approx(s.generated_tokens / s.seconds) and s.generated_tokens > 0
    rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
    assert s.peak_memory_mb >= 0.5 * rss
    assert s.generated_tokens == s.beam_steps
    # one step per pass comes from the target's own scores; every other step was covered by the draft tree
    assert len(s.from_draft) == s.beam_steps and s.from_draft.count(False) == s.target_passes


def test_auto_budget_from_cost_curve(exported):
    """budget="auto": the largest tree whose pass costs at most auto_slack times a pass over the beams alone, read
    off the engine's cost curve (measured once per engine); a request with it drafts that tree, exactly as one
    naming the same budget, and gives plain search's output."""
    from specbeam_edge.decoding.adaptive import auto_budget

    cpu = {1: 1.0, 2: 1.0, 4: 1.1, 8: 1.5, 16: 2.0, 32: 4.0, 64: 8.0}            # a CPU-like curve
    assert auto_budget(cpu, 1, slack=1.6) == 8 and auto_budget(cpu, 4, slack=2.0) == 16
    assert auto_budget({q: 1.0 for q in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)}, 4) == 1024   # streamed
    assert auto_budget({1: 1.0, 2: 5.0}, 2) == 2                                 # never fewer nodes than beams
    # an engine of its own: the measured curve stays with it
    eng = Engine(exported("llama", std=0.3, seed=3), draft=exported("llama", std=0.3, seed=11, layers=1))
    curve = eng.cost_curve(sizes=(1, 2, 4, 8), reps=1)
    assert set(curve) == {1, 2, 4, 8} and all(t > 0 for t in curve.values())
    auto_spec = SpeculativeConfig(adaptive=False, budget="auto")
    budget = eng.auto_budget(2, slack=auto_spec.auto_slack)
    kw = dict(num_beams=2, max_new_tokens=MAX_NEW)
    [ref] = plain(eng, PROMPTS[0], **kw)
    [auto] = eng.generate(PROMPTS[0], speculative=auto_spec, **kw)
    [named] = eng.generate(PROMPTS[0], speculative=SpeculativeConfig(adaptive=False, budget=budget), **kw)
    assert_same_hypotheses(auto, ref, scores=False)
    assert_same_hypotheses(auto, named, atol=0)
    assert (auto.stats.target_passes, auto.stats.draft_tokens_proposed) == \
        (named.stats.target_passes, named.stats.draft_tokens_proposed) and auto.stats.draft_tokens_proposed > 0


@pytest.mark.parametrize("K", [1, 2, 4])
def test_prompt_lookup_needs_no_draft_and_is_exact(exported, K):
    eng = Engine(exported("llama", std=0.3, seed=3))          # no draft model at all
    spec = SpeculativeConfig(adaptive=False, drafter="lookup", budget=32, max_depth=6)
    prompt = [3, 17, 33, 8, 99, 41, 7, 3, 17, 33, 8]            # repeats itself: lookups have material
    [ref] = plain(eng, prompt, num_beams=K, max_new_tokens=24)
    [fast] = eng.generate(prompt, num_beams=K, max_new_tokens=24, speculative=spec)
    assert_same_hypotheses(fast, ref, scores=False)
    assert fast.stats.draft_passes == 0 and fast.stats.draft_tokens_proposed > 0
    with pytest.raises(ValueError, match="drafter='sample'"):
        eng.generate(prompt, num_beams=2, do_sample=True, speculative=SpeculativeConfig(adaptive=False, drafter="lookup"))


def test_pass_chooser_tries_both_then_keeps_the_faster_and_probes():
    from specbeam_edge.generate import PassChooser

    ch = PassChooser(warmup=2, probe_every=4, max_interval=16)
    seen = []
    for _ in range(80):
        arm = ch.choose()
        seen.append(arm)
        ch.update(arm, seconds=3.0 if arm else 1.0, steps=1)    # speculating is 3x slower per step here
    assert seen[:4] == [False, False, True, True]                 # plain first, then the tree
    probes = [i for i, arm in enumerate(seen) if arm and i >= 4]
    assert len(probes) >= 3                                      # speculation is still probed now and then
    gaps = np.diff(probes)
    assert list(gaps) == sorted(gaps) and gaps[-1] == 16         # each confirming probe doubles the interval
    # when speculation becomes the faster choice, a probe notices and the chooser switches
    for _ in range(40):
        arm = ch.choose()
        ch.update(arm, seconds=0.2 if arm else 1.0, steps=1)
    assert ch.choose() is True


def test_pass_chooser_rates_a_tree_by_its_seconds_over_its_steps():
    """A tree pass that costs 1.5 plain passes and gives 1 or 3 steps (2 on average: 0.75 s a step) beats plain
    search (1 s a step). Averaging each pass's seconds / steps instead (1.5 and 0.5: 1.0) called it a tie and
    kept plain search on half the passes (found with SmolLM2-135M's lookahead head)."""
    from specbeam_edge.decoding.adaptive import PassChooser

    ch = PassChooser(warmup=2, probe_every=4, max_interval=16, smoothing=0.25)
    steps = iter([3, 1] * 200)
    seen = []
    for _ in range(200):
        arm = ch.choose()
        seen.append(arm)
        ch.update(arm, seconds=1.5 if arm else 1.0, steps=next(steps) if arm else 1)
    assert ch.rate[True] < ch.rate[False]
    assert sum(seen[20:]) >= 0.9 * len(seen[20:])


@pytest.mark.parametrize("probe_len", [1, 4])
def test_pass_chooser_probes_of_several_passes_see_a_tree_whose_steps_vary(probe_len):
    """A tree pass costs 1.5 plain passes and gives 3 steps or 1, every other pass (0.75 s a step against plain's
    1): after a stretch where it gave 1 step, a chooser whose probe is one pass can keep landing on the 1-step
    passes and stay with plain search (it did here: 6% of the last passes speculated); probes of 4 passes average
    the two kinds and return to the tree (the engine's setting for the lookahead head)."""
    from specbeam_edge.decoding.adaptive import PassChooser

    ch = PassChooser(warmup=2, probe_every=4, max_interval=16, probe_len=probe_len)

    def run(n, steps_of):
        seen = []
        for _ in range(n):
            arm = ch.choose()
            seen.append(arm)
            ch.update(arm, seconds=1.5 if arm else 1.0, steps=steps_of(ch.passes) if arm else 1)
        return seen
    alternating = lambda p: 3 if p % 2 == 0 else 1       # noqa: E731
    run(40, alternating)
    run(30, lambda p: 1)
    back = sum(run(200, alternating)[-50:]) / 50
    assert (back >= 0.8) if probe_len == 4 else (back < 0.2)


def test_pass_chooser_stops_trying_a_tree_that_cannot_pay():
    """A tree pass slower per step than plain search even with every drafted level accepted (its best case) ends
    speculation's warm-up at once and is probed only every hopeless_every passes; a tree that could pay is not
    judged by its best case."""
    from specbeam_edge.generate import PassChooser

    ch = PassChooser(warmup=3, probe_every=4, max_interval=16, hopeless_every=32)
    seen = []
    for _ in range(100):
        arm = ch.choose()
        seen.append(arm)
        # a pass over a 3-level tree costs 5 plain steps; 1 step accepted: best case 5/4 > 1 per step
        ch.update(arm, seconds=5.0 if arm else 1.0, steps=2 if arm else 1, max_steps=4 if arm else None)
    # the first tree pass after plain ones (the draft's catch-up) is not judged by its best case, the second is
    assert seen[:5] == [False, False, False, True, True] and seen[5] is False and ch.cannot_pay()
    tried = [i for i, arm in enumerate(seen) if arm]
    assert tried[:2] == [3, 4] and tried[2:]                                  # then only long-interval probes
    assert all(b - a >= 32 for a, b in zip(tried[1:], tried[2:]))
    ok = PassChooser(warmup=3, probe_every=4, max_interval=16, hopeless_every=32)
    for _ in range(6):                  # best case 3/4 per step beats plain: the warm-up runs its course
        arm = ok.choose()
        ok.update(arm, seconds=3.0 if arm else 1.0, steps=1, max_steps=4 if arm else None)
    assert ok.count == {True: 3, False: 3} and not ok.cannot_pay()
    empty = PassChooser(warmup=3, probe_every=4, max_interval=16, hopeless_every=32)
    for _ in range(6):                  # tree passes that drafted nothing report no best case
        arm = empty.choose()
        empty.update(arm, seconds=1.5 if arm else 1.0, steps=1)
    assert empty.count == {True: 3, False: 3} and not empty.cannot_pay()


def _requests(ch, n_requests, passes, tree_cost, tree_steps=2, catch_up_cost=3.0):
    """Simulated requests of `passes` passes each (the engine's order: new_request at a request's second pass):
    a plain pass costs 1 s for 1 step, a tree pass `tree_cost` s for `tree_steps` steps, plus `catch_up_cost` s
    when it follows plain passes (the draft model runs over the tokens it sat out). The choices, per request."""
    out, last = [], False
    for _ in range(n_requests):
        seen = []
        for p in range(passes):
            if p == 1:
                ch.new_request()
            arm = ch.choose()
            cost = tree_cost + (catch_up_cost if not last else 0.0) if arm else 1.0
            ch.update(arm, seconds=cost, steps=tree_steps if arm else 1)
            seen.append(arm)
            last = arm
        out.append(seen)
    return out


@pytest.mark.parametrize("catch_up", [True, False])
def test_pass_chooser_leaves_a_draft_models_catch_up_out(catch_up):
    """The coder pair's defect: after requests where plain search won, a probe of the tree was one pass that
    also paid the draft's catch-up over the tokens it sat out, so the tree always lost its probes and the
    chooser stopped drafting for good (1.02x over 16 prompts, where every prompt it drafted on ran 1.5-1.8x).
    With catch_up the switching pass is not a sample: a tree that now pays (0.75 s a step against 1) is taken
    again within the next request; without it (planted) the tree is never taken again."""
    from specbeam_edge.decoding.adaptive import PassChooser

    ch = PassChooser(warmup=3, probe_every=16, max_interval=512, catch_up=catch_up)
    _requests(ch, 4, 128, tree_cost=4.0)              # the tree loses: 2 s a step
    assert ch.best() is False
    later = _requests(ch, 2, 128, tree_cost=1.5)      # now it pays: 0.75 s a step
    share = sum(later[1]) / len(later[1])
    assert (share > 0.8) if catch_up else (share < 0.1), (share, ch.rate)


def test_pass_chooser_probes_each_request_but_not_each_request_of_a_batch():
    """A request's start asks for a probe of the losing choice two passes in (any drafter: the coder pair's
    draft model was probed only at the doubling interval, up to 512 passes, so its tree was not tried on the
    next prompts); requests starting together (a batch) share one such probe per probe_every passes."""
    from specbeam_edge.decoding.adaptive import PassChooser

    ch = PassChooser(warmup=2, probe_every=8, max_interval=512)
    for _ in range(600):                      # the tree loses everywhere: the interval grows to 512
        arm = ch.choose()
        ch.update(arm, seconds=3.0 if arm else 1.0, steps=1)
    assert ch.interval == 512
    ch.new_request()
    assert [ch.choose() for _ in range(3)][1] is True       # probed at the request's second pass
    ch.update(True, seconds=3.0, steps=1)
    start = ch.passes
    for _ in range(4):                        # four more requests start within probe_every passes
        ch.new_request()
    assert ch.next_probe - start >= 8, (ch.next_probe, start)
    # a draft model's chooser probes each request once but keeps its long interval (a probe costs two tree passes)
    draft = PassChooser(warmup=2, probe_every=8, max_interval=512, catch_up=True)
    last = False
    for _ in range(600):
        arm = draft.choose()
        draft.update(arm, seconds=(3.0 + (0 if last else 2.0)) if arm else 1.0, steps=1)
        last = arm
    interval = draft.interval
    draft.new_request()
    seen = [draft.choose() for _ in range(3)]
    assert seen[1] is True and draft.interval == interval == 512


def test_a_draft_models_chooser_probes_a_request_only_while_the_tree_loses():
    """The chosen arm is measured on every pass, so only a losing tree goes stale: a streamed target, where every
    plain pass costs a whole read of the weights, is not probed with plain search at each request (it was: 28 of
    142 passes at K=4). Where plain search is the choice, each request still probes the tree."""
    from specbeam_edge.decoding.adaptive import PassChooser

    wins = PassChooser(warmup=2, probe_every=8, max_interval=512, catch_up=True)
    loses = PassChooser(warmup=2, probe_every=8, max_interval=512, catch_up=True)
    # each request's choices, after the warm-up's requests
    seen = {name: _requests(ch, 6, 128, tree_cost=tree_cost, tree_steps=3, catch_up_cost=1.0)[2:]
            for name, ch, tree_cost in (("wins", wins, 1.0), ("loses", loses, 6.0))}
    plain = {name: [s.count(False) for s in requests] for name, requests in seen.items()}
    loses_seen = seen["loses"]
    assert wins.best() is True and loses.best() is False
    assert sum(plain["wins"]) <= 2, plain       # no plain probe per request, only the interval's (it was 1 each)
    assert all(n <= 126 for n in plain["loses"]), plain       # the tree is tried on every request,
    assert all(True in s[:4] for s in loses_seen), loses_seen   # at its start (its probe, two passes in)


def test_draft_model_searches_start_each_request_with_the_chooser(engines, monkeypatch):
    """ExactSearch tells its chooser of every request, a draft model's as a lookahead head's (was: the head's
    only)."""
    from specbeam_edge.decoding.adaptive import PassChooser

    starts = []
    real = PassChooser.new_request
    monkeypatch.setattr(PassChooser, "new_request", lambda self, after=2: (starts.append(self), real(self, after)))
    spec = SpeculativeConfig(budget=8, max_depth=3, adaptive=True)
    for prompt in PROMPTS:
        engines["same"].generate(prompt, num_beams=2, max_new_tokens=12, speculative=spec)
    assert len(starts) == len(PROMPTS) and starts[0].catch_up


def test_tree_passes_report_their_best_case(engines, monkeypatch):
    """ExactSearch tells the chooser each tree pass's best case: drafted depth + 1 steps (at least the steps it
    gave, at most max_depth + 1), and none when the drafter proposed nothing (prompt lookup without a match)."""
    from specbeam_edge.decoding.adaptive import PassChooser

    calls = []
    real = PassChooser.update

    def spy(self, speculated, seconds, steps, max_steps=None):
        calls.append((speculated, steps, max_steps))
        return real(self, speculated, seconds, steps, max_steps)
    monkeypatch.setattr(PassChooser, "update", spy)
    eng = engines["same"]
    eng.generate(PROMPTS[0], num_beams=2, max_new_tokens=24,
                 speculative=SpeculativeConfig(budget=16, max_depth=3, adaptive=True))
    trees = [(s, m) for spec, s, m in calls if spec]
    assert trees and all(m is not None and s <= m <= 4 for s, m in trees)
    assert all(m is None for spec, _, m in calls if not spec)
    calls.clear()
    from specbeam_edge.decoding.draft import PromptLookupDrafter
    def no_match(self, dcache, roots, scores, budget):
        yield from ()
        return []
    monkeypatch.setattr(PromptLookupDrafter, "__call__", no_match)
    eng.generate(PROMPTS[0], num_beams=1, max_new_tokens=16,
                 speculative=SpeculativeConfig(drafter="lookup", budget=8, max_depth=3, adaptive=True))
    assert any(spec for spec, _, _ in calls) and all(m is None for spec, _, m in calls if spec)


@pytest.mark.parametrize("draft", ["same", "random"])
def test_adaptive_speculation_equals_plain(engines, draft, monkeypatch):
    """Adaptive passes mix tree passes and plain passes (the draft cache catches up after plain ones); the
    output is plain beam search's whatever the mix, and the mix is reported: each request's plain_passes are
    the passes its chooser said not to draft, and its other passes are tree passes."""
    from specbeam_edge.decoding.adaptive import PassChooser

    choices = []                         # the chooser's answers, one per target pass of the current request
    real = PassChooser.choose

    def spy(self, pass_id=None):
        choice = real(self, pass_id)
        choices.append(choice)
        return choice
    monkeypatch.setattr(PassChooser, "choose", spy)
    eng = engines[draft]
    spec = SpeculativeConfig(budget=16, max_depth=3, adaptive=True)
    seen = []
    for K in (1, 3):
        for prompt in PROMPTS:
            [ref] = plain(eng, prompt, num_beams=K, max_new_tokens=24)
            choices.clear()
            [fast] = eng.generate(prompt, num_beams=K, max_new_tokens=24, speculative=spec)
            assert_same_hypotheses(fast, ref, scores=False)
            s = fast.stats
            # the prompt's pass drafts no tree (its first text waits for the target's prefill alone), then one choice
            # per target pass; plain_passes counts the passes without a tree, the rest drafted one
            assert len(choices) == s.target_passes - 1, (choices, s)
            assert s.plain_passes == choices.count(False) + 1, (choices, s)
            assert s.target_passes - s.plain_passes == choices.count(True)
            assert not s.from_draft[0], "the prompt's pass drafted a tree"
            # tree passes draft; a request of plain passes only drafts nothing and takes one step per pass
            if True in choices:
                assert s.draft_passes > 0 and s.draft_tokens_proposed > 0, (choices, s)
            else:
                assert s.draft_passes == s.draft_tokens_proposed == 0 and not any(s.from_draft), (choices, s)
            seen += choices
    # both kinds happened (the chooser's warm-up measures plain passes first, then the tree at least once: no
    # timing decides that), so the checks above saw a mix
    assert seen.count(True) >= 1 and seen.count(False) >= 3, seen
    # the choosers are kept per setting on the engine; after these requests both choices were measured (the
    # tree at least once: its warm-up ends early when its best case is slower than plain, which timing decides)
    chooser = eng._choosers[(3, 1.0, SpeculativeConfig(adaptive=False, budget=16, max_depth=3))].at(1)   # one request at a time
    assert chooser.count[True] >= 1 and chooser.count[False] >= 3


@pytest.mark.parametrize("draft", ["same", "random"])
@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("drafter", ["beam", "best_first"])
def test_merged_lookup_tree_equals_plain(engines, draft, K, drafter, monkeypatch):
    """Draft model and prompt lookup in one tree: exact, and lookup nodes are in it (the prompt repeats
    itself, so lookup has material): every node prompt lookup proposed is among the nodes the merged drafter
    hands the search, which counts them all in draft_tokens_proposed."""
    from specbeam_edge.decoding.draft import MergedDrafter, PromptLookupDrafter

    looked, merged = [], []          # per drafting pass: prompt lookup's nodes, the merged tree's nodes
    real_lookup, real_merged = PromptLookupDrafter.__call__, MergedDrafter.__call__

    def spy_lookup(self, dcache, roots, scores, budget):
        nodes = yield from real_lookup(self, dcache, roots, scores, budget)
        looked.append(list(nodes))
        return nodes

    def spy_merged(self, dcache, roots, scores, budget):
        nodes = yield from real_merged(self, dcache, roots, scores, budget)
        merged.append(list(nodes))
        return nodes
    monkeypatch.setattr(PromptLookupDrafter, "__call__", spy_lookup)
    monkeypatch.setattr(MergedDrafter, "__call__", spy_merged)
    eng = engines[draft]
    prompt = [3, 17, 33, 8, 99, 41, 7, 3, 17, 33, 8]
    spec = SpeculativeConfig(adaptive=False, drafter=drafter, budget=24, max_depth=4, with_lookup=True)
    [ref] = plain(eng, prompt, num_beams=K, max_new_tokens=20, num_return_sequences=K)
    [fast] = eng.generate(prompt, num_beams=K, max_new_tokens=20, num_return_sequences=K, speculative=spec)
    assert_same_hypotheses(fast, ref, scores=False)
    assert len(looked) == len(merged) == fast.stats.target_passes     # one merged tree per pass (no adaptivity)
    assert sum(map(len, looked)) > 0, looked                           # lookup found spans to propose
    assert all(set(lk) <= set(m) for lk, m in zip(looked, merged)), (looked, merged)
    assert fast.stats.draft_tokens_proposed == sum(map(len, merged))
    # without with_lookup prompt lookup proposes nothing: the lookup nodes above are there by the merge
    looked.clear()
    [model_only] = eng.generate(prompt, num_beams=K, max_new_tokens=20,
                                speculative=SpeculativeConfig(adaptive=False, drafter=drafter, budget=24, max_depth=4))
    assert looked == [] and model_only.stats.draft_passes > 0


def test_merged_drafter_splits_the_budget_by_measured_acceptance():
    from specbeam_edge.decoding.draft import MergedDrafter
    from specbeam_edge.decoding.tree import TokenTree

    class Fixed:
        """A drafter proposing given chains below the first root, within its budget (needs no pass, as prompt
        lookup)."""
        def __init__(self, chains):
            self.chains, self.budgets = chains, []

        def __call__(self, dcache, roots, scores, budget):
            yield from ()
            self.budgets.append(budget)
            out = []
            for chain in self.chains:
                node = roots[0]
                for t in chain[:budget]:
                    node = dcache.tree.add(node, t)
                    out.append(node)
            return out

    class View:
        tree = TokenTree()

    tree = View.tree
    root = tree.add_chain([1, 2, 3])[-1]
    lookup, model = Fixed([[7, 8, 9]]), Fixed([[5, 6]])
    merged = MergedDrafter(model, lookup, num_beams=2)
    share0 = merged.share()
    nodes = run_drafter(merged(View, [root], [0.0], 16))
    assert [tree.tokens[n] for n in nodes] == [7, 8, 9, 5, 6]          # lookup's chain, then the model's
    assert lookup.budgets[-1] + model.budgets[-1] == 16 and model.budgets[-1] >= 2
    # the target kept two levels of lookup's chain and none of the model's: lookup's share grows
    new_root = tree.add(tree.add(root, 7), 8)
    run_drafter(merged(View, [new_root, new_root], [0.0, -1.0], 16))
    assert merged.counts["lookup"] == [3.0, 5.0] and merged.counts["model"] == [1.0, 4.0]
    assert merged.share() > share0 and lookup.budgets[-1] > 8
    with pytest.raises(ValueError, match="with_lookup"):
        SpeculativeConfig(adaptive=False, drafter="lookup", with_lookup=True)


def test_default_draft_width_spends_the_budget_on_width_for_several_beams():
    """K > 1: a level is accepted only when it holds all K next beams, so the default tree is 4K wide (at least two
    levels deep) instead of K wide and max_depth deep; K = 1 keeps max_branch_width children per level."""
    from specbeam_edge.decoding.draft import DraftBeamSearch

    def width(K, budget=48, **kw):
        return DraftBeamSearch(SpeculativeConfig(budget=budget, **kw), K, [0], 512).width(budget)

    assert [width(K) for K in (1, 2, 4, 8)] == [4, 8, 16, 24]
    assert width(4, budget=8) == 4 and width(1, budget=2) == 4        # never below K or max_branch_width
    assert width(4, draft_width=5) == 5 and width(2, max_branch_width=6) == 8


def test_default_budget_deepens_K4_and_leaves_K1_K2_trees_alone():
    """The default budget (80) gives K = 4 five levels of 16 nodes (48 gave three); K = 1 and 2 stay bound by
    max_depth (4 x 6 and 8 x 6 nodes), so their trees are those of budget 48."""
    from specbeam_edge.decoding.draft import default_width

    spec = SpeculativeConfig(adaptive=False)

    def tree(K, budget):                      # (nodes a level, levels) of the default tree
        W = default_width(K, spec.max_branch_width, budget)
        return W, min(spec.max_depth, budget // W)

    assert {K: tree(K, spec.budget) for K in (1, 2, 4, 8)} == {1: (4, 6), 2: (8, 6), 4: (16, 5), 8: (32, 2)}
    assert all(tree(K, 48) == tree(K, spec.budget) for K in (1, 2))


def test_default_tree_at_K4_is_exact_and_uses_its_width(engines):
    spec = SpeculativeConfig(budget=48, max_depth=6, adaptive=False)
    [ref] = plain(engines["random"], PROMPTS[0], num_beams=4, max_new_tokens=MAX_NEW)
    [fast] = engines["random"].generate(PROMPTS[0], num_beams=4, max_new_tokens=MAX_NEW, speculative=spec)
    assert_same_hypotheses(fast, ref, scores=False)
    # 16 nodes per level, three levels: 48 per pass (a pass near the end may stop early at the length limit)
    assert fast.stats.draft_tokens_proposed > 24 * fast.stats.target_passes


def _reference_level(nodes, pred, top, cum, path, eos, K, take, min_lp):
    """The level selection as list comprehensions (what draft.level_picks replaced)."""
    order = [i for i in np.argsort(-cum, axis=None, kind="stable") if int(top.flat[i]) not in eos]
    from_pred = [i for i in order if nodes[i // top.shape[1]] in pred][:min(K, take)]
    if min_lp > -math.inf and (not from_pred or max(path.flat[i] for i in from_pred) < min_lp):
        return None
    chosen = set(from_pred)
    others = [i for i in order if i not in chosen and path.flat[i] >= min_lp]
    return from_pred + others[:take - len(from_pred)], len(from_pred)


@settings(max_examples=200, deadline=None)
@given(F=st.integers(1, 12), w=st.integers(1, 8), K=st.integers(1, 6), take=st.integers(1, 40),
       min_p=st.sampled_from([0.0, 0.05, 0.3]), n_eos=st.integers(0, 2), coarse=st.booleans(),
       seed=st.integers(0, 10 ** 6))
def test_level_picks_equal_the_list_reference(F, w, K, take, min_p, n_eos, coarse, seed):
    """draft.level_picks (array work) picks the same children in the same order as the list comprehensions it
    replaced, ties (coarse scores), EOS children and min_path_prob included."""
    from specbeam_edge.decoding.draft import level_picks

    rng = np.random.default_rng(seed)
    nodes = list(range(100, 100 + F))
    pred = set(rng.choice(nodes, size=rng.integers(1, F + 1), replace=False).tolist())
    top = rng.integers(0, 12, size=(F, w))
    lps = np.log(rng.dirichlet(np.ones(w), size=F)).astype(np.float32)
    if coarse:
        lps = np.round(lps)
    cum = rng.standard_normal(F)[:, None] + lps
    path = rng.uniform(-1, 0, F)[:, None] + lps
    eos = list(range(n_eos))
    min_lp = math.log(min_p) if min_p > 0 else -math.inf
    ref = _reference_level(nodes, pred, top, cum, path, set(eos), K, take, min_lp)
    got = level_picks(np.array([n in pred for n in nodes]), top, cum, path, np.array(eos, np.int64), K, take, min_lp)
    if ref is None:
        assert got is None
    else:
        assert got is not None and got[0].tolist() == ref[0] and got[1] == ref[1]


def test_a_loaded_draft_drafts_by_default_as_the_tools_do(exported):
    """Engine(target, draft=...) with no speculative settings speculates adaptively, as `specbeam generate` does
    (a request's first tree passes are the chooser's warm-up: no timing decides that they run), and its output is
    plain search's; speculative=None runs plain. The draft is the target, so every tree pass pays."""
    target = exported("llama", std=0.3, seed=3)
    eng = Engine(target, draft=target)          # its own: choosers learnt in other tests do not carry over
    for K in (1, 3):
        [ref] = plain(eng, PROMPTS[0], num_beams=K, max_new_tokens=24)
        [default] = eng.generate(PROMPTS[0], num_beams=K, max_new_tokens=24)
        assert_same_hypotheses(default, ref, scores=False)
        assert ref.stats.beam_steps_per_pass == 1.0
        assert default.stats.draft_passes > 0 and default.stats.beam_steps_per_pass > 1, default.stats
    [sampled] = eng.generate(PROMPTS[0], num_beams=2, do_sample=True, seed=1, max_new_tokens=8)
    assert sampled.stats.draft_passes > 0          # sampling drafts with the 'sample' drafter
    with pytest.raises(TypeError, match="speculative must be a SpeculativeConfig.*'default'"):
        eng.generate(PROMPTS[0], speculative="fast")
