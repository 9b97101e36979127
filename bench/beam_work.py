"""How much of a batched run is per-request beam work (issue 35 part 4: would one array step over all requests of
a pass pay?): timers around the search's replay, the rows' extraction from the pass output, the beam step and
its candidate ranking, for plain beam search on the shipped pair at several batch sizes.

    python -m bench.beam_work [--lines 48] [--beams 4] [--batches 1,16,48]

Prints per batch size the wall time, each part's seconds and share of the wall, and microseconds per request and
beam step; writes JSON. Shares, not speeds: still, run it with nothing else on the machine.
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
from specbeam_edge import beam, search  # noqa: E402
from specbeam_edge.shipped import shipped  # noqa: E402

PARTS = {"replay": (search.ExactSearch, "_replay"), "rows": (search.ExactSearch, "_beam_logprobs"),
         "step": (beam.BeamSearch, "step"), "ranking": (beam.BeamRows, "top")}


@contextlib.contextmanager
def timed(acc: dict):
    """While inside: each part's method adds its seconds to acc[part] (the methods are restored after)."""
    saved = {part: getattr(cls, name) for part, (cls, name) in PARTS.items()}
    for part, (cls, name) in PARTS.items():
        def wrapper(*a, _real=saved[part], _part=part, **kw):
            t = time.perf_counter()
            try:
                return _real(*a, **kw)
            finally:
                acc[_part] += time.perf_counter() - t
        setattr(cls, name, wrapper)
    try:
        yield acc
    finally:
        for part, (cls, name) in PARTS.items():
            setattr(cls, name, saved[part])


def run(lines: int, beams: int, batches: list[int], max_new: int) -> dict:
    src = (ROOT / "models" / "ende" / "test_sample.en").read_text(encoding="utf-8").splitlines()[:lines]
    eng = Engine(shipped("ende", "target"))
    prompts = [eng.tokenizer.format_prompt(s) for s in src]
    eng.generate(prompts[:4], num_beams=beams, max_new_tokens=16)              # warm-up
    report = {"machine": common.machine(), "lines": len(src), "beams": beams, "max_new_tokens": max_new, "rows": []}
    for size in batches:
        with timed(dict.fromkeys(PARTS, 0.0)) as acc:
            t0 = time.perf_counter()
            res = eng.generate(prompts, num_beams=beams, max_new_tokens=max_new, max_batch_size=size)
            wall = time.perf_counter() - t0
        steps = sum(r.stats.beam_steps for r in res)
        report["rows"].append({"batch": size, "wall_s": round(wall, 3),
                               **{f"{p}_s": round(v, 3) for p, v in acc.items()},
                               **{f"{p}_share": round(v / wall, 3) for p, v in acc.items()},
                               "replay_us_per_request_step": round(acc["replay"] / steps * 1e6, 1)})
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=48)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--batches", default="1,16,48")
    ap.add_argument("--max_new_tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "results")
    args = ap.parse_args(argv)
    report = run(args.lines, args.beams, [int(b) for b in args.batches.split(",")], args.max_new_tokens)
    path = common.write(args.out, "beam_work", report)
    print(common.table(report["rows"], ["batch", "wall_s", *(f"{p}_share" for p in PARTS),
                                        "replay_us_per_request_step"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
