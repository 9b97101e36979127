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
from specbeam_edge.execution.model import OnnxCausalLM
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


def _with_added_token(src, dst, token_id):
    """A copy of the HF folder `src` whose tokenizer names `token_id` as an added (special) token."""
    shutil.copytree(src, dst)
    spec = json.loads((dst / "tokenizer.json").read_text())
    spec.setdefault("added_tokens", []).append({"id": token_id, "content": "<|marker|>", "single_word": False,
                                                 "lstrip": False, "rstrip": False, "normalized": False,
                                                 "special": True})
    (dst / "tokenizer.json").write_text(json.dumps(spec))
    return dst


def test_head_tokens_keeps_the_low_ids_and_the_added_tokens(hf_models, exported, tmp_path):
    """`export --head_tokens N` (the Qwen2.5-Coder draft's head): the ids below N and the tokenizer's added tokens,
    scored as the full head scores them; every other token -inf."""
    src, _ = hf_models("llama", std=0.3, seed=11, layers=1)
    src = _with_added_token(src, tmp_path / "src", 300)
    full = export(src, tmp_path / "full", precision="fp32", output="both", quiet=True)
    cut = export(src, tmp_path / "cut", precision="fp32", output="both", quiet=True, head_tokens=100)
    spec = json.loads((src / "tokenizer.json").read_text())
    keep = np.array(sorted({*range(100), *(t["id"] for t in spec["added_tokens"])}), np.int64)
    assert 300 in keep
    cfg = json.loads((cut / "specbeam_config.json").read_text())
    assert cfg["head_tokens"]["below"] == 100 and cfg["head_tokens"]["count"] == len(keep)
    assert "head_tokens" not in json.loads((full / "specbeam_config.json").read_text())
    f_logits, _, _ = _pass(full)
    s_logits, _, s_top = _pass(cut)
    np.testing.assert_allclose(s_logits[:, keep], f_logits[:, keep], rtol=1e-5, atol=1e-5)
    assert np.isneginf(np.delete(s_logits, keep, axis=1)).all()
    assert np.isin(s_top, keep).all()


def test_head_tokens_of_a_head_already_cut_or_not_positive_is_refused(draft_src, tmp_path):
    with pytest.raises(ExportError, match="already scores a token subset"):
        export(draft_src, tmp_path / "a", precision="fp32", quiet=True, head_tokens=64)
    with pytest.raises(ExportError, match="head_tokens must be a positive number"):
        export(draft_src, tmp_path / "b", precision="fp32", quiet=True, head_tokens=0)


def test_a_head_tokens_int4_draft_leaves_speculative_output_unchanged(exported, hf_models, tmp_path):
    """As the Qwen2.5-Coder draft ships: int4, fp32 attention, its head cut."""
    src, _ = hf_models("llama", std=0.3, seed=11, layers=1)
    target = exported("llama", std=0.3, seed=3, output="both")
    draft = export(src, tmp_path / "d", precision="int4", output="both", quiet=True, head_tokens=120,
                   attention="fp32")
    plain, spec = Engine(target), Engine(target, draft=draft)
    cfg = SpeculativeConfig(adaptive=False, budget=12, max_depth=4)
    for num_beams in (1, 3):
        [a] = plain.generate([3, 17, 33, 8, 99], num_beams=num_beams, max_new_tokens=16)
        [b] = spec.generate([3, 17, 33, 8, 99], speculative=cfg, num_beams=num_beams, max_new_tokens=16)
        assert_same_hypotheses(a, b, scores=False)
        assert b.stats.draft_passes > 0


def test_a_cut_head_runs_as_a_draft_only(exported, hf_models, draft_src, tmp_path):
    """Before: a folder exported with --head_tokens ran as a target and answered garbage, exit 0 (it can never
    produce the tokens its head does not score)."""
    from specbeam_edge.commands import cli
    from specbeam_edge.config import ModelFolderError

    src, _ = hf_models("llama", std=0.3, seed=11, layers=1)
    cut = export(src, tmp_path / "cut", precision="fp32", output="both", quiet=True, head_tokens=100)
    sub = export(draft_src, tmp_path / "sub", precision="fp32", output="both", quiet=True)   # the checkpoint's own
    for folder, n in ((cut, json.loads((cut / "specbeam_config.json").read_text())["head_tokens"]["count"]),
                      (sub, len(SUBSET))):
        with pytest.raises(ModelFolderError) as e:
            Engine(folder)
        assert str(e.value) == (f"{folder}: its head scores {n} of its 320 tokens (a cut head: export --head_tokens), "
                                f"so it is a draft only; pass it as --draft beside its full model (or set "
                                f"head_tokens.target to true in its specbeam_config.json)")
    target = exported("llama", std=0.3, seed=3, output="both")
    assert Engine(target, draft=cut).generate("hello", max_new_tokens=3)[0].text is not None
    assert cli.main(["generate", "--model", str(cut), "--max_new_tokens", "2", "hello"]) == 2
    path = cut / "specbeam_config.json"
    cfg = json.loads(path.read_text())
    cfg["head_tokens"]["target"] = True                            # the folder says its answers never need the rest
    path.write_text(json.dumps(cfg))
    Engine(cut).generate("hello", max_new_tokens=2)
    cfg["head_tokens"]["count"] = 100000
    path.write_text(json.dumps(cfg))
    with pytest.raises(ModelFolderError, match=r"head_tokens must be \{count: 1 to 320, target: true or false\}"):
        Engine(cut)
