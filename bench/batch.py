"""Batch translation throughput: specbeam's continuous batching against CTranslate2's generate_batch on the same
weights (its own int8 conversion), by batch size, alternated in one run (A B A B; medians)."""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from specbeam_edge import Engine, SpeculativeConfig

from .common import median, save_figure
from .e2e import load_prompts

SIZES = (1, 8, 32, 64)


def _ours(engine, prompts, K, n_best, max_new, size, spec=None) -> dict:
    t0 = time.perf_counter()
    res = engine.generate(prompts, num_beams=K, num_return_sequences=n_best, max_new_tokens=max_new,
                          max_batch_size=size, speculative=spec)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "tokens": sum(_output_len(r.hypotheses[0].tokens, engine) for r in res),
            "outputs": [[h.tokens for h in r.hypotheses] for r in res],
            "passes": sum(r.stats.target_passes for r in res), "steps": sum(r.stats.beam_steps for r in res),
            "peak_mb": max(r.stats.peak_memory_mb for r in res),
            "kv_mb": max(r.stats.kv_cache_peak_mb for r in res)}


def _output_len(tokens: list[int], engine) -> int:
    """Tokens of the returned translation without its EOS: what CTranslate2's sequences_ids holds. (The beam
    steps a search ran, Stats.generated_tokens, run past the best hypothesis's end and counted 40% more on these
    lines: an earlier version of this table compared those with CTranslate2's output tokens.)"""
    return len(tokens) - int(bool(tokens) and tokens[-1] in engine.target.cfg.eos_token_ids)


def ct2_generator(hf: Path, threads: int):
    try:
        import ctranslate2
        from ctranslate2.converters import TransformersConverter
    except ImportError:
        return None, "ctranslate2 not installed (pip install -e '.[bench]')"
    out = Path(tempfile.mkdtemp()) / "ct2"
    try:
        TransformersConverter(str(hf)).convert(str(out), quantization="int8")
    except Exception as e:  # its converter follows transformers' internals: report, don't crash the bench
        return None, f"conversion failed: {str(e).splitlines()[0][:200]}"
    return ctranslate2.Generator(str(out), device="cpu", intra_threads=threads), None


def _ct2(gen, toks, K, n_best, max_new, size) -> dict:
    t0 = time.perf_counter()
    res = gen.generate_batch(toks, max_batch_size=size, beam_size=K, num_hypotheses=n_best, max_length=max_new,
                             include_prompt_in_result=False)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "tokens": sum(len(r.sequences_ids[0]) for r in res)}


