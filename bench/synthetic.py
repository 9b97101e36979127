"""Realistic scale: a large random-weight int8 target where a pass costs what it costs on a laptop, and a
synthetic drafter that proposes the target's true next beams with a controlled per-level acceptance rate.

This measures the runtime's own overheads and the tree-size/cost curve at scale, apart from draft quality.
The draft cost is honest: a real small draft model scores every proposed node, one call per tree level.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from specbeam_edge import Engine, SpeculativeConfig
from specbeam_edge.decoding.protocol import ScoreCall

from .common import median, save_figure


def build_models(hidden=768, layers=12, vocab=32000, seed=0, precision="fp16", layout="whole",
                 cache: Path | None = None, compute: str = "fp32") -> tuple[Path, Path]:
    """A random Llama target and a 1-layer random draft over the same vocabulary. The target defaults to fp16
    weights (fp32 compute), not whole-graph int8: onnxruntime's dynamic int8 quantizes activations per pass,
    so tree and single passes round differently and the exact-equality check of this benchmark would not
    hold (see the export notes); the split layout's int8 (DequantizeLinear) is batch-invariant.
    cache: a folder to keep the exported models in between runs (rebuilt only when missing)."""
    tag = f"L{layers}_H{hidden}_V{vocab}_s{seed}_{precision}_{layout}" + ("_c16" if compute == "fp16" else "")
    base = Path(cache) / tag if cache else Path(tempfile.mkdtemp(prefix="specbeam-synth-"))
    if (base / "target" / "specbeam_config.json").exists() and (base / "draft" / "specbeam_config.json").exists():
        return base / "target", base / "draft"
    import torch
    import transformers as tf
    from export import export

    from export.tiny import make_tokenizer

    out = []
    for name, (L, H, heads, kv) in {"target": (layers, hidden, hidden // 64, hidden // 256),
                                    "draft": (1, 128, 2, 1)}.items():
        torch.manual_seed(seed)
        cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=H, num_hidden_layers=L, num_attention_heads=heads,
                             num_key_value_heads=kv, intermediate_size=int(H * 8 / 3) // 16 * 16,
                             max_position_embeddings=1024, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                             tie_word_embeddings=False)
        m = tf.LlamaForCausalLM(cfg)
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.02 if p.dim() < 2 else 1.0 / p.shape[-1] ** 0.5)
        m.save_pretrained(base / f"hf_{name}")
        make_tokenizer(base / f"hf_{name}", vocab=300)
        del m
        # the tiny test tokenizer has fewer ids than the model; both models share it, so they stay compatible
        target = name == "target"
        out.append(export(base / f"hf_{name}", base / name, precision=precision if target else "fp32",
                          compute=compute if target else "fp32",
                          layout=layout if target else "whole", quiet=True, overwrite=True))
        shutil.rmtree(base / f"hf_{name}")
    return out[0], out[1]


class SyntheticDrafter:
    """Puts the oracle's next kept beams into the tree, level by level, each level with probability
    `acceptance` (a missed level ends the covered part); fills the rest of the budget with decoy children.
    Every node is scored by the real draft model, one call per level (the honest draft cost)."""

    def __init__(self, oracle: list[list[tuple[int, ...]]], prompt_len: int, acceptance: float, budget: int,
                 depth: int, seed: int = 0):
        self.oracle, self.prompt_len, self.a, self.budget, self.depth = oracle, prompt_len, acceptance, budget, depth
        self.rng = np.random.default_rng(seed)
        self.levels_covered = 0      # summed over calls: the drafter's side of beam steps per pass

    def __call__(self, dcache, roots, root_scores):
        """A generator drafter (custom_drafter runs it): one draft pass a level, through the scheduler."""
        tree = dcache.tree
        step = tree.depths[roots[0]] + 1 - self.prompt_len          # the oracle's running beams after `step` steps
        base = roots[0]
        while tree.depths[base] >= self.prompt_len:                 # the prompt's last node
            base = tree.parents[base]
        out, seen, covered = [], set(roots), True
        frontier = list(dict.fromkeys(roots))
        per_level = max(1, self.budget // self.depth)
        for lvl in range(1, self.depth + 1):
            if len(out) >= self.budget:
                break
            level = []
            covered = covered and step + lvl < len(self.oracle) and self.rng.random() < self.a
            if covered:
                self.levels_covered += 1
                for beam in self.oracle[step + lvl]:
                    n = base
                    for t in beam:
                        n = tree.add(n, t)
                    level.append(n)
            while len(level) < per_level and frontier:     # decoys below the previous level
                p = frontier[int(self.rng.integers(len(frontier)))]
                level.append(tree.add(p, int(self.rng.integers(1, 300))))
            new = [n for n in dict.fromkeys(level) if n not in seen]
            new = dcache.missing_ancestors(new)
            if new:
                yield ScoreCall(dcache, new)               # the honest draft cost of this level
            seen.update(new)
            out.extend(n for n in new if tree.depths[n] >= self.prompt_len)
            frontier = new or frontier
        return [n for n in dict.fromkeys(out) if n not in roots]


def plain_run(engine: Engine, prompt: list[int], K: int, max_new: int):
    """Plain beam search, recording the running beams after every step (the synthetic drafter's oracle).
    Returns (oracle, seconds, best hypothesis tokens)."""
    from specbeam_edge.config import GenerationConfig

    gen = GenerationConfig(num_beams=K, max_new_tokens=max_new)
    steps = [[()]]
    t0 = time.perf_counter()
    bs = None
    for bs, _ in engine.generate_passes(prompt, gen, None):
        steps.append([tuple(bs.tree.path(n)[bs.prompt_len:]) for n in bs.running])
    seconds = time.perf_counter() - t0
    return steps, seconds, bs.hypotheses(1)[0][0]


def compare(engine: Engine, prompts, K: int, specs, rates, *, reps: int, seeds: int, max_new: int,
            reset=None, snapshot=None) -> tuple[list[float], dict]:
    """Plain vs speculative with the synthetic drafter, A B A B: per repetition one plain run (which also
    records the oracle), then every spec and rate with `seeds` drafter seeds (a run has only a handful of
    passes). reset()/snapshot() bracket each run for extra counters (the offload statistics).
    Returns (plain seconds per repetition, {(spec, rate): [(ratio, results, plain runs, snapshot)]})."""
    plain_s, runs = [], {}
    for r in range(reps):
        if reset:
            reset()
        plain = [plain_run(engine, p, K, max_new) for p in prompts]
        plain_s.append(sum(x[1] for x in plain))
        plain_snap = snapshot() if snapshot else None
        for spec in specs:
            for a in rates:
                for sd in range(seeds):
                    if reset:
                        reset()
                    t0 = time.perf_counter()
                    fast = [engine.generate(p, num_beams=K, max_new_tokens=max_new, speculative=spec,
                                            drafter=SyntheticDrafter(x[0], len(p), a, spec.budget, spec.max_depth,
                                                                     seed=r * seeds + sd))[0]
                            for p, x in zip(prompts, plain)]
                    runs.setdefault((spec, a), []).append((plain_s[-1] / (time.perf_counter() - t0), fast, plain,
                                                           (plain_snap, snapshot() if snapshot else None)))
    return plain_s, runs


def summary(plain_s: list[float], rs: list) -> dict:
    """The figures every synthetic row reports, over all repetitions and seeds of one (spec, rate)."""
    fasts = [f for x in rs for f in x[1]]
    secs = [sum(f.stats.seconds for f in x[1]) for x in rs]
    return {"speedup": round(median([x[0] for x in rs]), 2),
            "bspp": round(sum(f.stats.beam_steps for f in fasts) / sum(f.stats.target_passes for f in fasts), 2),
            "identical": sum(f.hypotheses[0].tokens == p[2] for x in rs for f, p in zip(x[1], x[2])),
            "of": len(fasts), "draft_share": round(sum(f.stats.draft_seconds for f in fasts) / sum(secs), 3),
            "plain_s": round(median(plain_s), 3), "spec_s": round(median(secs), 3)}


def bench(*, K=4, rates=(0.5, 0.7, 0.9), trees=((8, 2), (12, 3), (16, 4), (32, 4)), max_new=48, reps=3, seeds=3,
          n_prompts=2, hidden=1024, layers=16, cache: Path | None = None) -> dict:
    """Exact speculative vs plain beam search on a random 16x1024 Llama (241M parameters, fp32, resident).
    trees: (budget, max_depth); budget = K * depth is the shape of a draft beam search of width K (each level
    the draft's K beams, all the target's with probability `acceptance`); a larger budget adds decoys, the
    waste of a wider or best-first tree. Per repetition: one plain run (which also records the oracle), then
    every tree and rate; the ratio is plain / speculative within the repetition, and its median is reported.
    fp32, not int8: dynamic int8 quantizes activations per pass, so tree passes round differently; on this
    random model (flat, near-tied logits) that flipped beams in 2 of 2 prompts and broke the replay."""
    target, draft = build_models(hidden=hidden, layers=layers, precision="fp32", cache=cache)
    engine = Engine(target, draft=draft)
    curve = engine.cost_curve(sizes=(1, 4, 8, 16, 32, 64, 128), reps=3)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(1, 300, size=12))) for _ in range(n_prompts)]
    for p in prompts:                                      # warm-up
        plain_run(engine, p, K, 8)
    specs = [SpeculativeConfig(adaptive=False, budget=budget, max_depth=depth) for budget, depth in trees]
    plain_s, runs = compare(engine, prompts, K, specs, rates, reps=reps, seeds=seeds, max_new=max_new)
    rows = []
    for (spec, a), rs in runs.items():
        extra = spec.budget - K * spec.max_depth
        rows.append({"acceptance": a, "budget": spec.budget, "max_depth": spec.max_depth,
                     "tree": f"{extra} decoys" if extra else "draft beam, width K", **summary(plain_s, rs)})
        print(f"synthetic: {rows[-1]}", file=sys.stderr)
    lm = engine.target
    return {"K": K, "max_new_tokens": max_new, "prompts": n_prompts, "reps": reps,
            "target_params_note": f"{lm.cfg.num_layers} layers x {lm.cfg.hidden_size} hidden, vocab "
                                  f"{lm.cfg.vocab_size}, fp32 (241M parameters at the default size)",
            "pass_ms_by_tree_size": {str(q): round(1e3 * t, 2) for q, t in curve.items()}, "rows": rows}


def plot(data: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for tree in dict.fromkeys((r["budget"], r["max_depth"], r["tree"]) for r in data["rows"]):
        rs = [r for r in data["rows"] if (r["budget"], r["max_depth"], r["tree"]) == tree]
        label = f"budget {tree[0]}, depth {tree[1]} ({tree[2]})"
        line, = axes[0].plot([r["acceptance"] for r in rs], [r["speedup"] for r in rs], marker="o", label=label)
        axes[0].plot([r["acceptance"] for r in rs], [r["bspp"] for r in rs], marker="s", ls="--", alpha=0.5,
                     color=line.get_color())
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].set(xlabel="per-level acceptance of the synthetic drafter", ylabel="speedup (solid), steps/pass (dashed)",
                title=f"random {data['target_params_note'].split(',')[0]}, K={data['K']}")
    axes[0].grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    c = data["pass_ms_by_tree_size"]
    axes[1].plot([int(q) for q in c], list(c.values()), marker="o")
    axes[1].set(xscale="log", xlabel="tree nodes in one target pass", ylabel="pass time (ms)",
                title="target pass cost at this scale")
    axes[1].grid(alpha=0.3, which="both")
    save_figure(fig, path)
