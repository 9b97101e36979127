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
    from family_models import make_family_model
    from test_gguf import write_gguf

    from export import export

    model = make_family_model(tmp_path / "hf", "smollm2", std=0.3, seed=3)
    path = tmp_path / "tiny.gguf"
    write_gguf(tmp_path / "hf", model, path, "llama", qtype=Q.Q4_1)
    folder = export(path, tmp_path / "sb", precision="int4", quiet=True)
    cfg = json.loads((folder / "specbeam_config.json").read_text())
    assert set(cfg["quantization"]["blocks"]) == {"q4_1"}               # every matrix as the file holds it
    _near_transformers(folder, tmp_path, path)


# -- blocks read from the file's bytes (from_ggml): K-quants and Q5 cannot be recovered from the values ----------
RAW = {"q4_k": Q.Q4_K, "q6_k": Q.Q6_K, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1,
       "q8_0": Q.Q8_0}
# where each kind keeps its fp16 fields (d, dmin or m), by byte offset in its block
FP16_AT = {"q4_k": (0, 2), "q6_k": (208,), "q5_0": (0,), "q5_1": (0, 2), "q4_0": (0,), "q4_1": (0, 2),
           "q8_0": (0,)}


def raw_blocks(kind: str, N: int, K: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """N rows of K values in `kind`'s ggml blocks: random codes and sub-scales, small finite fp16 scales (a file
    llama.cpp could have written; gguf-py quantizes none of the K-quants)."""
    from export.blocks import BYTES

    size, per = BYTES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (N, K // per * size), dtype=np.uint8)
    blk = raw.reshape(-1, size)
    for at in FP16_AT[kind]:
        d = (np.abs(rng.standard_normal(len(blk))) * scale + scale / 4).astype(np.float16)
        blk[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("kind", list(RAW))
def test_blocks_read_from_the_bytes_give_gguf_pys_values_bit_for_bit(kind):
    from export.blocks import from_ggml

    raw = raw_blocks(kind, 6, 512)
    b = from_ggml(raw, kind)
    assert b.kind == kind and b.codes.shape[1] * b.block == 512
    assert np.array_equal(b.values(), gguf.quants.dequantize(raw, RAW[kind]).T)
    assert b.equals(gguf.quants.dequantize(raw, RAW[kind]).T)


@pytest.mark.parametrize("kinds", [("q4_k", "q4_k", "q6_k"), ("q5_0", "q5_1", "q8_0"), ("q6_k", "q5_0", "q4_k")])
def test_graph_of_the_files_own_blocks_computes_x_at_w_and_rows_are_independent(kinds):
    from export.blocks import from_ggml

    shapes = {"A": (256, 256), "B": (32, 256), "C": (48, 256)}          # (N, K): a = x @ A feeds y = a @ C
    known = {k: from_ggml(raw_blocks(kind, N, K, seed=i), kind)
             for i, (kind, (k, (N, K))) in enumerate(zip(kinds, shapes.items()))}
    W = {k: b.values() for k, b in known.items()}
    ref_model, model = _graph256(W), _graph256(W)
    quant = gguf_int4(model, known)
    assert quant is not None and quant["blocks"] == {k: kinds.count(k) for k in set(kinds)}
    assert gguf_int4(_graph256(W)) is None or set(kinds) <= {"q8_0", "q4_0", "q4_1"}   # values alone: no grid
    x = np.random.default_rng(5).standard_normal((1, 9, 256)).astype(np.float32)
    ref, got = _run(ref_model, x), _run(model, x)
    assert np.abs(got - ref).max() < 3e-2 * np.abs(ref).max()      # int8 activations per block
    for rows in (2, 5):
        assert np.array_equal(_run(model, x[:, :rows]), got[:, :rows])


def test_known_blocks_that_do_not_give_the_values_are_not_used():
    from export.blocks import from_ggml

    known = {k: from_ggml(raw_blocks("q4_k", N, 256, seed=i), "q4_k") for i, (k, N) in enumerate(
        (("A", 256), ("B", 32), ("C", 48)))}
    W = {k: b.values() for k, b in known.items()}
    W["B"][7, 3] += 1e-3                                           # B's values are not the blocks' any more
    assert gguf_int4(_graph256(W), known) is None                  # B: the file's blocks refused, and no grid


def _graph256(weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """x [B, T, 256] -> a = x @ A (256), b = x @ B (32), y = a @ C (48), out = concat(y, b): K = 256 everywhere
    (K-quants need super-blocks of 256)."""
    nodes = [oh.make_node("MatMul", ["x", "A"], ["a"]), oh.make_node("MatMul", ["x", "B"], ["b"]),
             oh.make_node("MatMul", ["a", "C"], ["y"]), oh.make_node("Concat", ["y", "b"], ["out"], axis=-1)]
    g = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", 256])],
                      [oh.make_tensor_value_info("out", TensorProto.FLOAT, ["B", "T", None])],
                      [onh.from_array(w, k) for k, w in weights.items()])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 18)])
    m.ir_version = 9
    return m


