"""Batched decoding: every request's output in a batch equals its output alone (sequences, and scores to 1e-5),
whatever shares its passes, in whatever order requests arrive and whatever the batch limits."""
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specbeam_edge.execution.batch import score_one
from specbeam_edge import Engine, SpeculativeConfig
from specbeam_edge.decoding.scheduler import Scheduler
from helpers import assert_same_hypotheses, plain

RNG = np.random.default_rng(7)
# prompts of mixed lengths (3..40 tokens)
PROMPTS = [RNG.integers(1, 300, int(n)).tolist() for n in (3, 11, 40, 7, 25, 5, 17, 9)]
MAX_NEW = 14


@pytest.fixture(scope="module")
def models(exported):
    return {"target": exported("llama", std=0.3, seed=3), "draft": exported("llama", std=0.3, seed=11, layers=1),
            "topk": exported("llama", output="topk", std=0.3, seed=3),
            "split": exported("llama", "fp32", "split", std=0.3, seed=3)}


@pytest.fixture(scope="module")
def engine(models):
    return Engine(models["target"], draft=models["draft"])


def alone(eng, prompts, **kw):
    return [eng.generate(p, **kw)[0] for p in prompts]


SPECS = {"plain": None, "beam": SpeculativeConfig(drafter="beam", budget=16, max_depth=4, adaptive=False),
         "best_first": SpeculativeConfig(drafter="best_first", budget=24, max_depth=5, adaptive=False),
         "lookup": SpeculativeConfig(drafter="lookup", budget=16, max_depth=4, adaptive=False)}


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("mode", list(SPECS))
def test_batched_equals_alone(engine, K, mode):
    kw = dict(num_beams=K, max_new_tokens=MAX_NEW, num_return_sequences=K, speculative=SPECS[mode])
    ref = alone(engine, PROMPTS, **kw)
    got = engine.generate(PROMPTS, max_batch_size=8, **kw)
    for a, b in zip(ref, got):
        assert_same_hypotheses(a, b)
    # they really shared passes
    assert max(max(r.stats.batch_sizes) for r in got) > 1


def test_eos_hits_and_min_new_tokens_batched(models):
    eng = Engine(models["target"], draft=models["target"])
    eos = list(range(1, 300, 9))       # many EOS ids, so requests of one batch end at different steps
    for extra in ({}, {"min_new_tokens": 6}):
        kw = dict(num_beams=3, max_new_tokens=MAX_NEW, num_return_sequences=2, eos_token_id=eos, **extra)
        for spec in (None, SPECS["beam"]):
            ref = alone(eng, PROMPTS, speculative=spec, **kw)
            got = eng.generate(PROMPTS, max_batch_size=4, speculative=spec, **kw)
            for a, b in zip(ref, got):
                assert_same_hypotheses(a, b)
    lengths = {len(r.hypotheses[0].tokens) for r in ref}
    assert len(lengths) > 1, "requests of one batch should finish at different steps"


def test_topk_head_batched(models):
    eng = Engine(models["topk"], draft=models["draft"])
    for spec in (None, SPECS["beam"]):
        kw = dict(num_beams=4, max_new_tokens=MAX_NEW, speculative=spec)
        for a, b in zip(alone(eng, PROMPTS, **kw), eng.generate(PROMPTS, max_batch_size=8, **kw)):
            assert_same_hypotheses(a, b)


def test_streamed_target_batched(models):
    ref = Engine(models["target"], draft=models["draft"])
    eng = Engine(models["split"], draft=models["draft"], placement=["disk", "host"])
    for spec in (None, SPECS["beam"]):
        kw = dict(num_beams=2, max_new_tokens=MAX_NEW, speculative=spec)
        for a, b in zip(alone(ref, PROMPTS, **kw), eng.generate(PROMPTS, max_batch_size=8, **kw)):
            assert_same_hypotheses(a, b)


