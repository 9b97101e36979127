"""Export parity with PyTorch, split == whole, top-k head, and clear errors for bad input."""
import json
import shutil

import numpy as np
import pytest

from export import ExportError, export
from helpers import torch_path_logits
from specbeam_edge.execution.batch import score_one
from specbeam_edge.decoding.cache import TokenTree, TreeCache
from specbeam_edge.config import ModelFolderError
from specbeam_edge.execution.model import OnnxCausalLM

PROMPT = [5, 17, 33, 8, 99, 41, 7, 250, 61]
# two roots and depth 3 below the prompt: parents index into this list (-1 = child of the prompt's last token)
TREE_PARENTS = [-1, -1, 0, 0, 1, 2, 5]
TREE_TOKENS = [11, 12, 13, 14, 15, 16, 17]
# measured on these tiny random models (logit std ~0.6): max |diff| / max |logit|
TOL = {"fp32": 1e-5, "fp16": 2e-3, "int8w": 2e-2, "int8": 3e-2, "int8dyn": 3e-2, "int4": 0.2}


def tree_scenario(folder):
    """Prefill, a branching tree step over the past, and a step after compaction to one path.
    Returns [(ours [Q, V], token paths)] for the three phases."""
    lm = OnnxCausalLM(folder)
    tree = TokenTree()
    prompt_nodes = tree.add_chain(PROMPT)
    cache = TreeCache(lm, tree)
    phases = [(score_one(cache, prompt_nodes).logits, [PROMPT[:i + 1] for i in range(len(PROMPT))])]
    nodes = []
    for p, t in zip(TREE_PARENTS, TREE_TOKENS):
        nodes.append(tree.add(prompt_nodes[-1] if p < 0 else nodes[p], t))
    phases.append((score_one(cache, nodes).logits, [tree.path(n) for n in nodes]))
    keep = nodes[5]                       # path prompt -> 12 -> 15 -> 16
    assert cache.compact([keep], min_dead_fraction=0.0)
    assert len(cache) == len(PROMPT) + 3
    nxt = [tree.add(keep, 40), tree.add(keep, 41)]
    nxt.append(tree.add(nxt[0], 42))
    phases.append((score_one(cache, nxt).logits, [tree.path(n) for n in nxt]))
    return phases


@pytest.mark.parametrize("name", ["llama", "llama3rope", "qwen2", "mistral"])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8w", "int8", "int8dyn", "int4"])
def test_parity_with_torch(name, precision, hf_models, exported):
    _, model = hf_models(name)
    folder = exported(name, precision)
    for ours, paths in tree_scenario(folder):
        ref = torch_path_logits(model, paths)
        err = np.abs(ours - ref).max() / np.abs(ref).max()
        assert err < TOL[precision], (name, precision, err)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8w", "int8"])
def test_tree_pass_equals_single_paths(precision, exported):
    """Exact speculation compares a tree pass with one-path passes, so a target's precision must be
    batch-invariant: each node's logits in the branching tree pass equal those of its path scored alone. int8w
    stores int8 weights but computes in fp32 (onnxruntime folds the dequantization at load), so it qualifies,
    at about half of fp16's size; int8 computes in int8 with one activation scale per row; int8dyn (one scale per
    tensor) does not, and says so."""
    folder = exported("qwen2", precision)
    cfg = json.loads((folder / "specbeam_config.json").read_text())
    assert cfg["batch_invariant"] is True and cfg["precision"] == precision
    _, (tree_logits, paths), _ = tree_scenario(folder)
    lm = OnnxCausalLM(folder)
    for row, path in zip(tree_logits, paths):
        tree = TokenTree()
        alone = score_one(TreeCache(lm, tree), tree.add_chain(path)).logits[-1]
        np.testing.assert_allclose(row, alone, atol=1e-5 * np.abs(alone).max(), rtol=0)
    if precision == "int8w":
        def size(f):            # the graph and its tensors (model.onnx.data)
            return sum(p.stat().st_size for p in f.glob("model.onnx*"))
        assert size(folder) < 0.6 * size(exported("qwen2", "fp16"))
        assert cfg["quantization"]["weight_type"] == "int8"
        dynamic = json.loads((exported("qwen2", "int8dyn") / "specbeam_config.json").read_text())
        assert dynamic["batch_invariant"] is False


