"""Read a local Hugging Face causal-LM folder: config (through transformers' own config classes, so every
default is the one transformers uses), weights (safetensors, parsed here), rope tables."""
from __future__ import annotations

import contextlib
import functools
import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specbeam_edge.contract import read_json_object

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64, "I64": np.int64}


class ExportError(ValueError):
    """A model folder that cannot be exported; the message names the problem."""


def read_json(path: Path, default: dict | None = None) -> dict:
    """A JSON object file of the input folder (`default` when it is absent); a damaged one is an ExportError."""
    return read_json_object(path, ExportError, default, fix="fix or replace the file")


@dataclass(frozen=True)
class Rope:
    """Rotary tables of one kind of layer. `long_inv_freq` (LongRoPE) applies from `original_max` on."""
    inv_freq: np.ndarray              # [rotary_dim // 2]
    attention_scaling: float
    params: dict
    long_inv_freq: np.ndarray | None = None
    original_max: int | None = None


@dataclass(frozen=True)
class Arch:
    family: str
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rms_eps: float
    context_length: int
    qkv_bias: bool
    tied: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None
    ropes: dict                       # rope kind ("global", "local") -> Rope
    layer_rope: tuple                 # per layer: a key of `ropes`, or None for a layer without rope (NoPE)
    layer_sliding: tuple              # per layer: True for a sliding-window layer
    sliding_window: int | None = None
    rotary_dim: int = 0               # the leading dims of each head that rope rotates (Phi-3: partial)
    qk_norm: bool = False             # per-head RMSNorm of q and k before rope (Qwen3, Gemma 3)
    sandwich_norms: bool = False      # Gemma: norms after attention and around the MLP
    norm_offset: float = 0.0          # Gemma: RMSNorm scales by (1 + weight)
    embed_scale: float = 1.0          # Gemma: embeddings times sqrt(hidden)
    activation: str = "silu"          # or "gelu_tanh" (GeGLU)
    attn_scale: float | None = None   # None: 1 / sqrt(head_dim)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def heterogeneous(self) -> bool:
        """Layers differ in rope or window: the shared split-layout layer graph then reads per-layer flags."""
        return len(set(zip(self.layer_rope, self.layer_sliding))) > 1

    @property
    def rope_kinds(self) -> list[str]:
        return sorted(self.ropes)


def load_config(folder: Path):
    """transformers' config object for the folder (its defaults and legacy-field conversions included)."""
    if not (folder / "config.json").is_file():
        raise ExportError(f"{folder}: no config.json; this is not a Hugging Face model folder")
    read_json(folder / "config.json")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # transformers raises ValueError/KeyError/... for configs it cannot read
        raise ExportError(f"{folder / 'config.json'}: transformers cannot read it ({str(e).splitlines()[0]})") from None


