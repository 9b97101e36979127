"""Top-k heads (export --output_kind topk): the graph returns each node's best log-probs instead of a full
vocabulary row, so a 1,000-node tree does not move 1,000 x V floats out of the target. Beam search over them
equals beam search over full logits; drafters read them directly."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from specbeam_edge import Engine, SpeculativeConfig
from helpers import assert_same_hypotheses

PROMPTS = [[3, 17, 33, 8, 99, 41, 7], [250, 12, 9, 77]]


@pytest.fixture(scope="module")
def folders(exported):
    kw = dict(std=0.3, seed=3)
    return {"logits": exported("llama", **kw), "topk": exported("llama", output="topk", **kw),
            "split_topk": exported("llama", layout="split", output="topk", **kw),
            "draft_topk": exported("llama", output="topk", std=0.3, seed=11, layers=1)}


@pytest.mark.parametrize("K", [1, 2, 4])
def test_plain_beam_search_with_topk_head_equals_full_logits(folders, K):
    full, topk = Engine(folders["logits"]), Engine(folders["topk"])
    for prompt in PROMPTS:
        for extra in ({}, {"min_new_tokens": 6, "length_penalty": 0.0}):
            [a] = full.generate(prompt, num_beams=K, max_new_tokens=14, num_return_sequences=K, **extra)
            [b] = topk.generate(prompt, num_beams=K, max_new_tokens=14, num_return_sequences=K, **extra)
            assert_same_hypotheses(a, b, scores=False)
            np.testing.assert_allclose([h.score for h in a.hypotheses], [h.score for h in b.hypotheses], atol=1e-5)


@pytest.mark.parametrize("target", ["topk", "split_topk"])
@pytest.mark.parametrize("spec", [SpeculativeConfig(adaptive=False, drafter="beam", budget=24, max_depth=4),
                                  SpeculativeConfig(adaptive=False, drafter="best_first", budget=64, max_depth=8)],
                         ids=["beam", "best_first"])
def test_speculative_with_topk_heads_equals_plain(folders, target, spec):
    ref = Engine(folders["logits"])
    places = {"split_topk": ["disk", "resident"]}.get(target)
    engines = [Engine(folders[target], draft=folders["topk"], placement=places),        # draft == target
               Engine(folders[target], draft=folders["draft_topk"], placement=places)]  # unrelated draft
    for K in (1, 3):
        for prompt in PROMPTS:
            [plain] = ref.generate(prompt, num_beams=K, max_new_tokens=16)
            for eng in engines:
                [fast] = eng.generate(prompt, num_beams=K, max_new_tokens=16, speculative=spec)
                assert fast.hypotheses[0].tokens == plain.hypotheses[0].tokens
                assert abs(fast.hypotheses[0].score - plain.hypotheses[0].score) < 1e-5
    [same] = engines[0].generate(PROMPTS[0], num_beams=1, max_new_tokens=16, speculative=spec)
    assert same.stats.beam_steps_per_pass > 2          # the draft's top-k trees are used, not just scored


def test_sampling_refuses_a_topk_head(folders):
    eng = Engine(folders["topk"])
    with pytest.raises(ValueError, match="top-k head"):
        eng.generate(PROMPTS[0], num_beams=2, do_sample=True, max_new_tokens=4)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), width=st.integers(1, 9), vocab=st.sampled_from([7, 64, 600, 8192]),
       ties=st.booleans(), seed=st.integers(0, 10 ** 6))
def test_dense_top_ids_are_each_rows_best(rows, width, vocab, ties, seed):
    """The drafters' top-w per row (sampled threshold, then a partition of the few candidates): the values it
    picks are each row's w largest, ties included (coarse values make many)."""
    from specbeam_edge.execution.heads import _top_ids

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, vocab)).astype(np.float32)
    if ties:
        x = np.round(x * 2) / 2
    w = min(width, vocab - 1)
    ids = _top_ids(x, w)
    assert ids.shape == (rows, w)
    for r in range(rows):
        assert len(set(ids[r].tolist())) == w
        np.testing.assert_array_equal(np.sort(x[r, ids[r]]), np.sort(x[r])[-w:])


@pytest.fixture(scope="module")
def both(exported):
    """A 1-layer draft exported three ways: logits, top-k, and both heads in one graph (whole and split)."""
    kw = dict(std=0.3, seed=11, layers=1)
    return {kind: exported("llama", output=kind, **kw) for kind in ("logits", "topk", "both")} | \
        {"split_both": exported("llama", layout="split", output="both", **kw),
         "split_logits": exported("llama", layout="split", **kw)}


