"""A KV cache stored in fp16 (`export --kv_cache fp16`): half the bytes of a long prompt's cache, and every
equality the fp32 cache keeps. Each new key and value is rounded to fp16 before its first use, so a token scored
in a tree pass sees the numbers a plain step reads back from the cache: speculative == plain and batched ==
alone hold bit for bit; against the fp32 cache the log-probs move by the rounding only (a stated tolerance)."""
import json

import numpy as np
import pytest

from export import export
from export.hf import ExportError
from specbeam_edge import Engine, SpeculativeConfig
from specbeam_edge.decoding.cache import TreeCache
from specbeam_edge.decoding.protocol import ScoreCall
from specbeam_edge.decoding.tree import TokenTree
from specbeam_edge.execution import heads
from specbeam_edge.execution.batch import score_batch
from specbeam_edge.execution.model import OnnxCausalLM
from encdec_models import make_encdec_model
from family_models import check_parity, make_family_model
from helpers import assert_same_hypotheses, speculative_equals_plain

PROMPT = np.random.default_rng(0).integers(3, 250, 150).tolist()     # over batch.PROMPT_ROWS: the fp32 branch runs
TARGET = dict(std=0.3, seed=3)
SEARCH = {"phi4mini": {"original_max_position_embeddings": 32}}    # as test_families.SEARCH
# the largest change of the prompt's top-4 log-probs the fp16 cache made here, measured: 0.022 with int8 (per-row int8
# activations turn a rounded key into whole quantization steps a layer later) and 3e-4 with fp32 weights
TOLERANCE = {"int8": 0.05, "fp32": 2e-3}


def _prompt_scores(folder, prompt=PROMPT):
    """(top-4 log-probs and ids of the prompt's last token, the cache's arrays) after one prompt call."""
    model = OnnxCausalLM(folder)
    tree = TokenTree()
    cache = TreeCache(model, tree)
    [out] = score_batch([ScoreCall(cache, tree.add_chain(prompt), topk=4, head_from=len(prompt) - 1)])
    if isinstance(out, heads.TopKOutput):
        return out.logprobs[-1], out.ids[-1], cache.past
    lp = out.logits[-1] - np.logaddexp.reduce(out.logits[-1])
    ids = np.argsort(-lp)[:4]
    return lp[ids], ids, cache.past


@pytest.mark.parametrize("layout", ["whole", "split"])
def test_an_fp16_cache_is_declared_stored_and_half_the_bytes(exported, layout):
    """The graph declares its KV inputs and outputs fp16, the config says so, the runtime keeps the arrays in
    fp16 (half the fp32 cache's bytes) and the answer's best tokens are those of the fp32 cache."""
    half = exported("llama", "int8", layout, "both", kv_cache="fp16", **TARGET)
    full = exported("llama", "int8", layout, "both", kv_cache="fp32", **TARGET)
    assert json.loads((half / "specbeam_config.json").read_text())["kv_cache_dtype"] == "float16"
    assert json.loads((full / "specbeam_config.json").read_text())["kv_cache_dtype"] == "float32"
    assert OnnxCausalLM(half).kv_dtype == np.float16 and OnnxCausalLM(full).kv_dtype == np.float32
    lp16, ids16, kv16 = _prompt_scores(half)
    lp32, ids32, kv32 = _prompt_scores(full)
    assert all(k.dtype == np.float16 and v.dtype == np.float16 for k, v in kv16)
    assert sum(k.nbytes + v.nbytes for k, v in kv16) * 2 == sum(k.nbytes + v.nbytes for k, v in kv32)
    (k16, v16), (k32, v32) = kv16[0], kv32[0]       # the first layer's inputs are the same: its rows are rounded
    assert np.array_equal(k16, k32.astype(np.float16)) and np.array_equal(v16, v32.astype(np.float16))
    assert not np.array_equal(k32, k16.astype(np.float32))
    assert ids16[0] == ids32[0]
    assert np.abs(lp16 - lp32).max() < TOLERANCE["int8"]


def _path_logprobs(folder, path):
    """The log-prob of each token of `path` after PROMPT, one decode step (one row) at a time on one cache."""
    model = OnnxCausalLM(folder)
    tree = TokenTree()
    cache = TreeCache(model, tree)
    node = tree.add_chain(PROMPT)
    out = []
    for t in path:
        [o] = score_batch([ScoreCall(cache, node, topk=None, head_from=len(node) - 1)])
        row = o.logits[-1]
        out.append(row[t] - np.logaddexp.reduce(row))
        node = [tree.add(node[-1], t)]
    return np.array(out)


@pytest.mark.parametrize("precision", ["int8", "fp32"])
def test_an_fp16_cache_scores_as_the_fp32_cache_within_the_rounding(exported, precision):
    """Twelve decode steps after a long prompt (its unread rows in the fused fp32 branch for int8; every pass
    fused for fp32), the same tokens fed to both: each step's log-prob stays within TOLERANCE of the fp32
    cache's."""
    path = np.random.default_rng(4).integers(3, 250, 12).tolist()
    half = _path_logprobs(exported("llama", precision, "whole", "both", kv_cache="fp16", **TARGET), path)
    full = _path_logprobs(exported("llama", precision, "whole", "both", kv_cache="fp32", **TARGET), path)
    assert 0 < np.abs(half - full).max() < TOLERANCE[precision]


