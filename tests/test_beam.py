"""Peer check: our plain beam search == transformers `generate(num_beams=K)` on the same fp32 weights."""
import numpy as np
import pytest

from specbeam_edge import Engine

PROMPTS = [[3, 17, 33, 8, 99, 41, 7], [250, 12, 9]]
MAX_NEW = 12


@pytest.fixture(scope="module")
def peer(hf_models, exported):
    """A sharper random model (std 0.3) so that EOS ids chosen from its greedy output get hit mid-search."""
    import torch

    folder, model = hf_models("llama", std=0.3, seed=3)
    engine = Engine(exported("llama", std=0.3, seed=3))
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPTS[0]]), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None,
                             pad_token_id=0)
    greedy = out[0, len(PROMPTS[0]):].tolist()
    eos = [greedy[3], greedy[6]]       # two EOS ids that the search meets
    return model, engine, eos


def hf_beam(model, prompt, eos, **kw):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True, **kw)
    seqs = [s[len(prompt):].tolist() for s in out.sequences]
    scores = out.sequences_scores.tolist() if kw.get("num_beams", 1) > 1 else None
    return seqs, scores


@pytest.mark.parametrize("K", [1, 2, 4, 8])
@pytest.mark.parametrize("lp", [0.0, 1.0, 2.0])
@pytest.mark.parametrize("early", [False, True, "never"])
def test_beam_search_matches_transformers(peer, K, lp, early):
    model, engine, eos = peer
    n_ret = min(K, 3)
    for prompt in PROMPTS:
        hf_seqs, hf_scores = hf_beam(model, prompt, eos, num_beams=K, length_penalty=lp, early_stopping=early,
                                     num_return_sequences=n_ret)
        [res] = engine.generate(prompt, num_beams=K, max_new_tokens=MAX_NEW, length_penalty=lp,
                                early_stopping=early, num_return_sequences=n_ret, eos_token_id=eos)
        ours = [h.tokens for h in res.hypotheses]
        assert len(ours) == len(hf_seqs)
        for o, h in zip(ours, hf_seqs):
            # transformers pads shorter sequences with `pad_token_id or eos[0]` (pad 0 is falsy there)
            assert o == h[:len(o)] and all(t == eos[0] for t in h[len(o):]), (K, lp, early, ours, hf_seqs)
        if hf_scores is not None:
            np.testing.assert_allclose([h.score for h in res.hypotheses], hf_scores, atol=1e-4, rtol=1e-5)


def test_eos_is_actually_hit(peer):
    _, engine, eos = peer
    [res] = engine.generate(PROMPTS[0], num_beams=2, max_new_tokens=MAX_NEW, eos_token_id=eos, length_penalty=0.0,
                            num_return_sequences=2)
    assert any(h.tokens[-1] in eos and len(h.tokens) < MAX_NEW for h in res.hypotheses)


def test_min_new_tokens_matches_transformers(peer):
    model, engine, eos = peer
    hf_seqs, hf_scores = hf_beam(model, PROMPTS[0], eos, num_beams=4, min_new_tokens=6)
    [res] = engine.generate(PROMPTS[0], num_beams=4, max_new_tokens=MAX_NEW, min_new_tokens=6, eos_token_id=eos)
    assert res.hypotheses[0].tokens == hf_seqs[0][:len(res.hypotheses[0].tokens)]
    np.testing.assert_allclose(res.hypotheses[0].score, hf_scores[0], atol=1e-4)
    assert len(res.hypotheses[0].tokens) >= 6


