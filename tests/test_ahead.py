"""The lookahead head (export/ahead.py): a side branch of the target graph that guesses the token after each
node's best next token. Attaching it leaves every target output bit for bit as it was; its guesses equal the
numpy reference; speculation with it (drafter='ahead', no draft model) equals plain search, and with guesses
that are right it scores two tokens a pass."""
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from export import ahead
from specbeam_edge import Engine, SpeculativeConfig
from export.embedding import dequantize_embed
from specbeam_edge.execution.model import OnnxCausalLM
from specbeam_edge.decoding.search import ExactSearch
from helpers import assert_same_hypotheses

PROMPTS = [[3, 17, 33, 8, 99, 41, 7], [250, 12, 9, 77]]
GUESSES = 2
DEPTH = 3        # levels: GUESSES first-level guesses, then a chain of DEPTH - 1 below the first
COLS = GUESSES + DEPTH - 1


@pytest.fixture(scope="module")
def folders(exported, tmp_path_factory):
    """The same tiny target with and without a (random) lookahead head."""
    plain = exported("llama", output="both", std=0.3, seed=3)
    with_head = tmp_path_factory.mktemp("ahead") / "target"
    shutil.copytree(plain, with_head)
    cfg = OnnxCausalLM(plain).cfg
    rng = np.random.default_rng(5)
    tokens = np.sort(rng.choice(cfg.vocab_size, 40, replace=False))
    weights = ahead.random_weights(cfg.hidden_size, seed=1, scale=0.3)
    ahead.attach(with_head, weights, tokens, guesses=GUESSES, depth=DEPTH, digest="test")
    return {"plain": plain, "ahead": str(with_head), "weights": weights, "tokens": tokens}


