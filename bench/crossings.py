"""How many times the main job's control crosses from one module of the project into another, per target pass:
what a reader follows from the command line to onnxruntime's `InferenceSession.run` and back.

    python -m bench.crossings [--lines 4] [--beams 4]

Runs the translate tool's code path (specbeam_apps.translate: Settings, prepare, translate -> Engine ->
scheduler -> search -> cache/batch -> model -> InferenceSession.run) on the shipped en->de pair under
sys.setprofile, and counts Python calls whose caller and callee live in different modules of the project
(specbeam_edge, apps, export), plus the calls into onnxruntime's InferenceSession.run. Prints crossings per target
pass, for the whole job and for `Engine.generate` on one prompt, and the distinct module hops seen (docs/HISTORY.md
"Module crossings of the main job" lists them). Counts, not times: the machine's load does not change them.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

from tqdm import tqdm

from apps.translate import job
from apps.translate.__main__ import parse_args

ROOT = Path(__file__).resolve().parents[1]
OURS = ("specbeam_edge", "apps", "specbeam_apps", "export", "specbeam_export")


def _module(frame) -> str | None:
    name = frame.f_globals.get("__name__", "")
    if name.split(".")[0] in OURS:
        return name.replace("specbeam_apps", "apps").replace("specbeam_export", "export")
    if name.startswith("onnxruntime"):
        return "onnxruntime"
    return None


class Crossings:
    """sys.setprofile hook: a Python call whose caller's module differs from the callee's (both ours, or ours into
    onnxruntime) is one crossing; a C call to InferenceSession.run is one too."""

    def __init__(self):
        self.count = 0
        self.hops: collections.Counter = collections.Counter()
        self.runs = 0

    def __call__(self, frame, event, arg):
        if event == "call":
            callee, caller = _module(frame), frame.f_back and _module(frame.f_back)
            if callee and caller and callee != caller and not frame.f_code.co_name.startswith("<"):
                self.count += 1
                self.hops[(caller, callee)] += 1
        elif event == "c_call" and getattr(arg, "__name__", "") == "run" and "InferenceSession" in repr(
                getattr(arg, "__self__", "")):
            caller = _module(frame)
            if caller:
                self.count += 1
                self.runs += 1
                self.hops[(caller, "onnxruntime.InferenceSession.run")] += 1


def measure(fn) -> tuple[Crossings, object]:
    hook = Crossings()
    sys.setprofile(hook)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return hook, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.crossings", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=4, help="held-out lines translated by the job")
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "results"))
    a = ap.parse_args(argv)
    lines = (ROOT / "models" / "ende" / "test_sample.en").read_bytes().splitlines()[:a.lines]
    args = parse_args(["--beam_size", str(a.beams), "--threads", "2", "-q"])
    s = job.resolve(args)
    engine = job.open_engine(args, s)
    engine.generate("warm up", num_beams=a.beams, max_new_tokens=4, speculative=None)

    def translate():
        items, _, _ = job.prepare(s, engine, lines)
        return job.translate(s, engine, items, lambda i, out: None, tqdm(disable=True))

    hook, stats = measure(translate)
    one, res = measure(lambda: engine.generate(lines[0].decode(), num_beams=a.beams, speculative=s.speculative))
    passes, one_passes = stats.target_passes, res[0].stats.target_passes
    data = {"lines": a.lines, "beams": a.beams, "target_passes": passes,
            "crossings": hook.count, "crossings_per_pass": round(hook.count / max(passes, 1), 1),
            "generate_one": {"target_passes": one_passes, "crossings": one.count,
                             "crossings_per_pass": round(one.count / max(one_passes, 1), 1)},
            "hops": sorted(([f"{a_} -> {b_}", n] for (a_, b_), n in hook.hops.items()), key=lambda h: -h[1])}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "crossings.json").write_text(json.dumps(data, indent=1))
    print(f"translate job, {a.lines} lines, K={a.beams}: {hook.count} crossings over {passes} target passes "
          f"({data['crossings_per_pass']} per pass)")
    print(f"Engine.generate, one prompt: {one.count} crossings over {one_passes} target passes "
          f"({data['generate_one']['crossings_per_pass']} per pass)")
    for hop, n in data["hops"]:
        print(f"  {n:7d}  {hop}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
