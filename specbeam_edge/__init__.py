"""specbeam-edge: exact speculative beam search on ONNX Runtime."""
try:
    import onnxruntime  # noqa: F401  (the CPU or the GPU build: both install this module)
except ModuleNotFoundError as e:
    if e.name != "onnxruntime":
        raise
    raise ImportError("specbeam-edge needs ONNX Runtime, which comes with one of its extras: pip install "
                      "'specbeam-edge[cpu]', or 'specbeam-edge[gpu]' for CUDA (never both)") from None
from .config import GenerationConfig, ModelConfig, ModelFolderError, SpeculativeConfig
from .generate import Alternative, Engine, Hypothesis, Result, Stats, StreamChunk
from .model import OnnxCausalLM, share_threads

__all__ = ["Engine", "GenerationConfig", "SpeculativeConfig", "ModelConfig", "ModelFolderError", "OnnxCausalLM",
           "Result", "Hypothesis", "Alternative", "Stats", "StreamChunk", "share_threads"]
__version__ = "0.1.0"
