"""fp16-compute graphs (export --compute fp16, for GPUs): weights, activations and KV cache in fp16, logits fp32.
Parity with PyTorch within fp16's tolerance on the tree scenario, an fp16 cache in the runtime, exact speculation
and batching on the same graph, and clear refusals where it does not apply."""
import json

import numpy as np
import pytest

from export import ExportError, export
from helpers import assert_same_hypotheses, plain, torch_path_logits
from specbeam_edge import Engine, SpeculativeConfig
from specbeam_edge.execution.model import OnnxCausalLM
from test_export import tree_scenario

TOL = 1e-2        # max |diff| / max |logit| (measured ~2e-3 on these tiny models; fp16 keeps 11 bits)
PROMPTS = [[3, 17, 33, 8, 99, 41, 7], [250, 12, 9, 77]]


@pytest.fixture(scope="module")
def fp16c(hf_models, tmp_path_factory):
    base = tmp_path_factory.mktemp("fp16c")
    out = {}
    for name in ("llama", "qwen2"):
        src, _ = hf_models(name)
        out[name] = export(src, base / name, compute="fp16", quiet=True)
    src, _ = hf_models("llama")
    out["topk"] = export(src, base / "topk", compute="fp16", output="topk", quiet=True)
    return out


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_fp16_compute_parity_with_torch(fp16c, hf_models, name):
    _, model = hf_models(name)
    cfg = json.loads((fp16c[name] / "specbeam_config.json").read_text())
    assert cfg["compute_dtype"] == "float16" and cfg["precision"] == "fp16" and cfg["kv_cache_dtype"] == "float16"
    lm = OnnxCausalLM(fp16c[name])
    assert lm.kv_dtype == np.float16 and lm.empty_past()[0][0].dtype == np.float16
    for ours, paths in tree_scenario(fp16c[name]):
        assert ours.dtype == np.float32
        ref = torch_path_logits(model, paths)
        assert np.abs(ours - ref).max() / np.abs(ref).max() < TOL


@pytest.mark.parametrize("K", [1, 4])
def test_fp16_compute_speculative_and_batched_equal_plain(fp16c, K):
    eng = Engine(fp16c["llama"], draft=fp16c["llama"])      # an oracle draft on the fp16 graph itself
    spec = SpeculativeConfig(adaptive=False, drafter="beam", budget=16, max_depth=4)
    kw = dict(num_beams=K, max_new_tokens=14, num_return_sequences=K)
    for prompt in PROMPTS:
        [ref] = plain(eng, prompt, **kw)
        [fast] = eng.generate(prompt, speculative=spec, **kw)
        assert_same_hypotheses(fast, ref, scores=False)
        assert fast.stats.target_passes < ref.stats.target_passes
    # speculative requests batched: plain search's output, request by request
    alone = [plain(eng, p, **kw)[0] for p in PROMPTS]
    for a, b in zip(alone, eng.generate(PROMPTS, max_batch_size=2, speculative=spec, **kw)):
        assert_same_hypotheses(a, b, scores=False)
        np.testing.assert_allclose([h.score for h in a.hypotheses], [h.score for h in b.hypotheses], atol=1e-3)


def test_fp16_compute_topk_head_keeps_fp32_log_probs(fp16c):
    full, topk = OnnxCausalLM(fp16c["llama"]), OnnxCausalLM(fp16c["topk"])
    P = len(PROMPTS[0])
    ids, pos, mask = np.array([PROMPTS[0]]), np.arange(P)[None], np.tril(np.ones((P, P), bool))[None, None]
    logits, _ = full.forward(ids, pos, mask, full.empty_past())
    (vals, idx), _ = topk.forward(ids, pos, mask, topk.empty_past(), topk=8)
    assert vals.dtype == np.float32
    lp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits.max(-1, keepdims=True)
    np.testing.assert_allclose(vals, np.take_along_axis(lp, idx, -1), atol=2e-2)


def test_fp16_compute_refusals(hf_models, tmp_path):
    src, _ = hf_models("llama")
    for kw in (dict(layout="split"), dict(precision="int8"), dict(precision="int4")):
        with pytest.raises(ExportError, match="compute fp16"):
            export(src, tmp_path / "x", compute="fp16", quiet=True, **kw)
    with pytest.raises(ExportError, match="compute"):
        export(src, tmp_path / "y", compute="bf16", quiet=True)
    from export.__main__ import main
    assert main(["-i", str(src), "-o", str(tmp_path / "z"), "--compute", "fp16", "--layout", "split", "-q"]) == 2
    assert main(["-i", str(src), "-o", str(tmp_path / "z"), "--compute", "fp16", "-q"]) == 0
    assert json.loads((tmp_path / "z" / "specbeam_config.json").read_text())["compute_dtype"] == "float16"
