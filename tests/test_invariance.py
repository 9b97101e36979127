"""Batch-invariant quantized targets (export -p int8: per-row int8 compute) and the engine's load-time check.

Exact speculation needs a target whose logits for a node do not depend on the other nodes of its pass. These
tests score a branching tree in one pass and each path alone (invariance.measure) for every family, both layouts
and encoder-decoder models; the engine refuses a target that fails it (int8dyn: one activation scale per tensor)
and accepts one that passes; speculative == plain on int8 and int4 targets."""
import json
import os

import numpy as np
import onnx
import pytest

from encdec_models import make_encdec_model
from export import export
from family_models import FAMILIES, check_parity, make_family_model
from specbeam_edge import Engine, SpeculativeConfig
from specbeam_edge.execution import invariance
from specbeam_edge.execution.invariance import NotInvariantError
from specbeam_edge.execution.model import OnnxCausalLM
from helpers import assert_same_hypotheses, plain

# an fp32 graph's tree pass differs from its single passes by up to 1e-6 here (attention sums over more key
# columns in another order); an invariant precision may not differ by more than that order
INVARIANT_LIMIT = 1e-5
SPEC = SpeculativeConfig(drafter="beam", budget=24, max_depth=4, adaptive=False)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    cache = {}

    def get(name, precision, layout="whole"):
        key = (name, precision, layout)
        if key not in cache:
            root = tmp_path_factory.mktemp(f"{name}_{precision}_{layout}")
            model = make_family_model(root / "hf", name)
            cache[key] = (export(root / "hf", root / "sb", precision=precision, layout=layout, quiet=True), model)
        return cache[key]
    return get


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_int8_is_batch_invariant_and_close_to_torch_on_every_family(name, family):
    folder, model = family(name, "int8")
    cfg = json.loads((folder / "specbeam_config.json").read_text())
    assert cfg["batch_invariant"] is True and cfg["quantization"]["activations"] == "uint8 per row"
    assert invariance.measure(OnnxCausalLM(folder)) < INVARIANT_LIMIT
    # per-row int8 with 7-bit weights (the default; twice the step of 8 bits), random weights: within 8e-2 of
    # the largest logit (8-bit weights stayed within 4e-2 on a VNNI CPU)
    check_parity(folder, model, 8e-2)


@pytest.mark.parametrize("name", ["llama3.2", "gemma2"])
def test_split_int8_equals_whole_int8(name, family):
    """Both layouts quantize the same way (the streamed int8 weights feed MatMulInteger directly)."""
    whole = OnnxCausalLM(family(name, "int8")[0])
    split = OnnxCausalLM(family(name, "int8", "split")[0])
    assert invariance.measure(split) < INVARIANT_LIMIT
    ids, pos = np.array([[5, 17, 33, 8, 99]]), np.arange(5)[None]
    mask = np.tril(np.ones((5, 5), bool))[None, None]
    kpos = pos if whole.needs_key_positions else None
    a = whole.forward(ids, pos, mask, whole.empty_past(), key_positions=kpos)[0]
    b = split.forward(ids, pos, mask, split.empty_past(), key_positions=kpos)[0]
    np.testing.assert_allclose(a, b, atol=1e-5 * np.abs(a).max(), rtol=0)


def test_int8_graph_computes_in_int8(family):
    """Every weight MatMul of the int8 graph is a MatMulInteger over int8 weights (lm_head included): no fp32
    weight matrix is left, and no DynamicQuantizeLinear (one scale per tensor)."""
    folder, _ = family("qwen3", "int8")
    g = onnx.load(str(folder / "model.onnx")).graph
    ops = [n.op_type for n in g.node]
    assert "DynamicQuantizeLinear" not in ops and "MatMulInteger" in ops
    floats = {t.name for t in g.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2}
    assert not [n for n in g.node if n.op_type == "MatMul" and n.input[1] in floats]
    cfg = json.loads((folder / "specbeam_config.json").read_text())
    assert cfg["quantization"]["matmuls"] == 2 * 7 + 1       # 2 layers x 7 projections + lm_head
    # q/k/v and gate/up share their activation: one MatMulInteger each, then Split
    assert ops.count("MatMulInteger") == 2 * 4 + 1 and ops.count("Split") == 2 * 2


