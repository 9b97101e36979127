"""GGUF files as export input: a GGUF written here from a tiny random model (Q8_0 matrices, as llama.cpp's
converter lays them out), loaded by transformers (dequantized, tokenizer rebuilt), exported; the graph and plain
beam search equal transformers on the dequantized model."""
import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from export import export
from export.__main__ import main as export_main
from family_models import check_parity, make_family_model
from specbeam_edge import Engine
from specbeam_edge.text.tokenizer import Tokenizer

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}" \
           "{% if add_generation_prompt %}<|assistant|>{% endif %}"
# test name: (family_models name, GGUF architecture, model overrides). transformers rebuilds a Qwen3 config from
# GGUF without its head_dim (key_length), so the config's default 128 applies: every Qwen3 size has 128.
MODELS = {"llama": ("smollm2", "llama", {}), "qwen3": ("qwen3", "qwen3", {"head_dim": 128})}
PROMPTS = [[3, 17, 33, 8, 99, 41, 7], [250, 12, 9]]


def _rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores Llama's q/k rows interleaved per rotary pair (transformers undoes it on load)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer_fields(hf_folder, vocab_size: int):
    """tokenizer.ggml.* of a byte-level BPE tokenizer.json: tokens by id (unused ids padded), types, merges."""
    tok = json.loads((hf_folder / "tokenizer.json").read_text())
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    by_id = {i: t for t, i in {**tok["model"]["vocab"], **special}.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [gguf.TokenType.CONTROL if t in special else
             gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    return tokens, types, merges


def write_gguf(hf_folder, model, path, arch: str, qtype=None, stored=None):
    """A GGUF file of `model` with the metadata keys and tensor names llama.cpp writes for `arch`. stored(name,
    fp32 array) may give a matrix's bytes itself: (uint8 rows, quantization type), or None for `qtype`'s."""
    qtype = gguf.GGMLQuantizationType.Q8_0 if qtype is None else qtype
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    tokens, types, merges = _tokenizer_fields(hf_folder, cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen3" else "llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_pad_token_id(0)
    w.add_chat_template(TEMPLATE)
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     cfg.num_hidden_layers)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue                      # llama.cpp writes output.weight only for an untied head
        base, suffix = name.rsplit(".", 1)
        a = t.float().numpy()
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            a = _rope_permute(a, cfg.num_attention_heads if base.endswith("q_proj") else cfg.num_key_value_heads)
        own = stored(name, a) if stored is not None and a.ndim == 2 else None
        if own is not None:
            w.add_tensor(f"{names.get_name(base)}.{suffix}", own[0], raw_dtype=own[1])
        elif a.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(f"{names.get_name(base)}.{suffix}", gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(f"{names.get_name(base)}.{suffix}", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)          # see test_families.py: tiny generate calls, shared cores
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    """gguf_model(name) -> (.gguf path, exported folder, transformers' dequantized model, its tokenizer)."""
    import torch
    import transformers as tf

    base = tmp_path_factory.mktemp("gguf")
    cache = {}

    def get(name):
        if name not in cache:
            fam, arch, kw = MODELS[name]
            src = base / f"hf_{name}"
            model = make_family_model(src, fam, std=0.3, seed=3, **kw)
            path = base / f"{name}.gguf"
            write_gguf(src, model, path, arch)
            folder = export(path, base / f"sb_{name}", quiet=True)
            kw = dict(gguf_file=path.name, local_files_only=True)
            ref = tf.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32, **kw).eval()
            cache[name] = (path, folder, ref, tf.AutoTokenizer.from_pretrained(str(base), **kw))
        return cache[name]
    return get


@pytest.mark.parametrize("name", list(MODELS))
def test_gguf_export_parity(gguf_model, name):
    _, folder, ref, _ = gguf_model(name)
    check_parity(folder, ref, 1e-5)


@pytest.mark.parametrize("name", list(MODELS))
def test_gguf_weights_are_the_dequantized_ones(gguf_model, name):
    """Parity above is against the dequantized model, not the original: Q8_0 moved the weights (control)."""
    import torch

    path, folder, ref, _ = gguf_model(name)
    fam, _, kw = MODELS[name]
    original = make_family_model(path.parent / f"again_{name}", fam, std=0.3, seed=3, **kw)
    x = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        gap = (original(x).logits - ref(x).logits).abs().max().item()
    assert 1e-4 < gap < 0.5, gap
    cfg = json.loads((folder / "specbeam_config.json").read_text())
    assert cfg["source"]["folder_name"] == path.name
    assert cfg["family"] == name and cfg["num_layers"] == 2 and cfg["vocab_size"] == ref.config.vocab_size


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("K", [1, 4])
def test_gguf_beam_search_matches_transformers(gguf_model, name, K):
    import torch

    _, folder, ref, _ = gguf_model(name)
    engine = Engine(folder)
    with torch.no_grad():
        greedy = ref.generate(torch.tensor([PROMPTS[0]]), do_sample=False, max_new_tokens=10, eos_token_id=None,
                              pad_token_id=0)[0, len(PROMPTS[0]):].tolist()
    eos = [greedy[3], greedy[6]]          # tokens the search meets, so hypotheses finish mid-search
    for prompt in PROMPTS:
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, eos_token_id=eos,
                               pad_token_id=0, num_beams=K, num_return_sequences=K, output_scores=True,
                               return_dict_in_generate=True)
        [res] = engine.generate(prompt, num_beams=K, max_new_tokens=10, num_return_sequences=K, eos_token_id=eos)
        hf = [s[len(prompt):].tolist() for s in out.sequences]
        for o, h in zip([h.tokens for h in res.hypotheses], hf, strict=True):
            assert o == h[:len(o)] and all(t == eos[0] for t in h[len(o):]), (name, K, o, h)
        if K > 1:
            np.testing.assert_allclose([h.score for h in res.hypotheses], out.sequences_scores.tolist(), atol=1e-4)


@pytest.mark.parametrize("name", list(MODELS))
def test_gguf_tokenizer_and_chat_template(gguf_model, name):
    """The rebuilt tokenizer and the file's chat template reach the model folder unchanged."""
    _, folder, _, ref_tok = gguf_model(name)
    tok = Tokenizer(folder)
    text = "the quick brown fox, hello world"
    assert tok.encode(text) == ref_tok.encode(text, add_special_tokens=False)
    assert tok.decode(tok.encode(text)) == text
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat) == ref_tok.apply_chat_template(chat, tokenize=False,
                                                                         add_generation_prompt=True)
    assert tok.apply_chat_template(chat) == "<|system|>be brief\n<|user|>hi\n<|assistant|>"


