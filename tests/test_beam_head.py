"""Beam search over a beam head's best k entries per beam (beam.BeamRows with ids) == beam search over dense
log-probs: the same hypotheses and scores, step by step, for any K, EOS set, length penalty, early stopping,
n-best and min_new_tokens, with ties (the head never builds a vocabulary-sized row)."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from specbeam_edge.decoding.beam import BeamRows, BeamSearch, log_softmax
from specbeam_edge.execution.encdec import logits_processor
from specbeam_edge.decoding.tree import TokenTree

V = 300


def _searches(K, eos, lp, early, min_new, max_new):
    out = []
    for _ in range(2):
        tree = TokenTree()
        start = tree.add_chain([5, 6, 7])[-1]
        out.append(BeamSearch(tree, start, num_beams=K, prompt_len=3, max_new_tokens=max_new, eos_token_ids=eos,
                              length_penalty=lp, early_stopping=early, min_new_tokens=min_new))
    return out


def _head(dense: np.ndarray, k: int) -> BeamRows:
    """What a top-k head returns: each row's k best (ties: lower id first, as onnxruntime's TopK)."""
    ids = np.argsort(-dense, axis=1, kind="stable")[:, :k]
    return BeamRows(np.take_along_axis(dense, ids, axis=1), ids, dense.shape[1])


@settings(max_examples=120, deadline=None)
@given(K=st.integers(1, 5), n_eos=st.integers(1, 3), lp=st.sampled_from([0.0, 1.0, 2.5, -0.5]),
       early=st.sampled_from([False, True, "never"]), min_new=st.integers(0, 4), ties=st.booleans(),
       forced=st.booleans(), seed=st.integers(0, 10**6))
def test_beam_head_search_equals_dense_search(K, n_eos, lp, early, min_new, ties, forced, seed):
    rng = np.random.default_rng(seed)
    eos = list(range(n_eos))
    max_new = 8
    dense_bs, head_bs = _searches(K, eos, lp, early, min_new, max_new)
    # the topk the engine asks of a head: 2K + #EOS + 1 (+ banned tokens of an encoder-decoder)
    ban = [V - 1]
    k = 2 * K + n_eos + 1 + len(ban)
    process = logits_processor(ban, 0, 3 + max_new) if forced else None
    for step in range(max_new):
        if dense_bs.done:
            break
        logits = rng.normal(0, 3, (K, V)).astype(np.float32)
        if ties:
            logits = np.round(logits)            # many exact ties, across beams and tokens
        logits[:, :n_eos] += rng.normal(0, 2, (K, n_eos)).astype(np.float32)   # EOS often among the best
        dense = log_softmax(logits)
        a, b = BeamRows(dense), _head(dense, k)
        if process is not None:
            a, b = process(a, dense_bs.cur_len), process(b, head_bs.cur_len)
        ra, rb = dense_bs.step(a), head_bs.step(b)
        assert dense_bs.done == head_bs.done
        if not dense_bs.done:
            assert [dense_bs.tree.path(n) for n in ra] == [head_bs.tree.path(n) for n in rb]
            np.testing.assert_array_equal(dense_bs.scores, head_bs.scores)
    ha, hb = dense_bs.hypotheses(K), head_bs.hypotheses(K)
    assert [h[0] for h in ha] == [h[0] for h in hb]
    assert [h[1] for h in ha] == [h[1] for h in hb]


def test_dense_rows_of_a_head_fill_minus_inf():
    dense = log_softmax(np.random.default_rng(0).normal(size=(3, 50)).astype(np.float32))
    head = _head(dense, 4)
    full = head.dense()
    assert np.isinf(full).sum() == 3 * 46
    np.testing.assert_array_equal(np.sort(full, axis=1)[:, -4:], np.sort(dense, axis=1)[:, -4:])
