"""Export a local Hugging Face folder to a specbeam model folder (DESIGN sections 3-5)."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from specbeam_edge.contract import LAYOUTS, OUTPUT_KINDS, graph_io

from . import split, whole
from .attention import needs_key_positions
from .builder import KV_CACHE
from .config_file import TOKENIZER_FILES, copy_tokenizer, write_config
from .encdec import export_encdec, family_of
from .gguf_input import is_gguf, unpack
from .families import read_arch
from .hf import HEAD_TOKEN_IDS, Arch, ExportError, check_layer_count, global_names, read_json, read_weights
from .safety import check_output
from .save import ATTENTION, GEN_KEYS, PRECISIONS, ExportProgress, staged


def _generation_defaults(src: Path) -> dict:
    gen = read_json(src / "generation_config.json", {})
    return {k: gen[k] for k in GEN_KEYS if k in gen}


def _shape(arch: Arch) -> dict:
    """The config's graph shape and special tokens (config_file.SHAPE_KEYS)."""
    return dict(hidden_size=arch.hidden, num_layers=arch.layers, num_heads=arch.heads, num_kv_heads=arch.kv_heads,
                head_dim=arch.head_dim, context_length=arch.context_length, bos_token_id=arch.bos_token_id,
                eos_token_ids=arch.eos_token_ids, pad_token_id=arch.pad_token_id)


def _layer_info(arch: Arch) -> dict:
    """Rope of each kind and, per layer, its rope kind (None: no rope) and attention kind (the window)."""
    ropes = {k: {**r.params, "attention_scaling": r.attention_scaling} for k, r in arch.ropes.items()}
    info = {"rope": ropes["global"] if list(ropes) == ["global"] else ropes,
            "layer_rope": list(arch.layer_rope),
            "layer_types": ["sliding_attention" if s else "full_attention" for s in arch.layer_sliding]}
    if any(arch.layer_sliding):
        info["sliding_window"] = arch.sliding_window
    return info


def export(src: str | Path, dst: str | Path, *, precision: str = "fp32", layout: str = "whole",
           output: str = "logits", overwrite: bool = False, block_size: int = 32, quiet: bool = False,
           compute: str = "fp32", reduce_range: bool = True, attention: str | None = None,
           head_tokens: int | None = None, int4_weights: str = "file", kv_cache: str | None = None) -> Path:
    """Export the HF folder `src` into the specbeam model folder `dst`; returns dst.

    attention: "fp32" or "fp64" (attention computed in double, so a node's result does not depend on where the
    cache's dead columns sit); None: fp64 for int8 and int4 (ATTENTION), fp32 otherwise.
    kv_cache: the KV cache's storage, "fp32" or "fp16" (each new key and value rounded before its first use);
    None: fp16 with fp16 compute, else fp32 (_checked_kv_cache).
    compute: "fp32", or "fp16" for GPUs: weights, activations and the KV cache in fp16 (half the memory and
    bandwidth, tensor cores on CUDA), logits and the tree mask still fp32 at the graph's edge (`_to_fp16`).
    reduce_range: int8 weights in 7 bits (the default), so CPUs without VNNI never saturate their int16 sums
    (export/quant.py); False: 8 bits, half the weight rounding error, only for CPUs with VNNI.
    int4_weights: "file" keeps a GGUF's own blocks (export/blocks.py: Q4_K, Q6_K, Q5_0, ... exactly as the file
    holds them; 5- to 8-bit kinds take 8-bit codes); "rtn" quantizes every matrix round-to-nearest to 4 bits
    (onnxruntime's quantizer: one more rounding, smaller and faster where the file has 5-8-bit blocks).
    head_tokens: for a draft: its head scores only the ids below this and the tokenizer's added tokens
    (head_subset); the target still scores every token, so output is unchanged and a level costs less.
    The folder is written to a temporary sibling and renamed at the end, so a failure leaves nothing behind.
    """
    src, dst = Path(src), Path(dst)
    attention = _checked_options(precision, layout, output, block_size, compute, attention, head_tokens,
                                 int4_weights)
    kv_cache = _checked_kv_cache(kv_cache, compute)
    if not src.exists():
        raise ExportError(f"input {src} does not exist (pass a Hugging Face model folder or a .gguf file)")
    check_output(src, dst, overwrite)      # before the long work: never the input, a file or a link (safety.py)
    opts = dict(precision="fp16" if compute == "fp16" else precision, layout=layout, output=output,
                block_size=block_size, quiet=quiet, compute=compute, reduce_range=reduce_range, attention=attention,
                head_tokens=head_tokens, int4_weights=int4_weights, kv_cache=kv_cache)
    if is_gguf(src):             # transformers dequantizes the file; its config and tokenizer go to a side folder
        with tempfile.TemporaryDirectory(prefix="specbeam-gguf-") as side:
            return _export_decoder(Path(side), dst, unpack(src, Path(side), quiet), src.name, **opts)
    if not src.is_dir():
        raise ExportError(f"input folder {src} does not exist (pass a Hugging Face model folder or a .gguf file)")

    if family_of(src):           # Marian / M2M100 / NLLB: encoder graph + decoder graph (export/encdec.py)
        if compute != "fp32":
            raise ExportError("compute fp16 is not available for encoder-decoder models yet (export fp32 compute)")
        if head_tokens is not None:
            raise ExportError("head_tokens is for decoder-only drafts, not encoder-decoder models")
        if kv_cache != "fp32":                    # (compute is fp32 here, so fp16 was asked for)
            raise ExportError("kv_cache fp16 is for decoder-only models (an encoder-decoder's cache stays fp32): "
                              "export without it")
        return export_encdec(src, dst, family_of(src), precision=precision, layout=layout, output=output,
                             overwrite=overwrite, quiet=quiet, reduce_range=reduce_range, attention=attention)
    return _export_decoder(src, dst, None, src.name, **opts)