def test_int4_export_of_a_k_quant_gguf_keeps_every_block_and_the_embedding_exactly(tmp_path):
    """A Llama GGUF (q/k rows permuted by the converter) of Q4_K, Q6_K, Q5_0 and Q5_1 matrices, as a Q4_K_M file
    mixes them: `-p int4` keeps every matrix's blocks and the embedding table's (Q4_K: codes two a byte, scales
    and offsets), and computes transformers' logits within int8-activation rounding."""
    from family_models import make_family_model
    from test_gguf import write_gguf

    from export import export
    from export.embedding import embedding_values

    model = make_family_model(tmp_path / "hf", "smollm2", std=0.3, seed=3, hidden_size=256, intermediate_size=512,
                              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    kinds = {"v_proj": "q5_0", "down_proj": "q6_k", "embed_tokens": "q4_k", "lm_head": "q5_1"}
    files = {}

    def stored(name, a):
        kind = next((k for part, k in kinds.items() if part in name), "q4_k")
        files[name] = kind
        scale = 0.001 if kind.endswith("_k") else 0.02       # (sub-scales up to 63: weights of about 0.1-1)
        return raw_blocks(kind, a.shape[0], a.shape[1], seed=len(files), scale=scale), RAW[kind]
    path = tmp_path / "tiny.gguf"
    write_gguf(tmp_path / "hf", model, path, "llama", stored=stored)
    folder = export(path, tmp_path / "sb", precision="int4", quiet=True)
    cfg = json.loads((folder / "specbeam_config.json").read_text())
    assert cfg["quantization"]["blocks"] == {"q4_k": 10, "q5_0": 2, "q5_1": 1, "q6_k": 2}   # each as the file has it
    reader = gguf.GGUFReader(str(path))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    table = embedding_values(onnx.load(folder / "model.onnx", load_external_data=False).graph.initializer,
                             str(folder))
    assert np.array_equal(table, gguf.quants.dequantize(embd.data, embd.tensor_type))   # the file's, exactly
    _near_transformers(folder, tmp_path, path)


def test_int4_weights_rtn_requantizes_the_matrices_and_keeps_the_files_embedding(tmp_path):
    """`int4_weights="rtn"` (the shipped draft's choice: 4-bit where the file has 5-8-bit blocks) quantizes every
    matrix round-to-nearest, and its embedding table is still the file's own blocks, exactly."""
    from family_models import make_family_model
    from test_gguf import write_gguf

    from export import export
    from export.embedding import embedding_values

    model = make_family_model(tmp_path / "hf", "smollm2", std=0.3, seed=3, hidden_size=256, intermediate_size=512)
    path = tmp_path / "tiny.gguf"
    write_gguf(tmp_path / "hf", model, path, "llama", stored=lambda name, a: (raw_blocks("q5_0", *a.shape), Q.Q5_0))
    folder = export(path, tmp_path / "sb", precision="int4", quiet=True, int4_weights="rtn")
    cfg = json.loads((folder / "specbeam_config.json").read_text())
    assert cfg["quantization"]["method"].endswith("(RTN)")
    embd = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "token_embd.weight")
    table = embedding_values(onnx.load(folder / "model.onnx", load_external_data=False).graph.initializer,
                             str(folder))
    assert np.array_equal(table, gguf.quants.dequantize(embd.data, embd.tensor_type))


@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
def test_int8_keeps_the_files_embedding_blocks_and_split_equals_whole(tmp_path, kind):
    """int8 from a GGUF: the embedding table is the file's own blocks in both layouts (the split layout's rows
    read and dequantized by the runtime, offload.TableRows; the whole graph's by its nodes), the file's values
    exactly, and the split folder's logits equal the whole graph's bit for bit."""
    from family_models import make_family_model
    from test_gguf import write_gguf

    from export import export
    from specbeam_edge.execution.model import OnnxCausalLM

    model = make_family_model(tmp_path / "hf", "smollm2", std=0.3, seed=3, hidden_size=256, intermediate_size=512)
    path = tmp_path / "tiny.gguf"
    write_gguf(tmp_path / "hf", model, path, "llama", stored=lambda name, a: (
        raw_blocks(kind, *a.shape, scale=0.001), RAW[kind]) if "embed" in name else None)
    split = export(path, tmp_path / "split", precision="int8", layout="split", quiet=True)
    whole = export(path, tmp_path / "whole", precision="int8", quiet=True)
    table = json.loads((split / "specbeam_config.json").read_text())["files"]["embed_table"]
    assert table["kind"] == kind and table["dtype"] == "uint8"
    embd = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "token_embd.weight")
    want = gguf.quants.dequantize(embd.data, embd.tensor_type)
    ids = np.array([[3, 17, 33, 8, 99, 41, 7, 3]])
    lms = [OnnxCausalLM(f, threads=1) for f in (split, whole)]
    assert np.array_equal(lms[0].runner.embed_table[ids[0]], want[ids[0]])
    T = ids.shape[1]
    mask = np.tril(np.ones((T, T), bool))[None, None]
    got = [lm.forward(ids, np.arange(T)[None], mask, lm.empty_past())[0] for lm in lms]
    assert np.array_equal(got[0], got[1])


def _near_transformers(folder, hf_root, path) -> None:
    """The folder's logits on a 7-token prompt within int8-activation rounding of transformers' dequantized GGUF."""
    import torch
    import transformers as tf

    from specbeam_edge.execution.model import OnnxCausalLM

    ref = tf.AutoModelForCausalLM.from_pretrained(str(hf_root), gguf_file=path.name, dtype=torch.float32,
                                                  local_files_only=True).eval()
    ids = np.array([[3, 17, 33, 8, 99, 41, 7]])
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits[0].numpy()
    lm = OnnxCausalLM(folder, threads=1)
    T = ids.shape[1]
    got = lm.forward(ids, np.arange(T)[None], np.tril(np.ones((T, T), bool))[None, None], lm.empty_past())[0][0]
    assert np.abs(got - want).max() < 5e-2 * np.abs(want).max()