def test_beam_sampling_batched_is_seeded_per_request(engine):
    for spec in (None, SpeculativeConfig(adaptive=False, drafter="sample", max_depth=3, draft_width=3)):
        kw = dict(num_beams=2, max_new_tokens=MAX_NEW, do_sample=True, seed=1234, speculative=spec)
        for a, b in zip(alone(engine, PROMPTS, **kw), engine.generate(PROMPTS, max_batch_size=8, **kw)):
            assert_same_hypotheses(a, b)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(order=st.permutations(range(len(PROMPTS))), size=st.integers(1, 5),
       tokens=st.one_of(st.none(), st.integers(10, 80)))
def test_arrival_order_and_limits_do_not_change_outputs(engine, order, size, tokens):
    kw = dict(num_beams=2, max_new_tokens=8, speculative=SPECS["beam"])
    ref = {i: r for i, r in enumerate(engine.generate(PROMPTS, max_batch_size=1, **kw))}
    prompts = [PROMPTS[i] for i in order]
    seen = []
    for j, r in engine.generate_iter(prompts, max_batch_size=size, max_batch_tokens=tokens, **kw):
        seen.append(j)
        assert_same_hypotheses(ref[order[j]], r)
        assert max(r.stats.batch_sizes) <= size
    assert sorted(seen) == list(range(len(prompts)))


def test_batch_limits_hold(engine):
    """max_batch_size and max_batch_tokens bound what is in flight (a request over the token limit runs alone)."""
    from specbeam_edge.config import GenerationConfig
    from specbeam_edge.decoding.protocol import Job
    from specbeam_edge.search_setup import Request

    gen = GenerationConfig(num_beams=2, max_new_tokens=6)
    jobs = [Job(i, len(p), engine._new_search(Request(tuple(p), gen))) for i, p in enumerate(PROMPTS)]
    sched = Scheduler(engine.target, max_batch_size=3, max_batch_tokens=45)
    live, peak_n, peak_tokens = set(), 0, 0
    for i, _, finished in sched.run(jobs):
        live.add(i)
        peak_n = max(peak_n, len(live))
        tokens = sum(len(PROMPTS[j]) for j in live)
        assert len(live) == 1 or tokens <= 45
        peak_tokens = max(peak_tokens, tokens)
        if finished:
            live.discard(i)
    assert peak_n <= 3
    with pytest.raises(ValueError, match="max_batch_size"):
        Scheduler(engine.target, max_batch_size=0)


def test_passes_longer_than_the_context_are_chunked(exported):
    """A pass wider than the model's context (here 513 beams' worth of nodes) is split into chunks that fit."""
    folder = exported("llama", std=0.3, seed=3)
    eng = Engine(folder)
    ctx = eng.target.cfg.context_length
    from specbeam_edge.decoding.cache import TreeCache
    from specbeam_edge.decoding.tree import TokenTree

    tree = TokenTree()
    root = tree.add_chain([5, 6, 7])[-1]
    kids = [tree.add(root, t) for t in range(ctx + 20)]   # ctx + 20 siblings: one pass would overflow rotary
    cache = TreeCache(eng.target, tree)
    out = score_one(cache, cache.missing_ancestors(kids)).logits
    assert out.shape == (3 + ctx + 20, eng.target.cfg.vocab_size)
    ref = TreeCache(eng.target, tree)
    score_one(ref, ref.missing_ancestors([root]))
    np.testing.assert_allclose(score_one(ref, kids[-3:]).logits, out[-3:], atol=1e-4)


def test_threads_sharing_one_engine(models):
    """Threads calling generate on one engine (a streamed target) get what they get sequentially."""
    eng = Engine(models["split"], draft=models["draft"], placement=["disk", "disk"])
    kw = dict(num_beams=2, max_new_tokens=10, speculative=SPECS["beam"])
    ref = alone(eng, PROMPTS, **kw)
    got = [None] * len(PROMPTS)

    def work(i):
        got[i] = eng.generate(PROMPTS[i], **kw)[0]
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(ref, got):
        assert_same_hypotheses(a, b)


