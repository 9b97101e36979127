"""A model larger than its memory: Qwen2.5-Coder-1.5B (`specbeam fetch qwen2.5-coder-1.5b`) streamed from disk
under a memory budget while Qwen2.5-Coder-0.5B drafts, against plain search under the same budget, llama.cpp on
the same GGUF with its pages evicted after every token (what a machine with less memory than the model does), and
the disk's limit for any engine that reads the weights once per token.

Every arm is its own process (its own peak RSS), loaded once; prompts go to the arms in turn, the order reversed
every other prompt, one request at a time, 2 threads each:
  plain K=1, spec K=1        greedy: plain streamed; with the draft, the engine's defaults (no hand-set tree)
  plain K=4, spec K=4        beam search, K=4, the same
  llama.cpp evicted          greedy through llama-cpp-python's token loop; after every token its mapping of the
                             file is dropped (madvise MADV_DONTNEED on the range /proc/self/maps shows), then the
                             page cache (posix_fadvise DONTNEED): fadvise alone leaves pages a process maps
The disk's limit: the same files read once more with O_DIRECT, timed in the same run (the GGUF for an engine that
reads the GGUF; our streamed layer files for ours): bytes a token needs / bytes per second.
Reported per arm: median tokens/s over prompts (answer tokens / wall time), the median per-prompt ratio to its
plain arm and to llama.cpp evicted, tokens (beam steps) per target pass, per pass seconds streaming (waited for),
computing and drafting, bytes read per token, peak RSS; and whether every speculative output equals plain.

    python -m bench.stream                                  # 16 coding prompts x 128 new tokens, budget 1/4
    python -m bench.stream --prompts 6 --max_new 64 --no_llama
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from . import common
from .common import save_figure

ROOT = Path(__file__).resolve().parents[1]
# a second set of 16 coding prompts, written before the changes it measures (issue 64: a set the bench has not seen)
PROMPT_SETS = {"code": "code_prompts.json", "code2": "code_prompts_2.json"}


def prompt_set(name: str) -> list[str]:
    """The coding prompts of `--prompt_set` NAME (PROMPT_SETS)."""
    return json.loads((Path(__file__).parent / "data" / PROMPT_SETS[name]).read_text())


PROMPTS = prompt_set("code")
ARMS = ("plain K=1", "spec K=1", "plain K=4", "spec K=4", "llama.cpp evicted")


def target_bytes(folder: Path) -> int:
    """The bytes of weights a plain pass of `folder` uses: every layer file and the head graph (the embedding
    table is mapped and read a few rows at a time)."""
    cfg = json.loads((folder / "specbeam_config.json").read_text())
    layers = sum((folder / cfg["files"]["layer_weights"].format(i=i)).stat().st_size for i in range(cfg["num_layers"]))
    return layers + (folder / cfg["files"]["head"]).stat().st_size


def gguf_layer_bytes(path: Path) -> int | None:
    """The bytes of the GGUF's layer tensors (blk.*): what a plain token of an engine streaming the file's own
    blocks reads (None without the gguf package, which the export extra installs)."""
    try:
        import gguf
    except ImportError:
        return None
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors if t.name.startswith("blk."))


def direct_read_mb_s(paths: list[Path], chunk: int = 8 << 20) -> float:
    """MB/s reading the files once with O_DIRECT (no page cache: what the disk gives an engine that re-reads)."""
    import mmap

    buf = mmap.mmap(-1, chunk)
    total, t0 = 0, time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            while True:
                n = os.readv(fd, [buf])
                total += n
                if n < chunk:
                    break
        finally:
            os.close(fd)
    return total / 2**20 / (time.perf_counter() - t0)


def hwm_mb() -> float:
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024


# -- the arms, each in its own process ----------------------------------------------------------------------------
def _evict(path: Path) -> None:
    """Drop this process's mapped pages of `path` and then the file's page cache (a machine without the memory to
    keep it: every token reads it again)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    name = str(path.resolve())
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith(name):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            libc.madvise(lo, hi - lo, 4)                 # MADV_DONTNEED
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _llama_runner(arm: str, target: Path, gguf: Path, threads: int):
    """(ready line, run(job) -> result) of a llama.cpp arm: its token loop, the file evicted after every token."""
    from .llamacpp import generated, kernels, open_llama

    evict = "evicted" in arm
    # evicted: no repacked kernels, whose load copies their tensors into the process (1.8 GB resident on the EPYC
    # run, bench/README), which a machine that cannot hold the model does not have and no eviction reaches
    llm = open_llama(gguf, repack=not evict, n_ctx=2048, n_threads=threads, n_threads_batch=threads, n_batch=512,
                     seed=0, verbose=False, use_mmap=True)
    eos = {llm.token_eos(), *json.loads((target / "specbeam_config.json").read_text())["eos_token_ids"]}

    def run(job) -> dict:
        out, t0 = [], time.perf_counter()
        llm.reset()
        if evict:
            _evict(gguf)
        for tok in llm.generate(job["ids"], top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(tok)
            if tok in eos or len(out) >= job["max_new"]:
                break
            if evict:
                _evict(gguf)
        dt = time.perf_counter() - t0
        n = generated(out, eos)[1]
        return {"tokens": out, "n": n, "seconds": dt, "passes": n, "steps": n,
                "bytes_per_token": gguf.stat().st_size if evict else 0}
    return {"ready": arm, "kernels": kernels(), "repack": not evict, "peak_rss_mb_loaded": round(hwm_mb())}, run


def _ours_runner(arm: str, target: Path, draft: Path, budget: int, threads: int):
    """(ready line, run(job) -> result) of one of our arms: plain or speculative (the engine's defaults), K=1 or 4."""
    from specbeam_edge import Engine, SpeculativeConfig, share_threads

    share_threads(threads)          # as the tools run (model.share_threads)
    K, speculative = (4 if "K=4" in arm else 1), arm.startswith("spec")
    engine = Engine(target, draft=draft if speculative else None, threads=threads, max_memory=budget)
    spec = SpeculativeConfig() if speculative else None
    # untimed: the first request measures the target's batch invariance and the pass-cost model (both cached)
    engine.generate("warm up", num_beams=K, do_sample=False, max_new_tokens=4, speculative=spec)
    store = engine.target.runner.store

    def run(job) -> dict:
        st = store.stats
        before = (st.bytes_moved, st.wait_seconds, st.compute_seconds)
        t0 = time.perf_counter()
        [r] = engine.generate(job["ids"], num_beams=K, do_sample=False, max_new_tokens=job["max_new"],
                              speculative=spec)
        dt, s = time.perf_counter() - t0, r.stats
        return {"tokens": list(r.hypotheses[0].tokens), "score": r.hypotheses[0].score, "n": s.generated_tokens,
                "seconds": dt, "passes": s.target_passes, "plain_passes": s.plain_passes, "steps": s.beam_steps,
                "draft_seconds": s.draft_seconds, "stream_wait_seconds": st.wait_seconds - before[1],
                "compute_seconds": st.compute_seconds - before[2],
                "bytes_per_token": (st.bytes_moved - before[0]) / max(1, s.generated_tokens)}
    ready = {"ready": arm, "resident": engine.target.runner.placement.count("resident"),
             "streamed": engine.target.streamed_layers()}
    return ready, run


def worker(arm: str, target: Path, draft: Path, gguf: Path, budget: int, threads: int) -> None:
    """One arm: reads {"ids", "max_new"} lines on stdin, writes one JSON result line each (with the peak RSS)."""
    ready, run = (_llama_runner(arm, target, gguf, threads) if arm.startswith("llama.cpp") else
                  _ours_runner(arm, target, draft, budget, threads))
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        res = run(json.loads(line))
        res["peak_rss_mb"] = hwm_mb()
        print(json.dumps(res), flush=True)


class Arm:
    """An arm's worker process (`cmd`): one JSON line when ready, then one result line per job line sent."""

    def __init__(self, name: str, cmd: list[str]):
        self.name = name
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"arm {self.name!r} ended (exit status {self.proc.wait()})")
        return json.loads(line)

    def run(self, job: dict) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def run_alternated(arms: dict, jobs: list[dict], each=None) -> dict[str, list[dict]]:
    """Every job to every arm (its worker process), the arms' order reversed every other job; the results per arm,
    `each(result)` applied to each as it comes."""
    names = list(arms)
    rows = {n: [] for n in names}
    for i, job in enumerate(jobs):
        for n in (names if i % 2 == 0 else names[::-1]):
            r = arms[n].run(job)
            if each is not None:
                each(r)
            rows[n].append(r)
            print(f"prompt {i} {n}: {r['n']} tokens {r['seconds']:.1f} s, {r['steps'] / max(1, r['passes']):.2f}"
                  f" steps a pass", file=sys.stderr, flush=True)
    return rows


