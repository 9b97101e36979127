"""Property tests of the token tree, the tree mask and the tree cache: any sequence of tree growth and
accept/reject (compaction) keeps every scored node's logits equal to a from-scratch run over its path."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from specbeam_edge.execution.batch import score_one
from specbeam_edge.decoding.protocol import ScoreCall
from specbeam_edge.decoding.cache import TreeCache
from specbeam_edge.decoding.tree import TokenTree
from specbeam_edge.execution.model import OnnxCausalLM


@pytest.fixture(scope="module")
def lm(exported):
    return OnnxCausalLM(exported("qwen2"))


def from_scratch(lm, path):
    n = len(path)
    logits, _ = lm.forward(np.array([path]), np.arange(n)[None], np.tril(np.ones((n, n), bool))[None, None],
                           lm.empty_past())
    return logits[0, -1]


ops = st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(1, 5), st.integers(1, 300), st.booleans(),
                         st.floats(0, 1)), min_size=1, max_size=6)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(1, 300), min_size=1, max_size=6), steps=ops)
def test_cache_matches_recomputation(lm, prompt, steps):
    tree = TokenTree()
    cache = TreeCache(lm, tree)
    nodes = tree.add_chain(prompt)
    score_one(cache, nodes)
    live = [nodes[-1]]
    for pick, width, tok, compact, frac in steps:
        # grow: `width` children below a random live node, and a grandchild below the first of them
        parent = live[pick % len(live)]
        new = [tree.add(parent, (tok + 7 * i) % 300 + 1) for i in range(width)]
        new.append(tree.add(new[0], tok))
        new = [n for n in dict.fromkeys(new) if n not in cache]
        if not new:
            continue
        logits = score_one(cache, new).logits
        for j, n in enumerate(new):
            np.testing.assert_allclose(logits[j], from_scratch(lm, tree.path(n)), atol=2e-5)
        live = list(dict.fromkeys(live + new))
        if compact:
            # accept a random subset of live nodes, reject the rest
            keep = live[: max(1, int(frac * len(live)))]
            cache.compact(keep, min_dead_fraction=0.0)
            live = [n for n in live if n in cache]
            assert all(n in cache for n in keep)
            # the cache holds exactly the kept paths
            want = set()
            for n in keep:
                while n >= 0:
                    want.add(n)
                    n = tree.parents[n]
            assert set(cache.nodes) == want
    assert cache.vis.shape == (len(cache), len(cache))
    assert all(k.shape[2] == len(cache) for k, _ in cache.past)


def test_tree_mask_rows_are_ancestors():
    class Fake:
        def empty_past(self):
            return []
    tree = TokenTree()
    cache = TreeCache(Fake(), tree)
    a = tree.add_chain([1, 2])
    b, c = tree.add(a[-1], 3), tree.add(a[-1], 4)
    d = tree.add(b, 5)
    cache.slot = {a[0]: 0, a[1]: 1}
    cache.nodes = list(a)
    cache.vis = np.array([[1, 0], [1, 1]], bool)
    m = cache.tree_mask([b, c, d])
    np.testing.assert_array_equal(m.astype(int), [[1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 1, 0, 1]])


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.integers(1, 9).flatmap(   # equal lengths: one sub-batch (batch._buckets splits on length)
    lambda n: st.lists(st.lists(st.integers(1, 300), min_size=n, max_size=n), min_size=2, max_size=3)),
       steps=st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(1, 3), st.booleans(), st.floats(0, 1)),
                      min_size=1, max_size=6))
def test_batch_rows_match_recomputation(lm, prompts, steps, monkeypatch):
    """Caches scored together stay rows of their batch's arrays (padding slots dead, compaction inside the row,
    the next pass feeding the arrays without a copy); every node's logits still equal a from-scratch run."""
    from specbeam_edge.execution import batch

    shared = []
    real = batch._same_batch
    with monkeypatch.context() as m:      # undone after each example (a function-scoped patch stacked them)
        m.setattr(batch, "_same_batch", lambda caches: shared.append(real(caches)) or shared[-1])
        first_step = _batch_rows_run(lm, prompts, steps)
    if first_step:    # every request took part in the pass after the prefill: it fed the prefill's arrays
        assert shared[1] is not None


def test_the_pass_after_the_prefill_feeds_the_prefills_arrays(lm, monkeypatch):
    """The deterministic case of the property above (which holds it only for the examples where every request
    takes part): two requests, each adding a node after the prefill, reuse the prefill's batch arrays."""
    from specbeam_edge.execution import batch

    shared = []
    real = batch._same_batch
    monkeypatch.setattr(batch, "_same_batch", lambda caches: shared.append(real(caches)) or shared[-1])
    assert _batch_rows_run(lm, [[5, 6, 7], [8, 9, 10]], [(0, 2, False, 0.0)]) is True
    assert len(shared) == 2 and shared[0] is None and shared[1] is not None


def _batch_rows_run(lm, prompts, steps) -> bool:
    """Prefill `prompts` together, then the steps (pick, width, compact, frac), each node's logits checked against
    a from-scratch run; whether every request took part in the first step."""
    from specbeam_edge.execution import batch

    tree = TokenTree()
    caches = [TreeCache(lm, tree) for _ in prompts]
    lives = [[tree.add_chain(p)[-1]] for p in prompts]
    batch.score_batch([ScoreCall(c, tree.add_chain(p)) for c, p in zip(caches, prompts)])
    first_step = None
    for pick, width, compact, frac in steps:
        calls = []
        for r, (c, live) in enumerate(zip(caches, lives)):
            parent = live[(pick + r) % len(live)]
            new = [n for n in dict.fromkeys(tree.add(parent, (pick + 11 * i + r) % 300 + 1) for i in range(width))
                   if n not in c]
            calls.append(ScoreCall(c, new))
        outs = batch.score_batch(calls)
        for c, call, out, live in zip(caches, calls, outs, lives):
            for j, n in enumerate(call.nodes):
                np.testing.assert_allclose(out.logits[j], from_scratch(lm, tree.path(n)), atol=2e-5)
            live.extend(call.nodes)
            assert len(c.vis) == len(c) == len(c.positions) and c.padding == c.nodes.count(-1)
            if compact:
                c.compact(live[: max(1, int(frac * len(live)))], min_dead_fraction=0.0)
                live[:] = [n for n in live if n in c]
        if first_step is None:
            first_step = all(call.nodes for call in calls)
    return first_step


def test_batched_static_inputs_are_reused_only_for_the_same_requests():
    """The stacked cross K/V of a batch are reused while its requests (the same static dicts, in order) stay the
    same; a request that leaves or joins, or another order, stacks them anew (never another request's inputs)."""
    import numpy as np

    from specbeam_edge.execution import batch

    def static(n, v):
        return {"x": (np.full((1, 2, n), v, np.float32), 2)}
    a, b, c = static(3, 1.0), static(5, 2.0), static(4, 3.0)
    model, stacks = object(), batch.StaticStacks()
    first = stacks.get(model, [a, b])
    assert stacks.get(model, [a, b]) is first
    for other in ([b, a], [a, c], [a, b, c], [a]):
        out = stacks.get(model, other)
        assert out is not first
        np.testing.assert_array_equal(out["x"], batch._stack_static(other)["x"])
    assert stacks.get(object(), [a, b]) is not first          # another model has its own entry
    assert batch.StaticStacks().get(model, [a, b]) is not first    # another run (scheduler) its own
