"""Cost curve: one target pass over a tree of Q nodes on top of a prompt, for each model folder given."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from specbeam_edge.model import OnnxCausalLM

from .common import median, save_figure

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def pass_time(lm: OnnxCausalLM, past_len: int, Q: int, reps: int) -> float:
    rng = np.random.default_rng(0)
    ids = rng.integers(1, lm.cfg.vocab_size, size=(1, past_len))
    mask = np.tril(np.ones((past_len, past_len), bool))[None, None]
    _, past = lm.forward(ids, np.arange(past_len)[None], mask, lm.empty_past())
    parents = [-1] + [int(rng.integers(-1, j)) for j in range(1, Q)]   # a random tree below the prompt
    depth = []
    tm = np.zeros((Q, past_len + Q), bool)
    tm[:, :past_len] = True
    for j, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + 1)
        if p >= 0:
            tm[j] = tm[p]
        tm[j, past_len + j] = True
    q_ids = rng.integers(1, lm.cfg.vocab_size, size=(1, Q))
    pos = (past_len + np.array(depth))[None]
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        lm.forward(q_ids, pos, tm[None, None], past)
        times.append(time.perf_counter() - t0)
    return median(times[1:])


def bench(folders: list[Path], past_len: int = 64, sizes=SIZES, reps: int = 7, threads=None) -> dict:
    out = {"past_len": past_len, "models": {}}
    for f in folders:
        lm = OnnxCausalLM(f, threads=threads)
        ctx = lm.cfg.context_length
        pts = {}
        for Q in sizes:
            if past_len + Q > ctx:
                break
            pts[Q] = pass_time(lm, past_len, Q, reps)
        base = pts[1]
        out["models"][f"{f.parent.name}/{f.name} ({lm.cfg.precision})"] = {
            "ms": {str(q): round(t * 1e3, 3) for q, t in pts.items()},
            "ratio_to_q1": {str(q): round(t / base, 2) for q, t in pts.items()}}
    if len(folders) >= 2:      # the pair: target first, draft second
        curves = list(out["models"].values())
        out["speculation_ceiling"] = ceiling(curves[0]["ms"], curves[1]["ms"])
    return out


def _at(ms: dict, q: int) -> float:
    """A curve's pass time at q nodes, interpolated in log-log between measured sizes."""
    qs = np.array([int(k) for k in ms], float)
    return float(np.exp(np.interp(np.log(q), np.log(qs), np.log(list(ms.values())))))


def ceiling(target_ms: dict, draft_ms: dict, Ks=(1, 4), depths=(2, 4, 6), budget: int | None = None
            ) -> list[dict]:
    """The most exact speculation can gain with these pass costs: every drafted level accepted (depth + 1
    beam steps per target pass, the oracle's rate), one target pass over the K beams and the tree, and a draft pass
    per level (over the K beams, then over the level's W nodes), against plain beam search's K-node pass per step;
    Python overheads left out. Trees K wide for each depth, then the default tree at `budget` (W =
    draft.default_width, depth min(max_depth, budget // W)). "free_draft" drops the draft's cost: the bound for any
    draft on this target with that tree."""
    from specbeam_edge import SpeculativeConfig
    from specbeam_edge.config import DEFAULT_BUDGET
    from specbeam_edge.draft import default_width

    budget = budget or DEFAULT_BUDGET
    spec = SpeculativeConfig(adaptive=False, budget=budget)
    rows = []
    for K in Ks:
        W = default_width(K, spec.max_branch_width, budget)
        default = (W, min(spec.max_depth, budget // W), f"default, budget {budget}")
        shapes = [(K, d, "K wide") for d in depths] + [default]
        for width, depth, tree_kind in shapes:
            tree = _at(target_ms, K + width * depth)
            plain = (depth + 1) * _at(target_ms, K)
            draft = _at(draft_ms, K) + (depth - 1) * _at(draft_ms, width)
            rows.append({"K": K, "tree": tree_kind, "width": width, "depth": depth,
                         "free_draft": round(plain / tree, 2), "with_draft": round(plain / (tree + draft), 2)})
    return rows


def plot(data: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, d in data["models"].items():
        qs = [int(q) for q in d["ms"]]
        ax.plot(qs, list(d["ms"].values()), marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="tree nodes scored in one pass",
           ylabel="pass time (ms)", title=f"target pass cost vs tree size (past {data['past_len']})")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    save_figure(fig, path)
