"""python -m bench: measured speed of specbeam-edge, ratios side by side in one run.

    python -m bench                      # all scenarios on the shipped pair
    python -m bench --scenario e2e --quick

Writes bench/out/results/<scenario>.json and .png (an ignored folder) and prints a table; --out bench/results
replaces the committed numbers and renders bench/README.md from them. Numbers vary with machine load; the
ratios are what to read (each ratio is the median over alternated runs in this one process).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import common
from .report import COLS

ROOT = Path(__file__).resolve().parents[1]


DEFAULT_OUT = ROOT / "bench" / "out" / "results"      # ignored by git: a run never dirties the tracked results


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="e2e,batch,cost,peers,sampling,synthetic,offload,confidence,kv,quant",
                    help="comma list of: e2e, batch, cost, peers, sampling, synthetic, offload, confidence, kv, "
                         "quant, ray_scale, llamacpp, smollm2 "
                         "(ray_scale, llamacpp and smollm2 are not in the default: they need the ray extra, and the "
                         "llamacpp extra plus `specbeam fetch smollm2`)")
    ap.add_argument("--pair", default=str(ROOT / "models" / "ende"), help="pair folder (target/, draft/, hf/)")
    ap.add_argument("--out", default=str(DEFAULT_OUT),
                    help="output folder for JSON and PNG (bench/results holds the committed numbers)")
    ap.add_argument("--quick", action="store_true", help="fewer prompts and settings (a smoke run)")
    ap.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    ap.add_argument("--provider", choices=("cpu", "cuda"), default="cpu", help="execution provider (offload)")
    ap.add_argument("--parts", default=None,
                    help="quant: which parts, comma-separated (default all: exactness,quality,speed,speed_360m,"
                         "opus_mt,beam_step)")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    pair, out = Path(args.pair), Path(args.out)
    info = common.machine()
    print(f"machine: {info}", file=sys.stderr)
    for sc in args.scenario.split(","):
        if sc == "e2e":
            from . import e2e
            from specbeam_edge import SpeculativeConfig

            if args.quick:
                data = e2e.bench(pair, Ks=(1, 4), n_prompts=6, reps=2, max_new=64, threads=args.threads,
                                 specs=[SpeculativeConfig(adaptive=False, budget=32, max_depth=6),
                                        SpeculativeConfig(adaptive=False, drafter="best_first", budget=32,
                                                          max_depth=8)])
            else:
                data = e2e.bench(pair, threads=args.threads)
            data["machine"] = info
            common.write(out, "e2e", data)
            e2e.plot(data, out / "e2e.png")
            print(common.table(data["rows"], COLS["e2e"]))
        elif sc == "batch":
            from . import batch

            if args.quick:
                data = batch.bench(pair, n_prompts=24, max_new=48, reps=1, sizes=(1, 8), settings=((4, 1),))
                data["speculation"] = batch.bench_speculation(pair, n_prompts=8, max_new=32, reps=1, sizes=(1, 4))
            else:
                data = batch.bench(pair, threads=args.threads or 2)
                data["speculation"] = batch.bench_speculation(pair, threads=args.threads or 2)
            data["machine"] = info
            common.write(out, "batch", data)
            batch.plot(data, out / "batch.png")
            print(common.table(data["rows"], COLS["batch"]))
            print(common.table(data["speculation"]["rows"], COLS["batch_speculation"]))
        elif sc == "cost":
            from . import cost

            folders = [pair / "target", pair / "draft"] + sorted(p for p in (pair / "variants").glob("*") if p.is_dir())
            data = cost.bench(folders, sizes=cost.SIZES[:6] if args.quick else cost.SIZES, threads=args.threads)
            data["machine"] = info
            common.write(out, "cost", data)
            cost.plot(data, out / "cost.png")
            for name, d in data["models"].items():
                print(name, d["ms"])
        elif sc == "peers":
            from . import peers

            data = peers.bench(pair, n_prompts=4 if args.quick else 16, threads=args.threads)
            data["machine"] = info
            common.write(out, "peers", data)
            peers.plot(data, out / "peers.png")
            for k, v in data["tokens_per_second"].items():
                print(f"{k:28s} {v:8.1f} tok/s   speculative is {data['specbeam_speculative_over'][k]:.2f}x")
        elif sc == "sampling":
            from . import sampling

            data = sampling.bench(pair, n_prompts=4 if args.quick else 12, reps=1 if args.quick else 2,
                                  streamed=not args.quick)
            data["machine"] = info
            common.write(out, "sampling", data)
            print(common.table(data["rows"], COLS["sampling"]))
        elif sc == "synthetic":
            from . import synthetic

            data = synthetic.bench(reps=1 if args.quick else 3, max_new=16 if args.quick else 48,
                                   cache=ROOT / "bench" / "out" / "models")
            data["machine"] = info
            common.write(out, "synthetic", data)
            synthetic.plot(data, out / "synthetic.png")
            print(common.table(data["rows"], COLS["synthetic"]))
        elif sc == "offload":
            from . import offload
            from specbeam_edge.commands.flags import PROVIDERS

            data = offload.bench(pair, providers=PROVIDERS[args.provider], quick=args.quick,
                                 n_prompts=4 if args.quick else 8)
            data["scale"] = offload.bench_scale(providers=PROVIDERS[args.provider], quick=args.quick,
                                                cache=ROOT / "bench" / "out" / "models",
                                                Ks=(1,) if args.quick else (1, 4),
                                                rates=(0.9,) if args.quick else (0.7, 0.9, 0.95),
                                                max_new=16 if args.quick else 48)
            data["machine"] = info
            common.write(out, "offload", data)
            offload.plot(data, out / "offload.png")
            print(common.table(data["scale"]["rows"], offload.SCALE_COLS))
            print(common.table(data["rows"], COLS["offload"]))
        elif sc == "confidence":
            from . import confidence

            data = confidence.bench(pair, n_prompts=4 if args.quick else 16, max_new=32 if args.quick else 64,
                                    reps=1 if args.quick else 2, Ks=(1,) if args.quick else (1, 4),
                                    threads=args.threads or 2)
            data["machine"] = info
            common.write(out, "confidence", data)
            confidence.plot(data, out / "confidence.png")
            print(common.table(data["rows"], COLS["confidence"]))
        elif sc == "quant":
            from . import quant

            parts = ("exactness", "quality", "speed", "beam_step") if args.quick else quant.PARTS
            if args.parts:
                parts = tuple(args.parts.split(","))
                if unknown := set(parts) - set(quant.PARTS):
                    ap.error(f"unknown quant part(s) {sorted(unknown)}: choose from {','.join(quant.PARTS)}")
            data = quant.bench(pair, ROOT / "bench" / "out" / "quant", parts=parts, threads=args.threads or 2,
                               n_exact=8 if args.quick else 48, n_quality=24 if args.quick else 200,
                               n_speed=4 if args.quick else 8, reps=1 if args.quick else 3)
            data["machine"] = info
            common.write(out, "quant", data)
            quant.plot(data, out / "quant.png")
            for part in ("exactness", "quality", "speed", "speed_360m", "beam_step"):
                if data.get(part):
                    print(common.table(data[part], list(data[part][0])))
            if data.get("opus_mt"):
                print(common.table(data["opus_mt"]["rows"], list(data["opus_mt"]["rows"][0])))
        elif sc == "kv":
            from . import kv

            data = kv.bench(pair, n_prompts=8 if args.quick else 64, max_new=32 if args.quick else 128,
                            reps=1 if args.quick else 2, threads=args.threads or 2)
            data["machine"] = info
            common.write(out, "kv", data)
            kv.plot(data, out / "kv.png")
            print(common.table(data["rows"], COLS["kv"]))
        elif sc == "ray_scale":
            from . import ray_scale

            data = ray_scale.bench(pair, n_lines=32 if args.quick else 64, max_new=32 if args.quick else 48,
                                   reps=1 if args.quick else 2)
            data["machine"] = info
            common.write(out, "ray_scale", data)
            print(common.table(data["rows"], COLS["ray_scale"]))
            print(f"overhead at equal cores (1 - ray/local): {data['overhead_at_equal_cores']}\n{data['estimate']}")
        elif sc == "llamacpp":
            from . import llamacpp

            gguf, folders = llamacpp.default_inputs()
            data = llamacpp.bench(gguf, folders, n_prompts=4 if args.quick else 12, max_new=32 if args.quick else 128,
                                  threads=args.threads or 2)
            data["machine"] = info
            common.write(out, "llamacpp", data)
            llamacpp.plot(data, out / "llamacpp.png")
            for k, v in data["median_tokens_per_second"].items():
                agree = data["greedy_agreement_with_llama_cpp"].get(k)
                print(f"{k:20s} {v:8.1f} tok/s" + (f"   x{data['median_ratio_over_llama.cpp'][k]:.2f} of "
                      f"llama.cpp, {agree['identical']}/{agree['of']} greedy sequences identical" if agree else ""))
        elif sc == "smollm2":
            from . import smollm2

            target, draft, gguf = smollm2.default_inputs()
            data = smollm2.bench(target, draft, gguf, n_prompts=4 if args.quick else 24,
                                 max_new=32 if args.quick else 128, threads=args.threads or 2)
            data["pass_costs"] = smollm2.pass_costs(target, draft, args.threads or 2)
            data["machine"] = info
            common.write(out, "smollm2", data)
            smollm2.plot(data, out / "smollm2.png")
            for k, v in data["median_tokens_per_second"].items():
                same = data["identical_to_plain"].get(k)
                print(f"{k:24s} {v:8.1f} tok/s  x{data['median_ratio_to_plain'].get(k, 1):.2f} of plain"
                      + (f"  {data['beam_steps_per_target_pass'][k]:.2f} steps/pass"
                         if k in data["beam_steps_per_target_pass"] else "")
                      + (f"  identical {same['identical']}/{same['of']}" if same else ""))
        else:
            ap.error(f"unknown scenario {sc!r}")
    if out.resolve() == (ROOT / "bench" / "results").resolve():
        from .report import render

        render(out, ROOT / "bench" / "README.md", "python -m bench")
    return 0


if __name__ == "__main__":
    sys.exit(main())
