"""The laptop families (Qwen3, Llama 3.2, SmolLM2/3, Phi-3/4-mini, Gemma 2/3): export parity with PyTorch on
a prefill, a branching tree step and a step after compaction (windows shorter than the prompt), and plain beam
search == transformers `generate(num_beams=K)`."""
import json

import numpy as np
import pytest

from export import export
from family_models import FAMILIES, check_parity, make_family_model
from specbeam_edge import Engine
from helpers import speculative_equals_plain

TOL = {"fp32": 1e-5, "fp16": 2e-3, "int8w": 5e-2}   # int8w: round to nearest; measured 8.7e-3 (phi3) to 3.4e-2 (gemma3)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """transformers' generate on these tiny models is per-step overhead plus small matmuls: on a shared 2-core
    machine one torch thread measured 0.2 s per generate call against 1 to 5 s with the default threads."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def family(tmp_path_factory):
    """family(name, precision, layout, **model_kwargs) -> (specbeam folder, torch model), cached."""
    base = tmp_path_factory.mktemp("families")
    cache = {}

    def get(name, precision="fp32", layout="whole", **kw):
        mkey = (name, tuple(sorted(kw.items())))
        if mkey not in cache:
            src = base / f"hf_{name}_{len(cache)}"
            cache[mkey] = (src, make_family_model(src, name, **kw))
        src, model = cache[mkey]
        key = (mkey, precision, layout)
        if key not in cache:
            cache[key] = export(src, base / f"sb_{name}_{precision}_{layout}_{len(cache)}", precision=precision,
                                layout=layout, quiet=True)
        return cache[key], model
    return get


@pytest.mark.parametrize("name", list(FAMILIES))
def test_export_parity_fp32(name, family):
    check_parity(*family(name), TOL["fp32"])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_split_layout_parity(name, family):
    folder, model = family(name, layout="split")
    check_parity(folder, model, TOL["fp32"])
    # every family's resident layers run sessions of their own (export/resident.py), none falls back to feeding
    from specbeam_edge.execution.model import OnnxCausalLM
    lm = OnnxCausalLM(folder)
    assert len(lm.runner.layer_sessions) == lm.cfg.num_layers


@pytest.mark.parametrize("name", ["qwen3", "phi4mini", "gemma3"])
def test_export_parity_fp16(name, family):
    check_parity(*family(name, "fp16"), TOL["fp16"])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_export_parity_int8w(name, family):
    """int8 weight storage (dequantized at load, fp32 compute) stays within its tolerance of PyTorch on every
    family's graph pieces (sliding windows, soft-capping, partial RoPE, NoPE layers)."""
    check_parity(*family(name, "int8w"), TOL["int8w"])


BEAM_PROMPTS = [[3, 17, 33, 8, 99, 41, 7], [250, 12, 9]]
MAX_NEW = 10
# Past original_max_position_embeddings transformers' generate recomputes the whole Phi-3 cache with the long
# factors (deeper layers' states of earlier tokens change); a fixed cache cannot follow, so searches stay below it
SEARCH = {"phi4mini": {"original_max_position_embeddings": 32}}


@pytest.fixture(scope="module")
def peers(family):
    """peers(name) -> (torch model, engine, eos): a sharper random model (std 0.3) and two EOS ids its greedy
    output meets, so hypotheses finish mid-search."""
    import torch

    cache = {}

    def get(name):
        if name not in cache:
            _, model = family(name, std=0.3, seed=3, **SEARCH.get(name, {}))
            with torch.no_grad():
                out = model.generate(torch.tensor([BEAM_PROMPTS[0]]), do_sample=False, max_new_tokens=MAX_NEW,
                                     eos_token_id=None, pad_token_id=0)
            greedy = out[0, len(BEAM_PROMPTS[0]):].tolist()
            folder, _ = family(name, std=0.3, seed=3, **SEARCH.get(name, {}))
            cache[name] = (model, Engine(folder), [greedy[3], greedy[6]])
        return cache[name]
    return get


def _beam_case(peers, name, K, lp, early):
    import torch

    model, engine, eos = peers(name)
    n_ret = min(K, 3)
    for prompt in BEAM_PROMPTS:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos,
                                 pad_token_id=0, output_scores=True, return_dict_in_generate=True, num_beams=K,
                                 length_penalty=lp, early_stopping=early, num_return_sequences=n_ret)
        hf = [s[len(prompt):].tolist() for s in out.sequences]
        [res] = engine.generate(prompt, num_beams=K, max_new_tokens=MAX_NEW, length_penalty=lp, early_stopping=early,
                                num_return_sequences=n_ret, eos_token_id=eos)
        ours = [h.tokens for h in res.hypotheses]
        assert len(ours) == len(hf)
        for o, h in zip(ours, hf):
            # transformers pads shorter sequences with `pad_token_id or eos[0]` (pad 0 is falsy there)
            assert o == h[:len(o)] and all(t == eos[0] for t in h[len(o):]), (name, K, lp, early, ours, hf)
        if K > 1:
            np.testing.assert_allclose([h.score for h in res.hypotheses], out.sequences_scores.tolist(), atol=1e-4)


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("K,lp,early", [(1, 1.0, False), (4, 1.0, False), (4, 0.0, True)])
def test_beam_search_matches_transformers(peers, name, K, lp, early):
    _beam_case(peers, name, K, lp, early)


