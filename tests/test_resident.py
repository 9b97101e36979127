"""Resident KV caches (kv_resident: OrtValues bound with IOBinding, left on the session's device between passes)
give the host path's results bit for bit: plain, speculative, sampling, batched, streamed layers and
encoder-decoder models; and the cache really is resident (OrtValues), or the equality would prove nothing."""
import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from specbeam_edge.execution.batch import score_one
from specbeam_edge import Engine, SpeculativeConfig
from specbeam_edge.decoding.cache import TreeCache
from specbeam_edge.execution.model import OnnxCausalLM
from specbeam_edge.decoding.tree import TokenTree
from helpers import assert_same_hypotheses

RNG = np.random.default_rng(3)
PROMPTS = [RNG.integers(1, 300, int(n)).tolist() for n in (4, 19, 9, 31, 6)]
SPECS = {"plain": None, "beam": SpeculativeConfig(drafter="beam", budget=16, max_depth=4, adaptive=False),
         "best_first": SpeculativeConfig(drafter="best_first", budget=24, max_depth=5, adaptive=False)}


@pytest.fixture(scope="module")
def models(exported):
    return {"target": exported("llama", std=0.3, seed=3), "draft": exported("llama", std=0.3, seed=11, layers=1),
            "split": exported("llama", "fp32", "split", std=0.3, seed=3, layers=4)}


def same(a, b, batched=False):
    """Bit for bit: tokens and scores of every hypothesis, and the pass counts. Batched passes: host caches stay
    rows of the batch arrays (TreeCache.adopt_batch_row) while resident ones are packed afresh, so a batched pass attends
    over a different number of padding columns, and its sums may round differently in the last bit: scores to
    1e-5 there, as batched == alone (tests/test_batch.py)."""
    assert_same_hypotheses(a, b, scores=False)
    if batched:
        np.testing.assert_allclose([h.score for h in a.hypotheses], [h.score for h in b.hypotheses], atol=1e-5)
    else:
        assert [h.score for h in a.hypotheses] == [h.score for h in b.hypotheses]
    assert a.stats.target_passes == b.stats.target_passes


def test_resident_cache_is_ortvalues_and_host_cache_is_numpy(models):
    for resident, kind in ((True, ort.OrtValue), (False, np.ndarray)):
        lm = OnnxCausalLM(models["target"], kv_resident=resident)
        cuda = "CUDAExecutionProvider" in lm.runner.sess.get_providers()    # SPECBEAM_PROVIDER=cuda (the GPU check)
        assert lm.kv_resident is resident and lm.kv_device == ("cuda" if cuda else "cpu")
        cache = TreeCache(lm, TokenTree())
        score_one(cache, cache.tree.add_chain(PROMPTS[0]))
        assert all(isinstance(k, kind) and isinstance(v, kind) for k, v in cache.past)
        if resident:
            assert cache.past[0][0].device_name() == lm.kv_device
    # the default: resident on CUDA, host arrays on the CPU
    assert OnnxCausalLM(models["target"]).kv_resident is cuda


@pytest.mark.parametrize("K", [1, 4])
@pytest.mark.parametrize("mode", list(SPECS))
def test_resident_equals_host(models, K, mode):
    kw = dict(num_beams=K, max_new_tokens=14, num_return_sequences=K, speculative=SPECS[mode])
    host = Engine(models["target"], draft=models["draft"], kv_resident=False)
    dev = Engine(models["target"], draft=models["draft"], kv_resident=True)
    for p in PROMPTS:
        same(host.generate(p, **kw)[0], dev.generate(p, **kw)[0])
    # batched passes gather the residents on the host and hand each request its rows back
    for a, b in zip(host.generate(PROMPTS, max_batch_size=4, **kw), dev.generate(PROMPTS, max_batch_size=4, **kw)):
        same(a, b, batched=True)


def test_resident_sampling_equals_host(models):
    spec = SpeculativeConfig(drafter="sample", max_depth=4, adaptive=False)
    kw = dict(num_beams=2, do_sample=True, seed=11, max_new_tokens=12, speculative=spec)
    host = Engine(models["target"], draft=models["draft"], kv_resident=False)
    dev = Engine(models["target"], draft=models["draft"], kv_resident=True)
    for p in PROMPTS[:3]:
        same(host.generate(p, **kw)[0], dev.generate(p, **kw)[0])


@pytest.mark.parametrize("placement", [None, ["disk", "host", "resident", "disk"]])
def test_resident_streamed_layers_equal_host(models, placement):
    kw = dict(num_beams=4, max_new_tokens=10, speculative=SPECS["beam"])
    host = Engine(models["split"], draft=models["draft"], placement=placement, kv_resident=False)
    dev = Engine(models["split"], draft=models["draft"], placement=placement, kv_resident=True)
    for p in PROMPTS[:3]:
        same(host.generate(p, **kw)[0], dev.generate(p, **kw)[0])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(1, 4), st.floats(0, 1)), min_size=1, max_size=6))
def test_resident_compaction_equals_host(models, steps):
    """Growing and compacting a resident cache (a round trip through the host) keeps exactly the host cache's
    slots and values."""
    lms = [OnnxCausalLM(models["target"], kv_resident=r) for r in (False, True)]
    tree = TokenTree()
    caches = [TreeCache(lm, tree) for lm in lms]
    live = tree.add_chain(PROMPTS[1][:5])
    for c in caches:
        score_one(c, live)
    for pick, width, frac in steps:
        parent = live[pick % len(live)]
        new = list(dict.fromkeys(tree.add(parent, (pick + 7 * i) % 300 + 1) for i in range(width)))
        new = [n for n in new if n not in caches[0]]
        outs = [score_one(c, new).logits for c in caches]
        np.testing.assert_array_equal(outs[0], outs[1])
        live = list(dict.fromkeys(live + new))
        keep = live[: max(1, int(frac * len(live)))]
        for c in caches:
            c.compact(keep, min_dead_fraction=0.0)
        live = [n for n in live if n in caches[0]]
        assert caches[0].nodes == caches[1].nodes
        for (hk, hv), (dk, dv) in zip(caches[0].past, caches[1].past):
            np.testing.assert_array_equal(hk, dk.numpy())
            np.testing.assert_array_equal(hv, dv.numpy())


def test_resident_encoder_decoder_equals_host(tmp_path):
    pytest.importorskip("torch")
    from encdec_models import make_encdec_model
    from export import export

    make_encdec_model(tmp_path / "hf", "marian", seed=3)
    folder = export(tmp_path / "hf", tmp_path / "sb", quiet=True)
    rng = np.random.default_rng(5)
    sources = [rng.integers(1, 60, int(n)).tolist() + [0] for n in (3, 12, 7)]
    kw = dict(num_beams=4, max_new_tokens=10, num_return_sequences=2, speculative=SPECS["beam"])
    host, dev = Engine(folder, draft=folder, kv_resident=False), Engine(folder, draft=folder, kv_resident=True)
    for s in sources:
        same(host.generate(s, **kw)[0], dev.generate(s, **kw)[0])
    for a, b in zip(host.generate(sources, max_batch_size=3, **kw), dev.generate(sources, max_batch_size=3, **kw)):
        same(a, b, batched=True)