def _tree_inputs(m, n_past=5):
    """A prompt pass, then a branching tree pass over it (the inputs of the second)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(3, m.cfg.vocab_size, (1, n_past))
    _, past = m.forward(ids, np.arange(n_past)[None], np.tril(np.ones((n_past, n_past), bool))[None, None],
                        m.empty_past())
    tree = np.array([[11, 12, 13, 14]])
    mask = np.ones((1, 1, 4, n_past + 4), bool)
    mask[0, 0, :, n_past:] = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 1]], bool)
    return tree, np.array([[n_past, n_past + 1, n_past + 1, n_past]]), mask, past


def test_attaching_the_head_leaves_every_target_output_as_it_was(folders):
    a, b = OnnxCausalLM(folders["plain"]), OnnxCausalLM(folders["ahead"])
    assert b.ahead["guesses"] == GUESSES and b.ahead["depth"] == DEPTH and a.ahead is None
    ids, pos, mask, past = _tree_inputs(a)
    for topk in (None, 5):
        ha, pa = a.forward(ids, pos, mask, past, topk=topk)
        hb, pb = b.forward(ids, pos, mask, past, topk=topk, ahead=True)
        if topk is None:
            np.testing.assert_array_equal(ha, hb)
        else:
            assert len(hb) == 4                      # top-k log-probs, ids, then the head's guesses
            assert len(b.forward(ids, pos, mask, past, topk=topk)[0]) == 2       # a pass without the head
            np.testing.assert_array_equal(ha[0], hb[0])
            np.testing.assert_array_equal(ha[1], hb[1])
            assert hb[2].shape == hb[3].shape == (1, 4, COLS)
        for (ka, va), (kb, vb) in zip(pa, pb):
            np.testing.assert_array_equal(ka, kb)
            np.testing.assert_array_equal(va, vb)


def test_the_guesses_are_the_heads_arithmetic(folders):
    """The graph's guesses equal export.ahead.reference over the graph's own final hidden state."""
    m = OnnxCausalLM(folders["ahead"])
    model = onnx.load(str(m.folder / "model.onnx"))
    sess = ort.InferenceSession(ahead.with_hidden_output(model).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    ids, pos, mask, past = _tree_inputs(m)
    feed = {"input_ids": ids, "position_ids": pos, "attention_mask": m.additive_mask(mask),
            "topk": np.array([3], np.int64), "ahead_on": np.array([True])}
    for (kn, vn), (k, v) in zip(m.runner.past_names, past):
        feed[kn], feed[vn] = k, v
    top, lp, gid, h = sess.run(["topk_ids", "ahead_logprobs", "ahead_ids", "final_h"], feed)
    E = next(onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.name == "embed.weight")
    ref_lp, ref_ids = ahead.reference(h, top[..., 0], E, folders["weights"], folders["tokens"], GUESSES,
                                      ahead._rms_eps(model), depth=DEPTH)
    assert gid.shape == (1, 4, COLS)
    np.testing.assert_array_equal(gid, ref_ids)
    np.testing.assert_allclose(lp, ref_lp, atol=1e-4)
    assert set(np.unique(gid)) <= set(folders["tokens"].tolist())


@pytest.mark.parametrize("K", [1, 2, 4])
def test_speculation_with_the_head_equals_plain_search(folders, K):
    ref, fast = Engine(folders["plain"]), Engine(folders["ahead"])
    spec = SpeculativeConfig(drafter="ahead", adaptive=False, budget=8, max_branch_width=GUESSES, max_depth=DEPTH)
    for prompt in PROMPTS:
        [a] = ref.generate(prompt, num_beams=K, max_new_tokens=14, num_return_sequences=K)
        [b] = fast.generate(prompt, num_beams=K, max_new_tokens=14, num_return_sequences=K, speculative=spec)
        # tokens exactly; scores to 1e-5: an fp32 graph's sums round by the rows in a pass in the last bit on
        # CPUs with AVX-512 (as with a draft model; DESIGN "Quantized targets" point 1)
        assert_same_hypotheses(a, b)
        if K == 1:
            assert b.stats.draft_tokens_proposed > 0 and b.stats.draft_passes == 0


@pytest.mark.parametrize("depth", [1, 2, DEPTH])
def test_right_guesses_give_depth_plus_one_tokens_a_pass(folders, monkeypatch, depth):
    """An oracle in the head's place (each row's first guess and chain set to the tokens plain greedy search says
    next): every guess is taken, so every pass after the prompt's gives depth + 1 tokens, and the output is still
    plain search's. The search's own proposal code runs; only the head's numbers are replaced."""
    ref, fast = Engine(folders["plain"]), Engine(folders["ahead"])
    spec = SpeculativeConfig(drafter="ahead", adaptive=False, budget=8, max_branch_width=1, max_depth=depth)
    original = ExactSearch._guesses
    new = 16
    for prompt in PROMPTS:
        [a] = ref.generate(prompt, num_beams=1, max_new_tokens=new, min_new_tokens=new)
        seq = list(prompt) + list(a.hypotheses[0].tokens)

        def oracle(self, budget, seq=seq):
            for n in self.bs.running:
                p = self.tree.parents[n]
                if p in self.rows:
                    head, j = self.rows[p]
                    d = self.tree.depths[n]
                    cols = [0] + list(range(GUESSES, COLS))       # the first guess, then the chain
                    for c, t in zip(cols, seq[d + 1:]):
                        head.ahead_ids[j, c] = t
            return original(self, budget)

        monkeypatch.setattr(ExactSearch, "_guesses", oracle)
        [b] = fast.generate(prompt, num_beams=1, max_new_tokens=new, min_new_tokens=new, speculative=spec)
        monkeypatch.setattr(ExactSearch, "_guesses", original)
        assert b.hypotheses[0].tokens == a.hypotheses[0].tokens
        # the prompt's pass gives one token (no guess yet), every later pass depth + 1
        assert b.stats.target_passes == 1 + -(-(new - 1) // (depth + 1))


def test_the_head_needs_a_target_that_has_one(folders):
    eng = Engine(folders["plain"])
    with pytest.raises(ValueError, match="lookahead head"):
        eng.generate(PROMPTS[0], num_beams=1, max_new_tokens=4, speculative=SpeculativeConfig(drafter="ahead"))
    with pytest.raises(ValueError, match="already has a lookahead head"):
        ahead.attach(folders["ahead"], folders["weights"], folders["tokens"])


def test_an_int8_targets_head_runs_in_int8_and_leaves_the_target_as_it_was(exported, tmp_path):
    """On an int8 target the head's MatMuls are per-row int8 too (onnxruntime runs the head in every pass): the
    target's outputs stay bit for bit, and the guesses are the fp32 reference's on nearly every row."""
    src = exported("llama", precision="int8", output="both", std=0.3, seed=3)
    dst = tmp_path / "int8"
    shutil.copytree(src, dst)
    a = OnnxCausalLM(src)
    rng = np.random.default_rng(2)
    tokens = np.sort(rng.choice(a.cfg.vocab_size, 40, replace=False))
    weights = ahead.random_weights(a.cfg.hidden_size, seed=1, scale=0.3)
    ahead.attach(dst, weights, tokens, guesses=GUESSES, depth=DEPTH)
    b = OnnxCausalLM(dst)
    model = onnx.load(str(dst / "model.onnx"))
    [cond] = [n for n in model.graph.node if n.op_type == "If" and n.input[0] == "ahead_on"]
    then = next(a.g for a in cond.attribute if a.name == "then_branch")
    assert sum(n.op_type == "MatMulInteger" for n in then.node) == 3 * DEPTH    # 3 a level
    ids, pos, mask, past = _tree_inputs(a)
    ha, pa = a.forward(ids, pos, mask, past, topk=5)
    hb, pb = b.forward(ids, pos, mask, past, topk=5)
    np.testing.assert_array_equal(ha[0], hb[0])
    np.testing.assert_array_equal(ha[1], hb[1])
    for (ka, va), (kb, vb) in zip(pa, pb):
        np.testing.assert_array_equal(kb, ka)
    sess = ort.InferenceSession(ahead.with_hidden_output(model).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    feed = {"input_ids": ids, "position_ids": pos, "attention_mask": b.additive_mask(mask),
            "topk": np.array([3], np.int64), "ahead_on": np.array([True])}
    for (kn, vn), (k, v) in zip(b.runner.past_names, past):
        feed[kn], feed[vn] = k, v
    top, gid, h = sess.run(["topk_ids", "ahead_ids", "final_h"], feed)
    table = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.name.startswith("embed.")}
    E = dequantize_embed(table["embed.weight.i8"], table["embed.weight.blockscale"])    # the int8 table's values
    _, ref_ids = ahead.reference(h, top[..., 0], E, weights, tokens, GUESSES, ahead._rms_eps(model), depth=DEPTH)
    assert (gid[..., 0] == ref_ids[..., 0]).mean() >= 0.75


def test_the_recipes_torch_head_is_the_graphs_head():
    """models/smollm2/ahead.py trains `Head`; the graph computes export.ahead's arithmetic: the two agree, so a
    trained head guesses in the graph what it guessed in training."""
    torch = pytest.importorskip("torch")
    from models.smollm2.ahead import Head

    rng = np.random.default_rng(0)
    E = rng.standard_normal((50, 16)).astype(np.float32)
    tokens = np.arange(5, 45)
    head = Head(E, tokens, 1e-5)
    w = ahead.random_weights(16, seed=3, scale=0.3)
    w["b1"], w["b2"], w["norm"] = (rng.standard_normal(16).astype(np.float32) for _ in range(3))
    head.load({k: torch.from_numpy(v) for k, v in w.items()})
    h, nxt = rng.standard_normal((7, 16)).astype(np.float32), rng.integers(0, 50, 7)
    with torch.no_grad():
        lp = torch.log_softmax(head.logits(torch.from_numpy(h), torch.from_numpy(nxt)), -1).numpy()
    ref_lp, ref_ids = ahead.reference(h, nxt, E, w, tokens, 3, 1e-5, depth=3)
    np.testing.assert_array_equal(tokens[np.argsort(-lp, -1)[:, :3]], ref_ids[:, :3])
    np.testing.assert_allclose(np.sort(lp, -1)[:, ::-1][:, :3], ref_lp[:, :3], atol=1e-5)
    # the chain: level k reads level k - 1's predicted state and its best guess, as the graph does
    with torch.no_grad():
        y, g = torch.from_numpy(h), torch.from_numpy(nxt)
        for level in range(3):
            y, logits = head.step(y, g)
            lp = torch.log_softmax(logits, -1).numpy()
            g = torch.from_numpy(tokens[lp.argmax(-1)])
            if level:
                np.testing.assert_array_equal(g.numpy(), ref_ids[:, 2 + level])
                np.testing.assert_allclose(lp.max(-1), ref_lp[:, 2 + level], atol=1e-5)


def test_min_path_prob_keeps_only_the_guesses_the_head_believes(folders):
    """With min_path_prob the tree holds only guesses whose path probability under the head (the product of its
    levels' probabilities from the beam) is at least that: fewer guesses, and the output is still plain
    search's."""
    ref, fast = Engine(folders["plain"]), Engine(folders["ahead"])
    floor = 0.06
    proposed = {}
    for min_prob in (0.0, floor):
        spec = SpeculativeConfig(drafter="ahead", adaptive=False, budget=8, max_branch_width=GUESSES,
                                 max_depth=DEPTH, min_path_prob=min_prob)
        proposed[min_prob] = 0
        for prompt in PROMPTS:
            [a] = ref.generate(prompt, num_beams=1, max_new_tokens=14)
            [b] = fast.generate(prompt, num_beams=1, max_new_tokens=14, speculative=spec)
            assert_same_hypotheses(a, b)
            proposed[min_prob] += b.stats.draft_tokens_proposed
    assert 0 < proposed[floor] < proposed[0.0]


def test_a_full_disk_while_attaching_leaves_no_tmp_file_and_the_folder_as_it_was(folders, tmp_path, monkeypatch):
    """Issue 50 row 15: a disk that fills up while the graph with its head is written left a model-sized
    `model.onnx.ahead.tmp` in the model folder; now nothing is left and the folder is unchanged."""
    import errno
    dst = tmp_path / "target"
    shutil.copytree(folders["plain"], dst)
    before = {p.name: p.read_bytes() for p in dst.iterdir() if p.is_file()}

    def full(model, path, *a, **k):
        Path(path).write_bytes(b"half a graph")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(ahead.onnx, "save", full)
    with pytest.raises(OSError):
        ahead.attach(dst, folders["weights"], folders["tokens"], guesses=GUESSES, depth=DEPTH)
    assert {p.name: p.read_bytes() for p in dst.iterdir() if p.is_file()} == before