def rope_for(cfg, params: dict, head_dim: int) -> Rope:
    """Inverse frequencies exactly as transformers computes them (its own init functions, float32)."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = params.get("rope_type", "default")
    rotary = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if kind == "default":
        base = float(params["rope_theta"])
        inv = 1.0 / (base ** (torch.arange(0, rotary, 2, dtype=torch.int64).float() / rotary))
        return Rope(inv.numpy().astype(np.float32), 1.0, dict(params))
    if kind not in ("linear", "llama3", "longrope", "yarn"):
        # dynamic NTK rescales with the sequence length, which a fixed table cannot follow
        raise ExportError(f"rope type {kind!r} is not supported (supported: default, linear, llama3, longrope, yarn)")
    fn = ROPE_INIT_FUNCTIONS[kind]
    layer_type = params.get("_layer_type")
    inv, scaling = fn(cfg, None, layer_type=layer_type) if layer_type else fn(cfg, None)
    long_inv, orig = None, None
    if kind == "longrope":
        # transformers picks the long factors for a forward whose positions exceed the pretraining length
        orig = int(params["original_max_position_embeddings"])
        long_inv = (fn(cfg, None, seq_len=orig + 1, layer_type=layer_type) if layer_type
                    else fn(cfg, None, seq_len=orig + 1))[0].numpy().astype(np.float32)
    clean = {k: v for k, v in params.items() if not k.startswith("_")}
    return Rope(inv.numpy().astype(np.float32), float(scaling), clean, long_inv, orig)


def _eos_list(eos) -> list[int]:
    return [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])


_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
MAX_CONTEXT = 1 << 20     # positions the rotary tables are built for: 1M x 64 frequencies is 512 MB of cos/sin


def _check_sizes(cfg, folder: Path) -> None:
    """The sizes that shape the graph are positive integers (transformers accepts num_hidden_layers -2), and the
    context within MAX_CONTEXT (a config of 1e8 positions built 13 GB of rotary tables)."""
    for key in _SIZES + ("num_key_value_heads", "head_dim"):
        v = getattr(cfg, key, None)
        if v is None and key not in _SIZES:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ExportError(f"{folder / 'config.json'}: {key} must be an integer >= 1, got {v!r}")
    context = getattr(cfg, "max_position_embeddings", None)
    if context is not None and not (isinstance(context, int) and 1 <= context <= MAX_CONTEXT):
        raise ExportError(f"{folder / 'config.json'}: max_position_embeddings must be 1 to {MAX_CONTEXT:,} (the "
                          f"export builds rotary tables that long), got {context!r}; set it to the model's context")


def check_layer_count(weights: dict, layers: int, where: str, prefix: str = "model.layers.") -> None:
    """The checkpoint holds exactly the decoder layers config.json declares: a num_hidden_layers of 4 for a 6-layer
    checkpoint would otherwise export a cut-down model (fluent garbage, exit 0)."""
    found = sorted({int(k[len(prefix):].split(".", 1)[0]) for k in weights
                    if k.startswith(prefix) and k[len(prefix):].split(".", 1)[0].isdigit()})
    if found != list(range(layers)):
        have = f"layers {found[0]}-{found[-1]} ({len(found)})" if found else "no layers"
        raise ExportError(f"{where}: num_hidden_layers is {layers} in config.json, but the checkpoint has {have} "
                          f"under {prefix}*; fix config.json (or the checkpoint) so that they agree")


def _damaged(path: Path, why: str) -> ExportError:
    return ExportError(f"{path}: not a valid safetensors file ({why}); the download is truncated or damaged: "
                       f"fetch the file again")


class Tensors(Mapping):
    """A checkpoint's tensors by name, each read from its file (and converted) when asked for and not kept: an
    export holds one layer's tensors at a time, not the model (a 1.1 GB GGUF held as fp32 took 17 GB). `rows`
    reads a slice of a tensor's leading axis (an embedding or head table in chunks)."""

    def __init__(self, readers: dict[str, "Callable[[slice | None], np.ndarray]"],
                 shapes: dict[str, tuple[int, ...]], blocks: dict[str, "Callable[[], object]"] | None = None):
        self._readers, self.shapes, self._blocks = readers, shapes, blocks or {}

    def __getitem__(self, name: str) -> np.ndarray:
        return self._readers[name](None)

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        return self._readers[name](slice(start, stop))

    def blocks(self, name: str, start: int | None = None, stop: int | None = None):
        """A GGUF matrix's own blocks (export.blocks.Blocks of the [in, out] MatMul weight, rows in the order the
        processed tensor has them; or its rows start..stop as stored), or None where the file stores it otherwise."""
        read = self._blocks.get(name)
        return None if read is None else read(None if start is None else slice(start, stop))

    def __contains__(self, name) -> bool:         # (Mapping's own would read the tensor to find out)
        return name in self._readers

    def __iter__(self):
        return iter(self._readers)

    def __len__(self) -> int:
        return len(self._readers)


def read_rows(path: Path, offset: int, dtype, shape: tuple[int, ...], rows: slice | None) -> np.ndarray:
    """The tensor of `shape` and `dtype` stored row-major at `offset` of the file, or the rows `rows` of its leading
    axis; read into a new array (nothing stays mapped: an export's memory is what it holds)."""
    dtype = np.dtype(dtype)
    row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
    start, stop, _ = (rows or slice(None)).indices(shape[0] if shape else 1)
    out = np.empty(((stop - start),) + tuple(shape[1:]) if shape else (), dtype)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset + start * row)
        view = memoryview(out.reshape(-1).view(np.uint8)) if out.size else memoryview(b"")
        got = f.readinto(view) if out.size else 0
    if got != out.nbytes:
        raise ExportError(f"{path}: short read at byte {offset + start * row} (the file was truncated while "
                          f"exporting); fetch the file again")
    return out