@pytest.mark.parametrize("precision", ["fp16", "int8w"])
def test_stored_weights_are_widened_once_at_load(precision, exported, tmp_path):
    """fp16 and int8w weights reach the graph through Cast (x scale) nodes of initializers, which onnxruntime
    folds into fp32 weights when it loads the graph: the runtime's session options leave none of them to run
    on every pass, however large (onnxruntime's default skips outputs over 1 GiB: a large embedding would then
    be widened per pass). An int8w graph under a small folding limit keeps them, so the check can fail."""
    import onnx
    import onnxruntime as ort

    from specbeam_edge.execution.sessions import session_options

    folder = exported("llama", precision)

    def widening_nodes(limit):
        so = session_options(1, fold_limit_bytes=limit)
        so.optimized_model_filepath = str(tmp_path / f"opt_{limit}.onnx")
        ort.InferenceSession(str(folder / "model.onnx"), so, providers=["CPUExecutionProvider"])
        g = onnx.load(so.optimized_model_filepath, load_external_data=False).graph   # (names only)
        inits = {t.name for t in g.initializer}
        return [n.name for n in g.node if n.op_type == "Cast" and n.input[0] in inits]

    assert widening_nodes(0) == []
    if precision == "int8w":       # (fp16 initializers are widened by another of onnxruntime's rewrites)
        assert len(widening_nodes(64)) > 0


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8w", "int8"])
def test_split_equals_whole(precision, exported):
    """Streamed layers compute as the whole graph does: int8w (int8 weights, DequantizeLinear + fp32 MatMul per
    pass: CUDA has both kernels) and int8 (per-row int8 compute on the streamed int8 weights)."""
    split = tree_scenario(exported("qwen2", precision, "split"))
    whole = tree_scenario(exported("qwen2", precision, "whole"))
    for (a, _), (b, _) in zip(split, whole):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", ["whole", "split"])
def test_topk_head_matches_full_logits(layout, exported):
    full = OnnxCausalLM(exported("llama", "fp32", layout))
    topk = OnnxCausalLM(exported("llama", "fp32", layout, output="topk"))
    P = len(PROMPT)
    ids, pos = np.array([PROMPT]), np.arange(P)[None]
    mask = np.tril(np.ones((P, P), bool))[None, None]
    logits, _ = full.forward(ids, pos, mask, full.empty_past())
    (vals, idx), _ = topk.forward(ids, pos, mask, topk.empty_past(), topk=8)
    lp = logits - logits.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    ref_idx = np.argsort(-lp, axis=-1, kind="stable")[..., :8]
    np.testing.assert_array_equal(idx, ref_idx)
    np.testing.assert_allclose(vals, np.take_along_axis(lp, ref_idx, -1), atol=1e-5)


def test_export_cli_and_config(hf_models, tmp_path):
    from export.__main__ import main

    src, _ = hf_models("llama")
    out = tmp_path / "m"
    assert main(["-i", str(src), "-o", str(out), "-p", "int8", "-q"]) == 0
    cfg = json.loads((out / "specbeam_config.json").read_text())
    assert cfg["precision"] == "int8" and "per-row int8" in cfg["quantization"]["method"]
    assert cfg["num_kv_heads"] == 2 and cfg["layout"] == "whole" and cfg["batch_invariant"]
    # 7-bit weights by default (no int16 saturation on CPUs without VNNI); --full_range: 8 bits
    import onnx

    def widest(folder):
        q8 = [onnx.numpy_helper.to_array(t) for t in onnx.load(str(folder / "model.onnx")).graph.initializer
              if t.data_type == onnx.TensorProto.INT8 and not t.name.startswith("embed.")]   # (a table: no sums)
        return q8 and max(int(np.abs(q.astype(np.int16)).max()) for q in q8)
    assert widest(out) == 64 and cfg["quantization"]["reduce_range"] is True
    assert main(["-i", str(src), "-o", str(tmp_path / "r"), "-p", "int8", "--full_range", "-q"]) == 0
    assert widest(tmp_path / "r") == 127
    assert main(["-i", str(src), "-o", str(tmp_path / "d"), "-p", "int8dyn", "-q"]) == 0
    dyn = json.loads((tmp_path / "d" / "specbeam_config.json").read_text())
    assert "quantize_dynamic" in dyn["quantization"]["method"] and dyn["batch_invariant"] is False
    assert main(["-i", str(src), "-o", str(out), "-q"]) == 2          # exists: refused
    assert main(["-i", str(src), "-o", str(out), "-q", "--overwrite"]) == 0


