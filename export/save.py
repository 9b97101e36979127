"""What every export writes the same way, whole or encoder-decoder: the precisions and their quantization, the
progress bar, and the staged folder that replaces the output only when the export completes."""
from __future__ import annotations

import logging
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx
from onnx import helper as oh
from onnx import numpy_helper as onh

from .quant import rowwise_int8
from .resident import _external
from .safety import make_staging, replace_folder, stopped_on_signal

# batch-invariant (exact speculation): fp32, fp16, int8w (fp32 compute), int8 (per-row int8 compute, quant.py);
# int8dyn (quantize_dynamic) is not; int4 (MatMulNBits) depends on the kernel: the engine measures it at load
PRECISIONS = ("fp32", "fp16", "int8w", "int8", "int8dyn", "int4")
INVARIANT = {"fp32": True, "fp16": True, "int8w": True, "int8": True, "int8dyn": False, "int4": False}
# attention in double where int8 activations would amplify fp32 layout noise (attention._attention, DESIGN
# "Layout-exact attention"); --attention overrides
ATTENTION = {"int8": "fp64", "int4": "fp64"}
GEN_KEYS = ("num_beams", "max_new_tokens", "length_penalty", "early_stopping", "num_return_sequences",
             "no_repeat_ngram_size", "repetition_penalty", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p")


def memory_mb() -> int | None:
    """This process's resident memory now (Linux), else its peak so far (other Unixes); None where neither is
    known."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak // 2**20 if sys.platform == "darwin" else peak // 1024
    except (ImportError, AttributeError, ValueError):
        return None


class DataFile:
    """A graph's tensor file (`<graph>.data`), written as tensors come: each one's bytes appended 64-byte aligned
    and the tensor turned into a reference to them, so the graph's message never holds the weights."""
    ALIGN = 64
    INLINE_BYTES = 1024      # smaller tensors (shapes, scalars) stay in the graph file

    def __init__(self, path: Path):
        self.path, self.f, self.offset = path, open(path, "wb"), 0

    def _start(self) -> int:
        pad = (-self.offset) % self.ALIGN
        self.f.write(b"\0" * pad)
        self.offset += pad
        return self.offset

    def spill(self, tensors) -> None:
        """The tensors' bytes into the file (those of INLINE_BYTES or more), each left as a reference."""
        for t in tensors:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                continue
            if not t.raw_data:                     # a tensor made from a list of values: its bytes
                t.CopyFrom(onh.from_array(onh.to_array(t), t.name))
            if len(t.raw_data) < self.INLINE_BYTES:
                continue
            start = self._start()
            self.f.write(t.raw_data)
            self.offset += len(t.raw_data)
            t.ClearField("raw_data")
            _external(t, self.path.name, start, self.offset - start)

    def table(self, name: str, dtype, shape, chunks) -> onnx.TensorProto:
        """A tensor of `shape` written from the row chunks `chunks` straight to the file (never held whole)."""
        start = self._start()
        for c in chunks:
            c = np.ascontiguousarray(c, dtype)
            self.f.write(memoryview(c.reshape(-1).view(np.uint8)))
            self.offset += c.nbytes
        t = onnx.TensorProto(name=name, data_type=oh.np_dtype_to_tensor_dtype(np.dtype(dtype)), dims=list(shape))
        _external(t, self.path.name, start, self.offset - start)
        return t

    def close(self):
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ExportProgress:
    """The export's progress bar on stderr (tqdm; silent when quiet). Log records (onnxruntime's quantizer warns
    through `logging`) print above the bar instead of breaking into it."""

    def __init__(self, total: int, quiet: bool):
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self.bar = tqdm(total=total, disable=quiet, file=sys.stderr, unit="step", leave=True,
                        bar_format="{desc:<36} {n_fmt}/{total_fmt} [{elapsed}]")
        self._logs = logging_redirect_tqdm()
        self._logs.__enter__()

    def step(self, what: str):
        """One step done; its line shows the memory in use (an export's memory must not grow with the model)."""
        mb = memory_mb()
        self.bar.set_description_str(what if mb is None else f"{what} ({mb} MB in use)", refresh=False)
        self.bar.update(1)

    def close(self):
        self._logs.__exit__(None, None, None)
        self.bar.close()


@contextmanager
def staged(dst: Path, prog: ExportProgress):
    """A temporary folder beside `dst` that replaces `dst` when the block completes, and is removed when it fails
    (an interrupted, terminated or hung-up export leaves no half-written model folder; one killed outright is
    swept by the next export); the progress bar is closed either way."""
    with stopped_on_signal():
        tmp = make_staging(dst)       # with the permissions mkdir would give (mkdtemp's are 0700)
        try:
            yield tmp
            replace_folder(tmp, dst)   # old aside, new in, old deleted: an interrupt leaves one of them (safety.py)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            prog.close()


# protobuf refuses messages over 2 GB: larger graphs keep their tensors in `<file>.data` beside the graph
EXTERNAL_DATA_BYTES = 1_800_000_000


def _save(model: onnx.ModelProto, path: Path) -> bool:
    """Save the graph; True when its tensors went to `<file>.data`."""
    # the tensors' bytes, not model.ByteSize(): the upb protobuf refuses to size a message past 2 GB
    big = sum(len(t.raw_data) or t.ByteSize() for t in model.graph.initializer) > EXTERNAL_DATA_BYTES
    onnx.save_model(model, str(path), save_as_external_data=big, all_tensors_to_one_file=True,
                    location=path.name + ".data" if big else None)
    return big


def _save_quantized(model: onnx.ModelProto, dst: Path, reduce_range: bool = True) -> dict:
    """int8dyn: onnxruntime's quantize_dynamic on `model` into `dst`, through a temporary fp32 graph beside it, which
    is removed with its tensor file (measured: gemma-3-270m's int8 folder was 2688 MB with a 1.7 GB leftover, 962 MB
    without). The quantized graph of a past-2-GB fp32 graph can pass 2 GB too (fp32 embeddings and int8 matrices):
    its tensors then go to `<dst>.data`."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    raw = dst.with_name(dst.stem + ".fp32.onnx")
    big = _save(model, raw)
    logging.getLogger("onnxruntime.quantization").setLevel(logging.ERROR)
    try:
        quantize_dynamic(str(raw), str(dst), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"],
                         per_channel=True, reduce_range=reduce_range, use_external_data_format=big)
    finally:
        raw.unlink(missing_ok=True)
        raw.with_name(raw.name + ".data").unlink(missing_ok=True)
    return {"method": "onnxruntime quantize_dynamic (one activation scale per tensor: not batch-invariant)",
            "weight_type": "int8", "per_channel": True, "reduce_range": reduce_range,
            "ops": "DynamicQuantizeLinear + MatMulInteger (all weight MatMuls incl. lm_head); embeddings fp32"}


def rtn_int4(model: onnx.ModelProto, block_size: int) -> tuple[onnx.ModelProto, dict]:
    """onnxruntime's round-to-nearest MatMulNBits quantizer (symmetric, accuracy level 4) on `model`, a whole graph
    or one piece of it (export/whole.py): (the quantized graph, the config's quantization entry)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization").setLevel(logging.ERROR)
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.ERROR)
    cfg = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True, accuracy_level=4, bits=4)
    q = MatMulNBitsQuantizer(model, bits=4, block_size=block_size, is_symmetric=True, accuracy_level=4,
                             algo_config=cfg)
    q.process()
    return q.model.model, {"method": "onnxruntime MatMulNBitsQuantizer (RTN)", "bits": 4, "block_size": block_size,
                           "symmetric": True, "accuracy_level": 4,
                           "ops": "MatMulNBits (all weight MatMuls incl. lm_head)"}