def bench(args) -> dict:
    from specbeam_edge.text.tokenizer import Tokenizer

    tok = Tokenizer(args.target)
    prompts = prompt_set(args.prompt_set)[:args.prompts]
    ids = [tok.encode_prompt(tok.apply_chat_template([{"role": "user", "content": p}])) for p in prompts]
    names = [a for a in ARMS if a in args.arms]
    report = {"machine": common.machine(), "prompts": len(prompts), "max_new": args.max_new,
              "threads": args.threads, "budget_bytes": args.budget, "target_bytes": target_bytes(args.target),
              "target": str(Path(args.target).name), "draft": str(Path(args.draft).name),
              "gguf_layer_bytes": gguf_layer_bytes(args.gguf)}
    cfg = json.loads((Path(args.target) / "specbeam_config.json").read_text())
    layer_files = [Path(args.target) / cfg["files"]["layer_weights"].format(i=i) for i in range(cfg["num_layers"])]
    disk = {"before": {"gguf_mb_s": direct_read_mb_s([args.gguf]), "layers_mb_s": direct_read_mb_s(layer_files)}}
    arms = {}
    try:
        for n in names:
            arms[n] = Arm(n, [sys.executable, "-m", "bench.stream", "--worker", n, "--target", str(args.target),
                              "--draft", str(args.draft), "--gguf", str(args.gguf), "--budget", str(args.budget),
                              "--threads", str(args.threads)])
            print(f"{n}: {arms[n].info}", file=sys.stderr, flush=True)
        rows = run_alternated(arms, [{"ids": x, "max_new": args.max_new} for x in ids])
    finally:
        for a in arms.values():
            a.close()
    disk["after"] = {"gguf_mb_s": direct_read_mb_s([args.gguf]), "layers_mb_s": direct_read_mb_s(layer_files)}
    report["disk"] = disk
    report["arms"] = summarize(rows, arms_info={n: a.info for n, a in arms.items()})
    gguf_mb = args.gguf.stat().st_size / 2**20
    mb_s = statistics.median([disk[w]["gguf_mb_s"] for w in disk])
    report["disk_limit_tok_s"] = {"reading the GGUF once a token": round(mb_s / gguf_mb, 3)}
    if "plain K=1" in rows:
        per_tok = report["arms"]["plain K=1"]["bytes_per_token"] / 2**20
        lay_mb_s = statistics.median([disk[w]["layers_mb_s"] for w in disk])
        report["disk_limit_tok_s"]["reading our streamed layers once a token"] = round(lay_mb_s / per_tok, 3)
        if report["gguf_layer_bytes"]:      # issue 64's bound: <= 1.2x the file's layer bytes a plain token
            report["plain_bytes_over_file_layers"] = round(per_tok * 2**20 / report["gguf_layer_bytes"], 3)
    report["ratios"] = ratios(rows)
    report["identical"] = {f"K={k}": sum(a["tokens"] == b["tokens"] for a, b in zip(rows[f"plain K={k}"],
                                                                                    rows[f"spec K={k}"]))
                           for k in (1, 4) if f"plain K={k}" in rows and f"spec K={k}" in rows}
    report["rows"] = {n: [{k: v for k, v in r.items() if k != "tokens"} for r in rs] for n, rs in rows.items()}
    return report