@pytest.mark.parametrize("layout", ["whole", "split"])
@pytest.mark.parametrize("K", [1, 4])
def test_speculative_equals_plain_with_an_fp16_cache(exported, layout, K):
    """An int8 target with an fp16 cache: a tree pass scores its nodes with keys and values rounded as the cache
    holds them, so speculative search is plain search, over a prompt in chunks (its unread rows fused, in fp32)."""
    eng = Engine(exported("llama", "int8", layout, "both", kv_cache="fp16", **TARGET),
                 draft=exported("llama", **TARGET))          # its fp32 weights: most drafted tokens are accepted
    for m in (eng.target, eng.draft):
        m.prefill_chunk = 16
    spec = SpeculativeConfig(adaptive=False, budget=12, max_depth=4)
    ref, fast = speculative_equals_plain(eng, PROMPT, spec, num_beams=K, max_new_tokens=14, num_return_sequences=K)
    assert fast.stats.target_passes < ref.stats.target_passes          # drafted steps were accepted


@pytest.mark.parametrize("mode", ["plain", "speculative"])
def test_batched_equals_alone_with_an_fp16_cache(exported, mode):
    """Requests batched together (their caches padded into one array of fp16) answer bit for bit as alone."""
    eng = Engine(exported("llama", "int8", "whole", "both", kv_cache="fp16", **TARGET),
                 draft=exported("llama", std=0.3, seed=11, layers=1))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 250, int(n)).tolist() for n in (5, 9, 70)] + [[4, 8, 15]]
    kw = dict(num_beams=2, max_new_tokens=10, num_return_sequences=2,
              speculative=None if mode == "plain" else SpeculativeConfig(adaptive=False, budget=8, max_depth=3))
    alone = [eng.generate(p, **kw)[0] for p in prompts]
    together = eng.generate(prompts, max_batch_size=4, **kw)
    for a, b in zip(alone, together):
        assert_same_hypotheses(a, b, atol=0)
    assert max(max(r.stats.batch_sizes) for r in together) > 1


def test_the_cache_is_fp32_unless_asked_or_computed_in_fp16(exported, hf_models, tmp_path):
    """The default is fp32 in every precision and layout (split == whole), fp16 with fp16 compute; an
    encoder-decoder's cache stays fp32."""
    def kv(folder):
        return json.loads((folder / "specbeam_config.json").read_text())["kv_cache_dtype"]
    assert {kv(exported("llama", p, layout, **TARGET)) for p in ("fp32", "int8") for layout in ("whole", "split")} \
        == {kv(exported("llama", "int4", **TARGET))} == {"float32"}
    src, _ = hf_models("llama", **TARGET)
    assert kv(export(src, tmp_path / "h", compute="fp16", quiet=True)) == "float16"
    make_encdec_model(tmp_path / "marian", "marian", seed=3)
    assert kv(export(tmp_path / "marian", tmp_path / "m", precision="int8", quiet=True)) == "float32"


def test_kv_cache_refusals(hf_models, tmp_path):
    """One line naming the problem and the fix: an unknown type, an fp32 cache with fp16 compute, an
    encoder-decoder model."""
    src, _ = hf_models("llama", **TARGET)
    with pytest.raises(ExportError, match="kv_cache 'bf16' is not"):
        export(src, tmp_path / "a", kv_cache="bf16", quiet=True)
    with pytest.raises(ExportError, match="compute fp16 keeps its KV cache in fp16"):
        export(src, tmp_path / "b", compute="fp16", kv_cache="fp32", quiet=True)
    make_encdec_model(tmp_path / "marian", "marian", seed=3)
    with pytest.raises(ExportError, match="kv_cache fp16 is for decoder-only models"):
        export(tmp_path / "marian", tmp_path / "c", kv_cache="fp16", quiet=True)


@pytest.mark.parametrize("name", ["qwen3", "phi4mini", "gemma3"])
def test_the_family_kinds_with_an_fp16_cache(tmp_path, name):
    """q/k norms (Qwen3), partial rotary and LongRoPE's re-rotated cache keys (Phi-4-mini, its pretraining length
    crossed), sliding windows and sandwich norms (Gemma 3): with an fp16 cache the graph stays within fp16
    compute's tolerance of PyTorch (test_families.TOL), and an int8 target's speculative search is plain search."""
    model = make_family_model(tmp_path / "hf", name, seed=3)      # test_families' weights (measured: <= 9e-5)
    check_parity(export(tmp_path / "hf", tmp_path / "fp32", kv_cache="fp16", quiet=True), model, 2e-3)
    # below LongRoPE's pretraining length, as test_families' searches (a fixed cache cannot follow past it)
    make_family_model(tmp_path / "hf2", name, std=0.3, seed=3, **SEARCH.get(name, {}))
    target = export(tmp_path / "hf2", tmp_path / "int8", precision="int8", kv_cache="fp16", quiet=True)
    eng = Engine(target, draft=export(tmp_path / "hf2", tmp_path / "draft", quiet=True))
    spec = SpeculativeConfig(adaptive=False, drafter="beam", budget=24, max_depth=4, max_branch_width=3)
    for prompt in ([3, 17, 33, 8, 99, 41, 7], [250, 12, 9]):
        speculative_equals_plain(eng, prompt, spec, num_beams=2, max_new_tokens=10, num_return_sequences=2)
