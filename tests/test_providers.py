"""The CUDA path cannot lie: a CUDA session refuses CPU fallback, and the refusal names the ops left on the CPU
and the onnxruntime-gpu version that has their kernels. CPU-only: the provider list and the placement log are
stubbed where a GPU build would be needed; onnxruntime's refusal itself is real (the CPU build refuses too)."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from specbeam_edge.execution import providers as P
from specbeam_edge.execution.sessions import _session

HAS_CUDA = P.CUDA in ort.get_available_providers()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="this onnxruntime has no CUDA provider (the GPU check runs these)")

# onnxruntime's own VERBOSE placement lines (session_state.cc, VerifyEachNodeIsAssignedToAnEp), as 1.2x-1.3x print them
MIXED_LOG = """\
2026-11-30 15:59:13.1 [V:onnxruntime:, session_state.cc:1598 VerifyEachNodeIsAssignedToAnEp] Node placements
2026-11-30 15:59:13.1 [V:onnxruntime:, session_state.cc:1601 VerifyEachNodeIsAssignedToAnEp]  Node(s) placed on [CUDAExecutionProvider]. Number of nodes: 2
2026-11-30 15:59:13.1 [V:onnxruntime:, session_state.cc:1603 VerifyEachNodeIsAssignedToAnEp]   MatMul (out)
2026-11-30 15:59:13.1 [V:onnxruntime:, session_state.cc:1603 VerifyEachNodeIsAssignedToAnEp]   MemcpyFromHost (Memcpy)
2026-11-30 15:59:13.1 [V:onnxruntime:, session_state.cc:1601 VerifyEachNodeIsAssignedToAnEp]  Node(s) placed on [CPUExecutionProvider]. Number of nodes: 2
2026-11-30 15:59:13.1 [V:onnxruntime:, session_state.cc:1603 VerifyEachNodeIsAssignedToAnEp]   DynamicQuantizeLinear (quant)
2026-11-30 15:59:13.1 [V:onnxruntime:, session_state.cc:1603 VerifyEachNodeIsAssignedToAnEp]   MatMulInteger (qmm)
2026-11-30 15:59:13.1 [W:onnxruntime:, session_state.cc:1605 VerifyEachNodeIsAssignedToAnEp] Some nodes were not assigned to the preferred execution providers which may or may not have an negative impact on performance.
"""
ATTENTION_ON_CPU = [P.Placement(P.CUDA, 5, (("MatMul", "/l0/q"), ("MatMul", "/l0/k"), ("MatMul", "/l0/v"),
                                            ("MatMul", "/l1/q"), ("Add", "/l1/x"))),
                    P.Placement(P.CPU, 2, (("Attention", "/l0/attn"), ("Attention", "/l1/attn")))]


def quantized_graph(path):
    """x -> DynamicQuantizeLinear -> MatMulInteger -> Cast -> MatMul: ops with and without CUDA kernels."""
    w8 = numpy_helper.from_array(np.arange(12, dtype=np.uint8).reshape(4, 3), "w8")
    w = numpy_helper.from_array(np.ones((3, 2), np.float32), "w")
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"], name="quant"),
             helper.make_node("MatMulInteger", ["xq", "w8", "xz"], ["acc"], name="qmm"),
             helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("MatMul", ["accf", "w"], ["y"], name="out")]
    g = helper.make_graph(nodes, "q", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])], [w8, w])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)], ir_version=10), str(path))
    return path


@pytest.fixture
def graph(tmp_path):
    return quantized_graph(tmp_path / "q.onnx")


@pytest.fixture
def cuda_listed(monkeypatch):
    """This onnxruntime claims a CUDA provider (the CPU build still places every node on the CPU)."""
    monkeypatch.setattr(ort, "get_available_providers", lambda: [P.CUDA, P.CPU])


def test_parse_placements_reads_each_provider_block():
    assert P.parse_placements(MIXED_LOG) == [
        P.Placement(P.CUDA, 2, (("MatMul", "out"), ("MemcpyFromHost", "Memcpy"))),
        P.Placement(P.CPU, 2, (("DynamicQuantizeLinear", "quant"), ("MatMulInteger", "qmm")))]
    coloured = "\x1b[0;93m2026 [V:onnxruntime:, s.cc:1 VerifyEachNodeIsAssignedToAnEp]  All nodes placed on " \
               "[CPUExecutionProvider]. Number of nodes: 37\x1b[m"
    assert P.parse_placements(coloured) == [P.Placement(P.CPU, 37, ())]


def test_placement_log_is_read_back_from_this_onnxruntime(graph):
    """The real VERBOSE log of this (CPU) build, captured from file descriptor 2."""
    placements, log = P.node_placements(graph, [P.CPU])
    assert placements == [P.Placement(P.CPU, 4, ())]
    assert "All nodes placed on [CPUExecutionProvider]. Number of nodes: 4" in log


@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider'")
def test_cuda_session_refuses_graph_with_op_without_cuda_kernel(graph, cuda_listed, monkeypatch):
    monkeypatch.setattr(P, "node_placements", lambda path: (P.parse_placements(MIXED_LOG), MIXED_LOG))
    monkeypatch.setattr(P, "installed_onnxruntime", lambda: "onnxruntime-gpu 1.31.1")
    with pytest.raises(P.ProviderError) as e:
        _session(graph, 1, [P.CUDA, P.CPU])
    assert str(e.value) == (
        f"{graph}: with the CUDA provider (onnxruntime-gpu 1.31.1) 2 of 4 nodes would run on the CPU, and CPU "
        f"fallback is disabled: DynamicQuantizeLinear x1 (quant): no onnxruntime-gpu release up to 1.31.1 has a "
        f"CUDA kernel for it; {P._NO_KERNEL_REMEDY}; MatMulInteger x1 (qmm): no onnxruntime-gpu release up to "
        f"1.31.1 has a CUDA kernel for it; {P._NO_KERNEL_REMEDY}")


@pytest.mark.skipif(HAS_CUDA, reason="the CUDA provider of this onnxruntime takes the nodes it has kernels for")
def test_without_the_fallback_key_the_same_session_loads_on_the_cpu(graph, cuda_listed):
    """Control: what the guard prevents. Asked for CUDA alone, onnxruntime quietly runs the graph on the CPU."""
    with pytest.warns(UserWarning, match="CUDAExecutionProvider"):
        sess = ort.InferenceSession(str(graph), providers=[P.CUDA])
    assert sess.get_providers() == [P.CPU]


def test_attention_on_cpu_names_the_version_with_its_kernel():
    assert P.explain("m.onnx", ATTENTION_ON_CPU, version="onnxruntime-gpu 1.24.4") == (
        "m.onnx: with the CUDA provider (onnxruntime-gpu 1.24.4) 2 of 7 nodes would run on the CPU, and CPU "
        "fallback is disabled: Attention x2 (/l0/attn, /l1/attn): its CUDA kernel ships from onnxruntime-gpu "
        "1.25.0 on (pip install 'onnxruntime-gpu>=1.25.0')")


def test_op_refused_by_a_release_that_has_its_kernel_is_named_as_such():
    many = [ATTENTION_ON_CPU[0], P.Placement(P.CPU, 4, tuple(("Attention", f"/l{i}/attn") for i in range(4)))]
    assert P.explain("m.onnx", many, version="onnxruntime-gpu 1.31.1").endswith(
        "Attention x4 (/l0/attn, /l1/attn, /l2/attn, ...): this release has CUDA kernels for Attention (since "
        "1.25.0), but not for these nodes' types or attributes; see onnxruntime's OperatorKernels.md")
    unknown = [ATTENTION_ON_CPU[0], P.Placement(P.CPU, 1, (("Scan", ""),))]
    assert P.explain("m.onnx", unknown, version="onnxruntime-gpu 1.31.1").endswith(
        "Scan x1 ((unnamed)): not in specbeam's table of CUDA kernels; look it up in onnxruntime's "
        "OperatorKernels.md")


def test_all_nodes_on_cpu_means_the_cuda_provider_did_not_load():
    log = ("[E:onnxruntime:Default, provider_bridge_ort.cc:2100 TryGetProviderInfo_CUDA] Failed to load library "
           "libonnxruntime_providers_cuda.so with error: libcublasLt.so.13: cannot open shared object file\n")
    assert P.explain("m.onnx", [P.Placement(P.CPU, 9, ())], log, version="onnxruntime-gpu 1.31.1") == (
        "m.onnx: with the CUDA provider (onnxruntime-gpu 1.31.1) every node went to the CPU: the CUDA provider "
        "did not load (CUDA 13 and cuDNN 9 libraries on the library path?): " + log.strip())


@pytest.mark.skipif(HAS_CUDA, reason="this onnxruntime has the CUDA provider")
def test_cuda_without_the_gpu_build_says_what_to_install(graph):
    with pytest.raises(P.ProviderError) as e:
        _session(graph, 1, [P.CUDA, P.CPU])
    assert str(e.value) == (
        f"the CUDA provider was asked for, but {P.installed_onnxruntime()} offers only "
        f"{ort.get_available_providers()}: install the GPU build in place of the CPU one (pip uninstall -y "
        f"onnxruntime && pip install 'specbeam-edge[gpu]'; both packages install the module onnxruntime, so never "
        f"keep both)")


def test_cuda_session_options(graph, cuda_listed, monkeypatch):
    """Fallback disabled, the CPU provider left out of the list (onnxruntime refuses it then), full-fp32 matmuls,
    the caller's own CUDA options on top, and no retry on the CPU by onnxruntime's Python wrapper."""
    seen = {}

    class Session:
        def __init__(self, path, so, providers, provider_options, **kwargs):
            seen.update(fallback=so.get_session_config_entry(P.FALLBACK_KEY), providers=providers,
                         options=provider_options, **kwargs)

        def get_providers(self):
            return [P.CUDA, P.CPU]

    monkeypatch.setattr(ort, "InferenceSession", Session)
    _session(graph, 1, [(P.CUDA, {"device_id": "1"}), P.CPU])
    assert seen == {"fallback": "1", "providers": [P.CUDA], "options": [{"device_id": "1", "use_tf32": "0"}],
                    "enable_fallback": 0}


def test_provider_from_environment(monkeypatch):
    monkeypatch.delenv(P.PROVIDER_ENV, raising=False)
    assert P.default_providers() == [P.CPU]
    monkeypatch.setenv(P.PROVIDER_ENV, "CUDA")
    assert P.default_providers() == [P.CUDA]
    monkeypatch.setenv(P.PROVIDER_ENV, "tpu")
    with pytest.raises(ValueError, match=r"^SPECBEAM_PROVIDER='tpu': expected 'cpu' or 'cuda'$"):
        P.default_providers()


@needs_cuda
@pytest.mark.parametrize("precision,layout,output", [("fp32", "whole", "logits"), ("fp16", "whole", "topk"),
                                                     ("fp32", "split", "logits"), ("int8", "split", "topk")])
def test_exported_graphs_place_every_node_on_cuda(exported, precision, layout, output):
    """On a GPU: each graph the exporter writes in these forms loads with no node on the CPU."""
    for f in sorted(exported("llama", precision, layout, output).glob("*.onnx")):
        assert _session(f, 1, [P.CUDA]).get_providers()[0] == P.CUDA   # or ProviderError naming the CPU nodes


@needs_cuda
def test_dynamic_int8_graph_is_refused_on_cuda(graph):
    """On a GPU, nothing stubbed: onnxruntime's own placement names the ops without CUDA kernels."""
    with pytest.raises(P.ProviderError, match=r"DynamicQuantizeLinear x1 \(quant\): no onnxruntime-gpu release"):
        _session(graph, 1, [P.CUDA])
