"""The real pair in memory: Qwen2.5-Coder-1.5B with Qwen2.5-Coder-0.5B drafting, every layer resident, against
llama.cpp on the same GGUF files, plain and with its own speculative decoding.

Every arm is its own process, loaded once; prompts (bench/data/code_prompts.json, the model's chat template) go
to the arms in turn, the order reversed every other prompt, one request at a time, 2 threads each:
  plain K=1, spec K=1        ours, greedy: plain; with the 0.5B drafting, the engine's defaults (adaptive)
  plain K=4, spec K=4        ours, beam search K=4, the same
  llama.cpp                  llama-cpp-python's token loop on the 1.5B GGUF (greedy), resident
  llama.cpp speculative      llama.cpp's own `llama-speculative-simple` with the 0.5B GGUF as its draft (greedy,
                             its default draft length); one process per prompt, timed by its own report
                             (prompt encoding + decoding, model loading excluded as for every arm)
Reported per arm: median tokens/s over prompts, the median per-prompt ratios (ours speculative over ours plain,
over llama.cpp and over llama.cpp speculative), tokens (beam steps) per target pass, peak RSS; and how many
outputs equal their plain search: ours speculative vs ours plain (token ids), llama.cpp speculative vs llama.cpp
(texts, up to the shorter: llama.cpp's tool may run past the token limit by its accepted draft).

    python -m bench.pair --build_llama          # builds llama-speculative-simple once (CMake, a few minutes)
    python -m bench.pair --prompts 8 --max_new 64
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from . import common
from .common import save_figure
from .stream import (ROOT, Arm, _llama_runner, _ours_runner, hwm_mb, median_ratio, pair_arguments, prompt_set,
                     run_alternated)

ARMS = ("plain K=1", "spec K=1", "plain K=4", "spec K=4", "llama.cpp", "llama.cpp speculative")
LLAMA_TOOL = "llama-speculative-simple"


def tool_path() -> Path:
    from specbeam_edge import fetch

    return fetch.data_dir() / "tools" / LLAMA_TOOL


def build_llama(dest: Path, threads: int = 2, target: str = LLAMA_TOOL) -> Path:
    """llama.cpp's speculative-simple example (or another of its programs: `llama-server` for bench.serve), built
    from the llama.cpp sources that the installed llama-cpp-python's source distribution vendors (the same
    llama.cpp version as the plain arm), with the CMake options in $CMAKE_ARGS as pip's build of it took them
    (on a CPU whose AMX kernels crash: GGML_NATIVE=OFF, AVX-512 on, GGML_AMX_*=OFF; bench/README)."""
    import importlib.metadata

    version = importlib.metadata.version("llama-cpp-python")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", tmp], check=True)
        [sdist] = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        shutil.unpack_archive(sdist, tmp)
        src = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        build = src / "build"
        server = "ON" if target == "llama-server" else "OFF"
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                        "-DLLAMA_BUILD_TESTS=OFF", f"-DLLAMA_BUILD_SERVER={server}", "-DBUILD_SHARED_LIBS=OFF",
                        *os.environ.get("CMAKE_ARGS", "").split()], check=True)
        subprocess.run(["cmake", "--build", str(build), "-j", str(threads), "--target", target], check=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / "bin" / target, dest)
    return dest


# -- llama.cpp's speculative tool: its output and its report ------------------------------------------------------
def parse_tool(stdout: str, stderr: str, prompt_text: str) -> dict:
    """The answer's text (what the tool printed after the prompt) and its timings: 'encoded N tokens in S
    seconds' and 'decoded N tokens in S seconds', 'n_drafted', 'n_accept'."""
    nums = {}
    for key, pat in (("encoded", r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
                     ("decoded", r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")):
        m = re.search(pat, stderr)
        if not m:
            raise RuntimeError(f"{LLAMA_TOOL} printed no '{key} ... tokens' line: {stderr[-400:]}")
        nums[key] = (int(m.group(1)), float(m.group(2)))
    for key in ("n_drafted", "n_accept"):
        m = re.search(rf"{key}\s*=\s*(\d+)", stderr)
        nums[key] = int(m.group(1)) if m else 0
    marker = prompt_text.rstrip()[-40:]
    at = stdout.rfind(marker)
    answer = stdout[at + len(marker):] if at >= 0 else stdout
    return {"text": answer.strip(), **nums}


def same_text(a: str, b: str) -> bool:
    """Equal up to the shorter (a run that stopped at its token limit may end a few tokens apart)."""
    a, b = a.strip(), b.strip()
    n = min(len(a), len(b))
    return a[:n] == b[:n] and n > 0


def _spec_tool_runner(target_gguf: Path, draft_gguf: Path, threads: int, tool: Path):
    def run(job) -> dict:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(job["text"])
        try:
            p = subprocess.run([str(tool), "-m", str(target_gguf), "-md", str(draft_gguf), "--spec-type",
                                "draft-simple", "-f", f.name, "-n", str(job["max_new"]), "-t", str(threads), "-td",
                                str(threads), "--temp", "0", "--top-k", "1", "-c", "2048", "--seed", "0"],
                               capture_output=True, text=True)
        finally:
            os.unlink(f.name)
        if p.returncode:
            raise RuntimeError(f"{LLAMA_TOOL} failed ({p.returncode}): {p.stderr[-600:]}")
        r = parse_tool(p.stdout, p.stderr, job["text"])
        n, seconds = r["decoded"][0], r["encoded"][1] + r["decoded"][1]
        passes = max(1, n - r["n_accept"])            # a target pass per emitted token the draft did not supply
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024      # the tool's, the largest so far
        return {"text": r["text"], "n": n, "seconds": seconds, "passes": passes, "steps": n,
                "drafted": r["n_drafted"], "accepted": r["n_accept"], "peak_rss_mb": peak}
    return {"ready": "llama.cpp speculative"}, run


def worker(arm: str, args) -> None:
    """One arm: reads {"ids", "text", "max_new"} lines on stdin, writes one JSON result line each."""
    if arm == "llama.cpp speculative":
        ready, run = _spec_tool_runner(args.gguf, args.draft_gguf, args.threads, args.tool)
    elif arm == "llama.cpp":
        ready, run = _llama_runner(arm, args.target, args.gguf, args.threads)
    else:
        ready, run = _ours_runner(arm, args.target, args.draft, None, args.threads)
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        res = run(json.loads(line))
        res["peak_rss_mb"] = res.get("peak_rss_mb") or hwm_mb()
        print(json.dumps(res), flush=True)


def bench(args) -> dict:
    from specbeam_edge.text.tokenizer import Tokenizer

    tok = Tokenizer(args.target)
    prompts = prompt_set(args.prompt_set)[:args.prompts]
    texts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    jobs = [{"ids": tok.encode_prompt(t), "text": t, "max_new": args.max_new} for t in texts]
    names = [a for a in ARMS if a in args.arms]
    arms = {}
    report = {"machine": common.machine(), "prompts": len(jobs), "prompt_set": args.prompt_set,
              "max_new": args.max_new, "threads": args.threads, "target": Path(args.target).name,
              "draft": Path(args.draft).name}
    try:
        for n in names:
            arms[n] = Arm(n, [sys.executable, "-m", "bench.pair", "--worker", n, "--target", str(args.target),
                              "--draft", str(args.draft), "--gguf", str(args.gguf), "--draft_gguf",
                              str(args.draft_gguf), "--threads", str(args.threads), "--tool", str(args.tool)])
            print(f"{n}: {arms[n].info}", file=sys.stderr, flush=True)
        rows = run_alternated(arms, jobs, lambda r: r.update(text=tok.decode(r["tokens"])) if "tokens" in r else None)
    finally:
        for a in arms.values():
            a.close()
    report["arms"] = summarize(rows)
    report["ratios"] = ratios(rows)
    report["identical"] = identical(rows)
    report["rows"] = {n: [{k: v for k, v in r.items() if k not in ("tokens", "text")} for r in rs]
                      for n, rs in rows.items()}
    return report


def summarize(rows: dict) -> dict:
    out = {}
    for n, rs in rows.items():
        passes = sum(r["passes"] for r in rs)
        a = {"tok_s": round(statistics.median(r["n"] / r["seconds"] for r in rs), 3),
             "steps_per_pass": round(sum(r["steps"] for r in rs) / max(1, passes), 2),
             "peak_rss_mb": round(max(r["peak_rss_mb"] for r in rs))}
        if "draft_seconds" in rs[0]:
            a["draft_s_per_pass"] = round(sum(r["draft_seconds"] for r in rs) / max(1, passes), 3)
            a["plain_passes"] = sum(r["plain_passes"] for r in rs)
        if "accepted" in rs[0]:
            a["draft_accepted"] = round(sum(r["accepted"] for r in rs) / max(1, sum(r["drafted"] for r in rs)), 3)
        out[n] = a
    return out


def ratios(rows: dict) -> dict:
    """Median over prompts of tokens/s of one arm over another's."""
    pairs = [("spec K=1", "plain K=1"), ("spec K=4", "plain K=4"), ("plain K=1", "llama.cpp"),
             ("spec K=1", "llama.cpp"), ("spec K=1", "llama.cpp speculative"),
             ("llama.cpp speculative", "llama.cpp")]
    return {f"{a} / {b}": median_ratio(rows, a, b) for a, b in pairs if a in rows and b in rows}


def identical(rows: dict) -> dict:
    out = {}
    for k in (1, 4):
        if f"plain K={k}" in rows and f"spec K={k}" in rows:
            out[f"ours K={k}: spec == plain"] = sum(a["tokens"] == b["tokens"] for a, b in
                                                    zip(rows[f"plain K={k}"], rows[f"spec K={k}"]))
    if "llama.cpp" in rows and "llama.cpp speculative" in rows:
        out["llama.cpp: speculative == plain"] = sum(same_text(a["text"], b["text"]) for a, b in
                                                     zip(rows["llama.cpp"], rows["llama.cpp speculative"]))
    if "llama.cpp" in rows and "plain K=1" in rows:
        out["ours plain K=1 == llama.cpp (same GGUF, our int8 split export)"] = sum(
            same_text(a["text"], b["text"]) for a, b in zip(rows["llama.cpp"], rows["plain K=1"]))
    return out


def plot(report: dict, path: Path) -> None:
    m = report["machine"]
    bar_plot(report, path, f"Qwen2.5-Coder-1.5B + 0.5B in memory, {m['cpu']}, {report['threads']} threads, "
                           f"{report['prompts']} prompts x {report['max_new']}")


def bar_plot(report: dict, path: Path, title: str) -> None:
    """tokens/s per arm (llama.cpp's arms in another colour), each bar labelled with its tokens a pass."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = report["arms"]
    names = list(arms)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    colors = ["#47a" if not n.startswith("llama") else "#a74" for n in names]
    ax.bar(names, [arms[a]["tok_s"] for a in names], color=colors)
    for i, a in enumerate(names):
        ax.text(i, arms[a]["tok_s"], f"{arms[a]['tok_s']:.1f}\n{arms[a]['steps_per_pass']:.1f}/pass", ha="center",
                va="bottom", fontsize=7)
    ax.set_ylabel("tokens / s (median over prompts)")
    ax.tick_params(axis="x", rotation=20)
    fig.suptitle(title)
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pair_arguments(ap)
    ap.add_argument("--draft_gguf", type=Path, default=None, help="the draft's GGUF (default: the fetched one)")
    ap.add_argument("--tool", type=Path, default=None, help=f"llama.cpp's {LLAMA_TOOL} (default: the one "
                                                            f"--build_llama built)")
    ap.add_argument("--build_llama", action="store_true", help=f"build {LLAMA_TOOL} and exit")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--tag", default="pair")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from specbeam_edge import fetch

    args.tool = args.tool or tool_path()
    if args.build_llama:
        print(f"built {build_llama(args.tool, args.threads)}")
        return 0
    args.target = args.target or fetch.model_path("qwen2.5-coder-1.5b")
    args.draft = args.draft or fetch.model_path("qwen2.5-coder-0.5b")
    args.gguf = args.gguf or fetch.gguf_path("qwen2.5-coder-1.5b")
    args.draft_gguf = args.draft_gguf or fetch.gguf_path("qwen2.5-coder-0.5b")
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        ap.error(f"unknown arm(s) {', '.join(unknown)}; pick from {', '.join(ARMS)}")
    if args.worker:
        worker(args.worker, args)
        return 0
    if "llama.cpp speculative" in args.arms and not Path(args.tool).is_file():
        ap.error(f"{args.tool} does not exist; build it with python -m bench.pair --build_llama, or pass --tool")
    report = bench(args)
    path = common.write(args.out, args.tag, report)
    plot(report, args.out / f"{args.tag}.png")
    print(common.table([{"arm": a, **v} for a, v in report["arms"].items()],
                       ["arm", "tok_s", "steps_per_pass", "draft_s_per_pass", "plain_passes", "peak_rss_mb"]))
    print(json.dumps({k: report[k] for k in ("ratios", "identical")}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