def summarize(rows: dict, arms_info: dict) -> dict:
    out = {}
    for n, rs in rows.items():
        tok_s = [r["n"] / r["seconds"] for r in rs]
        passes = sum(r["passes"] for r in rs)
        a = {"tok_s": round(statistics.median(tok_s), 3), "steps_per_pass": round(sum(r["steps"] for r in rs) /
                                                                                     max(1, passes), 2),
             "bytes_per_token": round(statistics.median(r["bytes_per_token"] for r in rs)),
             "peak_rss_mb": round(max(r["peak_rss_mb"] for r in rs))}
        if "compute_seconds" in rs[0]:
            for k in ("stream_wait_seconds", "compute_seconds", "draft_seconds"):
                a[k.replace("_seconds", "_s_per_pass")] = round(sum(r[k] for r in rs) / max(1, passes), 3)
            a["plain_passes"] = sum(r["plain_passes"] for r in rs)
            a["passes"] = passes
        a.update({k: v for k, v in arms_info.get(n, {}).items() if k != "ready"})
        out[n] = a
    return out


def median_ratio(rows: dict, a: str, b: str) -> float:
    """Median over prompts of arm a's tokens/s over arm b's on the same prompt."""
    return round(statistics.median((x["n"] / x["seconds"]) / (y["n"] / y["seconds"])
                                   for x, y in zip(rows[a], rows[b])), 3)


