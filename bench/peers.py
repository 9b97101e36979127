"""Peers on the same weights: transformers generate(num_beams=K) (PyTorch, CPU) and, if installed,
CTranslate2's Generator.generate_batch(beam_size=K) on the target converted with its own converter (int8)."""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from specbeam_edge import Engine, SpeculativeConfig

from .e2e import load_prompts


def _ours(engine, prompts, K, spec, max_new):
    t0 = time.perf_counter()
    res = engine.generate(prompts, num_beams=K, max_new_tokens=max_new, speculative=spec)
    dt = time.perf_counter() - t0
    return sum(r.stats.beam_steps for r in res) / dt, [r.hypotheses[0].tokens for r in res]


def _transformers(hf: Path, ids_list, K, max_new, eos):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
    n, t0 = 0, time.perf_counter()
    with torch.no_grad():
        for ids in ids_list:
            out = model.generate(torch.tensor([ids]), num_beams=K, do_sample=False, max_new_tokens=max_new,
                                 eos_token_id=eos, pad_token_id=eos[0])
            gen = out[0, len(ids):].tolist()
            n += len(gen)
    return n / (time.perf_counter() - t0)


def _ctranslate2(hf: Path, engine, ids_list, K, max_new):
    try:
        import ctranslate2
        from ctranslate2.converters import TransformersConverter
    except ImportError:
        return None, "ctranslate2 not installed (pip install ctranslate2)"
    out = Path(tempfile.mkdtemp()) / "ct2"
    try:
        TransformersConverter(str(hf)).convert(str(out), quantization="int8")
    except Exception as e:  # its converter follows transformers' internals; report, don't crash the bench
        return None, f"conversion failed: {str(e).splitlines()[0][:200]}"
    gen = ctranslate2.Generator(str(out), device="cpu", intra_threads=2)
    toks = [[engine.tokenizer.id_to_token(i) for i in ids] for ids in ids_list]
    t0 = time.perf_counter()
    n = 0
    for t in toks:
        r = gen.generate_batch([t], beam_size=K, max_length=max_new, include_prompt_in_result=False)
        n += len(r[0].sequences_ids[0])
    return n / (time.perf_counter() - t0), None


def bench(pair: Path, *, K=4, n_prompts=16, max_new=128, threads=None) -> dict:
    hf = pair / "hf" / "target"
    engine = Engine(pair / "target", draft=pair / "draft", threads=threads)
    prompts = [engine.tokenizer.format_prompt(p) for p in load_prompts(pair, n_prompts)]
    ids_list = [engine.encode(p) for p in prompts]
    engine.generate(prompts[:2], num_beams=K, max_new_tokens=8)
    spec = SpeculativeConfig()
    rows = {}
    rows["specbeam plain"], _ = _ours(engine, prompts, K, None, max_new)
    rows["specbeam speculative"], _ = _ours(engine, prompts, K, spec, max_new)
    # the apps' default: drafts only while it pays (learns on the first prompts; that cost is included)
    rows["specbeam adaptive"], _ = _ours(engine, prompts, K, SpeculativeConfig(adaptive=True), max_new)
    notes = {}
    if hf.is_dir():
        rows["transformers (fp32, torch)"] = _transformers(hf, ids_list, K, max_new, list(engine.eos))
        ct, why = _ctranslate2(hf, engine, ids_list, K, max_new)
        if ct is not None:
            rows["ctranslate2 (int8)"] = ct
        else:
            notes["ctranslate2"] = why
    else:
        notes["transformers"] = f"{hf} missing"
    for k, v in rows.items():
        print(f"{k:28s} {v:8.1f} tok/s", file=sys.stderr)
    base = rows["specbeam speculative"]
    return {"K": K, "prompts": len(prompts), "tokens_per_second": {k: round(v, 1) for k, v in rows.items()},
            "specbeam_speculative_over": {k: round(base / v, 2) for k, v in rows.items()}, "notes": notes}


def plot(data: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(data["tokens_per_second"])
    ax.barh(names, [data["tokens_per_second"][n] for n in names], color="tab:blue")
    ax.set(xlabel="generated tokens/s (beam search, K=%d)" % data["K"], title="same weights, this machine")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
