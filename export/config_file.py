"""specbeam_config.json, written the same way for every model kind (decoder-only whole or split, encoder-decoder):
the fields every folder has (format, tokenizer checksum, the graph's shape, precision and its quantization, mask and
cache conventions, files, io, generation defaults, source) in one place, the kind's own entries passed in; and the
tokenizer files copied beside it."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from specbeam_edge.contract import CONFIG_FILE, FORMAT_VERSION, MASK_VALUE, file_sha256

from .save import INVARIANT

# the graph's shape and special tokens, in the config's order after vocab_size and tokenizer_sha256
SHAPE_KEYS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "context_length", "bos_token_id",
              "eos_token_ids", "pad_token_id")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def copy_tokenizer(src: Path, tmp: Path, names=TOKENIZER_FILES) -> None:
    """The tokenizer files of `names` that `src` holds, copied into `tmp`."""
    for f in names:
        if (src / f).is_file():
            shutil.copy2(src / f, tmp / f)


def write_config(tmp: Path, t0: float, *, family: str, vocab_size: int, shape: dict, layout: str, precision: str,
                 quant: dict | None, compute: str, attention: str, output: str, files: dict, kind: dict, io: dict,
                 generation: dict, source_name: str, kv_cache: str = "fp32") -> None:
    """specbeam_config.json into `tmp` (which holds tokenizer.json). shape: SHAPE_KEYS' values; kind: the model
    kind's own entries, which go between files and io (a decoder's rope and layer kinds, an encoder-decoder's static
    inputs); t0: when the export started (source.export_seconds)."""
    cfg = {
        "format_version": FORMAT_VERSION, "family": family, "vocab_size": vocab_size,
        "tokenizer_sha256": file_sha256(tmp / "tokenizer.json"), **{k: shape[k] for k in SHAPE_KEYS},
        "layout": layout, "precision": precision, "quantization": quant,
        "compute_dtype": "float16" if compute == "fp16" else "float32",
        "attention_dtype": "float64" if attention == "fp64" else "float16" if compute == "fp16" else "float32",
        "kv_cache_dtype": "float16" if kv_cache == "fp16" else "float32",
        # the exporter's claim; the engine measures it when it loads a target for exact speculation. int8dyn
        # quantizes activations per tensor: a node's logits depend on the other nodes of the pass (up to 1e-2)
        "batch_invariant": INVARIANT[precision],
        "mask": "additive_float32", "mask_value": MASK_VALUE, "present": "concat",
        "output": output, "files": files, **kind, "io": io, "generation": generation,
        "source": {"folder_name": source_name, "export_seconds": round(time.time() - t0, 2)},
    }
    (tmp / CONFIG_FILE).write_text(json.dumps(cfg, indent=2))
