"""Cost curve: one target pass over a tree of Q nodes on top of a prompt, for each model folder given.

`python -m bench --scenario cost` runs it on the shipped pair. `python -m bench.cost` asks what a drafter must do
on a real model: the fetched SmolLM2-135M target (its head-less copy) and a random-weight int8 model at
SmolLM2-360M's shapes, pass time over 1-16 rows alternated model by model, and the beam steps a pass a tree of
that many rows must give for speculation to reach a goal speed-up (the rows' cost only; a drafter's own cost is
on top):

    python -m bench.cost                                   # the two models above
    python -m bench.cost --folders A B --sizes 1,2,4,8     # any model folders
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from specbeam_edge.execution.model import OnnxCausalLM

from . import common
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
    from specbeam_edge.decoding.draft import default_width

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


GOALS = (1.3, 1.6, 2.0)


def alternated(folders: list[Path], *, past_len: int = 64, sizes=(1, 2, 4, 6, 8, 16), rounds: int = 3,
               reps: int = 7, threads: int = 2, goals=GOALS) -> dict:
    """Pass time over each number of rows, for each folder: `rounds` rounds, the folders' order reversed every
    other round, the median of each round's `reps` passes, then the median over rounds. needed[goal][q]: the
    beam steps a pass over q rows must give for `goal` x plain (one row a pass): goal x (its time / one row's)."""
    models = [OnnxCausalLM(f, threads=threads) for f in folders]
    names = [f"{Path(f).name} ({lm.cfg.precision})" for f, lm in zip(folders, models)]
    times: dict = {n: {q: [] for q in sizes} for n in names}
    for r in range(rounds):
        order = list(zip(names, models))
        for name, lm in (order if r % 2 == 0 else order[::-1]):
            for q in sizes:
                times[name][q].append(pass_time(lm, past_len, q, reps))
    out = {"past_len": past_len, "threads": threads, "rounds": rounds, "goals": list(goals), "models": {}}
    for name in names:
        ms = {q: median(v) * 1e3 for q, v in times[name].items()}
        ratio = {q: t / ms[sizes[0]] for q, t in ms.items()}
        out["models"][name] = {
            "ms": {str(q): round(t, 2) for q, t in ms.items()},
            "ratio_to_q1": {str(q): round(r, 3) for q, r in ratio.items()},
            "needed_steps_a_pass": {str(g): {str(q): round(g * r, 2) for q, r in ratio.items()} for g in goals}}
    return out


def main(argv=None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m bench.cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folders", nargs="*", help="model folders (default: the fetched SmolLM2-135M target's "
                                                 "head-less copy and a random int8 model at SmolLM2-360M shapes)")
    ap.add_argument("--sizes", default="1,2,4,6,8,16", help="rows a pass (comma list; the first is the base)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "results"))
    a = ap.parse_args(argv)
    work = Path(__file__).resolve().parent / "out" / "models"
    folders = [Path(f) for f in a.folders] if a.folders else _default_folders(work)
    info = common.machine()                 # before the run: its load average is the machine's, not ours
    data = alternated(folders, sizes=tuple(int(x) for x in a.sizes.split(",")), rounds=a.rounds,
                      threads=a.threads)
    data["machine"] = info
    out = Path(a.out)
    common.write(out, "rowcost", data)
    plot(data, out / "rowcost.png")
    for name, d in data["models"].items():
        print(name, "ms", d["ms"], "x one row", d["ratio_to_q1"])
        for g, need in d["needed_steps_a_pass"].items():
            print(f"  steps a pass for {g}x:", need)
    print(json.dumps(data["machine"]))
    return 0


def _default_folders(work: Path) -> list[Path]:
    from export import export
    from specbeam_edge import fetch

    from .quant import smollm2_shapes
    from .smollm2 import headless_copy

    target = fetch.model_path("smollm2")
    if not (Path(target) / "specbeam_config.json").is_file():
        raise SystemExit("the SmolLM2-135M target is not fetched: run `specbeam fetch smollm2`, or name --folders")
    plain = headless_copy(target, work / "smollm2-headless") or Path(target)
    big = work / "smollm2_360m_int8"
    if not (big / "specbeam_config.json").is_file():
        export(smollm2_shapes(work / "smollm2_360m_hf"), big, precision="int8", quiet=True, overwrite=True)
    return [plain, big]


if __name__ == "__main__":
    import sys

    sys.exit(main())