def _checked_kv_cache(kv_cache: str | None, compute: str) -> str:
    """--kv_cache checked against compute; returns it. None: fp16 with fp16 compute, else fp32, in both layouts
    (split == whole). fp16 is not the default: it lowered a whole graph's long-prompt peak (SmolLM2-135M, 5,600
    tokens: 719 against 974 MB) but raised the split layout's (Qwen2.5-Coder-1.5B, 4,000 tokens: 2.67-2.80 against
    2.55-2.61 GB), decoding as fast in both (bench/README "Long prompts")."""
    if kv_cache is None:
        return "fp16" if compute == "fp16" else "fp32"
    if kv_cache not in KV_CACHE:
        raise ExportError(f"kv_cache {kv_cache!r} is not 'fp32' or 'fp16'")
    if compute == "fp16" and kv_cache != "fp16":
        raise ExportError("compute fp16 keeps its KV cache in fp16: export without kv_cache fp32")
    return kv_cache


def _checked_options(precision: str, layout: str, output: str, block_size, compute: str, attention: str | None,
                     head_tokens, int4_weights: str) -> str:
    """export's options checked against each other, before any file is read; returns the attention to use."""
    if compute not in ("fp32", "fp16"):
        raise ExportError(f"compute {compute!r} is not 'fp32' or 'fp16'")
    if compute == "fp16" and (layout != "whole" or precision not in ("fp32", "fp16")):
        raise ExportError("compute fp16 is for the whole layout with fp32 or fp16 weights (it stores fp16 "
                          f"weights itself), not layout {layout!r} with {precision} weights")
    if precision not in PRECISIONS:
        raise ExportError(f"precision {precision!r} is not one of {PRECISIONS}")
    attention = attention or ATTENTION.get(precision, "fp32")
    if attention not in ("fp32", "fp64"):
        raise ExportError(f"attention {attention!r} is not 'fp32' or 'fp64'")
    if attention == "fp64" and compute == "fp16":
        raise ExportError("attention fp64 is for fp32 compute (compute fp16 runs attention in fp16)")
    if layout not in LAYOUTS:
        raise ExportError(f"layout {layout!r} is not 'whole' or 'split'")
    if output not in OUTPUT_KINDS:
        raise ExportError(f"output {output!r} is not one of {OUTPUT_KINDS}")
    if layout == "split" and precision == "int4":
        raise ExportError("layout 'split' supports fp32, fp16 and int8 weights (int4 needs constant weights)")
    if (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 16
            or block_size & (block_size - 1)):
        raise ExportError(f"block_size must be a power of two >= 16 (int4 blocks), got {block_size!r}")
    if int4_weights not in ("file", "rtn"):
        raise ExportError(f"int4_weights {int4_weights!r} is not 'file' or 'rtn'")
    if head_tokens is not None and (isinstance(head_tokens, bool) or not isinstance(head_tokens, int)
                                    or head_tokens < 1):
        raise ExportError(f"head_tokens must be a positive number of token ids, got {head_tokens!r}")
    return attention