def save_precision(model: onnx.ModelProto, dst: Path, precision: str, reduce_range: bool = True) -> dict | None:
    """Write the fp32-compute graph `model` built whole in memory (export/whole.py's in-memory path, the
    encoder-decoder's graphs) to `dst` at `precision`; returns the quantization entry of the config (None: the
    graph is saved as built). int4 is never built whole: export/whole.py quantizes it a piece at a time."""
    if precision == "int8":
        quant = rowwise_int8(model, reduce_range=reduce_range)
        _save(model, dst)
        return quant
    if precision == "int8dyn":
        return _save_quantized(model, dst, reduce_range)
    _save(model, dst)
    return None


# int8w: a storage format (graph.stored_weight), measured on the shipped en->de target (6x256): BLEU 43.18 vs
# 42.78 for fp16 storage (beam 4, 300 held-out lines), 8.8 vs 17 MB, the same pass cost
INT8W = {"method": "specbeam int8 weight storage: symmetric per output channel (round to nearest), Cast x scale "
                   "folded at load; fp32 compute", "weight_type": "int8", "per_channel": True, "storage": "int8w"}


def stored_as(precision: str) -> dict:
    """The quantization entry of weights kept as stored: int8w's storage, else none at `precision`."""
    return INT8W if precision == "int8w" else {"method": "none", "storage": precision}
