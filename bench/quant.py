"""Exact-safe quantized targets: per-row int8 (`-p int8`) against fp32 and quantize_dynamic (`-p int8dyn`).

For each precision of the shipped en->de target (exported from its HF checkpoint in the pair's hf/ folder):
- invariance: the engine's load-time measure (a tree pass vs each node alone, relative to the largest logit);
- exactness: speculative (the shipped draft, trees forced, K = 4) == plain on held-out lines, and batched (all
  lines in one batch) == alone, counted line by line;
- quality: BLEU / chrF of plain beam 4 on the pair's held-out sample (test_sample.en/.de);
- speed: plain beam search one request at a time, K = 1 and 4, the precisions alternated A B C A B C, on the
  shipped target and on a random-weight model at SmolLM2-360M shapes (32 layers x 960, vocabulary 49,152), where
  the weights no longer fit the CPU's caches.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from specbeam_edge import Engine, SpeculativeConfig
from specbeam_edge.execution import invariance

from .common import median, save_figure

PRECISIONS = ("fp32", "int8", "int8dyn")
PARTS = ("exactness", "quality", "speed", "speed_360m", "opus_mt", "beam_step")
SPEC = SpeculativeConfig(drafter="beam", budget=80, max_depth=6, adaptive=False)
# SmolLM2-360M (HuggingFaceTB/SmolLM2-360M config): 32 layers, hidden 960, 15 heads / 5 KV heads, MLP 2560
SMOLLM2_360M = dict(vocab_size=49152, hidden_size=960, num_hidden_layers=32, num_attention_heads=15,
                    num_key_value_heads=5, intermediate_size=2560, max_position_embeddings=2048,
                    tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def exports(hf: Path, work: Path, precisions=PRECISIONS) -> dict[str, Path]:
    """The model exported at each precision into `work` (kept between runs)."""
    from export import export

    out = {}
    for p in precisions:
        d = work / p
        if not (d / "specbeam_config.json").is_file():
            export(hf, d, precision=p, quiet=True, overwrite=True)
        out[p] = d
    return out


def _ids(engine, lines):
    return [engine.tokenizer.encode(engine.tokenizer.format_prompt(x)) for x in lines]


def exactness(folders: dict, draft: Path, lines: list[str], *, K=4, max_new=96, threads=2) -> list[dict]:
    rows = []
    for p, folder in folders.items():
        eng = Engine(folder, draft=draft, threads=threads)
        check = invariance.check(eng.target, use_cache=False)
        prompts = _ids(eng, lines)
        alone = [eng.generate(x, num_beams=K, max_new_tokens=max_new, speculative=None)[0] for x in prompts]
        batched = eng.generate(prompts, num_beams=K, max_new_tokens=max_new, max_batch_size=len(prompts),
                           speculative=None)
        row = {"precision": p, "invariance": check.max_diff, "lines": len(lines),
               "batched_eq_alone": sum(a.hypotheses[0].tokens == b.hypotheses[0].tokens
                                       for a, b in zip(alone, batched))}
        if check.ok:
            spec = [eng.generate(x, num_beams=K, max_new_tokens=max_new, speculative=SPEC)[0] for x in prompts]
            row["speculative_eq_plain"] = sum(a.hypotheses[0].tokens == s.hypotheses[0].tokens
                                              for a, s in zip(alone, spec))
        else:     # the engine refuses it; forced past the check, as a user of an older version got it
            eng.skip_invariance_check()
            spec = [eng.generate(x, num_beams=K, max_new_tokens=max_new, speculative=SPEC)[0] for x in prompts]
            row["speculative_eq_plain"] = sum(a.hypotheses[0].tokens == s.hypotheses[0].tokens
                                              for a, s in zip(alone, spec))
            row["refused_by_engine"] = True
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    return rows


def quality(folders: dict, src: list[str], ref: list[str], *, K=4, max_new=160, threads=2) -> list[dict]:
    import sacrebleu

    rows = []
    for p, folder in folders.items():
        eng = Engine(folder, threads=threads)
        res = eng.generate(_ids(eng, src), num_beams=K, max_new_tokens=max_new, max_batch_size=32)
        hyp = [r.text.strip() for r in res]
        rows.append({"precision": p, "lines": len(src), "bleu": round(sacrebleu.corpus_bleu(hyp, [ref]).score, 2),
                     "chrf": round(sacrebleu.corpus_chrf(hyp, [ref]).score, 2)})
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def speed(folders: dict, prompts_of, *, Ks=(1, 4), reps=3, max_new=64, threads=2, label="") -> list[dict]:
    """tokens/s of plain beam search one request at a time, the precisions alternated within each repetition;
    the ratio to fp32 is the median of the per-repetition ratios."""
    engines = {p: Engine(f, threads=threads) for p, f in folders.items()}
    rows = []
    for K in Ks:
        tps = {p: [] for p in engines}
        for _ in range(reps):
            for p, eng in engines.items():
                prompts = prompts_of(eng)
                eng.generate(prompts[0], num_beams=K, max_new_tokens=4)          # warm-up
                t0, n = time.perf_counter(), 0
                for x in prompts:
                    [r] = eng.generate(x, num_beams=K, max_new_tokens=max_new)
                    n += len(r.hypotheses[0].tokens)
                tps[p].append(n / (time.perf_counter() - t0))
        for p in engines:
            ratios = [a / b for a, b in zip(tps[p], tps["fp32"])]
            rows.append({"model": label, "precision": p, "K": K, "tokens_per_s": round(median(tps[p]), 1),
                         "vs_fp32": round(median(ratios), 2), "runs": [round(x, 1) for x in tps[p]]})
            print(rows[-1], file=sys.stderr, flush=True)
    return rows


def opus_mt(work: Path, *, K=4, n=32, length=48, batches=(1, 4, 16, 32), reps=2, threads=2) -> dict:
    """Beam search (K) on a random Marian at Opus-MT base shapes (58,101 tokens): specbeam's per-row int8 with
    a logits head and with the beam head (`output="both"`), fp32, against CTranslate2 int8, every system at
    every batch size, alternated within each repetition; plus speculative (the int8 target drafting for itself)
    == plain, and top-1 agreement with CTranslate2 float32."""
    from export import export

    from .peers import _ct2_encdec, _ours_encdec, _sources, make_marian

    work.mkdir(parents=True, exist_ok=True)
    hf = make_marian(work / "hf")
    variants = {"fp32": dict(precision="fp32"), "int8": dict(precision="int8"),
                "int8 beam head": dict(precision="int8", output="both")}
    engines = {}
    for name, kw in variants.items():
        d = work / ("sb_" + name.replace(" ", "_"))
        if not (d / "specbeam_config.json").is_file():
            export(hf, d, quiet=True, overwrite=True, **kw)
        engines[name] = Engine(d, threads=threads)
        engines[name].generate(_sources(2), num_beams=K, max_new_tokens=4)        # warm-up
    sources = _sources(n)
    tps: dict = {}
    tops: dict = {}
    for _ in range(reps):
        for b in batches:
            for name, eng in engines.items():
                v, tops[f"specbeam {name} b{b}"], _ = _ours_encdec(eng, sources, K, length, b)
                tps.setdefault(f"specbeam {name} b{b}", []).append(v)
            v, tops[f"ctranslate2 int8 b{b}"] = _ct2_encdec(hf, work, sources, K, length, b, "int8", threads)
            tps.setdefault(f"ctranslate2 int8 b{b}", []).append(v)
            print({k: round(x[-1], 1) for k, x in tps.items() if k.endswith(f"b{b}")}, file=sys.stderr, flush=True)
    _, ref = _ct2_encdec(hf, work, sources, K, length, batches[0], "float32", threads)
    med = {k: round(median(v), 1) for k, v in tps.items()}
    best_ct2 = max(med[f"ctranslate2 int8 b{b}"] for b in batches)
    rows = []
    for name in engines:
        for b in batches:
            key = f"specbeam {name} b{b}"
            rows.append({"system": f"specbeam {name}", "batch": b, "tokens_per_s": med[key],
                         "vs_ct2_int8_same_batch": round(med[key] / med[f"ctranslate2 int8 b{b}"], 2),
                         "vs_ct2_int8_best_batch": round(med[key] / best_ct2, 2),
                         "top1_eq_ct2_float32": sum(a == r for a, r in zip(tops[key], ref))})
    for b in batches:
        rows.append({"system": "ctranslate2 int8", "batch": b, "tokens_per_s": med[f"ctranslate2 int8 b{b}"],
                     "top1_eq_ct2_float32": sum(a == r for a, r in zip(tops[f"ctranslate2 int8 b{b}"], ref))})
    # exactness of the new int8 target: speculative (drafting for itself, trees forced) == plain
    eng = Engine(work / "sb_int8_beam_head", draft=work / "sb_int8", threads=threads)
    plain = eng.generate(sources, num_beams=K, max_new_tokens=length + 1, max_batch_size=1, speculative=None)
    fast = eng.generate(sources, num_beams=K, max_new_tokens=length + 1, max_batch_size=1,
                        speculative=SpeculativeConfig(drafter="beam", budget=32, max_depth=4, adaptive=False))
    same = sum(a.hypotheses[0].tokens == f.hypotheses[0].tokens for a, f in zip(plain, fast))
    return {"K": K, "sentences": n, "length": length, "reps": reps, "rows": rows,
            "speculative_eq_plain": f"{same}/{n}", "runs": {k: [round(x, 1) for x in v] for k, v in tps.items()}}


def beam_step_share(work: Path, *, vocabs=(58101, 151936), K=4, n=6, max_new=48, threads=2) -> list[dict]:
    """The share of a plain beam search (K, one request at a time) spent in the beam step and in building its
    rows (cProfile), with a logits head and with the beam head (`output="both"`), at each vocabulary size, on a
    small random Llama (4 layers x 256) so that the vocabulary's cost shows."""
    import cProfile
    import pstats

    import numpy as np
    import torch
    import transformers as tf

    from export import export

    rows = []
    for V in vocabs:
        hf = work / f"llama_v{V}"
        if not (hf / "config.json").is_file():
            torch.manual_seed(0)
            cfg = tf.LlamaConfig(vocab_size=V, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=768, max_position_embeddings=512,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=2)
            tf.LlamaForCausalLM(cfg).eval().save_pretrained(hf)
            tf.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(hf)
            _word_tokenizer(hf, V)
        prompts = [np.random.default_rng(i).integers(3, V, 12).tolist() for i in range(n)]
        for head in ("logits", "both"):
            d = work / f"sb_v{V}_{head}"
            if not (d / "specbeam_config.json").is_file():
                export(hf, d, precision="int8", output=head, quiet=True, overwrite=True)
            eng = Engine(d, threads=threads)
            eng.generate(prompts[0], num_beams=K, max_new_tokens=4)
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            for x in prompts:
                eng.generate(x, num_beams=K, max_new_tokens=max_new)
            prof.disable()
            total = time.perf_counter() - t0
            st = pstats.Stats(prof).stats
            cum = {f"{Path(k[0]).name}:{k[2]}": v[3] for k, v in st.items()}
            step = cum.get("beam.py:step", 0.0) + cum.get("heads.py:beam_rows", 0.0)
            ort_s = sum(v[2] for k, v in st.items() if "onnxruntime_pybind11_state" in k[2] and k[2].endswith(".run>"))
            rows.append({"vocab": V, "head": head, "seconds": round(total, 2),
                         "beam_step_share": round(step / total, 3), "onnxruntime_share": round(ort_s / total, 3)})
            print(rows[-1], file=sys.stderr, flush=True)
    return rows


