"""Beam steps over a batched pass (issue 35 part 4): the requests' beam steps taken together, as one array
computation per pass (beam.step_many, the default), against each search stepping alone, side by side; and how
much of the run per-request beam work still is (the rows' extraction from the pass output, the steps, their
candidate ranking), for plain beam search on the shipped pair at several batch sizes.

    python -m bench.beam_work [--lines 48] [--beams 4] [--batches 1,16,48] [--repeats 3]

Arms alternate within every repetition (the machine is shared); medians of the repetitions. Prints per batch size
each arm's wall time, the ratio, each part's share of the wall in the default arm and microseconds per request
and beam step; checks that both arms give the same tokens and scores; writes JSON and a plot.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from specbeam_edge import Engine  # noqa: E402
from specbeam_edge.decoding import beam, search  # noqa: E402
from specbeam_edge.shipped import shipped  # noqa: E402

PARTS = {"rows": (search.ExactSearch, "_beam_logprobs"), "step": (beam, "step_many"),
         "ranking": (beam.BeamRows, "top")}


def _one_by_one(states, rows):
    """The other arm: every search takes its own step (what the scheduler did before step_many)."""
    for bs, r in zip(states, rows):
        bs.step(r)


@contextlib.contextmanager
def patched(owner, name, value):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@contextlib.contextmanager
def timed(acc: dict):
    """While inside: each part's function adds its seconds to acc[part] (the functions are restored after)."""
    with contextlib.ExitStack() as stack:
        for part, (owner, name) in PARTS.items():
            def wrapper(*a, _real=getattr(owner, name), _part=part, **kw):
                t = time.perf_counter()
                try:
                    return _real(*a, **kw)
                finally:
                    acc[_part] += time.perf_counter() - t
            stack.enter_context(patched(owner, name, wrapper))
        yield acc


def _run(eng, prompts, beams, max_new, size, arm):
    with contextlib.ExitStack() as stack:
        if arm == "alone":
            stack.enter_context(patched(beam, "step_many", _one_by_one))
        acc = stack.enter_context(timed(dict.fromkeys(PARTS, 0.0)))
        t0 = time.perf_counter()
        res = eng.generate(prompts, num_beams=beams, max_new_tokens=max_new, max_batch_size=size)
        wall = time.perf_counter() - t0
    out = [[(h.tokens, h.score) for h in r.hypotheses] for r in res]
    return wall, acc, sum(r.stats.beam_steps for r in res), out


def run(lines: int, beams: int, batches: list[int], max_new: int, repeats: int) -> dict:
    src = (ROOT / "models" / "ende" / "test_sample.en").read_text(encoding="utf-8").splitlines()[:lines]
    eng = Engine(shipped("ende", "target"))
    prompts = [eng.tokenizer.format_prompt(s) for s in src]
    eng.generate(prompts[:4], num_beams=beams, max_new_tokens=16)              # warm-up
    report = {"machine": common.machine(), "lines": len(src), "beams": beams, "max_new_tokens": max_new,
              "repeats": repeats, "rows": []}
    for size in batches:
        walls = {"together": [], "alone": []}
        parts, same = [], True
        for rep in range(repeats):
            outs = {}
            for arm in (("together", "alone") if rep % 2 == 0 else ("alone", "together")):
                wall, acc, steps, outs[arm] = _run(eng, prompts, beams, max_new, size, arm)
                walls[arm].append(wall)
                if arm == "together":
                    parts.append((wall, acc, steps))
            same &= outs["together"] == outs["alone"]
        wall, acc, steps = sorted(parts, key=lambda p: p[0])[len(parts) // 2]
        together, alone = common.median(walls["together"]), common.median(walls["alone"])
        report["rows"].append({
            "batch": size, "together_s": round(together, 3), "alone_s": round(alone, 3),
            "alone_over_together": round(alone / together, 3), "identical": same,
            **{f"{p}_share": round(v / wall, 3) for p, v in acc.items()},
            "beam_us_per_request_step": round((acc["rows"] + acc["step"]) / steps * 1e6, 1)})
    return report


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["alone_s"] for r in rows], 0.4, label="each search steps alone")
    ax.bar([i + 0.2 for i in x], [r["together_s"] for r in rows], 0.4, label="steps together (step_many)")
    ax.set_xticks(list(x), [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"plain K={report['beams']}, {report['lines']} lines x {report['max_new_tokens']} tokens")
    ax.legend(fontsize=8)
    common.save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=48)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--batches", default="1,16,48")
    ap.add_argument("--max_new_tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "results")
    args = ap.parse_args(argv)
    report = run(args.lines, args.beams, [int(b) for b in args.batches.split(",")], args.max_new_tokens,
                 args.repeats)
    path = common.write(args.out, "beam_work", report)
    plot(report, args.out / "beam_work.png")
    print(common.table(report["rows"], ["batch", "alone_s", "together_s", "alone_over_together", "identical",
                                        *(f"{p}_share" for p in PARTS), "beam_us_per_request_step"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