def _read_safetensors(path: Path) -> tuple[dict, dict]:
    """Parse one .safetensors file's header (8-byte header size, JSON header, raw data): a reader per tensor
    (bf16 becomes fp32 when read) and its shape. A truncated or garbage file is an ExportError naming it (every
    offset is checked against the file's size)."""
    size = path.stat().st_size
    if size < 8:
        raise _damaged(path, f"{size} bytes")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise _damaged(path, f"its header claims {n} bytes, the file has {size}")
        raw_header = f.read(n)
    try:
        header = json.loads(raw_header)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _damaged(path, "its header is not JSON") from None
    if not isinstance(header, dict):
        raise _damaged(path, "its header is not a JSON object")
    readers, shapes = {}, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise _damaged(path, f"tensor {name} has no dtype/shape/data_offsets") from None
        if dtype not in _DTYPES:
            raise ExportError(f"{path.name}: tensor {name} has unsupported dtype {dtype}")
        want = int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[dtype]).itemsize
        if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b <= size - 8 - n and b - a == want):
            raise _damaged(path, f"tensor {name} lies outside the file or has the wrong size")
        readers[name] = functools.partial(_safetensor, path, 8 + n + a, dtype, tuple(shape))
        shapes[name] = tuple(shape)
    return readers, shapes


def _safetensor(path: Path, offset: int, dtype: str, shape: tuple, rows: slice | None) -> np.ndarray:
    raw = read_rows(path, offset, _DTYPES[dtype], shape, rows)
    return (raw.astype(np.uint32) << 16).view(np.float32) if dtype == "BF16" else raw


def checkpoint_names(folder: Path) -> list[str]:
    """The tensor names in the folder's *.safetensors files (their headers only); [] when there are none."""
    return [name for path in sorted(folder.glob("*.safetensors")) for name in _read_safetensors(path)[0]]