def head_subset(ids: np.ndarray | None, arch: Arch, tokenizer: Path, below: int) -> np.ndarray | None:
    """The ids of a head over the ids below `below` and the tokenizer's added tokens (chat markers, end of text);
    None when that is every token. For a draft: Qwen2.5's 151,936-token head was a fifth of a 0.5B draft level;
    byte-pair ids are numbered by merge order, so low ids are the frequent tokens (the first 65,536 covered 98%
    of this repository's code and README). ids: the checkpoint's own subset, which refuses another."""
    if ids is not None:
        raise ExportError(f"the model's head already scores a token subset ({HEAD_TOKEN_IDS}); export it without "
                          f"head_tokens")
    try:
        added = [int(t["id"]) for t in read_json(tokenizer).get("added_tokens", [])]
    except (TypeError, KeyError, ValueError) as e:
        raise ExportError(f"{tokenizer}: cannot read its added tokens ({e})") from None
    ids = np.unique(np.concatenate([np.arange(min(below, arch.vocab_size), dtype=np.int64),
                                    np.array([i for i in added if 0 <= i < arch.vocab_size], np.int64)]))
    return None if len(ids) >= arch.vocab_size else ids


def _head_tokens(below: int | None, head_ids: np.ndarray | None, arch: Arch) -> dict:
    """The config's `head_tokens` entry of a cut head (--head_tokens, or the checkpoint's own subset): how many
    tokens it scores, so the runtime keeps a top-k within them and runs the folder as a draft only."""
    if below is not None:
        return {"head_tokens": {"below": below, "count": arch.vocab_size if head_ids is None else int(len(head_ids)),
                                "rule": "the ids below `below` and the tokenizer's added tokens"}}
    if head_ids is not None:
        return {"head_tokens": {"count": int(len(head_ids)), "rule": f"the checkpoint's {HEAD_TOKEN_IDS}"}}
    return {}


def _export_decoder(src: Path, dst: Path, weights: dict | None, source_name: str, *, precision: str, layout: str,
                    output: str, block_size: int, quiet: bool, compute: str = "fp32",
                    reduce_range: bool = True, attention: str = "fp32", head_tokens: int | None = None,
                    int4_weights: str = "file", kv_cache: str = "fp32") -> Path:
    """A decoder-only model from the HF-style folder `src` (weights: read from it when None). The weights are read a
    tensor at a time (hf.Tensors); the split layout also writes them so (export/split.py)."""
    if not (src / "tokenizer.json").is_file():
        raise ExportError(f"{src}: no tokenizer.json (a `tokenizers` fast tokenizer is required)")
    t0 = time.time()
    arch = read_arch(src)
    weights = read_weights(src) if weights is None else weights
    check_layer_count(weights, arch.layers, source_name)
    head, head_ids = global_names(weights, arch)
    if head_tokens is not None:
        head_ids = head_subset(head_ids, arch, src / "tokenizer.json", head_tokens)
    prog = ExportProgress(arch.layers + 3, quiet)
    with staged(dst, prog) as tmp:
        files, quant = _write_graphs(tmp, weights, arch, head, head_ids, precision, layout, output, attention,
                                     block_size, reduce_range, compute, int4_weights, prog, kv_cache)
        copy_tokenizer(src, tmp, (*TOKENIZER_FILES, "chat_template.jinja"))
        write_config(tmp, t0, family=arch.family, vocab_size=arch.vocab_size, shape=_shape(arch), layout=layout,
                     precision=precision, quant=quant, compute=compute, attention=attention, output=output,
                     kv_cache=kv_cache, files=files,
                     kind={**_layer_info(arch), **_head_tokens(head_tokens, head_ids, arch)},
                     io=graph_io(output, key_positions=needs_key_positions(arch), head_from=layout == "whole",
                                 prompt_attention=attention == "fp64"),
                     generation=_generation_defaults(src), source_name=source_name)
        prog.step("write config")
    return dst


def _write_graphs(tmp: Path, weights, arch: Arch, head, head_ids, precision: str, layout: str, output: str,
                  attention: str, block_size: int, reduce_range: bool, compute: str, int4_weights: str,
                  prog, kv_cache: str) -> tuple[dict, dict | None]:
    """The layout's graphs and weight files written into `tmp` by the layout's writer (export/whole.py,
    export/split.py): (the config's files entry, its quantization)."""
    if layout == "whole":
        return whole.write(tmp, weights, arch, head, head_ids, precision, output, attention, block_size,
                           reduce_range, compute, int4_weights, prog, kv_cache)
    return split.write_split(tmp, weights, arch, head, head_ids, precision, output, attention, reduce_range,
                             prog.step, kv_cache)
