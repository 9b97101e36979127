"""Hostile GGUF headers and tensors, written here from a tiny random model: each is refused in one line naming the
file, the key (or tensor) and the fix, exit 2, before transformers builds anything from it. Before: a
context_length of 1e8 built 13 GB of rotary tables, a block_count of 100,000 ran 147 s into a MemoryError, one
below the stored layers exported a 1-layer model (exit 0), NaN weights exported silently, and F64 / I8 / Q8_1
tensors were a NotImplementedError traceback."""
import gguf
import numpy as np
import pytest

from export.__main__ import main as export_main
from family_models import make_family_model
from test_gguf import write_gguf

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(HF folder, torch model) of a tiny 2-layer Llama (4 heads of 16, 4 key/value heads)."""
    src = tmp_path_factory.mktemp("hf") / "smollm2"
    return src, make_family_model(src, "smollm2", std=0.3, seed=3)


def _write(model, path, monkeypatch, header: dict | None = None, **kw):
    """write_gguf with header keys overridden: {GGUFWriter method: the value it writes}."""
    src, m = model
    with monkeypatch.context() as mp:
        for method, value in (header or {}).items():
            real = getattr(gguf.GGUFWriter, method)
            mp.setattr(gguf.GGUFWriter, method, lambda self, _, real=real, value=value: real(self, value))
        write_gguf(src, m, path, "llama", **kw)
    return path


def _refused(path, tmp_path, capsys) -> str:
    out = tmp_path / "out"
    assert export_main(["-i", str(path), "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"specbeam-export: error: {path}: "), err
    assert "Traceback" not in err and not out.exists()
    return err


@pytest.mark.parametrize("method, value, says", [
    ("add_context_length", 10 ** 8, "llama.context_length is 100000000, not a context of 1 to 1,048,576"),
    ("add_context_length", 0, "llama.context_length is 0"),
    ("add_block_count", 100_000, "llama.block_count is 100000, but the file holds the tensors of 2 layers"),
    ("add_block_count", 1, "llama.block_count is 1, but the file holds the tensors of 2 layers (blk.0 to blk.1)"),
    ("add_head_count", 8, "llama.attention.head_count gives blk.0.attn_q.weight 128 rows, but the tensor has 64"),
    ("add_head_count_kv", 3, "llama.attention.head_count 4 is not a multiple of head_count_kv 3"),
    ("add_embedding_length", 96, "llama.embedding_length gives token_embd.weight 96 columns, but the tensor has 64"),
])
def test_a_header_value_the_tensors_contradict_is_refused(model, tmp_path, monkeypatch, capsys, method, value, says):
    path = _write(model, tmp_path / "bad.gguf", monkeypatch, {method: value})
    err = _refused(path, tmp_path, capsys)
    assert says in err and "gguf-set-metadata" in err, err


def _poison(model, name: str, value: float, index=0):
    """Put `value` in one element of the model's parameter `name` (restored by the caller)."""
    import torch

    p = dict(model[1].named_parameters())[name]
    old = p.detach().clone()
    with torch.no_grad():
        p.view(-1)[index] = value
    return lambda: p.data.copy_(old)


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")     # gguf-py quantizing the NaN
@pytest.mark.parametrize("name, value, qtype, tensor", [
    ("model.norm.weight", float("nan"), None, "output_norm.weight"),
    ("model.layers.1.self_attn.o_proj.weight", float("inf"), Q.F32, "blk.1.attn_output.weight"),
    ("model.layers.0.mlp.up_proj.weight", float("nan"), Q.Q8_0, "blk.0.ffn_up.weight"),
])
def test_nan_or_infinite_weights_are_refused_as_they_are_read(model, tmp_path, monkeypatch, capsys, name, value,
                                                                qtype, tensor):
    restore = _poison(model, name, value)
    try:
        path = _write(model, tmp_path / "nan.gguf", monkeypatch, qtype=qtype)
    finally:
        restore()
    err = _refused(path, tmp_path, capsys)
    assert f"tensor {tensor} holds NaN or infinite values" in err, err


def _stored_as(kind):
    """stored= for write_gguf: the down projection of layer 0 in `kind`, every other matrix as Q8_0."""
    def stored(name, a):
        if name != "model.layers.0.mlp.down_proj.weight":
            return None
        if kind == Q.F64:
            return a.astype(np.float64), kind
        if kind == Q.I8:
            return np.clip(a * 100, -127, 127).astype(np.int8), kind
        block, size = gguf.GGML_QUANT_SIZES[kind]
        return np.zeros((a.shape[0], a.shape[1] // block * size), np.uint8), kind
    return stored


@pytest.mark.parametrize("kind", [Q.F64, Q.I8, Q.Q8_1])
def test_a_tensor_type_gguf_py_cannot_read_is_named(model, tmp_path, monkeypatch, capsys, kind):
    path = _write(model, tmp_path / "type.gguf", monkeypatch, stored=_stored_as(kind))
    err = _refused(path, tmp_path, capsys)
    assert f"tensor blk.0.ffn_down.weight is stored as {kind.name}, a type the exporter cannot read" in err, err
    assert "llama-quantize" in err


def test_an_honest_file_still_exports(model, tmp_path, monkeypatch):
    path = _write(model, tmp_path / "good.gguf", monkeypatch)
    assert export_main(["-i", str(path), "-o", str(tmp_path / "out"), "-q"]) == 0


def test_a_checkpoint_context_past_the_bound_is_refused(model, tmp_path, capsys):
    """The same bound for a Hugging Face folder's max_position_embeddings (its rotary tables are built as long)."""
    import json
    import shutil

    src = tmp_path / "hf"
    shutil.copytree(model[0], src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 10 ** 8}))
    assert export_main(["-i", str(src), "-o", str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"specbeam-export: error: {src / 'config.json'}: max_position_embeddings must be 1 to 1,048,576 "
                   f"(the export builds rotary tables that long), got 100000000; set it to the model's context")
