"""Shipped pair end to end: plain beam search vs exact speculative beam search, alternated A B A B, one request
at a time (the README's main job: one line, batch 1; the tree budget is per target pass, shared by the requests
in it, so a batch of 12 would give each request a twelfth of it)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from specbeam_edge import Engine, SpeculativeConfig

from .common import median, save_figure


def load_prompts(pair: Path, n: int) -> list[str]:
    lines = (pair / "test_sample.en").read_text("utf-8").splitlines()
    return lines[:n]


def run_once(engine, prompts, K, spec, max_new, batch=1):
    t0 = time.perf_counter()
    res = engine.generate(prompts, num_beams=K, max_new_tokens=max_new, speculative=spec, max_batch_size=batch)
    dt = time.perf_counter() - t0
    steps = sum(r.stats.beam_steps for r in res)
    passes = sum(r.stats.target_passes for r in res)
    draft_s = sum(r.stats.draft_seconds for r in res)
    return {"seconds": dt, "beam_steps": steps, "target_passes": passes, "draft_share": draft_s / dt,
            "proposed": sum(r.stats.draft_tokens_proposed for r in res),
            "accepted": sum(r.stats.draft_tokens_accepted for r in res), "texts": [r.text for r in res]}


def bench(pair: Path, *, Ks=(1, 2, 4, 8), specs=None, n_prompts=12, reps=3, max_new=128, threads=None, batch=1):
    engine = Engine(pair / "target", draft=pair / "draft", threads=threads)
    prompts = [engine.tokenizer.format_prompt(p) for p in load_prompts(pair, n_prompts)]
    specs = specs or [SpeculativeConfig(adaptive=False, drafter="lookup", budget=16, max_depth=6, max_branch_width=2),
                      SpeculativeConfig(adaptive=False, drafter="beam", budget=4, max_depth=4, draft_width=1),
                      SpeculativeConfig(adaptive=False, drafter="beam", budget=16, max_depth=4),
                      SpeculativeConfig(adaptive=False, drafter="beam", budget=32, max_depth=6),
                      SpeculativeConfig(adaptive=False, drafter="best_first", budget=16, max_depth=6),
                      SpeculativeConfig(adaptive=False, drafter="best_first", budget=32, max_depth=8),
                      SpeculativeConfig(drafter="beam", adaptive=True)]   # the apps' default (budget 80)
    engine.generate(prompts[:2], num_beams=1, max_new_tokens=16, speculative=specs[0])  # warm-up
    rows = []
    for K in Ks:
        for spec in specs:
            if (spec.budget != "auto" and spec.budget < K) or (spec.draft_width or K) < K:
                continue
            ratios, a_runs, b_runs = [], [], []
            for _ in range(reps):          # A B A B: plain then speculative, back to back
                a = run_once(engine, prompts, K, None, max_new, batch)
                b = run_once(engine, prompts, K, spec, max_new, batch)
                ratios.append(a["seconds"] / b["seconds"])
                a_runs.append(a)
                b_runs.append(b)
            b0 = b_runs[0]
            row = {"K": K, "drafter": spec.drafter, "budget": spec.budget, "max_depth": spec.max_depth,
                   "draft_width": spec.draft_width, "adaptive": spec.adaptive or None,
                   "plain_s": median([r["seconds"] for r in a_runs]), "spec_s": median([r["seconds"] for r in b_runs]),
                   "speedup": median(ratios), "bspp": b0["beam_steps"] / b0["target_passes"],
                   "target_passes": b0["target_passes"], "plain_passes": a_runs[0]["target_passes"],
                   "draft_share": median([r["draft_share"] for r in b_runs]),
                   "plain_tok_s": a_runs[0]["beam_steps"] / median([r["seconds"] for r in a_runs]),
                   "spec_tok_s": b0["beam_steps"] / median([r["seconds"] for r in b_runs]),
                   "accepted_per_proposed": b0["accepted"] / max(1, b0["proposed"]),
                   "identical": sum(x == y for x, y in zip(a_runs[0]["texts"], b0["texts"])), "of": len(prompts)}
            rows.append(row)
            print(f"K={K} {spec.drafter:10s} budget={spec.budget!s:>4} speedup {row['speedup']:.2f}x "
                  f"bspp {row['bspp']:.2f} identical {row['identical']}/{len(prompts)}", file=sys.stderr)
    return {"pair": pair.name, "prompts": len(prompts), "batch": batch, "reps": reps, "max_new_tokens": max_new,
            "rows": rows}


def plot(data: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for drafter, marker in (("beam", "o"), ("best_first", "s")):
        for K in sorted({r["K"] for r in data["rows"]}):
            rs = [r for r in data["rows"] if r["K"] == K and r["drafter"] == drafter and not r.get("adaptive")
                  and r["budget"] != "auto"]      # "auto" rows have no fixed budget to place on the axis
            if not rs:
                continue
            axes[0].plot([r["budget"] for r in rs], [r["speedup"] for r in rs], marker=marker,
                         label=f"K={K} {drafter}")
            axes[1].plot([r["budget"] for r in rs], [r["bspp"] for r in rs], marker=marker, label=f"K={K} {drafter}")
    ad = [r for r in data["rows"] if r.get("adaptive") and r["budget"] != "auto"]
    if ad:
        axes[0].scatter([r["budget"] for r in ad], [r["speedup"] for r in ad], marker="*", s=90, color="black",
                        label="adaptive (apps' default)", zorder=3)
        axes[0].legend(fontsize=7)
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].set(xlabel="draft tree budget (nodes)", ylabel="wall-clock speedup vs plain beam search",
                title="exact speculative beam search (median of A/B pairs)")
    axes[1].set(xlabel="draft tree budget (nodes)", ylabel="beam steps per target pass", title="steps per pass")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2)
    save_figure(fig, path)