def test_adaptive_requests_sharing_a_pass_make_one_choice(engine, monkeypatch):
    """With adaptive speculation, a batch drafts together or not at all (so each arm's timing is a whole pass's),
    and the outputs stay those of plain beam search."""
    from specbeam_edge.decoding.adaptive import PassChooser

    seen: dict = {}
    real = PassChooser.choose

    def spy(self, pass_id=None):
        choice = real(self, pass_id)
        seen.setdefault(pass_id, set()).add(choice)
        return choice
    monkeypatch.setattr(PassChooser, "choose", spy)
    spec = SpeculativeConfig(drafter="beam", budget=16, max_depth=4, adaptive=True)
    kw = dict(num_beams=2, max_new_tokens=MAX_NEW)
    got = engine.generate(PROMPTS, max_batch_size=4, speculative=spec, **kw)
    assert len(seen) > 3 and all(len(c) == 1 for c in seen.values()), seen
    for a, b in zip(alone(engine, PROMPTS, **kw), got):
        assert_same_hypotheses(a, b)


def test_auto_budget_is_shared_by_the_batch(models):
    """budget='auto': the pass's node budget comes from the cost curve at the batch's load and is split over
    its requests (smaller trees per request in a busy batch); outputs stay those of plain beam search."""
    eng = Engine(models["target"], draft=models["draft"])
    eng._curve = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.1, 16: 1.3, 32: 1.5, 64: 2.0, 128: 3.5, 256: 7.0}   # CPU-like
    spec = SpeculativeConfig(drafter="beam", budget="auto", max_depth=4, draft_width=4, adaptive=False)
    kw = dict(num_beams=2, max_new_tokens=MAX_NEW, speculative=spec)
    ref = alone(eng, PROMPTS, **kw)
    got = eng.generate(PROMPTS, max_batch_size=8, **kw)
    for a, b in zip(ref, got):
        assert_same_hypotheses(a, b)
    per_pass = lambda rs: sum(r.stats.draft_tokens_proposed for r in rs) / sum(r.stats.target_passes for r in rs)  # noqa: E731
    assert per_pass(got) < per_pass(ref)


def test_sub_batches_keep_a_prefill_apart_from_decoding_requests():
    from specbeam_edge.execution.batch import _buckets

    shapes = [(50, 4)] * 31 + [(0, 60)]
    groups = _buckets(shapes)
    assert sorted(i for g in groups for i in g) == list(range(32))
    assert [31] in groups                                   # the 60-token prefill runs on its own
    mixed = [(10, 4), (300, 4), (20, 4), (400, 4), (30, 4), (350, 4), (15, 4), (500, 4), (12, 4), (320, 4)]
    assert sorted(sorted(mixed[i][0] for i in g) for g in _buckets(mixed)) == [[10, 12, 15, 20, 30],
                                                                              [300, 320, 350, 400, 500]]


