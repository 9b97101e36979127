"""int4 with a GGUF's own blocks (export/blocks.py): the codes and scales recovered from dequantized Q4_0 / Q4_1 /
Q8_0 weights rebuild them bit for bit, the MatMulNBits graph computes x @ W within int8-activation rounding, a row's
result does not depend on the other rows of its pass, and `-p int4` on a Q4_1 GGUF keeps the file's blocks."""
import json

import gguf
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as onh

from export.blocks import gguf_int4, recover

Q = gguf.GGMLQuantizationType
KINDS = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q8_0": Q.Q8_0}


def dequantized(kind: str, N: int, K: int, seed: int = 0) -> np.ndarray:
    """A [K, N] matrix as transformers hands it on: gguf-py's quantize then dequantize (blocks along K)."""
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.1
    t = KINDS[kind]
    return np.ascontiguousarray(gguf.quants.dequantize(gguf.quants.quantize(w, t), t).T)


def rebuilt(b) -> np.ndarray:
    zp = {"q4_0": 8, "q4_1": 0, "q8_0": 128}[b.kind]
    w = (b.scale[..., None] * (b.codes.astype(np.float32) - zp)).astype(np.float32)
    if b.offset is not None:
        w = w + b.offset[..., None]
    return w.reshape(b.codes.shape[0], -1).T


@pytest.mark.parametrize("kind", list(KINDS))
def test_recovered_blocks_rebuild_the_weights_bit_for_bit(kind):
    W = dequantized(kind, 40, 96)
    b = recover(W)
    assert b is not None and b.kind == kind
    assert np.array_equal(rebuilt(b), W)


def test_weights_off_every_grid_are_not_recovered():
    rng = np.random.default_rng(1)
    assert recover(rng.standard_normal((96, 8)).astype(np.float32)) is None       # plain fp32
    assert recover(dequantized("q4_1", 8, 96)[:80]) is None                       # K not a multiple of 32
    W = dequantized("q4_0", 8, 96)
    W[5, 3] += 1e-3                                                               # one value off the grid
    assert recover(W) is None


def _graph(weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """x [B, T, 96] -> a = x @ A, b = x @ B (one activation: merged), y = a @ C, out = concat(y, b)."""
    nodes = [oh.make_node("MatMul", ["x", "A"], ["a"]), oh.make_node("MatMul", ["x", "B"], ["b"]),
             oh.make_node("MatMul", ["a", "C"], ["y"]), oh.make_node("Concat", ["y", "b"], ["out"], axis=-1)]
    g = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", 96])],
                      [oh.make_tensor_value_info("out", TensorProto.FLOAT, ["B", "T", None])],
                      [onh.from_array(w, k) for k, w in weights.items()])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 18)])
    m.ir_version = 9
    return m


def _run(model, x):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]


@pytest.mark.parametrize("kinds", [("q4_1", "q4_1", "q8_0"), ("q4_0", "q8_0", "q4_1")])
def test_graph_computes_the_file_weights_and_rows_are_independent(kinds):
    W = {"A": dequantized(kinds[0], 64, 96, 2), "B": dequantized(kinds[1], 32, 96, 3),
         "C": dequantized(kinds[2], 48, 64, 4)}
    ref_model, model = _graph(W), _graph(W)
    quant = gguf_int4(model)
    assert quant["matmuls"] == 3 and sum(quant["blocks"].values()) == 3
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulNBits") == (2 if kinds[0] == kinds[1] else 3)      # A and B of one kind: merged
    assert ("MatMul" in ops) == ("q4_1" in kinds)                                 # q4_1's block offsets
    x = np.random.default_rng(5).standard_normal((1, 9, 96)).astype(np.float32)
    ref, got = _run(ref_model, x), _run(model, x)
    assert np.abs(got - ref).max() < 3e-2 * np.abs(ref).max()      # int8 activations per block of 32
    for rows in (2, 5):                                            # a row's result alone, whatever else is in the pass
        assert np.array_equal(_run(model, x[:, :rows]), got[:, :rows])


def test_graph_with_a_weight_off_the_grid_is_left_untouched():
    W = {"A": dequantized("q4_1", 64, 96), "B": np.random.default_rng(0).standard_normal((96, 32)).astype(np.float32),
         "C": dequantized("q8_0", 48, 64)}
    model = _graph(W)
    before = model.SerializeToString()
    assert gguf_int4(model) is None
    assert model.SerializeToString() == before


def test_int4_export_of_a_q4_1_gguf_keeps_its_blocks(tmp_path):
    import torch
    import transformers as tf
    from family_models import make_family_model
    from test_gguf import write_gguf

    from export import export
    from specbeam_edge.model import OnnxCausalLM

    model = make_family_model(tmp_path / "hf", "smollm2", std=0.3, seed=3)
    path = tmp_path / "tiny.gguf"
    write_gguf(tmp_path / "hf", model, path, "llama", qtype=Q.Q4_1)
    folder = export(path, tmp_path / "sb", precision="int4", quiet=True)
    cfg = json.loads((folder / "specbeam_config.json").read_text())
    assert set(cfg["quantization"]["blocks"]) == {"q4_1"}               # every matrix as the file holds it
    ref = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32,
                                                  local_files_only=True).eval()
    ids = np.array([[3, 17, 33, 8, 99, 41, 7]])
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits[0].numpy()
    lm = OnnxCausalLM(folder, threads=1)
    T = ids.shape[1]
    got = lm.forward(ids, np.arange(T)[None], np.tril(np.ones((T, T), bool))[None, None], lm.empty_past())[0][0]
    assert np.abs(got - want).max() < 5e-2 * np.abs(want).max()
