"""The stages of the GPU check (bench/gpu_check.sh runs each under its own time limit with SPECBEAM_PROVIDER=cuda:
every session of a stage is then a CUDA session with CPU fallback disabled).

    python -m bench.gpu.check probe OUT      # onnxruntime build, providers, every node of the realistic target on CUDA
    python -m bench.gpu.check cost OUT       # pass time by tree size, realistic-scale target, resident on CUDA
    python -m bench.gpu.check e2e OUT        # exact speculative vs plain beam search at that scale (quick)
    python -m bench.gpu.check offload OUT    # the same target streamed under a memory budget (quick)
    python -m bench.gpu.check kv OUT         # plain beam search, KV resident on the device vs host arrays

Each stage writes OUT/<stage>_<provider>.json. The realistic-scale target is bench/synthetic.py's random 16x1024 Llama
(241M parameters, vocab 32000), kept in bench/out/models between runs on a machine that stays up.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from specbeam_edge.execution.providers import PROVIDER_ENV, default_providers, installed_onnxruntime

from .. import common, cost, offload, synthetic

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "bench" / "out" / "models"
# LAYERSxHIDDEN; a small one (e.g. 2x256 with SPECBEAM_PROVIDER=cpu) runs every stage on a CPU as a smoke test
_L, _H = os.environ.get("GPU_CHECK_SCALE", "16x1024").split("x")
SCALE = dict(layers=int(_L), hidden=int(_H))
SIZES = (1, 4, 16, 64, 256)


def probe(out: Path) -> dict:
    import onnxruntime as ort

    from specbeam_edge.execution.model import OnnxCausalLM

    t0 = time.perf_counter()
    target, draft = synthetic.build_models(**SCALE, precision="fp32", cache=CACHE)
    built = time.perf_counter() - t0
    lm = OnnxCausalLM(target, providers=default_providers())   # ProviderError, naming the ops, if any node lands on the CPU
    return {"onnxruntime": installed_onnxruntime(), "module": ort.__file__,
            "available_providers": ort.get_available_providers(), "session_providers": lm.runner.sess.get_providers(),
            "device": ort.get_device(), "build_models_s": round(built, 1), "target": str(target)}


def cost_curve(out: Path) -> dict:
    """pass(Q) over a 64-token prompt, fp32 and fp16 compute (export --compute fp16: fp16 weights, activations
    and KV cache); the ratio pass(Q=64)/pass(Q=1) is the number the issue asks for (how wide a tree one pass
    absorbs on this GPU)."""
    from specbeam_edge.execution.model import OnnxCausalLM

    res = {}
    for precision in ("fp32", "fp16"):
        target, _ = synthetic.build_models(**SCALE, precision=precision, cache=CACHE, compute=precision)
        lm = OnnxCausalLM(target, providers=default_providers())
        ms = {str(q): round(1e3 * cost.pass_time(lm, 64, q, reps=7), 3) for q in SIZES}
        res[precision] = {"ms": ms, "ratio_to_q1": {q: round(t / ms["1"], 2) for q, t in ms.items()},
                          "q64_over_q1": round(ms["64"] / ms["1"], 2)}
        print(f"cost {precision}: {res[precision]}", file=sys.stderr)
    return {"model": f"random Llama {_L}x{_H}, vocab 32000, whole layout, resident", "past_len": 64, "curves": res}


def e2e(out: Path) -> dict:
    return synthetic.bench(reps=1, max_new=16, cache=CACHE, **SCALE)


def offload_scale(out: Path) -> dict:
    return offload.bench_scale(providers=default_providers(), quick=True, cache=CACHE, Ks=(1,), rates=(0.9,), max_new=16,
                               **SCALE)


def kv(out: Path, K: int = 4, max_new: int = 16, reps: int = 3) -> dict:
    """Plain beam search at the realistic scale with the KV cache resident on the device (I/O binding, the
    CUDA default) against host arrays (the whole cache crosses the bus twice a pass), alternated."""
    import numpy as np

    from specbeam_edge import Engine

    target, _ = synthetic.build_models(**SCALE, precision="fp32", cache=CACHE)
    engines = {r: Engine(target, providers=default_providers(), kv_resident=r) for r in (False, True)}
    prompt = list(map(int, np.random.default_rng(0).integers(1, 300, size=48)))
    times, outs = {False: [], True: []}, {}
    for eng in engines.values():
        eng.generate(prompt, num_beams=K, max_new_tokens=4)     # warm-up
    for _ in range(reps):
        for r, eng in engines.items():
            t0 = time.perf_counter()
            [res] = eng.generate(prompt, num_beams=K, max_new_tokens=max_new, min_new_tokens=max_new)
            times[r].append(time.perf_counter() - t0)
            outs[r] = [h.tokens for h in res.hypotheses]
    ms = {("resident" if r else "host"): round(1e3 * min(t) / max_new, 3) for r, t in times.items()}
    data = {"model": f"random Llama {_L}x{_H}", "K": K, "max_new_tokens": max_new, "ms_per_step": ms,
            "resident_speedup": round(ms["host"] / ms["resident"], 2), "identical": outs[False] == outs[True]}
    print(f"kv: {data}", file=sys.stderr)
    return data


STAGES = {"probe": probe, "cost": cost_curve, "e2e": e2e, "offload": offload_scale, "kv": kv}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in STAGES:
        print(f"usage: python -m bench.gpu.check {{{','.join(STAGES)}}} OUT", file=sys.stderr)
        return 2
    stage, out = argv[0], Path(argv[1])
    t0 = time.perf_counter()
    data = STAGES[stage](out)
    data["machine"] = common.machine()
    data["stage_s"] = round(time.perf_counter() - t0, 1)
    name = f"{stage}_{os.environ.get(PROVIDER_ENV, 'cpu')}"
    print(f"{stage}: wrote {common.write(out, name, data)} in {data['stage_s']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
