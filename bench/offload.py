"""Offloaded target (SpecExec regime): layers streamed from disk or host memory under a budget below the
model's size. Pass time vs tree size per placement, and exact speculative vs plain beam search end to end
under the same placement."""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from specbeam_edge import Engine, SpeculativeConfig
from specbeam_edge.model import OnnxCausalLM

from .common import median
from .cost import pass_time
from .e2e import load_prompts

SIZES = (1, 4, 16, 64, 256, 1024)


def split_target(pair: Path) -> Path:
    """The pair's target in the split layout (exported from its HF checkpoint into a temporary folder)."""
    from export import export

    out = Path(tempfile.mkdtemp(prefix="specbeam-split-")) / "target_split"
    return export(pair / "hf" / "target", out, precision="fp32", layout="split", quiet=True)


def bench(pair: Path, *, providers=None, n_prompts=8, reps=2, max_new=96, Ks=(1, 4), quick=False) -> dict:
    folder = split_target(pair)
    L = OnnxCausalLM(folder).cfg.num_layers
    placements = {"resident": ["resident"] * L, "host": ["host"] * L, "disk": ["disk"] * L}
    curve = {}
    for name, places in placements.items():
        lm = OnnxCausalLM(folder, placement=places, providers=providers)
        pts = {}
        for Q in (SIZES[:4] if quick else SIZES):
            if 32 + Q > lm.cfg.context_length:
                break
            lm.store.stats.passes = 0
            pts[str(Q)] = round(1e3 * pass_time(lm, 32, Q, reps=3 if quick else 5), 3)
        curve[name] = {"ms": pts, "bytes_moved_per_pass": lm.store.stats.per_pass()["bytes_moved_per_pass"]}
        print(f"pass ms ({name}): {pts}", file=sys.stderr)
    engine = Engine(folder, draft=pair / "draft", placement=placements["disk"], providers=providers)
    prompts = [engine.tokenizer.format_prompt(p) for p in load_prompts(pair, n_prompts)]
    rows = []
    specs = [SpeculativeConfig(drafter="lookup", budget=32, max_depth=8, max_branch_width=4),
             SpeculativeConfig(drafter="best_first", budget=64, max_depth=12, max_branch_width=4),
             SpeculativeConfig(drafter="beam", budget=96, max_depth=12)]
    for K in Ks:
        for spec in specs[:1] if quick else specs:
            ratios, res = [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                a = engine.generate(prompts, num_beams=K, max_new_tokens=max_new)
                ta = time.perf_counter() - t0
                t0 = time.perf_counter()
                b = engine.generate(prompts, num_beams=K, max_new_tokens=max_new, speculative=spec)
                tb = time.perf_counter() - t0
                ratios.append(ta / tb)
                res.append((a, b))
            a, b = res[0]
            steps = sum(r.stats.beam_steps for r in b)
            passes = sum(r.stats.target_passes for r in b)
            off = b[-1].stats.offload or {}
            row = {"K": K, "drafter": spec.drafter, "budget": spec.budget, "max_depth": spec.max_depth,
                   "speedup": round(median(ratios), 2), "bspp": round(steps / passes, 2),
                   "identical": sum(x.text == y.text for x, y in zip(a, b)), "of": len(prompts),
                   "bytes_moved_per_pass": off.get("bytes_moved_per_pass"),
                   "load_ms_per_pass": off.get("load_ms_per_pass"), "wait_ms_per_pass": off.get("wait_ms_per_pass"),
                   "compute_ms_per_pass": off.get("compute_ms_per_pass")}
            rows.append(row)
            print(f"offloaded K={K} {spec.drafter} budget={spec.budget}: {row}", file=sys.stderr)
    return {"placements": curve, "rows": rows, "layers": L, "providers": providers or ["CPUExecutionProvider"]}


def plot(data: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, d in data["placements"].items():
        ax.plot([int(q) for q in d["ms"]], list(d["ms"].values()), marker="o", label=f"layers {name}")
    ax.set(xscale="log", yscale="log", xlabel="tree nodes in one target pass", ylabel="pass time (ms)",
           title="target pass cost by layer placement")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