@pytest.mark.parametrize("kind", ["marian", "m2m100"])
def test_encoder_decoder_int8_is_invariant_and_exact(kind, tmp_path):
    make_encdec_model(tmp_path / "hf", kind, seed=3)
    int8 = export(tmp_path / "hf", tmp_path / "int8", precision="int8", quiet=True)
    assert "MatMulInteger" in {n.op_type for n in onnx.load(str(int8 / "encoder.onnx")).graph.node}
    assert invariance.measure(OnnxCausalLM(int8)) < INVARIANT_LIMIT
    eng = Engine(int8, draft=int8)
    src = [5, 17, 33, 8, 0 if kind == "marian" else 2]
    for K in (1, 4):
        [ref] = plain(eng, src, num_beams=K, max_new_tokens=10, num_return_sequences=K)
        [fast] = eng.generate(src, num_beams=K, max_new_tokens=10, num_return_sequences=K, speculative=SPEC)
        assert_same_hypotheses(ref, fast, scores=False)
def test_dynamic_int8_is_measured_not_invariant(exported):
    folder = exported("qwen2", "int8dyn")
    assert json.loads((folder / "specbeam_config.json").read_text())["batch_invariant"] is False
    assert invariance.measure(OnnxCausalLM(folder)) > invariance.TOLERANCE


def test_engine_refuses_a_target_that_is_not_invariant_for_exact_speculation(exported):
    """The int8dyn target: plain search runs, exact speculation is refused with the precision, the measured
    difference and the fix; the per-row int8 export of the same weights is accepted."""
    dyn = exported("llama", "int8dyn", std=0.3, seed=3)
    eng = Engine(dyn, draft=dyn)
    [ref] = plain(eng, [3, 17, 33], num_beams=2, max_new_tokens=4)
    # plain search runs, and as it does without a draft loaded (it asserted only that some token came out)
    assert ref.hypotheses[0].tokens == Engine(dyn).generate([3, 17, 33], num_beams=2, max_new_tokens=4)[0] \
        .hypotheses[0].tokens
    with pytest.raises(NotInvariantError, match=r"int8dyn target is not batch-invariant.*-p int8") as e:
        eng.generate([3, 17, 33], num_beams=2, max_new_tokens=4, speculative=SPEC)
    assert "\n" not in str(e.value)
    ok = exported("llama", "int8", std=0.3, seed=3)
    Engine(ok, draft=dyn).generate([3, 17, 33], num_beams=2, max_new_tokens=4, speculative=SPEC)


