"""specbeam-edge: exact speculative beam search on ONNX Runtime.

The public names load on first use (module __getattr__), so `import specbeam_edge.contract` or `.config` (the
exporter writes its folders with them) does not pay for onnxruntime's import. Whether ONNX Runtime is installed
is still checked here, without importing it: without one of the extras, importing the package names them."""
import importlib
import importlib.util

if importlib.util.find_spec("onnxruntime") is None:    # the CPU or the GPU build: both install this module
    raise ImportError("specbeam-edge needs ONNX Runtime, which comes with one of its extras: pip install "
                      "'specbeam-edge[cpu]', or 'specbeam-edge[gpu]' for CUDA (never both)")

# public name -> the module that defines it
_LAZY = {"GenerationConfig": "config", "ModelConfig": "config", "ModelFolderError": "config",
         "SpeculativeConfig": "config", "Alternative": "generate", "Engine": "generate", "Hypothesis": "generate",
         "Result": "generate", "Stats": "generate", "StreamChunk": "generate", "OnnxCausalLM": "execution.model",
         "share_threads": "execution.sessions"}

__all__ = ["Engine", "GenerationConfig", "SpeculativeConfig", "ModelConfig", "ModelFolderError", "OnnxCausalLM",
           "Result", "Hypothesis", "Alternative", "Stats", "StreamChunk", "share_threads"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """Import a public name's module on first use and keep the name (later lookups skip this function)."""
    if name not in _LAZY:
        raise AttributeError(f"module 'specbeam_edge' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
