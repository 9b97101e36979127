"""Peers on the same weights: transformers generate(num_beams=K) (PyTorch, CPU) and, if installed,
CTranslate2's Generator.generate_batch(beam_size=K) on the target converted with its own converter (int8)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from specbeam_edge import Engine, SpeculativeConfig

from .batch import ct2_generator
from .common import save_figure
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
    """CTranslate2 int8 on the same weights, one request at a time: (tokens/s, None) or (None, why not)."""
    gen, why = ct2_generator(hf, threads=2)
    if gen is None:
        return None, why
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
    engine.generate(prompts[:2], num_beams=K, max_new_tokens=8, speculative=None)
    spec = SpeculativeConfig(adaptive=False)
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
    save_figure(fig, path)


# -- encoder-decoder: a random Marian at Opus-MT base shapes vs CTranslate2's Translator on the same weights --
OPUS_MT_BASE = dict(vocab_size=58101, d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                    decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
                    max_position_embeddings=512, activation_function="swish", scale_embedding=True,
                    share_encoder_decoder_embeddings=True, pad_token_id=58100, eos_token_id=0,
                    decoder_start_token_id=58100, forced_eos_token_id=0)


def make_marian(folder: Path, seed: int = 0) -> Path:
    """A random-weight MarianMTModel with Opus-MT base shapes (opus-mt-en-de: 6+6 layers, d_model 512, vocab
    58101, </s> 0, <unk> 1, <pad> last) and a word-level tokenizer over that vocabulary (CTranslate2's converter
    reads the vocabulary from the tokenizer); returns the folder (kept between runs)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, models

    torch.manual_seed(seed)
    cfg = tf.MarianConfig(**OPUS_MT_BASE)
    cfg.architectures = ["MarianMTModel"]
    model = tf.MarianMTModel(cfg).eval()           # transformers' own init (normal, std 0.02)
    model.save_pretrained(folder)
    tf.GenerationConfig(eos_token_id=0, pad_token_id=58100, decoder_start_token_id=58100, forced_eos_token_id=0,
                        bad_words_ids=[[58100]]).save_pretrained(folder)
    words = ["</s>", "<unk>"] + [f"w{i}" for i in range(2, 58100)] + ["<pad>"]
    Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")).save(
        str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": "<pad>"}))
    return folder


def _sources(n: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(2, 58100, int(rng.integers(8, 40))).tolist() + [0] for _ in range(n)]


def _ours_encdec(engine, sources, K, length, batch, spec=None):
    """(tokens/s, top hypotheses without EOS, beam steps per target pass); `length` tokens then the forced EOS."""
    t0 = time.perf_counter()
    res = engine.generate(sources, num_beams=K, max_new_tokens=length + 1, max_batch_size=batch, speculative=spec)
    dt = time.perf_counter() - t0
    tops = [[t for t in r.hypotheses[0].tokens if t != 0] for r in res]
    steps = sum(r.stats.beam_steps for r in res) / max(1, sum(r.stats.target_passes for r in res))
    return sum(map(len, tops)) / dt, tops, steps


def _ct2_encdec(hf: Path, work: Path, sources, K, length, batch, quantization, threads):
    import ctranslate2
    from ctranslate2.converters import TransformersConverter

    out = work / f"ct2_{quantization}"
    if not (out / "model.bin").is_file():
        TransformersConverter(str(hf)).convert(str(out), quantization=quantization, force=True)
    tr = ctranslate2.Translator(str(out), device="cpu", intra_threads=threads, inter_threads=1)
    toks = [["</s>" if i == 0 else f"w{i}" for i in s] for s in sources]
    tr.translate_batch(toks[:2], beam_size=K, max_decoding_length=4)          # warm-up
    t0 = time.perf_counter()
    res = tr.translate_batch(toks, beam_size=K, max_decoding_length=length, max_batch_size=batch)
    dt = time.perf_counter() - t0
    tops = [r.hypotheses[0] for r in res]
    tops = [[0 if t == "</s>" else int(t[1:]) for t in h if t != "</s>"] for h in tops]
    return sum(map(len, tops)) / dt, tops


def bench_encdec(work: Path, *, K: int = 4, n: int = 16, length: int = 48, batches=(1, 4, 16), threads: int = 2,
                 out=sys.stderr) -> dict:
    """tokens/s of beam search (K) on a random Opus-MT-base Marian: specbeam fp32 and int8 (plain, and
    speculative with the int8 export drafting for the fp32 one) against CTranslate2 int8 and float32, at batch
    1 and each size in `batches`; plus how many top hypotheses agree with CTranslate2 float32 (same weights)."""
    from export.core import export

    work.mkdir(parents=True, exist_ok=True)
    hf = make_marian(work / "hf")
    sb = {p: work / f"sb_{p}" for p in ("fp32", "int8")}
    for p, d in sb.items():
        if not (d / "specbeam_config.json").is_file():
            export(hf, d, precision=p, quiet=True)
    sources = _sources(n)
    rows, tops, steps = {}, {}, {}
    for p in ("fp32", "int8"):
        eng = Engine(sb[p], threads=threads)
        eng.generate(sources[:2], num_beams=K, max_new_tokens=4)                # warm-up
        for b in batches:
            rows[f"specbeam {p} b{b}"], tops[f"specbeam {p} b{b}"], _ = _ours_encdec(eng, sources, K, length, b)
    eng = Engine(sb["fp32"], draft=sb["int8"], threads=threads)
    spec = SpeculativeConfig(drafter="beam", budget=32, max_depth=4, adaptive=False)
    for b in (1, max(batches)):
        name = f"specbeam fp32 + int8 draft b{b}"
        rows[name], tops[name], steps[name] = _ours_encdec(eng, sources, K, length, b, spec)
    for q in ("int8", "float32"):
        for b in batches:
            rows[f"ctranslate2 {q} b{b}"], tops[f"ctranslate2 {q} b{b}"] = _ct2_encdec(
                hf, work, sources, K, length, b, q, threads)
    ref = tops[f"ctranslate2 float32 b{batches[0]}"]
    agree = {k: sum(a == r for a, r in zip(v, ref)) for k, v in tops.items()}
    for k, v in rows.items():
        print(f"{k:34s} {v:8.1f} tok/s   top-1 == ct2 float32: {agree[k]}/{n}", file=out)
    best = {name: max(v for k, v in rows.items() if k.startswith(name + " b"))
            for name in ("specbeam fp32", "specbeam int8", "ctranslate2 int8", "ctranslate2 float32")}
    return {"K": K, "sentences": n, "length": length, "threads": threads, "shapes": OPUS_MT_BASE,
            "tokens_per_second": {k: round(v, 1) for k, v in rows.items()},
            "best_batch_tokens_per_second": {k: round(v, 1) for k, v in best.items()},
            "beam_steps_per_pass": {k: round(v, 2) for k, v in steps.items()},
            "top1_agrees_with_ct2_float32": agree}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="encoder-decoder peers: random Opus-MT-base Marian, specbeam vs "
                                             "CTranslate2 on the same weights")
    ap.add_argument("--work", required=True, help="folder for the model, its exports and conversions (kept)")
    ap.add_argument("--sentences", type=int, default=16)
    ap.add_argument("--length", type=int, default=48, help="generated tokens per sentence")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,4,16", help="batch sizes (comma list; the first is the reference)")
    a = ap.parse_args()
    print(json.dumps(bench_encdec(Path(a.work), n=a.sentences, length=a.length, threads=a.threads,
                                  batches=tuple(int(b) for b in a.batches.split(","))), indent=1))
