"""GGUF files (Ollama, LM Studio, llama.cpp) as export input: transformers reads the file, dequantizes its
weights and rebuilds its tokenizer (`from_pretrained(folder, gguf_file=...)`); the result is handed to the
same exporter as a Hugging Face folder, so a GGUF model gets exactly the graph its architecture gets."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .hf import ExportError, quiet_transformers

# general.architecture values transformers reads (and dequantizes) whose model classes export/families/ covers
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def _load(path: Path, quiet: bool = False):
    """The dequantized fp32 torch model and the rebuilt tokenizer; transformers' errors become ExportErrors."""
    import torch
    import transformers as tf

    kw = dict(gguf_file=path.name, local_files_only=True)
    try:
        with quiet_transformers(quiet):
            model = tf.AutoModelForCausalLM.from_pretrained(
                str(path.parent), dtype=torch.float32, quantization_config=tf.GgufConfig(dequantize=True), **kw)
            tok = tf.AutoTokenizer.from_pretrained(str(path.parent), **kw)
    except ImportError as e:
        raise ExportError(f"{path}: reading GGUF files needs the export extra's `gguf` and `accelerate` packages "
                          f"(pip install -e \".[export]\"): {str(e).splitlines()[0]}") from None
    except Exception as e:  # transformers raises ValueError/KeyError/NotImplementedError for files it cannot read
        raise ExportError(f"{path}: transformers cannot load this GGUF file ({str(e).splitlines()[0]}); "
                          f"GGUF architectures of the supported families: {', '.join(GGUF_ARCHITECTURES)}") from None
    return model.eval(), tok


def unpack(path: Path, side: Path, quiet: bool = False) -> dict[str, np.ndarray]:
    """Write the model's config.json, generation_config.json and tokenizer files into the empty folder `side`
    and return its fp32 weights by checkpoint name (the folder then reads like a Hugging Face one)."""
    import transformers as tf

    model, tok = _load(path, quiet)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)          # the weights handed on are plain fp32
    cfg["architectures"] = [type(model).__name__]  # GGUF configs name no class; the exporter picks by it
    (side / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    tf.GenerationConfig.from_model_config(model.config).save_pretrained(side)
    tok.save_pretrained(side)
    if not (side / "tokenizer.json").is_file():
        raise ExportError(f"{path}: transformers rebuilt no fast tokenizer (tokenizer.json) from this file")
    weights = {}
    for name, t in model.state_dict().items():
        if not t.is_floating_point():
            raise ExportError(f"{path}: tensor {name} stayed quantized ({t.dtype}) after loading; "
                              f"this transformers version did not dequantize it")
        weights[name] = t.detach().float().numpy()
    return weights
