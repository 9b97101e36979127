"""Execution providers: which one a session uses, and a CUDA path that cannot silently run nodes on the CPU.

With the CUDA provider onnxruntime quietly assigns every node that has no CUDA kernel to the CPU and copies the
tensors across the bus around it: the session loads, the output is right, and the pass is slow. The opset-23
`Attention` op that every exported layer uses is such a node before onnxruntime-gpu 1.25.0. So a CUDA session
here sets `session.disable_cpu_ep_fallback`, and when onnxruntime refuses the graph, the placement onnxruntime
itself logs is read back to name the ops on the CPU and the onnxruntime-gpu version that has their kernels.
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import onnxruntime as ort

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
PROVIDER_ENV = "SPECBEAM_PROVIDER"          # cpu | cuda: the provider when a caller names none
FALLBACK_KEY = "session.disable_cpu_ep_fallback"
# use_tf32 0: fp32 matrix products in full fp32, so a CUDA pass scores like the CPU one (TF32 keeps 10 mantissa
# bits, enough to reorder near-tied beams); device_id 0 unless the caller passes ("CUDAExecutionProvider", {...})
CUDA_OPTIONS = {"device_id": "0", "use_tf32": "0"}
_REFUSAL = "fallback to CPU EP has been explicitly disabled"

# The first onnxruntime-gpu release whose CUDA provider library registers a kernel for the op, read from the
# kernel classes in libonnxruntime_providers_cuda.so of the 1.22.0, 1.23.0, 1.23.2, 1.24.4, 1.25.0 and 1.31.1
# wheels (onnxruntime::cuda::Attention first appears in 1.25.0; RMSNorm and RotaryEmbedding of the ONNX domain in
# 1.23.0). None: no release up to 1.31.1 has one. Op types are keyed without domain: the names do not collide.
CUDA_KERNEL_SINCE: dict[str, str | None] = {
    "Attention": "1.25.0",
    "RMSNormalization": "1.23.0",
    "RotaryEmbedding": "1.23.0",
    "DynamicQuantizeLinear": None,
    "MatMulInteger": None,        # CUDA has int8 x int8 only; dynamic quantization feeds uint8 activations
}
_NO_KERNEL_REMEDY = ("the dynamic int8 graphs (export -p int8, layout whole) need them: export the model with "
                     "-p fp16, or -p int8w --layout split (weights dequantized by DequantizeLinear)")


class ProviderError(RuntimeError):
    """The requested execution provider cannot run this graph as asked (missing, or nodes left on the CPU)."""


@dataclass(frozen=True)
class Placement:
    """One block of onnxruntime's placement log: the nodes one provider took."""
    provider: str
    count: int
    nodes: tuple[tuple[str, str], ...]   # (op type, node name); empty when onnxruntime logged only the count

    def __post_init__(self):
        if self.nodes and len(self.nodes) != self.count:
            raise ValueError(f"{self.provider}: {self.count} nodes logged but {len(self.nodes)} listed")


def default_providers() -> list[str]:
    """The provider list when a caller names none: $SPECBEAM_PROVIDER (cpu or cuda), else the CPU."""
    name = os.environ.get(PROVIDER_ENV, "cpu").strip().lower() or "cpu"
    if name not in ("cpu", "cuda"):
        raise ValueError(f"{PROVIDER_ENV}={os.environ[PROVIDER_ENV]!r}: expected 'cpu' or 'cuda'")
    return [CUDA] if name == "cuda" else [CPU]


def wants_cuda(providers) -> bool:
    return any(_name(p) == CUDA for p in providers)


def _name(p) -> str:
    return p[0] if isinstance(p, tuple) else p