def _spread_grid(names, per_point: int) -> list[tuple]:
    """The rest of the issue's grid (K in {2, 8} x length_penalty x early_stopping), each point on `per_point`
    families in turn instead of on all of them: every family still meets both K, every length penalty and every
    early_stopping mode, at a fraction of the cost (the full cross was 144 cases)."""
    points = [(K, lp, early) for K in (2, 8) for lp in (0.0, 1.0, 2.0) for early in (False, True, "never")]
    stride = len(names) // per_point
    return [(names[(i + j * stride) % len(names)], *pt) for i, pt in enumerate(points) for j in range(per_point)]


GRID = _spread_grid(list(FAMILIES), per_point=3)


def test_grid_spread_covers_every_family():
    for name in FAMILIES:
        mine = [case[1:] for case in GRID if case[0] == name]
        assert {K for K, _, _ in mine} == {2, 8}, (name, mine)
        assert {lp for _, lp, _ in mine} == {0.0, 1.0, 2.0}, (name, mine)
        assert {str(e) for _, _, e in mine} == {"False", "True", "never"}, (name, mine)


@pytest.mark.slow
@pytest.mark.parametrize("name,K,lp,early", GRID)
def test_beam_search_matches_transformers_grid(peers, name, K, lp, early):
    _beam_case(peers, name, K, lp, early)


@pytest.mark.parametrize("name", ["qwen3", "smollm3", "phi4mini", "gemma3", "gemma2"])
def test_min_new_tokens_matches_transformers(peers, name):
    import torch

    model, engine, eos = peers(name)
    with torch.no_grad():
        out = model.generate(torch.tensor([BEAM_PROMPTS[0]]), do_sample=False, max_new_tokens=MAX_NEW,
                             eos_token_id=eos, pad_token_id=0, num_beams=4, min_new_tokens=6,
                             output_scores=True, return_dict_in_generate=True)
    [res] = engine.generate(BEAM_PROMPTS[0], num_beams=4, max_new_tokens=MAX_NEW, min_new_tokens=6, eos_token_id=eos)
    best = res.hypotheses[0]
    assert best.tokens == out.sequences[0, len(BEAM_PROMPTS[0]):].tolist()[:len(best.tokens)]
    assert len(best.tokens) >= 6
    np.testing.assert_allclose(best.score, out.sequences_scores[0].item(), atol=1e-4)


@pytest.mark.parametrize("name", ["qwen3", "smollm3", "phi4mini", "phi3", "gemma3", "gemma2"])
@pytest.mark.parametrize("K", [1, 4])
def test_speculative_equals_plain(family, name, K):
    from specbeam_edge import SpeculativeConfig

    target, _ = family(name, std=0.3, seed=3, **SEARCH.get(name, {}))
    other, _ = family(name, std=0.3, seed=11, **({} if name == "gemma3" else {"num_hidden_layers": 1}))
    spec = SpeculativeConfig(adaptive=False, drafter="beam", budget=24, max_depth=4, max_branch_width=3)
    for draft in (target, other):
        eng = Engine(target, draft=draft)
        for prompt in BEAM_PROMPTS:
            ref, fast = speculative_equals_plain(eng, prompt, spec, num_beams=K, max_new_tokens=14,
                                                 num_return_sequences=K)
            assert fast.stats.beam_steps == ref.stats.beam_steps


def test_config_records_layer_kinds(family):
    cfg = json.loads((family("gemma3")[0] / "specbeam_config.json").read_text())
    assert cfg["sliding_window"] == 4
    assert cfg["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert cfg["layer_rope"] == ["local", "local", "global"]
    assert "key_position_ids" in cfg["io"]["inputs"]
    cfg = json.loads((family("smollm3")[0] / "specbeam_config.json").read_text())
    assert cfg["layer_rope"] == ["global", None, "global", None] and "sliding_window" not in cfg
    assert "key_position_ids" not in cfg["io"]["inputs"]


@pytest.mark.parametrize("precision", ["fp32", "int8w", "int8", "int4"])
def test_large_graph_layout_leaves_only_the_model(tmp_path, monkeypatch, precision):
    """Graphs past protobuf's limit keep their tensors in model.onnx.data (quantized ones too); int8/int4 quantize a
    temporary fp32 graph, whose .data file must not stay in the folder (it did: 1.7 GB of gemma-3-270m's 2.7 GB
    int8 folder). Same logits either way."""
    from specbeam_edge.execution.model import OnnxCausalLM

    make_family_model(tmp_path / "hf", "qwen3")
    small = export(tmp_path / "hf", tmp_path / "small", precision=precision, quiet=True)
    monkeypatch.setattr("export.save.EXTERNAL_DATA_BYTES", 0)    # every graph counts as large
    big = export(tmp_path / "hf", tmp_path / "big", precision=precision, quiet=True)
    files = sorted(p.name for p in big.iterdir())
    onnx_files = [f for f in files if f.startswith("model")]
    assert onnx_files == ["model.onnx", "model.onnx.data"], files
    ids, pos = np.array([[5, 17, 33]]), np.arange(3)[None]
    mask = np.tril(np.ones((3, 3), bool))[None, None]
    outs = [OnnxCausalLM(f).forward(ids, pos, mask, OnnxCausalLM(f).empty_past())[0] for f in (small, big)]
    np.testing.assert_array_equal(outs[0], outs[1])
