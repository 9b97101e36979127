"""Confidence-following tree depth (SpeculativeConfig.min_path_prob): exact speculative beam search with the
shipped draft and with an oracle draft (draft = target), against plain beam search, by threshold. Drafting on
every pass (adaptive off), so the tree's cost and yield are what is measured."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from specbeam_edge import Engine, SpeculativeConfig

from .common import median, save_figure
from .e2e import load_prompts

TAUS = (0.0, 0.05, 0.2)


def bench(pair: Path, *, n_prompts=16, max_new=64, reps=2, Ks=(1, 4), taus=TAUS, threads=2) -> dict:
    rows = []
    for draft in ("shipped", "oracle"):
        eng = Engine(pair / "target", draft=pair / ("draft" if draft == "shipped" else "target"), threads=threads)
        prompts = [eng.tokenizer.format_prompt(p) for p in load_prompts(pair, n_prompts)]
        for K in Ks:
            arms = {"plain": None, **{t: SpeculativeConfig(min_path_prob=t, adaptive=False) for t in taus}}
            runs = {a: [] for a in arms}
            for _ in range(reps):
                for a, spec in arms.items():     # alternated: plain, each threshold, plain, ...
                    t0 = time.perf_counter()
                    res = eng.generate(prompts, num_beams=K, max_new_tokens=max_new, max_batch_size=1,
                                       speculative=spec)
                    runs[a].append((time.perf_counter() - t0, res))
            base = median([s for s, _ in runs["plain"]])
            ref = [[h.tokens for h in r.hypotheses] for r in runs["plain"][0][1]]
            for t in taus:
                stats = [r.stats for r in runs[t][0][1]]
                rows.append({"draft": draft, "K": K, "min_path_prob": t,
                             "speedup": round(base / median([s for s, _ in runs[t]]), 2),
                             "bspp": round(sum(s.beam_steps for s in stats) / sum(s.target_passes for s in stats), 2),
                             "draft_passes": sum(s.draft_passes for s in stats),
                             "nodes_per_pass": round(sum(s.draft_tokens_proposed for s in stats)
                                                     / sum(s.target_passes for s in stats), 1),
                             "identical": all([[h.tokens for h in r.hypotheses] for r in res] == ref
                                              for _, res in runs[t])})
                print(rows[-1], file=sys.stderr)
    return {"prompts": n_prompts, "max_new_tokens": max_new, "reps": reps, "threads": threads, "rows": rows}


def plot(data: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4))
    for (draft, K) in sorted({(r["draft"], r["K"]) for r in data["rows"]}):
        rs = [r for r in data["rows"] if r["draft"] == draft and r["K"] == K]
        x = [r["min_path_prob"] for r in rs]
        axes[0].plot(x, [r["speedup"] for r in rs], "o-", label=f"{draft} draft, K={K}")
        axes[1].plot(x, [r["bspp"] for r in rs], "o-", label=f"{draft} draft, K={K}")
    axes[0].set(xlabel="min_path_prob", ylabel="speedup over plain beam search")
    axes[1].set(xlabel="min_path_prob", ylabel="beam steps per target pass")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    save_figure(fig, path)