def _word_tokenizer(folder: Path, V: int) -> None:
    """A word-level tokenizer with exactly V tokens (w0 .. w{V-1}): random-weight models need one of their size."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              "eos_token": "w2", "bos_token": "w1"}))


def smollm2_shapes(folder: Path) -> Path:
    """A random-weight Llama at SmolLM2-360M shapes with a byte-level tokenizer (kept between runs)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMOLLM2_360M)).eval()     # transformers' init (std 0.02)
    model.save_pretrained(folder)
    tf.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(folder)
    _word_tokenizer(folder, SMOLLM2_360M["vocab_size"])
    return folder


def bench(pair: Path, work: Path, *, n_exact=24, n_quality=200, n_speed=8, reps=3, threads=2,
          parts=PARTS) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    folders = exports(pair / "hf" / "target", work / "ende")
    src = (pair / "test_sample.en").read_text("utf-8").splitlines()
    ref = (pair / "test_sample.de").read_text("utf-8").splitlines()
    data: dict = {"threads": threads}
    if "exactness" in parts:
        data["exactness"] = exactness(folders, pair / "draft", src[:n_exact], threads=threads)
    if "quality" in parts:
        data["quality"] = quality(folders, src[:n_quality], ref[:n_quality], threads=threads)
    if "speed" in parts:
        data["speed"] = speed(folders, lambda e: _ids(e, src[:n_speed]), reps=reps, threads=threads,
                              label="shipped en->de target (6 x 256)")
    if "speed_360m" in parts:
        import numpy as np

        big = exports(smollm2_shapes(work / "smollm2_360m_hf"), work / "smollm2_360m", ("fp32", "int8"))
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, 49152, 24).tolist() for _ in range(max(2, n_speed // 2))]
        data["speed_360m"] = speed(big, lambda e: prompts, Ks=(4,), reps=reps, max_new=32, threads=threads,
                                   label="random weights, SmolLM2-360M shapes (32 x 960)")
    if "beam_step" in parts:
        data["beam_step"] = beam_step_share(work / "beam_step", threads=threads)
    if "opus_mt" in parts:
        data["opus_mt"] = opus_mt(work / "opus_mt", reps=reps if reps < 3 else 2, threads=threads)
    return data


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data.get("speed", []) + data.get("speed_360m", [])
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels = [f"{'360M shapes' if '360M' in r['model'] else 'en->de'}\n{r['precision']} K={r['K']}" for r in rows]
    ax.bar(range(len(rows)), [r["vs_fp32"] for r in rows], color=["#888" if r["precision"] == "fp32" else
                                                                  "#2a7" if r["precision"] == "int8" else "#d84"
                                                                  for r in rows])
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("tokens/s vs fp32 (plain beam search)")
    ax.set_title("per-row int8 (exact-safe) vs fp32 and quantize_dynamic (int8dyn)", fontsize=9)
    save_figure(fig, path, dpi=120)
