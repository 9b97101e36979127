"""Layout-exact attention (export --attention fp64, the default for int8 and int4): a node's logits must not depend
on where masked columns sit in the cache (dead tree nodes, siblings of the same pass), or a tree pass and a plain
step differ in the last bits, which int8 activations turn into different tokens on real models."""
import numpy as np
import pytest

from export import export
from specbeam_edge import Engine, SpeculativeConfig
from specbeam_edge.execution.invariance import NotInvariantError
from specbeam_edge.execution.model import OnnxCausalLM
from helpers import plain

PROMPT = [3, 17, 33, 8, 99, 41, 7, 250, 12, 9, 77, 5, 61, 140, 22, 18, 4, 90, 31, 201, 6, 13, 55, 70]
CHAIN = [11, 42, 87, 9, 130, 64]


def _past(m, n):
    mask = np.tril(np.ones((n, n), bool))[None, None]
    _, past = m.forward(np.array([PROMPT[:n]]), np.arange(n)[None], mask, m.empty_past(1))
    return past


def _chain(m, past, visible):
    """Logits of CHAIN scored causally over `past`, seeing the past columns where `visible` is True."""
    n, P = len(CHAIN), len(visible)
    mask = np.zeros((n, P + n), bool)
    mask[:, :P] = visible
    mask[:, P:] = np.tril(np.ones((n, n), bool))
    logits, _ = m.forward(np.array([CHAIN]), np.arange(P, P + n)[None] - (~visible).sum(), mask[None, None], past)
    return logits[0]


def layout_difference(folder) -> float:
    """The largest |difference| of the chain's logits between a compact past and the same past with masked
    random columns interleaved (relative to the largest |logit|)."""
    m = OnnxCausalLM(folder)
    P = len(PROMPT)
    past = _past(m, P)
    ref = _chain(m, past, np.ones(P, bool))
    rng = np.random.default_rng(0)
    worst = 0.0
    for dead in ([3, 9, 10, 17], list(range(1, 2 * P, 2))):   # a few; every other column
        keep = np.ones(P + len(dead), bool)
        keep[dead] = False
        grown = []
        for k, v in past:
            k2 = rng.standard_normal((1, k.shape[1], len(keep), k.shape[3])).astype(np.float32)
            v2 = rng.standard_normal(k2.shape).astype(np.float32)
            k2[:, :, keep], v2[:, :, keep] = k, v
            grown.append((k2, v2))
        got = _chain(m, grown, keep)
        worst = max(worst, float(np.abs(got - ref).max() / np.abs(ref).max()))
    return worst


@pytest.mark.parametrize("precision", ["int8", "fp32"])
def test_attention_in_double_ignores_the_cache_layout_bit_for_bit(hf_models, tmp_path, precision):
    src, _ = hf_models("llama", std=0.3, seed=3)
    folder = export(src, tmp_path / precision, precision=precision, attention="fp64", quiet=True)
    assert layout_difference(folder) == 0.0


def test_fp32_attention_depends_on_the_layout_in_the_last_bits(hf_models, tmp_path):
    """What the double attention removes (if onnxruntime's fp32 kernels ever stop depending on it, the default can
    go back to fp32 attention)."""
    src, _ = hf_models("llama", std=0.3, seed=3)
    folder = export(src, tmp_path / "fp32", precision="fp32", quiet=True)
    assert 0.0 < layout_difference(folder) < 1e-5


def test_an_int8_target_with_fp32_attention_is_refused_for_exact_speculation(exported, hf_models, tmp_path):
    src, _ = hf_models("llama", std=0.3, seed=3)
    old = export(src, tmp_path / "old", precision="int8", attention="fp32", quiet=True)
    engine = Engine(old, draft=exported("llama", std=0.3, seed=11, layers=1))
    with pytest.raises(NotInvariantError, match="computes attention in fp32.*specbeam-export -p int8"):
        engine.generate(PROMPT[:6], num_beams=2, max_new_tokens=4, speculative=SpeculativeConfig(adaptive=False))
    [no_draft] = plain(Engine(old), PROMPT[:6], num_beams=2, max_new_tokens=4)    # plain search still runs
    # ...and gives the search the refused engine gives without speculation (it asserted only a non-empty output)
    [same] = plain(engine, PROMPT[:6], num_beams=2, max_new_tokens=4)
    assert no_draft.hypotheses[0].tokens == same.hypotheses[0].tokens