def test_check_is_cached_per_model_file(exported, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECBEAM_CACHE_DIR", str(tmp_path))
    folder = exported("llama", "int8", std=0.3, seed=3)
    first = invariance.check(OnnxCausalLM(folder, min_rows=2))
    assert first.ok and not first.cached and (tmp_path / "invariance.json").is_file()

    def boom(model, rows=None):
        raise AssertionError("measured again")
    monkeypatch.setattr(invariance, "measure", boom)
    again = invariance.check(OnnxCausalLM(folder, min_rows=2))
    assert again.cached and again.max_diff == first.max_diff
    st = (folder / "model.onnx").stat()             # a replaced graph file is a new key
    os.utime(folder / "model.onnx", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(AssertionError, match="measured again"):
        invariance.check(OnnxCausalLM(folder, min_rows=2))


def test_a_cached_failure_is_refused_without_measuring(exported, monkeypatch, tmp_path):
    """The cache decides as the measurement did (a planted entry for this file)."""
    monkeypatch.setenv("SPECBEAM_CACHE_DIR", str(tmp_path))
    folder = exported("llama", "int8", std=0.3, seed=3)
    model = OnnxCausalLM(folder, min_rows=2)
    # both floors: the load-time floor check reads the one-row entry
    keys = {invariance.cache_key(model, rows): 0.5 for rows in (1, 2)}
    (tmp_path / "invariance.json").write_text(json.dumps(keys))
    eng = Engine(folder, draft=folder)
    with pytest.raises(NotInvariantError, match="5.0e-01"):
        eng.generate([3, 17, 33], num_beams=2, max_new_tokens=4, speculative=SPEC)


def test_a_quantized_targets_floor_is_measured_at_one_row(exported, monkeypatch, tmp_path):
    """int8/int4 targets score one row a pass only where the check with one-row steps measures exactly 0 on this
    machine (a last bit off, 3e-7, keeps the padding row); the result is cached per model file; an explicit
    min_rows, an fp32 target and a target streaming its layers do not measure."""
    monkeypatch.setenv("SPECBEAM_CACHE_DIR", str(tmp_path))
    measured = []

    def fake(diff):
        def measure(model, rows):
            measured.append(rows)
            return diff if rows == 1 else 0.0
        return measure
    int8, int4 = exported("llama", "int8", std=0.3, seed=3), exported("llama", "int4", std=0.3, seed=3)
    monkeypatch.setattr(invariance, "measure", fake(3e-7))
    assert Engine(int8).target.min_rows == 2 and measured == [1]
    assert Engine(int8).target.min_rows == 2 and measured == [1]          # cached: not measured again
    monkeypatch.setattr(invariance, "measure", fake(0.0))
    assert Engine(int4).target.min_rows == 1 and measured == [1, 1]
    assert Engine(int4).target.min_rows == 1 and measured == [1, 1]
    assert OnnxCausalLM(int4).min_rows == 2 and measured == [1, 1]        # a model alone: the safe floor, no check
    assert Engine(int8, min_rows=1).target.min_rows == 1 and Engine(int4, min_rows=3).target.min_rows == 3
    assert Engine(exported("llama", std=0.3, seed=3)).target.min_rows == 1
    split = exported("llama", "int8", layout="split", std=0.3, seed=3)
    layers = OnnxCausalLM(split, min_rows=2).cfg.num_layers
    assert Engine(split, placement=["disk"] * layers).target.min_rows == 2    # every layer streamed
    assert measured == [1, 1]
    assert Engine(split).target.min_rows == 1 and measured == [1, 1, 1]    # all resident: measured


def test_the_measured_floor_is_what_the_kernels_give(exported, monkeypatch, tmp_path):
    """Without stand-ins: the floor is 1 exactly when one-row steps score every node of the check's tree bit for
    bit (on this CPU both precisions measure 0 at one row; the floor follows whichever way it comes out)."""
    monkeypatch.setenv("SPECBEAM_CACHE_DIR", str(tmp_path))
    for precision in ("int8", "int4"):
        folder = exported("llama", precision, std=0.3, seed=3)
        one = OnnxCausalLM(folder, min_rows=2)
        assert Engine(folder).target.min_rows == (1 if invariance.measure(one, rows=1) == 0.0 else 2)


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("K", [1, 4])
def test_speculative_equals_plain_on_quantized_targets(exported, precision, K):
    """int4 (MatMulNBits) passes the engine's check on this machine, so it may speculate; where it does not, the
    engine refuses it (the test above). Same tokens; scores within 1e-3: a tree pass lays out a node's key
    columns differently from plain search (its siblings sit between them, masked), so fp32 attention sums round
    differently in the last bit, which an int8/int4 activation can turn into one quantization step (DESIGN)."""
    target = exported("llama", precision, std=0.3, seed=3)
    draft = exported("llama", "int8dyn", std=0.3, seed=11, layers=1)
    eng = Engine(target, draft=draft)
    if precision == "int4" and not invariance.check(eng.target).ok:
        pytest.skip("MatMulNBits is not batch-invariant on this CPU / onnxruntime (the engine refuses it)")
    for prompt in ([3, 17, 33, 8, 99, 41, 7], [250, 12, 9, 77]):
        [ref] = plain(eng, prompt, num_beams=K, max_new_tokens=16, num_return_sequences=K)
        [fast] = eng.generate(prompt, num_beams=K, max_new_tokens=16, num_return_sequences=K, speculative=SPEC)
        assert_same_hypotheses(ref, fast, scores=False)
        np.testing.assert_allclose([h.score for h in ref.hypotheses], [h.score for h in fast.hypotheses],
                                   atol=1e-3)


def test_rowwise_rewrite_of_a_small_graph():
    """quant.rowwise_int8 on a hand-built graph: a weight shared by two MatMuls of different inputs is quantized
    once (no duplicate initializer), each row's result equals that row computed alone bit for bit, and the
    result is within int8 rounding of fp32; --reduce_range keeps weights in [-64, 64]."""
    import onnxruntime as ort
    from onnx import TensorProto as TP
    from onnx import helper as oh
    from onnx import numpy_helper as onh

    from export.quant import quantize_columns, rowwise_int8

    rng = np.random.default_rng(0)
    W = rng.normal(size=(64, 48)).astype(np.float32)
    g = oh.make_graph([oh.make_node("MatMul", ["a", "w"], ["ya"]), oh.make_node("MatMul", ["b", "w"], ["yb"])], "g",
                      [oh.make_tensor_value_info(n, TP.FLOAT, ["M", 64]) for n in "ab"],
                      [oh.make_tensor_value_info(n, TP.FLOAT, ["M", 48]) for n in ("ya", "yb")],
                      [onh.from_array(W, "w")])
    m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 23)], ir_version=10)
    assert rowwise_int8(m)["matmuls"] == 2                  # 7-bit weights, the default
    names = [t.name for t in m.graph.initializer]
    assert len(names) == len(set(names)) and "w" not in names
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    x = (rng.normal(size=(9, 64)) * rng.uniform(0.01, 30, (9, 1))).astype(np.float32)   # rows of any scale
    ya, yb = sess.run(None, {"a": x, "b": x[::-1].copy()})
    np.testing.assert_array_equal(ya, yb[::-1])
    for i in range(len(x)):
        alone = sess.run(None, {"a": x[i:i + 2], "b": x[i:i + 2]})[0][0]
        np.testing.assert_array_equal(alone, ya[i])
    assert np.abs(ya - x @ W).max() / np.abs(x @ W).max() < 1e-2
    q, _ = quantize_columns(W, reduce_range=True)
    assert int(np.abs(q.astype(np.int16)).max()) == 64