def test_fixed_budget_is_per_pass_and_shared(engine):
    """A fixed budget is the pass's: each of n requests sharing it drafts at most max(K, budget // n) nodes."""
    spec = SpeculativeConfig(drafter="beam", budget=16, max_depth=4, draft_width=4, adaptive=False)
    got = engine.generate(PROMPTS, max_batch_size=8, num_beams=2, max_new_tokens=MAX_NEW, speculative=spec)
    for r in got:
        # each pass drafted at most max(2, 16 // sharing requests); the first pass used the size at admission
        cap = sum(max(2, 16 // n) for n in r.stats.batch_sizes) + 16
        assert r.stats.draft_tokens_proposed <= cap, (r.stats.draft_tokens_proposed, cap)
    alone_ = engine.generate(PROMPTS[0], num_beams=2, max_new_tokens=MAX_NEW, speculative=spec)[0]
    assert alone_.stats.draft_tokens_proposed / alone_.stats.target_passes > \
        sum(r.stats.draft_tokens_proposed for r in got) / sum(r.stats.target_passes for r in got)


def test_each_request_reports_its_own_kv_cache_peak(engine):
    """Stats.kv_cache_peak_mb is the request's own cache (target + draft): without speculation the same batched
    as alone (a batch shares passes, not caches); with it, the batch's shared tree budget keeps it no larger."""
    kw = dict(num_beams=2, max_new_tokens=MAX_NEW)
    ref = alone(engine, PROMPTS, speculative=None, **kw)           # (a loaded draft drafts unless told not to)
    for a, b in zip(ref, engine.generate(PROMPTS, max_batch_size=8, speculative=None, **kw)):
        assert b.stats.kv_cache_peak_mb == a.stats.kv_cache_peak_mb > 0
    spec = alone(engine, PROMPTS, speculative=SPECS["beam"], **kw)
    assert all(s.stats.kv_cache_peak_mb > r.stats.kv_cache_peak_mb for s, r in zip(spec, ref))   # + draft cache


@pytest.fixture(scope="module")
def phi4mini(tmp_path_factory):
    """A tiny Phi-4-mini (LongRoPE: the graph re-rotates cached keys), context 64."""
    pytest.importorskip("torch")
    from export import export
    from family_models import make_family_model

    base = tmp_path_factory.mktemp("phi4mini")
    make_family_model(base / "hf", "phi4mini")
    return export(base / "hf", base / "sb", quiet=True)


def test_batch_rows_never_outgrow_the_context(phi4mini):
    """Batch rows keep padding slots, so a row can grow past context_length while every request's own slots stay
    below it; rows are then packed afresh (as long caches, they would only cost attention). Two requests alone
    reach 62 and 63 slots; batched they must too."""
    from specbeam_edge.execution.batch import score_batch
    from specbeam_edge.decoding.protocol import ScoreCall
    from specbeam_edge.decoding.cache import TreeCache
    from specbeam_edge.execution.model import OnnxCausalLM
    from specbeam_edge.decoding.tree import TokenTree

    lm = OnnxCausalLM(phi4mini)
    assert lm.cfg.context_length == 64
    tree = TokenTree()
    caches = [TreeCache(lm, tree) for _ in range(2)]
    tips = [tree.add_chain([5 + r] * 40)[-1] for r in range(2)]
    score_batch([ScoreCall(c, c.missing_ancestors([t])) for c, t in zip(caches, tips)])
    for k in range(15):
        calls = []
        for r, c in enumerate(caches):
            kids = [tree.add(tips[r], 10 + k)] + ([tree.add(tips[r], 100 + k)] if (k + r) % 2 else [])
            calls.append(ScoreCall(c, kids))
            tips[r] = kids[0]
        score_batch(calls)
    assert [len(c) - c.padding for c in caches] == [62, 63]


def test_long_rope_cache_longer_than_the_context(phi4mini):
    """A cache can hold more slots than context_length (dead draft nodes, K diverging beams) while every position
    stays inside; LongRoPE graphs re-rotate every cached key, one key per rotary row, so such passes run
    (onnxruntime refused a past longer than its rotary tables before) and speculation stays exact."""
    eng = Engine(phi4mini, draft=phi4mini)
    rng = np.random.default_rng(0)
    spec = SpeculativeConfig(adaptive=False, drafter="beam", budget=16, max_depth=4)
    for L in (30, 40):
        prompt = rng.integers(1, 200, L).tolist()
        kw = dict(num_beams=4, max_new_tokens=64, eos_token_id=[])
        [ref] = plain(eng, prompt, **kw)
        [fast] = eng.generate(prompt, speculative=spec, **kw)
        assert_same_hypotheses(fast, ref, scores=False)


def test_finished_requests_let_go_of_their_kv(engine):
    """A finished request's cache may be a row of its batch's arrays; once the request is done its KV is let go,
    so finished requests do not keep whole batches alive while the rest of the job runs (measured before the
    fix: 300 lines at K=4 peaked at 7.4 GB instead of 1.8 GB)."""
    import gc

    from specbeam_edge.decoding.cache import TreeCache

    def caches_with_kv():
        gc.collect()
        return sum(1 for c in gc.get_objects()
                   if isinstance(c, TreeCache) and c.past and c.past[0][0].shape[2] > 0)

    done = 0
    for _ in engine.generate_iter(PROMPTS, num_beams=4, max_new_tokens=MAX_NEW, max_batch_size=2,
                                  speculative=SPECS["beam"]):
        done += 1
        if done < len(PROMPTS):     # at most the running requests' target and draft caches hold KV
            assert caches_with_kv() <= 2 * 2, done
