"""specbeam-edge: exact speculative beam search on ONNX Runtime."""
from .config import GenerationConfig, ModelConfig, ModelFolderError, SpeculativeConfig
from .generate import Engine, Hypothesis, Result, Stats, StreamChunk
from .model import OnnxCausalLM

__all__ = ["Engine", "GenerationConfig", "SpeculativeConfig", "ModelConfig", "ModelFolderError", "OnnxCausalLM",
           "Result", "Hypothesis", "Stats", "StreamChunk"]
__version__ = "0.1.0"
