"""GGUF files (Ollama, LM Studio, llama.cpp) as export input: transformers rebuilds the config and the tokenizer
from the file's metadata (`from_pretrained(folder, gguf_file=...)`) and its loader's per-family tensor processors
give each tensor's values; the tensors are read and dequantized one at a time (`unpack`), so a model larger than
memory exports, and a GGUF model gets exactly the graph its architecture gets."""
from __future__ import annotations

import contextlib
import copy
import functools
import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .gguf_checks import check_header
from .hf import ExportError, Tensors, quiet_transformers, read_rows

# general.architecture values transformers reads (and dequantizes) whose model classes export/families/ covers
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def _load(path: Path, quiet: bool = False):
    """The dequantized fp32 torch model and the rebuilt tokenizer; transformers' errors become ExportErrors."""
    import torch
    import transformers as tf

    kw = dict(gguf_file=path.name, local_files_only=True)
    with _named_errors(path), quiet_transformers(quiet):
        model = tf.AutoModelForCausalLM.from_pretrained(
            str(path.parent), dtype=torch.float32, quantization_config=tf.GgufConfig(dequantize=True), **kw)
        tok = tf.AutoTokenizer.from_pretrained(str(path.parent), **kw)
    return model.eval(), tok


@contextlib.contextmanager
def _named_errors(path: Path):
    """transformers' and gguf-py's failures on a file as one-line ExportErrors naming it."""
    try:
        yield
    except ExportError:
        raise                           # already one line naming the file (gguf_checks)
    except ImportError as e:
        raise ExportError(f"{path}: reading GGUF files needs the export extra's `gguf` and `accelerate` packages "
                          f"(pip install -e \".[export]\"): {str(e).splitlines()[0]}") from None
    except Exception as e:  # transformers raises ValueError/KeyError/NotImplementedError for files it cannot read
        raise ExportError(f"{path}: transformers cannot load this GGUF file ({str(e).splitlines()[0]}); "
                          f"GGUF architectures of the supported families: {', '.join(GGUF_ARCHITECTURES)}") from None


def unpack(path: Path, side: Path, quiet: bool = False) -> Tensors:
    """Write the model's config.json, generation_config.json and tokenizer files into the empty folder `side`
    and return its weights by checkpoint name, each dequantized to fp32 when read (the folder then reads like a
    Hugging Face one). The values are transformers' own: the same gguf-py dequantizer and the same per-family
    tensor processor (Llama's q/k row order, Gemma's norm offset) it applies when it loads the whole model, one
    tensor at a time instead of the model at once (a 1.1 GB file took 17 GB loaded whole)."""
    import torch
    import transformers as tf
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    kw = dict(gguf_file=path.name, local_files_only=True)
    with _named_errors(path), quiet_transformers(quiet), _one_reader(path) as reader:
        check_header(path, reader)      # before transformers builds anything from the header's numbers
        cfg = tf.AutoConfig.from_pretrained(str(path.parent), **kw)
        tok = tf.AutoTokenizer.from_pretrained(str(path.parent), **kw)
        parsed = gguf_utils.load_gguf_checkpoint(str(path), return_tensors=False)
        with torch.device("meta"):          # the module tree names the tensors; it holds no weights
            skeleton = tf.AutoModelForCausalLM.from_config(cfg)
    d = cfg.to_dict()
    d.pop("quantization_config", None)
    d["architectures"] = [type(skeleton).__name__]  # GGUF configs name no class; the exporter picks by it
    (side / "config.json").write_text(json.dumps(d, indent=2, default=str))
    tf.GenerationConfig.from_model_config(cfg).save_pretrained(side)
    tok.save_pretrained(side)
    if not (side / "tokenizer.json").is_file():
        raise ExportError(f"{path}: transformers rebuilt no fast tokenizer (tokenizer.json) from this file")
    arch = parsed["config"].get("model_type")
    processor = TENSOR_PROCESSORS.get(_ARCH_NAMES.get(arch, arch), TensorProcessor)(config=parsed["config"])
    names = get_gguf_hf_weights_map(skeleton, processor)
    return _tensors(path, reader, processor, names)


