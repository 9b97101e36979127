"""HF model folder -> specbeam model folder (torch-free; onnx + onnxruntime quantizers).

`export` and `PRECISIONS` load on first use: `specbeam-export --help` and a one-line error work in an install
without the export extra (onnx, torch, transformers)."""
from .hf import ExportError

__all__ = ["export", "ExportError", "PRECISIONS"]


def __getattr__(name):
    if name in ("export", "PRECISIONS"):
        from . import core

        return getattr(core, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