def ratios(rows: dict) -> dict:
    """Median over prompts of each arm's tokens/s over its plain arm's and over llama.cpp evicted's."""
    out = {}
    for k in (1, 4):
        if f"spec K={k}" in rows and f"plain K={k}" in rows:
            out[f"spec K={k} / plain K={k}"] = median_ratio(rows, f"spec K={k}", f"plain K={k}")
    if "llama.cpp evicted" in rows:
        for n in ("spec K=1", "plain K=1"):
            if n in rows:
                out[f"{n} / llama.cpp evicted"] = median_ratio(rows, n, "llama.cpp evicted")
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = report["arms"]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    names = list(arms)
    ax[0].bar(names, [arms[a]["tok_s"] for a in names], color="#47a")
    for lbl, v in report["disk_limit_tok_s"].items():
        ax[0].axhline(v, ls="--", color="#a44" if "GGUF" in lbl else "#c84", lw=1, label=f"disk limit: {lbl}")
    ax[0].set_ylabel("tokens / s")
    ax[0].legend(fontsize=7)
    ours = [a for a in names if "compute_s_per_pass" in arms[a]]
    bottom = [0.0] * len(ours)
    for key, color in (("stream_wait_s_per_pass", "#a44"), ("compute_s_per_pass", "#47a"),
                       ("draft_s_per_pass", "#4a7")):
        vals = [arms[a][key] for a in ours]
        ax[1].bar(ours, vals, bottom=bottom, color=color, label=key.replace("_s_per_pass", ""))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax[1].set_ylabel("seconds per target pass")
    ax[1].legend(fontsize=7)
    for a in ax:
        a.tick_params(axis="x", rotation=20)
    m = report["machine"]
    fig.suptitle(f"Qwen2.5-Coder-1.5B streamed under {report['budget_bytes'] / 2**20:.0f} MB, {m['cpu']}, "
                 f"{report['threads']} threads")
    save_figure(fig, path)


def pair_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags every benchmark of the fetched pair takes (bench.stream, bench.pair)."""
    ap.add_argument("--target", type=Path, default=None, help="the target's folder (default: the fetched 1.5B)")
    ap.add_argument("--draft", type=Path, default=None, help="the draft's folder (default: the fetched 0.5B)")
    ap.add_argument("--gguf", type=Path, default=None, help="the target's GGUF (default: the fetched one)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt_set", choices=sorted(PROMPT_SETS), default="code",
                    help="bench/data's coding prompts (code) or the second set (code2, code_prompts_2.json)")
    ap.add_argument("--max_new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pair_arguments(ap)
    ap.add_argument("--budget", type=int, default=None, help="memory budget in bytes (default: 1/4 of the "
                                                             "target's weights: layers and head)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    ap.add_argument("--no_llama", action="store_true", help="without the llama.cpp arm")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--tag", default="stream")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from specbeam_edge import fetch

    args.target = args.target or fetch.model_path("qwen2.5-coder-1.5b")
    args.draft = args.draft or fetch.model_path("qwen2.5-coder-0.5b")
    args.gguf = args.gguf or fetch.gguf_path("qwen2.5-coder-1.5b")
    args.budget = args.budget or target_bytes(Path(args.target)) // 4
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if args.no_llama:
        args.arms = [a for a in args.arms if not a.startswith("llama")]
    if args.worker:
        worker(args.worker, Path(args.target), Path(args.draft), Path(args.gguf), args.budget, args.threads)
        return 0
    report = bench(args)
    path = common.write(args.out, args.tag, report)
    plot(report, args.out / f"{args.tag}.png")
    print(common.table([{"arm": a, **v} for a, v in report["arms"].items()],
                       ["arm", "tok_s", "steps_per_pass", "stream_wait_s_per_pass", "compute_s_per_pass",
                        "draft_s_per_pass", "bytes_per_token", "peak_rss_mb"]))
    print(json.dumps({k: report.get(k) for k in ("ratios", "identical", "disk_limit_tok_s", "disk",
                                                 "plain_bytes_over_file_layers")}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