def _no_leftovers(parent):
    return not [p for p in parent.iterdir() if p.name.startswith(".")]


def test_bad_inputs(hf_models, tmp_path):
    src, _ = hf_models("llama")
    # a folder without weights
    nowt = tmp_path / "noweights"
    shutil.copytree(src, nowt)
    for f in nowt.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ExportError, match="safetensors"):
        export(nowt, tmp_path / "o1", quiet=True)
    # an unsupported architecture
    gpt = tmp_path / "gpt"
    shutil.copytree(src, gpt)
    cfg = json.loads((gpt / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (gpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="not supported"):
        export(gpt, tmp_path / "o2", quiet=True)
    # a config whose shapes do not match the weights
    bad = tmp_path / "badshape"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="shape"):
        export(bad, tmp_path / "o3", quiet=True)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o3").exists()
    assert _no_leftovers(tmp_path)
    # an output folder that exists
    (tmp_path / "exists").mkdir()
    with pytest.raises(ExportError, match="overwrite"):
        export(src, tmp_path / "exists", quiet=True)


def test_loader_validation(exported, tmp_path):
    good = exported("llama", "fp32", "split")
    with pytest.raises(ModelFolderError, match="does not exist"):
        OnnxCausalLM(tmp_path / "nope")
    broken = tmp_path / "broken"
    shutil.copytree(good, broken)
    (broken / "weights" / "layer_1.bin").unlink()
    with pytest.raises(ModelFolderError, match="layer_1.bin"):
        OnnxCausalLM(broken)
    trunc = tmp_path / "trunc"
    shutil.copytree(good, trunc)
    data = (trunc / "weights" / "layer_0.bin").read_bytes()
    (trunc / "weights" / "layer_0.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFolderError, match="truncated"):
        OnnxCausalLM(trunc)
    nocfg = tmp_path / "nocfg"
    shutil.copytree(good, nocfg)
    (nocfg / "specbeam_config.json").unlink()
    with pytest.raises(ModelFolderError, match="specbeam_config.json"):
        OnnxCausalLM(nocfg)
    wrong = tmp_path / "wrong"
    shutil.copytree(exported("llama"), wrong)
    cfg = json.loads((wrong / "specbeam_config.json").read_text())
    cfg["num_layers"] = 3
    (wrong / "specbeam_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFolderError, match="num_layers is 3, but model.onnx has 2 layers"):
        OnnxCausalLM(wrong)


@pytest.mark.parametrize("shape", [(5000, 37), (3, 9000), (8193, 100)])
def test_the_streamed_layers_quantize_as_the_graph_does(shape):
    """quant.quantize_columns works a chunk of rows at a time (the exporter's memory is a chunk, not 4x the
    matrix): bit for bit the whole-matrix arithmetic it replaced, which the graphs' per-row int8 was built with."""
    from export.quant import quantize_columns

    rng = np.random.default_rng(0)
    w = (rng.standard_normal(shape) * rng.random(shape[1])).astype(np.float32)
    for reduce_range in (True, False):
        qmax = 64.0 if reduce_range else 127.0
        scale = (np.maximum(np.abs(w).max(axis=0), 1e-12) / qmax).astype(np.float32)
        whole = (np.clip(np.rint(w / scale), -qmax, qmax).astype(np.int8), scale)
        for a, b in zip(whole, quantize_columns(w, reduce_range)):
            assert a.dtype == b.dtype and np.array_equal(a, b)
