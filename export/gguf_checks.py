"""A GGUF file's header checked against the tensors the file holds, before transformers builds anything from it.

transformers takes the header's numbers as they are: a `block_count` of 100,000 built a model skeleton for 147 s
into a MemoryError, one below the stored layers exported a cut-down model (exit 0, fluent garbage), a
`context_length` of 1e8 built 13 GB of rotary tables, and a tensor type gguf-py cannot dequantize (F64, I8, Q8_1)
was a NotImplementedError traceback. Each is refused here in one line naming the file, the key and the fix. NaN
or infinite weights are refused as each tensor is read (gguf_input.finite)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from .hf import MAX_CONTEXT, ExportError

_LAYER = re.compile(r"blk\.(\d+)\.")
_FIX = "the file is damaged or its header was edited: download it again, or set the key with gguf-set-metadata"


def check_header(path: Path, reader) -> None:
    """Every header value the export builds from, against the tensors of `reader` (gguf-py's GGUFReader)."""
    arch = _value(reader, "general.architecture")
    if not isinstance(arch, str):
        return                          # transformers names a file without one
    _check_types(path, reader.tensors)
    tensors = {t.name: t for t in reader.tensors}
    _check_layers(path, arch, _value(reader, f"{arch}.block_count"), tensors)
    context = _value(reader, f"{arch}.context_length")
    if context is not None and not (_count(context) and context <= MAX_CONTEXT):
        raise ExportError(f"{path}: {arch}.context_length is {context}, not a context of 1 to {MAX_CONTEXT:,} "
                          f"positions (the export builds rotary tables that long); {_FIX} (the context the model "
                          f"was trained for)")
    _check_shapes(path, arch, reader, tensors)


def _value(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _check_types(path: Path, tensors) -> None:
    """Every tensor in a type gguf-py dequantizes (a probe of one zero block: F64, I8, Q8_1 are not)."""
    from gguf import GGML_QUANT_SIZES, dequantize

    known: dict = {}
    for t in tensors:
        kind = t.tensor_type
        if kind not in known:
            try:
                dequantize(np.zeros((1, GGML_QUANT_SIZES[kind][1]), np.uint8), kind)
                known[kind] = True
            except (NotImplementedError, KeyError, ValueError):
                known[kind] = False
        if not known[kind]:
            raise ExportError(f"{path}: tensor {t.name} is stored as {kind.name}, a type the exporter cannot read "
                              f"(gguf-py dequantizes F32, F16, BF16 and llama.cpp's quantized types); convert the "
                              f"file with llama.cpp's llama-quantize (e.g. to Q8_0) or export the original checkpoint")


def _check_layers(path: Path, arch: str, count, tensors: dict) -> None:
    """block_count is the number of layers whose tensors the file holds (blk.0 ... blk.N-1)."""
    found = sorted({int(m[1]) for name in tensors if (m := _LAYER.match(name))})
    if _count(count) and found == list(range(count)):
        return
    have = f"the tensors of {len(found)} layers (blk.{found[0]} to blk.{found[-1]})" if found else "no layer tensors"
    raise ExportError(f"{path}: {arch}.block_count is {count}, but the file holds {have}; {_FIX} (to the number of "
                      f"layers stored)")


def _check_shapes(path: Path, arch: str, reader, tensors: dict) -> None:
    """embedding_length and the attention's head counts and key length against the shapes of token_embd and of
    blk.0's q and k projections (gguf-py lists a matrix's shape columns first)."""
    heads = _value(reader, f"{arch}.attention.head_count")
    kv = _value(reader, f"{arch}.attention.head_count_kv")
    kv = heads if kv is None else kv
    for key, v in (("attention.head_count", heads), ("attention.head_count_kv", kv)):
        if not _count(v):
            raise ExportError(f"{path}: {arch}.{key} is {v}, not a number of heads >= 1; {_FIX}")
    if heads % kv:
        raise ExportError(f"{path}: {arch}.attention.head_count {heads} is not a multiple of head_count_kv {kv}; "
                          f"{_FIX}")
    hidden = _value(reader, f"{arch}.embedding_length")
    head_dim = _value(reader, f"{arch}.attention.key_length") or (hidden // heads if _count(hidden) else None)
    want = {"embedding_length": ("token_embd.weight", 0, hidden),
            "attention.head_count": ("blk.0.attn_q.weight", 1, heads * head_dim if _count(head_dim) else None),
            "attention.head_count_kv": ("blk.0.attn_k.weight", 1, kv * head_dim if _count(head_dim) else None)}
    for key, (name, axis, size) in want.items():
        t = tensors.get(name)
        if t is None or len(t.shape) != 2 or size is None:
            continue                    # (a family's fused q/k/v: the exporter's own shape checks name it)
        got = int(t.shape[axis])
        if size != got:
            raise ExportError(f"{path}: {arch}.{key} gives {name} {size} {'columns' if axis == 0 else 'rows'}, but "
                              f"the tensor has {got}; {_FIX}")
