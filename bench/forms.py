"""The fetched pair in memory in two weight forms, side by side: which one a folder should hold (issue: keep the
GGUF's own blocks where they pay).

  int8    the fetched split folder: every matrix per-row int8 (MatMulInteger), its layers resident
  blocks  a whole folder from the same GGUF with `-p int4`: every matrix in the file's own blocks (Q4_K as 4-bit
          codes with a scale and an offset per 32, Q6_K as 8-bit codes per 16, ...: export/blocks.py), computed
          by onnxruntime's MatMulNBits

Each arm is `LABEL=TARGET[+DRAFT]:MODE` (MODE plain or spec, greedy), its own process, loaded once; prompts
(bench/data/code_prompts.json, the chat template) go to the arms in turn, the order reversed every other prompt,
2 threads each. Reported per arm: median tokens/s, tokens a target pass, draft seconds a pass, peak RSS, the
folders' sizes; per pair of arms of one target: spec == plain on every prompt.

    python -m export -i <sources>/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf -o <1.5B blocks> -p int4 \\
        --output_kind both
    python -m export -i <sources>/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf -o <0.5B blocks> -p int4 \\
        --output_kind both --attention fp32 --head_tokens 65536
    python -m bench.forms --prompts 8 --max_new 64 --arm "int8 plain=<1.5B>:plain" \\
        --arm "int8 spec=<1.5B>+<0.5B>:spec" --arm "blocks plain=<1.5B blocks>:plain" \\
        --arm "blocks spec=<1.5B blocks>+<0.5B blocks>:spec"
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from . import common
from .stream import PROMPTS, ROOT, Arm, hwm_mb, median_ratio, run_alternated


def parse_arm(spec: str) -> tuple[str, Path, Path | None, str]:
    """'LABEL=TARGET[+DRAFT]:MODE' -> (label, target, draft or None, mode)."""
    try:
        label, rest = spec.split("=", 1)
        folders, mode = rest.rsplit(":", 1)
    except ValueError:
        raise SystemExit(f"bench.forms: --arm {spec!r}: write LABEL=TARGET[+DRAFT]:plain|spec") from None
    target, _, draft = folders.partition("+")
    if mode not in ("plain", "spec") or (mode == "spec") != bool(draft):
        raise SystemExit(f"bench.forms: --arm {spec!r}: 'spec' takes TARGET+DRAFT, 'plain' a TARGET alone")
    return label, Path(target), Path(draft) if draft else None, mode


def folder_mb(path: Path) -> float:
    return round(sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 1e6, 1)


def worker(target: Path, draft: Path | None, threads: int) -> None:
    """One arm: reads {"ids", "max_new"} lines on stdin, writes one JSON result line each."""
    from specbeam_edge import Engine, share_threads

    share_threads(threads)
    engine = Engine(target, draft=draft, threads=threads)
    mode = {} if draft is not None else {"speculative": None}      # a loaded draft drafts by default
    engine.generate("warm up", num_beams=1, do_sample=False, max_new_tokens=4, **mode)
    print(json.dumps({"ready": str(target)}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        t0 = time.perf_counter()
        [r] = engine.generate(job["ids"], num_beams=1, do_sample=False, max_new_tokens=job["max_new"], **mode)
        dt, s = time.perf_counter() - t0, r.stats
        print(json.dumps({"tokens": list(r.hypotheses[0].tokens), "n": s.generated_tokens, "seconds": dt,
                          "passes": s.target_passes, "steps": s.beam_steps, "draft_seconds": s.draft_seconds,
                          "peak_rss_mb": hwm_mb()}), flush=True)


def bench(args) -> dict:
    from specbeam_edge.text.tokenizer import Tokenizer

    arms_spec = [parse_arm(a) for a in args.arm]
    tok = Tokenizer(arms_spec[0][1])
    ids = [tok.encode_prompt(tok.apply_chat_template([{"role": "user", "content": p}]))
           for p in PROMPTS[:args.prompts]]
    report = {"machine": common.machine(), "prompts": len(ids), "max_new": args.max_new, "threads": args.threads,
              "folders_mb": {}}
    arms = {}
    try:
        for label, target, draft, mode in arms_spec:
            for f in (target, draft):
                if f is not None:
                    report["folders_mb"][f.name] = folder_mb(f)
            cmd = [sys.executable, "-m", "bench.forms", "--worker", str(target), "--threads", str(args.threads)]
            arms[label] = Arm(label, cmd + (["--worker_draft", str(draft)] if draft else []))
        rows = run_alternated(arms, [{"ids": x, "max_new": args.max_new} for x in ids])
    finally:
        for a in arms.values():
            a.close()
    report["arms"] = {}
    for (label, target, draft, mode) in arms_spec:
        rs = rows[label]
        passes = sum(r["passes"] for r in rs)
        report["arms"][label] = {
            "target": target.name, "draft": None if draft is None else draft.name, "mode": mode,
            "tok_s": round(statistics.median(r["n"] / r["seconds"] for r in rs), 3),
            "steps_per_pass": round(sum(r["steps"] for r in rs) / max(1, passes), 2),
            "draft_s_per_pass": round(sum(r["draft_seconds"] for r in rs) / max(1, passes), 4),
            "peak_rss_mb": round(max(r["peak_rss_mb"] for r in rs))}
    labels = [a[0] for a in arms_spec]
    report["ratios"] = {f"{a} / {b}": median_ratio(rows, a, b) for a in labels for b in labels if a != b}
    report["identical"] = {}
    for a, ta, _, ma in arms_spec:
        for b, tb, _, mb in arms_spec:
            if ta == tb and ma == "spec" and mb == "plain":
                report["identical"][f"{a} == {b}"] = sum(x["tokens"] == y["tokens"] for x, y in zip(rows[a], rows[b]))
    report["rows"] = {n: [{k: v for k, v in r.items() if k != "tokens"} for r in rs] for n, rs in rows.items()}
    return report


def plot(report: dict, path: Path) -> None:
    from .pair import bar_plot

    m = report["machine"]
    bar_plot(report, path, f"weight forms in memory, {m['cpu']}, {report['threads']} threads, "
                           f"{report['prompts']} prompts x {report['max_new']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", action="append", default=[], help="LABEL=TARGET[+DRAFT]:plain|spec (repeat)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max_new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--tag", default="forms")
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker_draft", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.worker_draft, args.threads)
        return 0
    if len(args.arm) < 2:
        ap.error("name at least two arms (--arm LABEL=TARGET[+DRAFT]:plain|spec)")
    report = bench(args)
    path = common.write(args.out, args.tag, report)
    plot(report, args.out / f"{args.tag}.png")
    print(json.dumps({k: report[k] for k in ("arms", "ratios", "identical", "folders_mb")}, indent=1))
    print(f"wrote {path} and {args.out / (args.tag + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