@pytest.mark.parametrize("K", [1, 4])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram_size_matches_transformers(peer, exported, K, n):
    """A random model repeats itself (without the ban its greedy output repeats a bigram); with it, sequences
    and scores are transformers', and speculation (the target drafting for itself) keeps them."""
    from specbeam_edge import SpeculativeConfig
    from specbeam_edge.decoding.beam import repeated_ngram_ends

    model, engine, eos = peer
    for prompt in PROMPTS:
        hf_seqs, hf_scores = hf_beam(model, prompt, None, num_beams=K, no_repeat_ngram_size=n)
        [res] = engine.generate(prompt, num_beams=K, max_new_tokens=MAX_NEW, no_repeat_ngram_size=n,
                                eos_token_id=[])
        assert res.hypotheses[0].tokens == hf_seqs[0]
        if hf_scores is not None:
            np.testing.assert_allclose(res.hypotheses[0].score, hf_scores[0], atol=1e-4)
        full = prompt + res.hypotheses[0].tokens
        grams = [tuple(full[i:i + n]) for i in range(len(full) - n + 1)]
        assert len(grams) == len(set(grams))
        fast = Engine(exported("llama", std=0.3, seed=3), draft=exported("llama", std=0.3, seed=3))
        [spec] = fast.generate(prompt, num_beams=K, max_new_tokens=MAX_NEW, no_repeat_ngram_size=n, eos_token_id=[],
                               speculative=SpeculativeConfig(budget=16, max_depth=4, adaptive=False))
        assert spec.hypotheses[0].tokens == res.hypotheses[0].tokens
    assert list(repeated_ngram_ends([1, 2, 3, 1, 2], 3)) == [3] and list(repeated_ngram_ends([5, 5], 1)) == [5, 5]


@pytest.mark.parametrize("K", [1, 4])
@pytest.mark.parametrize("penalty", [1.5, 0.8])
def test_repetition_penalty_matches_transformers(peer, exported, K, penalty):
    """transformers applies it to the logits in greedy decoding and to the log-probs in beam search; sequences
    (and beam scores) equal, with and without speculation, and with no_repeat_ngram_size beside it."""
    from specbeam_edge import SpeculativeConfig

    model, engine, eos = peer
    fast = Engine(exported("llama", std=0.3, seed=3), draft=exported("llama", std=0.3, seed=3))
    spec = SpeculativeConfig(budget=16, max_depth=4, adaptive=False)
    changed = False
    for prompt in PROMPTS:
        for extra in ({}, {"no_repeat_ngram_size": 2}):
            hf_seqs, hf_scores = hf_beam(model, prompt, None, num_beams=K, repetition_penalty=penalty, **extra)
            kw = dict(num_beams=K, max_new_tokens=MAX_NEW, repetition_penalty=penalty, eos_token_id=[], **extra)
            [res] = engine.generate(prompt, **kw)
            assert res.hypotheses[0].tokens == hf_seqs[0]
            if hf_scores is not None:
                np.testing.assert_allclose(res.hypotheses[0].score, hf_scores[0], atol=1e-4)
            [sp] = fast.generate(prompt, speculative=spec, **kw)
            assert sp.hypotheses[0].tokens == res.hypotheses[0].tokens
            [plain] = engine.generate(prompt, num_beams=K, max_new_tokens=MAX_NEW, eos_token_id=[], **extra)
            changed |= plain.hypotheses[0].tokens != res.hypotheses[0].tokens
    assert changed          # the penalty changes what this model says


def test_batch_of_prompts_equals_one_by_one(peer):
    _, engine, eos = peer
    batch = engine.generate(PROMPTS, num_beams=4, max_new_tokens=MAX_NEW, eos_token_id=eos)
    for prompt, res in zip(PROMPTS, batch):
        [single] = engine.generate(prompt, num_beams=4, max_new_tokens=MAX_NEW, eos_token_id=eos)
        assert res.hypotheses[0].tokens == single.hypotheses[0].tokens


def test_top_k_selection_is_exact_with_ties_and_infinities():
    """_top's sampled threshold never loses a candidate: equal to a full sort (value desc, index asc)."""
    from specbeam_edge.decoding.beam import _top

    rng = np.random.default_rng(1)
    for trial in range(400):
        n, k = int(rng.integers(1, 40000)), int(rng.integers(1, 20))
        v = rng.standard_normal(n).astype(np.float32)
        if trial % 3 == 0:
            v = np.round(v, 1)                      # many exact ties
        if trial % 5 == 0:
            v[rng.integers(0, n, n // 2)] = -np.inf  # a top-k head's missing entries
        np.testing.assert_array_equal(_top(v, k), np.lexsort((np.arange(n), -v))[:k])
