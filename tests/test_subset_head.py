"""A draft whose head scores only some tokens (`lm_head.token_ids`): the SmolLM2 draft keeps 8,192 of 49,152 so a
draft level costs a fraction of a target pass. The graph maps the head's columns back to vocabulary ids (top-k)
and spreads its logits over the vocabulary with -inf elsewhere; the target still scores every token, so
speculative output stays identical to plain search."""
import json
import shutil

import numpy as np
import pytest

from export import export
from export.hf import ExportError
from specbeam_edge import Engine, SpeculativeConfig
from specbeam_edge.model import OnnxCausalLM
from helpers import assert_same_hypotheses

SUBSET = np.array(sorted({0, 1, *range(2, 320, 3)}), np.int64)       # the EOS (0) and every third token


def subset_copy(src, dst, ids=SUBSET):
    """The HF folder `src` with its head cut to the rows of `ids` (and those ids stored beside it)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    [f] = sorted(dst.glob("*.safetensors"))
    w = load_file(f)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    w["lm_head.weight"] = np.ascontiguousarray(head[ids])
    w["lm_head.token_ids"] = np.asarray(ids, np.int64)
    save_file(w, f)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def draft_src(hf_models, tmp_path_factory):
    src, _ = hf_models("llama", std=0.3, seed=11, layers=1)
    return subset_copy(src, tmp_path_factory.mktemp("subset") / "draft")


def _pass(folder, topk=4):
    m = OnnxCausalLM(folder)
    ids = np.array([[3, 17, 33, 8, 99, 41, 7]], np.int64)
    T = ids.shape[1]
    mask = np.tril(np.ones((T, T), bool))[None, None]
    (lp, top), _ = m.forward(ids, np.arange(T)[None], mask, m.empty_past(1), topk=topk)
    logits, _ = m.forward(ids, np.arange(T)[None], mask, m.empty_past(1))
    return logits[0], lp[0], top[0]


@pytest.mark.parametrize("layout", ["whole", "split"])
def test_subset_head_scores_its_tokens_as_the_full_head(exported, draft_src, tmp_path, layout):
    full = exported("llama", std=0.3, seed=11, layers=1, output="both", layout=layout)
    sub = export(draft_src, tmp_path / "sub", precision="fp32", layout=layout, output="both", quiet=True)
    f_logits, _, _ = _pass(full)
    s_logits, s_lp, s_top = _pass(sub)
    np.testing.assert_allclose(s_logits[:, SUBSET], f_logits[:, SUBSET], rtol=1e-5, atol=1e-5)
    outside = np.setdiff1d(np.arange(f_logits.shape[1]), SUBSET)
    assert np.isneginf(s_logits[:, outside]).all()
    # its top-k: the best subset tokens, as vocabulary ids, with log-probs normalised over the subset
    cut = f_logits[:, SUBSET]
    want_lp = cut - np.log(np.exp(cut - cut.max(-1, keepdims=True)).sum(-1, keepdims=True)) - cut.max(-1, keepdims=True)
    order = np.argsort(-cut, axis=-1, kind="stable")[:, :4]
    np.testing.assert_array_equal(s_top, SUBSET[order])
    np.testing.assert_allclose(s_lp, np.take_along_axis(want_lp, order, -1), atol=1e-5)


@pytest.mark.parametrize("num_beams", [1, 4])
def test_speculation_with_a_subset_head_draft_equals_plain(exported, draft_src, tmp_path, num_beams):
    target = exported("llama", std=0.3, seed=3, output="both")
    draft = export(draft_src, tmp_path / "d", precision="fp32", output="both", quiet=True)
    plain = Engine(target)
    spec = Engine(target, draft=draft)
    cfg = SpeculativeConfig(adaptive=False, budget=16, max_depth=4)
    for prompt in ([3, 17, 33, 8, 99, 41, 7], [250, 12, 9, 77]):
        [a] = plain.generate(prompt, num_beams=num_beams, max_new_tokens=16, num_return_sequences=num_beams)
        [b] = spec.generate(prompt, speculative=cfg, num_beams=num_beams, max_new_tokens=16, num_return_sequences=num_beams)
        assert_same_hypotheses(a, b, scores=False)
        assert b.stats.draft_passes > 0                                  # the draft grew trees


def test_subset_head_ids_must_be_distinct_vocabulary_ids(hf_models, tmp_path):
    src, _ = hf_models("llama", std=0.3, seed=11, layers=1)
    bad = subset_copy(src, tmp_path / "bad", ids=np.array([0, 5, 5, 7]))
    with pytest.raises(ExportError, match="lm_head.token_ids must hold distinct token ids"):
        export(bad, tmp_path / "out", precision="fp32", quiet=True)