def installed_onnxruntime() -> str:
    """'onnxruntime-gpu 1.31.1', or the CPU package's name and version (both install the module onnxruntime)."""
    for dist in ("onnxruntime-gpu", "onnxruntime"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return f"onnxruntime {ort.__version__}"


def cuda_session(path: Path, so: ort.SessionOptions, providers) -> ort.InferenceSession:
    """A session whose every node runs on the CUDA provider, or ProviderError naming the nodes that would not."""
    available = ort.get_available_providers()
    if CUDA not in available:
        raise ProviderError(
            f"the CUDA provider was asked for, but {installed_onnxruntime()} offers only {available}: install the "
            f"GPU build in place of the CPU one (pip uninstall -y onnxruntime && pip install 'specbeam-edge[gpu]'; "
            f"both packages install the module onnxruntime, so never keep both)")
    options = next((dict(p[1]) for p in providers if isinstance(p, tuple) and p[0] == CUDA), {})
    so.add_session_config_entry(FALLBACK_KEY, "1")
    # the CPU provider stays out of the list: onnxruntime refuses an explicit CPU entry with fallback disabled;
    # enable_fallback 0: onnxruntime's Python wrapper would otherwise retry a failed CUDA provider on the CPU
    try:
        sess = ort.InferenceSession(str(path), so, providers=[CUDA], provider_options=[{**CUDA_OPTIONS, **options}],
                                    enable_fallback=0)
    except Exception as e:  # onnxruntime raises its own Fail type
        if _REFUSAL not in f"{e} {e.__cause__}":
            raise
        raise ProviderError(explain(path, *node_placements(path))) from None
    if sess.get_providers()[0] != CUDA:   # a provider that failed to load is replaced without an error
        raise ProviderError(f"{path}: onnxruntime created the session on {sess.get_providers()} instead of CUDA")
    return sess


def node_placements(path: Path, providers: list[str] | None = None) -> tuple[list[Placement], str]:
    """Where onnxruntime puts each node of the graph with CUDA first and CPU fallback allowed: its own VERBOSE
    placement log, read back from the process's stderr (onnxruntime's C++ logger writes there, not to Python)."""
    so = ort.SessionOptions()
    so.log_severity_level = 0
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    providers = providers or ([CUDA, CPU] if CUDA in ort.get_available_providers() else [CPU])
    log = captured_stderr(lambda: ort.InferenceSession(str(path), so, providers=providers))
    return parse_placements(log), log


def captured_stderr(fn) -> str:
    """Run fn with file descriptor 2 sent to a temporary file; return what was written there."""
    with tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            fn()
        except Exception as e:  # the log up to the failure still says where the nodes went
            print(f"[specbeam] diagnostic session failed: {e}", file=sys.stderr, flush=True)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        return tmp.read().decode("utf-8", "replace")


_HEADER = re.compile(r"(?:All nodes|Node\(s\)) placed on \[(\w+)\]\. Number of nodes: (\d+)")
_NODE = re.compile(r"VerifyEachNodeIsAssignedToAnEp\]\s{3}(\S+) \((.*)\)\s*$")


def parse_placements(log: str) -> list[Placement]:
    """onnxruntime's VerifyEachNodeIsAssignedToAnEp lines -> one Placement per provider. The format (1.22 to
    1.32): '... Node(s) placed on [CUDAExecutionProvider]. Number of nodes: 2', then one line per node
    '...EpAssigned]   MatMul (/l0/q)'; a provider that took every node: 'All nodes placed on [X]. Number of
    nodes: N' and no node lines."""
    blocks: list[tuple[str, int, list]] = []
    for line in re.sub(r"\x1b\[[0-9;]*m", "", log).splitlines():   # colour codes when stderr is a terminal
        if m := _HEADER.search(line):
            blocks.append((m.group(1), int(m.group(2)), []))
        elif blocks and (m := _NODE.search(line)):
            blocks[-1][2].append((m.group(1), m.group(2)))
    return [Placement(p, n, tuple(nodes)) for p, n, nodes in blocks]


def explain(path: Path, placements: list[Placement], log: str = "", version: str | None = None) -> str:
    """The refusal of a CUDA session as a message: which ops onnxruntime put on the CPU, and what to do."""
    version = version or installed_onnxruntime()
    head = f"{path}: with the CUDA provider ({version}) "
    on_cpu = [p for p in placements if p.provider == CPU]
    if not placements:
        return head + ("onnxruntime put nodes on the CPU and CPU fallback is disabled; its placement log could "
                       "not be read (set log_severity_level 0 on a session to see 'Node(s) placed on')")
    if not any(p.provider == CUDA and p.count for p in placements):
        errors = [ln.strip() for ln in log.splitlines() if "[E:" in ln or "Failed to load" in ln][:1]
        return head + (f"every node went to the CPU: the CUDA provider did not load (CUDA 13 and cuDNN 9 "
                       f"libraries on the library path?){': ' + errors[0] if errors else ''}")
    total = sum(p.count for p in placements)
    ops: dict[str, list[str]] = {}
    for p in on_cpu:
        for op, name in p.nodes:
            ops.setdefault(op, []).append(name)
    parts = [_op_remedy(op, names, version) for op, names in ops.items()]
    n_cpu = sum(p.count for p in on_cpu)
    return head + f"{n_cpu} of {total} nodes would run on the CPU, and CPU fallback is disabled: " + "; ".join(parts)


def _op_remedy(op: str, names: list[str], version: str) -> str:
    shown = ", ".join(n or "(unnamed)" for n in names[:3]) + (", ..." if len(names) > 3 else "")
    what = f"{op} x{len(names)} ({shown})"
    if op not in CUDA_KERNEL_SINCE:
        return f"{what}: not in specbeam's table of CUDA kernels; look it up in onnxruntime's OperatorKernels.md"
    since = CUDA_KERNEL_SINCE[op]
    if since is None:
        return f"{what}: no onnxruntime-gpu release up to 1.31.1 has a CUDA kernel for it; {_NO_KERNEL_REMEDY}"
    if _release(version) >= _release(since):
        return (f"{what}: this release has CUDA kernels for {op} (since {since}), but not for these nodes' types "
                f"or attributes; see onnxruntime's OperatorKernels.md")
    return f"{what}: its CUDA kernel ships from onnxruntime-gpu {since} on (pip install 'onnxruntime-gpu>={since}')"


def _release(version: str) -> tuple[int, ...]:
    """'onnxruntime-gpu 1.24.4' or '1.25.0.dev1' -> (1, 24, 4); () when no number is there."""
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return tuple(int(g or 0) for g in m.groups()) if m else ()
