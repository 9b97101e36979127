"""onnxruntime sessions: their options, the process's shared thread pool, the run options that give a run's
arena memory back, the check of a graph's inputs and outputs, and a run with its KV bound where it is computed
(the runners, whole_graph.py and pipeline.py, load and run their graphs with them)."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..config import ModelFolderError, few
from .providers import ProviderError, cuda_session, default_providers, wants_cuda


def _session(path: Path, threads: int | None, providers, spin: bool = True,
             arena: bool = True) -> ort.InferenceSession:
    """arena False: the session's CPU tensors come from malloc and go back after each run instead of staying in
    onnxruntime's arena, which keeps its largest run's memory for good (OnnxCausalLM's `arena`)."""
    so = session_options(threads, spin)
    so.enable_cpu_mem_arena = arena
    providers = list(providers or default_providers())
    try:
        if wants_cuda(providers):   # every node on CUDA, or ProviderError naming the ones that would not be
            return cuda_session(path, so, providers)
        return ort.InferenceSession(str(path), so, providers=providers)
    except ProviderError:
        raise
    except Exception as e:  # onnxruntime raises several exception types for bad files
        raise ModelFolderError(f"{path}: onnxruntime cannot load this graph ({str(e).splitlines()[0][:200]})") from None


_POOL: list[int] = []      # the size of the process's shared thread pool, once made


def default_threads(threads: int | None) -> int:
    """The onnxruntime threads of a session that names none: the cores, at most 8."""
    return threads or min(os.cpu_count() or 1, 8)


def share_threads(threads: int | None = None) -> bool:
    """Run every onnxruntime session of this process on one shared thread pool of `threads` threads (default
    min(cores, 8)); call it before the first Engine. Sessions that run one after another (28 resident layer
    sessions, a draft and its target) then share warm threads that may spin. With a pool each, spinning threads
    of one session took the cores from the next, and without spinning every small node waited for a thread to
    wake (Qwen2.5-Coder-1.5B resident, 2 threads: 8.8 -> 11.0 tok/s plain, its 0.5B draft's chain 280 -> 180 ms
    a pass, same tokens). Every Engine calls it unless made with shared_pool=False, so the library runs as the
    tools do. Process-wide: afterwards onnxruntime refuses sessions made with a pool of their own (your own
    InferenceSession needs `SessionOptions.use_per_session_threads = False`), and a later Engine's `threads` no
    longer changes anything. Returns whether the pool is shared (SPECBEAM_SHARED_POOL=0 keeps a pool per
    session)."""
    if os.environ.get("SPECBEAM_SHARED_POOL", "1") == "0":
        return False
    if not _POOL:
        n = default_threads(threads)
        ort.set_global_thread_pool_sizes(n, 1)
        _POOL.append(n)
    return True


def threads_shared() -> bool:
    """Whether this process runs its sessions on one shared pool (share_threads)."""
    return bool(_POOL)


def session_options(threads: int | None, spin: bool = True, fold_limit_bytes: int = 0) -> ort.SessionOptions:
    """The CPU/CUDA session options of every graph; fold_limit_bytes other than 0 only for tests."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    if _POOL:
        so.use_per_session_threads = False
    else:
        so.intra_op_num_threads = default_threads(threads)
        so.inter_op_num_threads = 1
        # a session with a pool of its own must not busy-wait between runs when another alternates with it:
        # its spinning threads steal the cores from the other (measured: target pass 16.6 ms instead of 6.9 ms)
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    # fold every constant subgraph, however large (0: no limit): fp16 and int8w weights are widened to fp32
    # once, at load. onnxruntime >= 1.27 leaves a node whose output exceeds 1 GiB unfolded by default (an
    # embedding of 65,536 x 4,097 fp32 was then widened on every pass: 2.3 s per pass, measured)
    so.add_session_config_entry("optimization.constant_folding_max_output_size_in_bytes", str(fold_limit_bytes))
    return so


def run_options(arena: bool, device: str) -> ort.RunOptions | None:
    """A CPU session with an arena gives the memory no tensor holds back at the end of each run: the arena
    otherwise keeps its largest run for good, and the runs of a long prompt grow with its KV cache (a 3,000-token
    prompt left 3.1 GB behind). A later, smaller run allocates afresh: no slower in measurement."""
    if not arena or device != "cpu":
        return None
    ro = ort.RunOptions()
    ro.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return ro


def _libc():
    """glibc, or None where the C library has no malloc_trim / mallopt (macOS, Windows, musl)."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
            _LIBC.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC or None


_LIBC = None
M_MMAP_THRESHOLD = -3                  # glibc's mallopt parameter
MMAP_THRESHOLD = 4 << 20               # buffers of this size or more are mapped, and unmapped when freed


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing): buffers a long
    prompt's passes freed stay in the process's heap, which glibc returns only from its top (SmolLM2-135M after a
    2,600-token prompt: 408 MB RSS, 254 MB after the trim, 240 MB loaded; the arena's shrinking alone left it)."""
    libc = _libc()
    if libc:
        libc.malloc_trim(0)


def cap_heap_buffers() -> None:
    """Buffers of MMAP_THRESHOLD bytes or more go back to the system when freed (glibc's mmap threshold, fixed; a
    process that sets MALLOC_MMAP_THRESHOLD_ keeps its own). glibc raises the threshold to the largest block freed
    (up to 32 MB), after which a long prompt's chunk buffers (attention scores, MLP rows: 4-32 MB) came from the
    heap, stayed there when freed and added up across layers: Qwen2.5-Coder-1.5B over a 4,000-token prompt peaked
    at 4.1 GB instead of 2.6 GB (llama.cpp: 2.1 GB), at the same speed. Once per process."""
    global _CAPPED
    libc = _libc()
    if not _CAPPED and libc and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    _CAPPED = True


_CAPPED = False


def declares(sess: ort.InferenceSession, name: str) -> bool:
    """Whether the graph takes an input of this name."""
    return any(i.name == name for i in sess.get_inputs())


def check_io(sess: ort.InferenceSession, want_in: set, want_out: set, name: str) -> None:
    """The graph takes exactly `want_in` and gives at least `want_out`, or one line naming the difference."""
    got_in = {i.name for i in sess.get_inputs()}
    got_out = {o.name for o in sess.get_outputs()}
    if got_in != want_in or not want_out <= got_out:
        raise ModelFolderError(f"{name}: graph I/O does not match specbeam_config.json "
                               f"(missing inputs [{few(sorted(want_in - got_in))}], unexpected inputs "
                               f"[{few(sorted(got_in - want_in))}], missing outputs "
                               f"[{few(sorted(want_out - got_out))}]); re-export the model")


def run_bound(sess: ort.InferenceSession, feed: dict, host_outputs: list[str], device_outputs: list[str],
              device: str, runs=None) -> list:
    """One run with IOBinding: inputs are host arrays or OrtValues already on the device (bound as they are: a
    resident cache is not copied); `host_outputs` come back as numpy arrays, `device_outputs` stay OrtValues on
    `device` (allocated by onnxruntime, so nothing crosses the bus). runs: its onnxruntime RunOptions."""
    io = sess.io_binding()
    for name, a in feed.items():
        if isinstance(a, ort.OrtValue):
            io.bind_ortvalue_input(name, a)
        else:
            io.bind_cpu_input(name, np.ascontiguousarray(a))
    for name in host_outputs:
        io.bind_output(name, "cpu")
    for name in device_outputs:
        io.bind_output(name, device)
    sess.run_with_iobinding(io, runs)
    outs = io.get_outputs()
    return [o.numpy() for o in outs[:len(host_outputs)]] + list(outs[len(host_outputs):])
