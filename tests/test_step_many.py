"""beam.step_many (the beam steps of every request of a batched pass as one array computation) == each search's
own step, bit for bit: running beams, scores, finished hypotheses, the early-stop state, for requests that differ
in K, EOS set, length penalty, early stopping, min_new_tokens, length limit and head kind, with ties, mixed with
searches that step alone (greedy, constrained)."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from specbeam_edge.decoding.beam import BeamRows, BeamSearch, log_softmax, step_many
from specbeam_edge.decoding.constraints import ConstrainedBeamSearch, Constraints
from specbeam_edge.decoding.tree import TokenTree

V = 200

request = st.fixed_dictionaries({
    "K": st.sampled_from([1, 2, 3, 4, 4, 4]), "n_eos": st.integers(0, 3),
    "lp": st.sampled_from([0.0, 1.0, 2.5, -0.5]), "early": st.sampled_from([False, True, "never"]),
    "min_new": st.integers(0, 3), "max_new": st.integers(1, 9), "prompt": st.integers(1, 4),
    "head": st.booleans(), "constrained": st.integers(0, 5)})


def _search(cfg):
    tree = TokenTree()
    start = tree.add_chain(list(range(10, 10 + cfg["prompt"])))[-1]
    kw = dict(num_beams=cfg["K"], prompt_len=cfg["prompt"], max_new_tokens=cfg["max_new"],
              eos_token_ids=list(range(cfg["n_eos"])), length_penalty=cfg["lp"], early_stopping=cfg["early"],
              min_new_tokens=cfg["min_new"])
    if cfg["constrained"] == 0 and cfg["K"] > 1:
        return ConstrainedBeamSearch(tree, start, constraints=Constraints([[[7, 8]]]), **kw)
    return BeamSearch(tree, start, **kw)


def _rows(logp: np.ndarray, head: bool, K: int) -> BeamRows:
    if not head:
        return BeamRows(logp)
    k = 2 * K + 4
    ids = np.argsort(-logp, axis=1, kind="stable")[:, :k]
    return BeamRows(np.take_along_axis(logp, ids, axis=1), ids, V)


def _state(bs):
    path = bs.tree.path
    return ([path(n) for n in bs.running], bs.scores.tobytes(), bs.fin_scores.tobytes(), bs.fin_done.tolist(),
            [path(n) if n >= 0 else None for n in bs.fin_nodes], bs.improvable, bs.done, bs.cur_len)


@settings(max_examples=150, deadline=None)
@given(cfgs=st.lists(request, min_size=1, max_size=6), ties=st.booleans(), seed=st.integers(0, 10**6))
def test_step_many_equals_each_search_stepping_alone(cfgs, ties, seed):
    rng = np.random.default_rng(seed)
    alone, together = [_search(c) for c in cfgs], [_search(c) for c in cfgs]
    for _ in range(10):
        live = [i for i, bs in enumerate(alone) if not bs.done]
        if not live:
            break
        rows = []
        for i in live:
            x = rng.normal(0, 3, (cfgs[i]["K"], V)).astype(np.float32)
            if ties:
                x = np.round(x)                     # exact ties across beams and tokens
            x[:, :3] += 2                           # EOS often among the best
            rows.append(_rows(log_softmax(x), cfgs[i]["head"], cfgs[i]["K"]))
        for i, r in zip(live, rows):
            alone[i].step(r)
        step_many([together[i] for i in live], rows)
        for i in live:
            assert _state(together[i]) == _state(alone[i])
    for a, b in zip(alone, together):
        assert a.hypotheses(a.num_beams) == b.hypotheses(b.num_beams)


def test_step_many_checks_what_it_is_given():
    """A finished search is refused as by its own step (the array path must not step it silently)."""
    import pytest

    cfg = {"K": 2, "n_eos": 1, "lp": 1.0, "early": False, "min_new": 0, "max_new": 1, "prompt": 2, "head": False,
           "constrained": 1}
    searches = [_search(cfg), _search(cfg)]
    rows = [BeamRows(log_softmax(np.zeros((2, V), np.float32))) for _ in searches]
    step_many(searches, rows)
    assert all(bs.done for bs in searches)
    with pytest.raises(RuntimeError, match="already finished"):
        step_many(searches, rows)
