"""Long prompts: peak memory and time of one request whose prompt is 512, 2,600 or 5,600 tokens long, 8 new tokens,
greedy, on the fetched SmolLM2-135M (`specbeam fetch smollm2`), the prompt a line of common English words cut to
the exact token count.

Each prompt length runs in a child process of its own, so its peak is its own (VmHWM from /proc/self/status:
Linux). Reported per length: the RSS once the model is loaded, the peak during the request, the RSS after the
answer, and the RSS after a second, short request (what a long prompt leaves behind), the request's seconds and
the KV cache's own peak bytes (the part that must grow with the prompt).

    python -m bench.long_prompt                                  # 512, 2600, 5600 tokens
    python -m bench.long_prompt --lengths 2600 --chunk 0         # the prompt in one pass (no chunks)
    python -m bench.long_prompt --model DIR --search default     # another folder; the engine's default search

Writes long_prompt.json and .png into --out (default the ignored bench/out/results).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from . import common

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more write "
         "go see number no way could people my than first water been call who oil its now find long down day did "
         "get come made may part").split()


def prompt_ids(tokenizer, n: int, seed: int = 0) -> list[int]:
    """Exactly n token ids of a line of common English words (seeded)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(" ".join(rng.choice(WORDS, 512)) + " ")
    return ids[:n]


def _status(key: str) -> int:
    """A /proc/self/status figure in MB."""
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return round(int(line.split()[1]) / 1024)
    raise KeyError(key)


def child(model: str, draft: str | None, length: int, chunk: int | None, search: str, threads: int,
          max_new: int, max_memory: str | None = None) -> dict:
    """One request of `length` prompt tokens in this process, then a short one: the figures of one row."""
    from specbeam_edge import Engine
    from specbeam_edge.flags import parse_size

    engine = Engine(model, draft, threads=threads, max_memory=parse_size(max_memory))
    if chunk is not None:      # 0: the whole prompt in one pass
        for m in (engine.target, engine.draft):
            if m is not None:
                m.prefill_chunk = chunk or m.cfg.context_length
    loaded = _status("VmRSS")
    ids = prompt_ids(engine.tokenizer, length)
    spec = "default" if search == "default" else None
    t0 = time.perf_counter()
    [r] = engine.generate(ids, speculative=spec, max_new_tokens=max_new, num_beams=1, do_sample=False)
    seconds = time.perf_counter() - t0
    peak, after = _status("VmHWM"), _status("VmRSS")
    engine.generate(prompt_ids(engine.tokenizer, 16, seed=1), speculative=spec, max_new_tokens=max_new,
                    num_beams=1, do_sample=False)
    return {"prompt_tokens": length, "seconds": round(seconds, 2), "rss_loaded_mb": loaded, "peak_rss_mb": peak,
            "rss_after_mb": after, "rss_after_short_mb": _status("VmRSS"),
            "kv_peak_mb": round(r.stats.kv_cache_peak_mb),
            "tokens": list(r.hypotheses[0].tokens), "score": r.hypotheses[0].score}


def run(args, length: int) -> dict:
    cmd = [sys.executable, "-m", "bench.long_prompt", "--child", str(length), "--model", args.model,
           "--search", args.search, "--threads", str(args.threads), "--max_new", str(args.max_new)]
    if args.draft:
        cmd += ["--draft", args.draft]
    if args.chunk is not None:
        cmd += ["--chunk", str(args.chunk)]
    if args.max_memory:
        cmd += ["--max_memory", args.max_memory]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"prompt_tokens": length, "error": tail[:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["rows"] if "error" not in r]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    x = [r["prompt_tokens"] for r in rows]
    for key, label in (("peak_rss_mb", "peak RSS"), ("rss_after_short_mb", "RSS after a short request next"),
                       ("rss_loaded_mb", "RSS once loaded")):
        ax.plot(x, [r[key] for r in rows], marker="o", label=label)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("MB")
    ax.set_ylim(0, max([r["peak_rss_mb"] for r in rows] + [1]) * 1.15)
    chunk = data["chunk"] if data["chunk"] is not None else "default"
    ax.set_title(f"{Path(data['model']).name}: one request, {data['max_new']} new tokens, prefill chunk {chunk}")
    ax.legend(loc="upper left")
    common.save_figure(fig, path)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.long_prompt", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the fetched smollm2)")
    ap.add_argument("--draft", default=None, help="draft folder (default: none)")
    ap.add_argument("--lengths", default="512,2600,5600", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--chunk", type=int, default=None,
                    help="prefill chunk in rows (default: the model's own; 0: the whole prompt in one pass)")
    ap.add_argument("--search", choices=("plain", "default"), default="plain",
                    help="plain greedy, or the engine's default (its lookahead head or draft, adaptive)")
    ap.add_argument("--max_memory", default=None,
                    help="stream the layers under this weight budget (a split export), e.g. 50MB")
    ap.add_argument("--threads", type=int, default=2, help="onnxruntime threads")
    ap.add_argument("--max_new", type=int, default=8, help="new tokens per request")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "results")
    ap.add_argument("--tag", default="long_prompt", help="name of the JSON and PNG files")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.model is None:
        from specbeam_edge import fetch

        args.model = str(fetch.model_path("smollm2"))
    if args.child is not None:
        print(json.dumps(child(args.model, args.draft, args.child, args.chunk, args.search, args.threads,
                               args.max_new, args.max_memory)))
        return 0
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        rows.append(run(args, n))
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("tokens", "score")}), file=sys.stderr)
    data = {"model": args.model, "draft": args.draft, "chunk": args.chunk, "max_memory": args.max_memory,
            "search": args.search,
            "max_new": args.max_new, "threads": args.threads, "machine": common.machine(), "rows": rows}
    common.write(args.out, args.tag, data)
    _plot(data, args.out / f"{args.tag}.png")
    cols = ["prompt_tokens", "seconds", "rss_loaded_mb", "peak_rss_mb", "rss_after_mb", "rss_after_short_mb",
            "kv_peak_mb", "error"]
    print(common.table(rows, cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
