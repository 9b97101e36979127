"""Speculative beam sampling (DSBD) vs plain beam sampling on the shipped pair, W in {2, 4}: wall-clock ratio
at equal output quality (average target log-probability per token of the returned hypotheses), and the
widths the dynamic rule chose."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from specbeam_edge import Engine, SpeculativeConfig

from .common import median
from .e2e import load_prompts


def bench(pair: Path, *, Ws=(2, 4), thresholds=(0.0, 0.7), n_prompts=12, reps=2, max_new=96,
          streamed: bool = True) -> dict:
    """Rows for the shipped pair resident (target + distilled draft) and, with `streamed`, for the target
    streamed from disk with its own int8 copy as the resident draft (the regime where a pass moves weights)."""
    setups = [("resident, distilled draft", Engine(pair / "target", draft=pair / "draft"), n_prompts)]
    if streamed and (pair / "variants" / "target_int8").is_dir():
        from .offload import split_target

        folder = split_target(pair)
        L = Engine(folder).target.cfg.num_layers
        setups.append(("streamed from disk, int8 self-draft",
                       Engine(folder, draft=pair / "variants" / "target_int8", placement=["disk"] * L),
                       max(2, n_prompts // 2)))
    rows = []
    for setup, engine, n in setups:
        prompts = [engine.tokenizer.format_prompt(p) for p in load_prompts(pair, n)]
        for W in Ws:
            for t in thresholds:
                rows.append(_row(engine, prompts, W, t, reps, max_new, setup))
    return {"prompts": n_prompts, "reps": reps, "max_new_tokens": max_new, "rows": rows}


def _row(engine, prompts, W, t, reps, max_new, setup) -> dict:
    spec = SpeculativeConfig(adaptive=False, drafter="sample", max_depth=4, draft_width=max(W, 4), width_threshold=t)
    ratios, lp_a, lp_b, widths, bspp = [], [], [], [], []
    for r in range(reps):
        t0 = time.perf_counter()
        a = engine.generate(prompts, num_beams=W, do_sample=True, seed=r, max_new_tokens=max_new, speculative=None)
        ta = time.perf_counter() - t0
        t0 = time.perf_counter()
        b = engine.generate(prompts, num_beams=W, do_sample=True, seed=r, max_new_tokens=max_new, speculative=spec)
        tb = time.perf_counter() - t0
        ratios.append(ta / tb)
        lp_a += [x.hypotheses[0].score for x in a]
        lp_b += [x.hypotheses[0].score for x in b]
        widths += [w for x in b for w in x.stats.widths]
        bspp.append(sum(x.stats.beam_steps for x in b) / sum(x.stats.target_passes for x in b))
    row = {"setup": setup, "W": W, "width_threshold": t, "speedup": round(median(ratios), 2),
           "bspp": round(median(bspp), 2), "plain_logp_per_token": round(float(np.mean(lp_a)), 3),
           "spec_logp_per_token": round(float(np.mean(lp_b)), 3),
           "mean_width": round(float(np.mean(widths)), 2) if widths else None}
    print(f"sampling {setup} W={W} t={t}: {row}", file=sys.stderr)
    return row