def test_the_saturation_probe_is_the_graph_it_says_and_the_warning_names_the_fix(tmp_path):
    """The runtime's probe bytes are this MatMulInteger (built with onnx here; the runtime carries the bytes and
    needs no onnx). On a CPU whose kernel saturates, an int8 export with 8-bit weights gets a warning naming the
    fix; a 7-bit one (the default) does not; on a VNNI CPU neither does."""
    import base64
    import zlib
    from types import SimpleNamespace

    from onnx import TensorProto as TP
    from onnx import helper as oh
    from onnx import numpy_helper as onh

    from specbeam_edge.execution import invariance

    g = oh.make_graph([oh.make_node("MatMulInteger", ["a", "w", "za"], ["y"])], "probe",
                      [oh.make_tensor_value_info("a", TP.UINT8, [2, 64])],
                      [oh.make_tensor_value_info("y", TP.INT32, [2, 16])],
                      [onh.from_array(np.full((64, 16), 127, np.int8), "w"),
                       onh.from_array(np.array(128, np.uint8), "za")])
    model = oh.make_model(g, opset_imports=[oh.make_opsetid("", 13)], ir_version=8, producer_name="specbeam-edge")
    assert zlib.decompress(base64.b64decode(invariance.SATURATION_PROBE)) == model.SerializeToString()
    cfg = lambda bits7: SimpleNamespace(folder=tmp_path, raw={"precision": "int8",   # noqa: E731
                                                              "quantization": {"reduce_range": bits7}})
    saturates = invariance.int8_sums_saturate()
    msg = invariance.saturation_warning(cfg(False))
    assert (msg is not None) == saturates
    if msg:
        assert "re-export it without --full_range" in msg
    assert invariance.saturation_warning(cfg(True)) is None
    assert invariance.saturation_warning(SimpleNamespace(folder=tmp_path, raw={"precision": "fp32"})) is None


def test_default_int8_weights_never_saturate(tmp_path):
    """7-bit weights by default: the worst pair of products fits int16 (255 x 64 x 2 = 32,640), so the per-row int8
    MatMul is within rounding of fp32 on any x86 CPU; 8-bit weights (--full_range) are not on one that saturates
    (measured on an AVX2-only CPU: 17% of the largest value)."""
    import onnxruntime as ort
    from onnx import TensorProto as TP
    from onnx import helper as oh
    from onnx import numpy_helper as onh

    from export.quant import rowwise_int8
    from specbeam_edge.execution.invariance import int8_sums_saturate

    rng = np.random.default_rng(0)
    W = rng.normal(size=(64, 48)).astype(np.float32)
    x = (rng.normal(size=(9, 64)) * rng.uniform(0.01, 30, (9, 1))).astype(np.float32)
    errs = {}
    for bits7 in (True, False):
        g = oh.make_graph([oh.make_node("MatMul", ["a", "w"], ["y"])], "g",
                          [oh.make_tensor_value_info("a", TP.FLOAT, ["M", 64])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, ["M", 48])], [onh.from_array(W, "w")])
        m = oh.make_model(g, opset_imports=[oh.make_opsetid("", 23)], ir_version=10)
        rowwise_int8(m, reduce_range=bits7)
        y = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"a": x})[0]
        errs[bits7] = np.abs(y - x @ W).max() / np.abs(x @ W).max()
    assert errs[True] < 1.5e-2
    assert (errs[False] > 5e-2) == int8_sums_saturate(), errs


def test_engine_warns_about_an_8_bit_int8_target_where_sums_saturate(hf_models, tmp_path, monkeypatch):
    """An int8 target exported with --full_range, loaded where the kernel saturates (forced here): a
    QuantizationWarning naming the fix; the default 7-bit export, and a draft, load without one."""
    import warnings

    from export import export
    from specbeam_edge import Engine
    from specbeam_edge.execution.invariance import QuantizationWarning

    src, _ = hf_models("llama")
    full = export(src, tmp_path / "full", precision="int8", reduce_range=False, quiet=True)
    seven = export(src, tmp_path / "seven", precision="int8", quiet=True)
    monkeypatch.setattr(invariance, "_SATURATES", True)
    with pytest.warns(QuantizationWarning, match="re-export it without --full_range"):
        Engine(full)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Engine(seven, draft=full)