def read_weights(folder: Path) -> Tensors:
    """The folder's safetensors checkpoint, read a tensor at a time (Tensors)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ExportError(f"{folder}: no *.safetensors weight files (only safetensors checkpoints are supported)")
    readers, shapes = {}, {}
    for f in files:
        r, s = _read_safetensors(f)
        readers.update(r)
        shapes.update(s)
    return Tensors(readers, shapes)


def expected_layer_shapes(arch: Arch) -> dict[str, tuple]:
    """Checkpoint tensors of one decoder layer (names after the family's renames) and their shapes."""
    H, hd, nh, nkv, I = arch.hidden, arch.head_dim, arch.heads, arch.kv_heads, arch.intermediate
    expect = {
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (nh * hd, H), "self_attn.k_proj.weight": (nkv * hd, H),
        "self_attn.v_proj.weight": (nkv * hd, H), "self_attn.o_proj.weight": (H, nh * hd),
        "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
    }
    if arch.qkv_bias:
        expect.update({"self_attn.q_proj.bias": (nh * hd,), "self_attn.k_proj.bias": (nkv * hd,),
                       "self_attn.v_proj.bias": (nkv * hd,)})
    if arch.qk_norm:
        expect.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    if arch.sandwich_norms:
        expect.update({"pre_feedforward_layernorm.weight": (H,), "post_feedforward_layernorm.weight": (H,)})
    return expect


def layer_flags(arch: Arch, i: int) -> dict[str, np.ndarray]:
    """Per-layer selectors for the shared split-layout layer graph: a one-hot over the rope kinds plus "no
    rope", and 1.0 for a sliding-window layer. Exact: the graph multiplies finite values by 0 or 1."""
    kinds = arch.rope_kinds + [None]
    return {"rope_select": np.array([float(arch.layer_rope[i] == k) for k in kinds], np.float32),
            "sliding": np.array([float(arch.layer_sliding[i])], np.float32)}


# a draft's head may score only some tokens: lm_head.weight [S, hidden] and this int64 [S] tensor of their ids
HEAD_TOKEN_IDS = "lm_head.token_ids"


def global_names(w: Tensors, arch: Arch) -> tuple[str, np.ndarray | None]:
    """Check the embedding, final norm and lm_head of the checkpoint `w` against the config without reading
    them; returns (the head's tensor name, head_ids: None when the head scores every token)."""
    emb = "model.embed_tokens.weight"
    if emb not in w:
        raise ExportError("weight model.embed_tokens.weight is missing from the checkpoint")
    if w.shapes[emb] != (arch.vocab_size, arch.hidden):
        raise ExportError(f"model.embed_tokens.weight has shape {w.shapes[emb]} but config.json implies "
                          f"{(arch.vocab_size, arch.hidden)}")
    head = "lm_head.weight" if "lm_head.weight" in w else emb if arch.tied else None
    if head is None:
        raise ExportError("weight lm_head.weight is missing and tie_word_embeddings is false")
    if "model.norm.weight" not in w:
        raise ExportError("weight model.norm.weight is missing from the checkpoint")
    ids = w[HEAD_TOKEN_IDS] if HEAD_TOKEN_IDS in w else None
    if ids is None and w.shapes[head] != (arch.vocab_size, arch.hidden):
        raise ExportError(f"lm_head.weight has shape {w.shapes[head]} but config.json implies "
                          f"{(arch.vocab_size, arch.hidden)}")
    if ids is not None:        # a head over a token subset (a draft's): its rows score these vocabulary ids
        ids = np.asarray(ids).astype(np.int64).ravel()
        if w.shapes[head] != (len(ids), arch.hidden):
            raise ExportError(f"lm_head.weight has shape {w.shapes[head]} but {HEAD_TOKEN_IDS} names "
                              f"{len(ids)} tokens: one row per named token is needed")
        if len(np.unique(ids)) != len(ids) or ids.min() < 0 or ids.max() >= arch.vocab_size:
            raise ExportError(f"{HEAD_TOKEN_IDS} must hold distinct token ids in 0..{arch.vocab_size - 1}")
    return head, ids


def final_norm(w: Tensors, arch: Arch) -> np.ndarray:
    return np.asarray(w["model.norm.weight"], np.float32) + np.float32(arch.norm_offset)


def embed_rows(w: Tensors, arch: Arch, start: int, stop: int) -> np.ndarray:
    """Rows start..stop of the embedding table as the graph uses them (scaled: transformers multiplies the
    looked-up rows by the fp32 scale; scaling the table is the same product)."""
    name = "model.embed_tokens.weight"
    rows = np.asarray(w.rows(name, start, stop), np.float32)
    return rows * np.float32(arch.embed_scale) if arch.embed_scale != 1.0 else rows


def global_weights(w: Tensors, arch: Arch) -> dict[str, np.ndarray]:
    """Embedding (scaled), final norm, lm_head [hidden, S] and head_ids (None: the head scores every token)."""
    head, ids = global_names(w, arch)
    emb = embed_rows(w, arch, 0, arch.vocab_size)
    lm_head = emb if head == "model.embed_tokens.weight" and arch.embed_scale == 1.0 else w[head]
    return {"embed": emb, "norm": final_norm(w, arch), "lm_head": np.asarray(lm_head, np.float32).T.copy(),
            "head_ids": ids}


@contextlib.contextmanager
def quiet_transformers(quiet: bool):
    """Without transformers' progress bars when quiet (`export -q`): its own switch for loading weights, and its
    GGUF reader's tqdm, which it calls directly, past that switch."""
    if not quiet:
        yield
        return
    import functools
    from unittest import mock

    import transformers as tf
    import transformers.modeling_gguf_pytorch_utils as reader
    from tqdm.auto import tqdm

    bars = tf.utils.logging.is_progress_bar_enabled()
    tf.utils.logging.disable_progress_bar()
    try:
        with mock.patch.object(reader, "tqdm", functools.partial(tqdm, disable=True)):
            yield
    finally:
        if bars:
            tf.utils.logging.enable_progress_bar()