def test_cli_exports_a_gguf_file(gguf_model, tmp_path, capsys):
    path, folder, _, _ = gguf_model("llama")
    assert export_main(["-i", str(path), "-o", str(tmp_path / "cli"), "-q"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert (tmp_path / "cli" / "model.onnx").read_bytes() == (folder / "model.onnx").read_bytes()


def test_unreadable_gguf_names_the_file(tmp_path, capsys):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    assert export_main(["-i", str(bad), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"specbeam-export: error: {bad}: transformers cannot load this GGUF file ("), err
    assert err.endswith("; GGUF architectures of the supported families: llama, mistral, qwen2, qwen3, phi3, gemma2, "
                        "gemma3\n"), err
    assert not (tmp_path / "out").exists()


def test_listed_gguf_architectures_are_read_by_transformers():
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from export.gguf_input import GGUF_ARCHITECTURES

    assert set(GGUF_ARCHITECTURES) <= set(GGUF_SUPPORTED_ARCHITECTURES)


def test_quiet_gguf_export_prints_no_progress_bars(tmp_path, capfd):
    """export -q: transformers' GGUF reader prints its own bars ("Converting and de-quantizing ..."); quiet
    silences them too."""
    fam, arch, kw = MODELS["llama"]
    model = make_family_model(tmp_path / "hf", fam, std=0.3, seed=3, **kw)
    write_gguf(tmp_path / "hf", model, tmp_path / "m.gguf", arch)
    capfd.readouterr()
    export(tmp_path / "m.gguf", tmp_path / "sb", quiet=True)
    err = capfd.readouterr().err
    assert "%|" not in err and "it/s" not in err, err[-300:]


@pytest.mark.parametrize("name", list(MODELS))
def test_gguf_tensors_read_one_at_a_time_are_transformers_own(gguf_model, name, tmp_path):
    """The exporter reads a GGUF a tensor at a time (export.gguf_input.unpack): every tensor, and every chunk of
    rows of one, is bit for bit what transformers' whole-model load gives (its dequantizer and its Llama q/k
    row order), so the streamed export computes what the old one did."""
    from export.gguf_input import unpack

    path, _, ref, _ = gguf_model(name)
    side = tmp_path / "side"
    side.mkdir()
    tensors = unpack(path, side, quiet=True)
    expected = {k: v.float().numpy() for k, v in ref.state_dict().items()}
    if ref.config.tie_word_embeddings:
        expected.pop("lm_head.weight")          # the file holds one table; the exporter ties it (global_names)
    assert sorted(tensors) == sorted(expected)
    for k, v in expected.items():
        assert tensors.shapes[k] == v.shape and np.array_equal(tensors[k], v), k
    table = expected["model.embed_tokens.weight"]
    assert np.array_equal(np.concatenate([tensors.rows("model.embed_tokens.weight", a, a + 7)
                                          for a in range(0, len(table), 7)]), table)
    assert json.loads((side / "config.json").read_text())["architectures"] == [type(ref).__name__]


@pytest.mark.slow
@pytest.mark.parametrize("source, layout, precision", [("gguf", "split", "int8"), ("gguf", "whole", "int4"),
                                                       ("safetensors", "split", "int8")])
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads a process's peak from /proc (Linux)")
def test_export_memory_does_not_grow_with_depth(tmp_path, source, layout, precision):
    """The exporter reads and writes a tensor at a time: a GGUF (or a safetensors folder) of 12 layers (each 64 MB
    of fp32 weights, 770 MB in all) exports within 150 MB of the peak RSS of the same shapes with 2 layers. Holding
    the model (as transformers' whole load did) adds 640 MB. Each export runs in its own process, so each peak is
    its own."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    peaks = {}
    for layers in (2, 12):
        src = tmp_path / f"hf{layers}"
        model = make_family_model(src, "qwen3", hidden_size=1024, intermediate_size=4096, num_attention_heads=8,
                                  num_key_value_heads=4, head_dim=128, num_hidden_layers=layers)
        path = tmp_path / f"m{layers}.gguf" if source == "gguf" else src
        if source == "gguf":
            write_gguf(src, model, path, "qwen3")
        del model
        # VmHWM: this process's own peak (ru_maxrss would count the pytest process it was forked from)
        script = (f"import sys; sys.path.insert(0, {str(root)!r}); from export import export; "
                  f"export({str(path)!r}, {str(tmp_path / f'out{layers}')!r}, precision={precision!r}, "
                  f"layout={layout!r}, quiet=True); "
                  f"print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0])")
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
        peaks[layers] = int(out.stdout.split()[-1]) / 1024          # MB (the kernel reports kB)
    assert peaks[12] - peaks[2] < 150, peaks