def bench(pair: Path, *, n_prompts=200, max_new=128, reps=2, threads=2, sizes=SIZES,
          settings=((4, 1), (1, 1), (4, 4))) -> dict:
    """settings: (K, n_best) pairs. Rows per setting and batch size: tokens/s and lines/s of both engines."""
    engine = Engine(pair / "target", draft=pair / "draft", threads=threads)
    lines = load_prompts(pair, n_prompts)
    prompts = [engine.tokenizer.format_prompt(p) for p in lines]
    ids = [engine.encode(p) for p in prompts]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))   # both engines get the lines sorted by length
    prompts, ids = [prompts[i] for i in order], [ids[i] for i in order]
    gen, why = ct2_generator(pair / "hf" / "target", threads)
    toks = [[engine.tokenizer.id_to_token(i) for i in x] for x in ids]
    engine.generate(prompts[:4], num_beams=4, max_new_tokens=8, max_batch_size=4, speculative=None)  # warm-up
    rows, curves = [], {}
    for K, n_best in settings:
        ours = {s: [] for s in sizes}
        theirs = {s: [] for s in sizes}
        alone = None
        for _ in range(reps):
            for s in sizes:
                r = _ours(engine, prompts, K, n_best, max_new, s)
                alone = alone or (r["outputs"] if s == 1 else None)
                if alone is not None and r["outputs"] != alone:
                    print(f"warning: batch {s} output differs from batch 1 (K={K})", file=sys.stderr)
                ours[s].append(r)
                if gen is not None:
                    theirs[s].append(_ct2(gen, toks, K, n_best, max_new, s))
        for s in sizes:
            tps = median([r["tokens"] / r["seconds"] for r in ours[s]])
            row = {"K": K, "n_best": n_best, "batch": s, "specbeam_tok_s": round(tps, 1),
                   "specbeam_lines_s": round(median([len(prompts) / r["seconds"] for r in ours[s]]), 2),
                   "identical_to_batch1": all(r["outputs"] == alone for r in ours[s]),
                   "peak_mb": round(max(r["peak_mb"] for r in ours[s]), 1),
                   "kv_mb_per_request": round(max(r["kv_mb"] for r in ours[s]), 2)}
            if theirs[s]:
                row["ct2_int8_tok_s"] = round(median([r["tokens"] / r["seconds"] for r in theirs[s]]), 1)
                row["ct2_int8_lines_s"] = round(median([len(prompts) / r["seconds"] for r in theirs[s]]), 2)
            rows.append(row)
            print(row, file=sys.stderr)
        # ratios in lines/s: both engines translate the same lines (token counts differ where outputs differ)
        mine = [r for r in rows if r["K"] == K and r["n_best"] == n_best]
        best_ours = max(r["specbeam_lines_s"] for r in mine)
        one = next(r["specbeam_lines_s"] for r in mine if r["batch"] == 1)
        summary = {"specbeam_best_over_one_at_a_time": round(best_ours / one, 2)}
        if gen is not None:
            best_ct2 = max(r["ct2_int8_lines_s"] for r in mine if r["batch"] in (8, 32, 64) or len(sizes) < 3)
            summary["specbeam_over_ctranslate2_best"] = round(best_ours / best_ct2, 2)
        curves[f"K={K} n_best={n_best}"] = summary
    data = {"prompts": len(prompts), "max_new_tokens": max_new, "threads": threads, "reps": reps, "rows": rows,
            "summary": curves, "notes": {"ctranslate2": why} if why else {}}
    main = curves.get("K=4 n_best=1", {})
    if "specbeam_over_ctranslate2_best" in main:
        data["specbeam_over_ctranslate2_best"] = main["specbeam_over_ctranslate2_best"]
    return data


def bench_speculation(pair: Path, *, n_prompts=48, max_new=96, reps=2, threads=2, sizes=(1, 4, 16), K=4) -> dict:
    """Does speculation still pay inside a batch? plain vs adaptive (the default) vs always drafting."""
    engine = Engine(pair / "target", draft=pair / "draft", threads=threads)
    prompts = [engine.tokenizer.format_prompt(p) for p in load_prompts(pair, n_prompts)]
    arms = {"plain": None, "adaptive": SpeculativeConfig(adaptive=True),
            "always": SpeculativeConfig(adaptive=False), "lookup": SpeculativeConfig(drafter="lookup", budget=16)}
    rows = []
    for s in sizes:
        runs = {a: [] for a in arms}
        for _ in range(reps):
            for a, spec in arms.items():
                runs[a].append(_ours(engine, prompts, K, 1, max_new, s, spec))
        base = median([r["seconds"] for r in runs["plain"]])
        for a in arms:
            rows.append({"batch": s, "arm": a, "speedup_over_plain": round(base / median([r["seconds"] for r in runs[a]]), 2),
                         "bspp": round(sum(r["steps"] for r in runs[a]) / max(1, sum(r["passes"] for r in runs[a])), 2),
                         "identical": all(r["outputs"] == runs["plain"][0]["outputs"] for r in runs[a])})
            print(rows[-1], file=sys.stderr)
    return {"K": K, "prompts": len(prompts), "rows": rows}


def plot(data: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({(r["K"], r["n_best"]) for r in data["rows"]})
    fig, axes = plt.subplots(1, len(settings), figsize=(4 * len(settings), 3.4), squeeze=False)
    for ax, (K, nb) in zip(axes[0], settings):
        rs = [r for r in data["rows"] if r["K"] == K and r["n_best"] == nb]
        ax.plot([r["batch"] for r in rs], [r["specbeam_lines_s"] for r in rs], "o-", label="specbeam")
        if "ct2_int8_lines_s" in rs[0]:
            ax.plot([r["batch"] for r in rs], [r["ct2_int8_lines_s"] for r in rs], "s--", label="CTranslate2 int8")
        ax.set(xscale="log", xlabel="max batch size", ylabel="lines/s", title=f"K={K}, n_best={nb}")
        ax.grid(alpha=0.3)
        ax.legend()
    save_figure(fig, path)
