"""HF model folder -> specbeam model folder (torch-free; onnx + onnxruntime quantizers)."""
from .core import PRECISIONS, export
from .hf import ExportError

__all__ = ["export", "ExportError", "PRECISIONS"]