@contextlib.contextmanager
def _one_reader(path: Path):
    """One gguf-py reader of the file for every reader transformers makes while it builds the config and the
    tokenizer: parsing the header of a 151,936-token vocabulary takes 15 s, and they did it three times."""
    import gguf

    reader = gguf.GGUFReader(str(path))          # (a damaged header: _named_errors names the file)
    import transformers.modeling_gguf_pytorch_utils as loader

    made, load = gguf.GGUFReader, loader.load_gguf_checkpoint
    parsed = {}

    def shared(p, *args, **kwargs):
        return reader if Path(p).resolve() == path.resolve() else made(p, *args, **kwargs)

    def load_once(p, return_tensors=False, **kwargs):      # its metadata, parsed once (4 s each time)
        if return_tensors or kwargs or Path(p).resolve() != path.resolve():
            return load(p, return_tensors, **kwargs)
        if "metadata" not in parsed:
            parsed["metadata"] = load(p, False)
        return copy.deepcopy(parsed["metadata"])            # (callers pop keys from it)
    gguf.GGUFReader, loader.load_gguf_checkpoint = shared, load_once
    try:
        yield reader
    finally:
        gguf.GGUFReader, loader.load_gguf_checkpoint = made, load


# transformers' config model_type -> the GGUF architecture name its TENSOR_PROCESSORS table is keyed by
_ARCH_NAMES = {"gemma3_text": "gemma3"}


def _tensors(path: Path, reader, processor, names: dict[str, str]) -> Tensors:
    """Readers of the file's tensors under their checkpoint names (gguf-py's reader gives where each lies; its
    bytes are read from the file when asked for, so nothing of the file stays mapped in memory)."""
    from .blocks import BYTES

    readers, shapes, blocks = {}, {}, {}
    for t in reader.tensors:
        hf_name = names.get(t.name)
        if hf_name is None:
            continue
        where = _Stored(t.name, t.tensor_type, t.data_offset, t.data.dtype, tuple(t.data.shape))
        readers[hf_name] = functools.partial(_read_tensor, path, where, processor, names)
        shapes[hf_name] = tuple(int(d) for d in reversed(t.shape.tolist()))
        kind = t.tensor_type.name.lower()
        if kind in BYTES and len(where.shape) == 2:
            blocks[hf_name] = functools.partial(_read_blocks, path, where, kind, processor, names)
    return Tensors(readers, shapes, blocks)


def _read_blocks(path: Path, t: _Stored, kind: str, processor, names: dict, rows: slice | None):
    """A quantized matrix's own blocks (export.blocks.from_ggml), its rows put in the order transformers'
    processor puts them (Llama's q/k rows are permuted: found by processing a column of row numbers), or the
    stored rows `rows`. The caller checks the blocks' values against the processed tensor before using them."""
    from .blocks import from_ggml

    b = from_ggml(read_rows(path, t.offset, t.dtype, t.shape, rows), kind)
    if rows is not None:
        return b
    rows = np.arange(b.codes.shape[0], dtype=np.float32)[:, None]
    order = processor.process(weights=rows, name=t.name, tensor_key_mapping=names,
                              parsed_parameters={"tensors": {}}).weights
    order = np.asarray(order, np.float32).reshape(-1)
    if order.shape == rows[:, 0].shape and not np.array_equal(order, rows[:, 0]):
        pick = order.astype(np.int64)
        b.codes, b.scale = b.codes[pick], b.scale[pick]
        b.offset = None if b.offset is None else b.offset[pick]
    return b


class _Stored(NamedTuple):
    """Where a tensor's bytes lie in the file and how gguf-py lays them out (a quantized tensor: rows of blocks)."""
    name: str
    qtype: int
    offset: int
    dtype: np.dtype
    shape: tuple


def _read_tensor(path: Path, t: _Stored, processor, names: dict, rows: slice | None) -> np.ndarray:
    """One tensor (or rows of it) dequantized to fp32 and processed as transformers' loader does."""
    from gguf import dequantize

    raw = read_rows(path, t.offset, t.dtype, t.shape, rows)
    w = dequantize(raw, t.qtype)
    w = processor.process(weights=w, name=t.name, tensor_key_mapping=names, parsed_parameters={"tensors": {}}).weights
    return finite(path, t.name, np.array(w, dtype=np.float32))   # transformers copies it into an fp32 parameter


def finite(path: Path, name: str, w: np.ndarray) -> np.ndarray:
    """w, refused in one line when it holds a NaN or an infinity: such a file exported silently and then answered
    nothing at one beam and raised an IndexError at two."""
    if not np.isfinite(w).all():
        raise ExportError(f"{path}: tensor {name} holds NaN or infinite values ({int((~np.isfinite(w)).sum())} of "
                          f"{w.size}); the file is damaged: download it again or convert the model anew")
    return w