@pytest.mark.parametrize("layout", ["whole", "split"])
def test_both_head_answers_with_logits_or_topk(both, layout):
    """export --output_kind both: a run without top-k returns the logits graph's logits, a run with one the top-k
    graph's (log-probs, ids); onnxruntime computes only the head asked for."""
    from specbeam_edge.execution.model import OnnxCausalLM

    name = {"whole": ("both", "logits"), "split": ("split_both", "split_logits")}[layout]
    m, ref, topk = (OnnxCausalLM(both[n]) for n in (*name, "topk"))
    ids = np.array([[3, 17, 33, 8]], np.int64)
    pos = np.arange(4, dtype=np.int64)[None]
    mask = np.tril(np.ones((4, 4), bool))[None, None]
    logits, _ = m.forward(ids, pos, mask, m.empty_past())
    np.testing.assert_allclose(logits, ref.forward(ids, pos, mask, ref.empty_past())[0], atol=1e-6)
    (lp, tok), _ = m.forward(ids, pos, mask, m.empty_past(), topk=5)
    (lp2, tok2), _ = topk.forward(ids, pos, mask, topk.empty_past(), topk=5)
    np.testing.assert_array_equal(tok, tok2)
    np.testing.assert_allclose(lp, lp2, atol=1e-6)
    assert lp.shape == (1, 4, 5)


@pytest.mark.parametrize("K", [1, 4])
def test_a_both_head_target_answers_exact_search_in_one_kind(both, K):
    """Before: a 'both' target answered a one-row pass with logits and larger passes with its top-k, so exact
    search mixed the two kinds in one step (an AttributeError in speculative K = 4: the streaming example on the
    shipped pair once its target had both heads) and plain greedy's scores came from Python's log-softmax while
    speculative greedy's came from the graph's. Now every pass of exact search reads the top-k: speculative ==
    plain in tokens and scores, and a one-row target pass is a top-k one."""
    from specbeam_edge.execution.batch import ScoreCall, score_batch
    from specbeam_edge.decoding.cache import TreeCache
    from specbeam_edge.execution.heads import TopKOutput
    from specbeam_edge.decoding.tree import TokenTree

    target = both["both"]
    ref, fast = Engine(target), Engine(target, draft=both["logits"])
    # every pass scores two rows or more (as int8 graphs once did, DESIGN "Quantized targets" point 1): on CPUs with AVX-512
    # onnxruntime's one-row fp32 MatMul (GEMV) rounds the last bit differently from two rows and more, which
    # would hide the difference under test (scores from the graph vs from Python's log-softmax, same size)
    ref.target.min_rows = fast.target.min_rows = 2
    spec = SpeculativeConfig(drafter="beam", budget=24, max_depth=4, adaptive=False)
    for prompt in PROMPTS:
        [plain] = ref.generate(prompt, num_beams=K, max_new_tokens=14)
        [spec_out] = fast.generate(prompt, num_beams=K, max_new_tokens=14, speculative=spec)
        assert [(h.tokens, h.score) for h in spec_out.hypotheses] == [(h.tokens, h.score) for h in plain.hypotheses]
    tree = TokenTree()
    cache = TreeCache(ref.target, tree)
    [out] = score_batch([ScoreCall(cache, tree.add_chain([3]), topk=5, replayed=True)])
    assert isinstance(out, TopKOutput)


@pytest.mark.parametrize("K", [1, 4])
def test_both_head_draft_feeds_exact_search_its_topk_and_sampling_its_logits(folders, both, top_calls, K):
    """A 'both' draft: exact speculative search equals plain and drafts from the top-k outputs (no full-vocabulary
    work in Python per draft level of two rows or more); speculative beam sampling reads its logits and matches
    the logits draft."""
    target = folders["logits"]
    ref = Engine(target)
    fast = Engine(target, draft=both["both"])
    spec = SpeculativeConfig(drafter="beam", budget=24, max_depth=4, adaptive=False)
    for prompt in PROMPTS:
        [plain] = ref.generate(prompt, num_beams=K, max_new_tokens=14)
        [spec_out] = fast.generate(prompt, num_beams=K, max_new_tokens=14, speculative=spec)
        assert spec_out.hypotheses[0].tokens == plain.hypotheses[0].tokens
        assert spec_out.stats.draft_passes > 0
    # batched requests share the draft's passes
    batched = fast.generate(PROMPTS, num_beams=K, max_new_tokens=14, speculative=spec, max_batch_size=2)
    assert [r.hypotheses[0].tokens for r in batched] == \
        [ref.generate(p, num_beams=K, max_new_tokens=14)[0].hypotheses[0].tokens for p in PROMPTS]
    # every draft level over two rows or more came from the graph's TopK (one row: Python's is cheaper)
    assert top_calls["TopK"] and all(rows == 1 for rows in top_calls["Dense"])
    sampling = SpeculativeConfig(adaptive=False, drafter="sample", max_depth=3)
    outs = [Engine(target, draft=both[kind]).generate(PROMPTS[0], num_beams=2, do_sample=True, seed=5,
                                                        max_new_tokens=12, speculative=sampling)[0].text
            for kind in ("both", "logits")]
    assert outs[0] == outs[1]
