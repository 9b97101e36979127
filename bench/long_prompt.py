"""Long prompts: peak memory and time of one request whose prompt is 512, 2,600 or 5,600 tokens long, 8 new tokens,
greedy, on the fetched SmolLM2-135M (`specbeam fetch smollm2`), the prompt a line of common English words cut to
the exact token count. With --llama_cpp, llama.cpp (llama-cpp-python) runs the same token ids on the GGUF the
model was exported from (the fetch keeps it), each length's two arms back to back, alternating which goes first;
its kernels are named in the JSON (open_llama: its repacked kernels on).

Each prompt length runs in a child process of its own, so its peak is its own (VmHWM from /proc/self/status:
Linux). Reported per length: the RSS once the model is loaded, the peak during the request, the RSS after the
answer, and the RSS after a second, short request (what a long prompt leaves behind), the request's seconds and
the KV cache's own peak bytes (the part that must grow with the prompt).

    python -m bench.long_prompt                                  # 512, 2600, 5600 tokens
    python -m bench.long_prompt --lengths 2600 --chunk 0         # the prompt in one pass (no chunks)
    python -m bench.long_prompt --model DIR --search default     # another folder; the engine's default search
    python -m bench.long_prompt --llama_cpp                      # and llama.cpp on the fetched GGUF, side by side

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
    from specbeam_edge.commands.flags import parse_size

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


def llama_child(gguf: str, model: str, length: int, threads: int, max_new: int, flash_attn: bool = True) -> dict:
    """The same request through llama.cpp in this process: the prompt's ids (the model folder's tokenizer, the
    GGUF's own vocabulary), greedy, max_new tokens."""
    from specbeam_edge.text.tokenizer import Tokenizer

    from .llamacpp import kernels, open_llama

    ids = prompt_ids(Tokenizer(Path(model)), length)
    # flash attention on, as llama.cpp's own tools default to on a CPU ("auto"); llama-cpp-python's default is off
    llm = open_llama(gguf, n_ctx=length + max_new + 16, n_threads=threads, n_threads_batch=threads, n_batch=512,
                     seed=0, verbose=False, flash_attn=flash_attn)
    loaded = _status("VmRSS")
    t0 = time.perf_counter()
    out = []
    for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(tok))
        if len(out) >= max_new or tok == llm.token_eos():
            break
    seconds = time.perf_counter() - t0
    return {"prompt_tokens": length, "seconds": round(seconds, 2), "rss_loaded_mb": loaded,
            "peak_rss_mb": _status("VmHWM"), "rss_after_mb": _status("VmRSS"), "tokens": out, "kernels": kernels(),
            "flash_attn": flash_attn}


def run(args, length: int, arm: str = "ours") -> dict:
    if arm == "llama.cpp":
        cmd = [sys.executable, "-m", "bench.long_prompt", "--child_llama", str(length), "--gguf", args.gguf,
               "--model", args.model, "--llama_flash_attn", args.llama_flash_attn,
               "--threads", str(args.threads), "--max_new", str(args.max_new)]
        return _child_row(cmd, length)
    cmd = [sys.executable, "-m", "bench.long_prompt", "--child", str(length), "--model", args.model,
           "--search", args.search, "--threads", str(args.threads), "--max_new", str(args.max_new)]
    if args.draft:
        cmd += ["--draft", args.draft]
    if args.chunk is not None:
        cmd += ["--chunk", str(args.chunk)]
    if args.max_memory:
        cmd += ["--max_memory", args.max_memory]
    return _child_row(cmd, length)


def _child_row(cmd: list[str], length: int) -> dict:
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
    peers = [r for r in data.get("llama_cpp", {}).get("rows", []) if "error" not in r]
    if peers:
        ax.plot([r["prompt_tokens"] for r in peers], [r["peak_rss_mb"] for r in peers], marker="s", ls="--",
                label="llama.cpp peak RSS")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("MB")
    ax.set_ylim(0, max([r["peak_rss_mb"] for r in rows + peers] + [1]) * 1.15)
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
    ap.add_argument("--llama_cpp", action="store_true",
                    help="also run llama.cpp (llama-cpp-python) on the GGUF, alternating with ours per length")
    ap.add_argument("--gguf", default=None, help="the GGUF for --llama_cpp (default: the fetched smollm2's kept one)")
    ap.add_argument("--llama_flash_attn", choices=("on", "off"), default="on",
                    help="llama.cpp's flash attention (its own tools' default on a CPU: on)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child_llama", type=int, default=None, help=argparse.SUPPRESS)
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
    if args.child_llama is not None:
        print(json.dumps(llama_child(args.gguf, args.model, args.child_llama, args.threads, args.max_new,
                                     args.llama_flash_attn == "on")))
        return 0
    if args.llama_cpp and args.gguf is None:
        from specbeam_edge import fetch

        args.gguf = str(fetch.gguf_path("smollm2"))
    rows, peers = [], []
    for k, n in enumerate(int(x) for x in args.lengths.split(",")):
        arms = ["ours", "llama.cpp"] if args.llama_cpp else ["ours"]
        for arm in arms if k % 2 == 0 else arms[::-1]:          # alternating which arm goes first
            row = run(args, n, arm)
            (rows if arm == "ours" else peers).append(row)
            print(json.dumps({"arm": arm, **{k: v for k, v in row.items() if k not in ("tokens", "score")}}),
                  file=sys.stderr)
    name = lambda path: path and Path(path).name       # a folder's or file's name: no path of this machine
    data = {"model": name(args.model), "draft": name(args.draft), "chunk": args.chunk, "max_memory": args.max_memory,
            "search": args.search, "max_new": args.max_new, "threads": args.threads, "machine": common.machine(),
            "rows": rows, **({"llama_cpp": {"gguf": name(args.gguf), "rows": peers}} if args.llama_cpp else {})}
    if peers:
        data["ratios"] = ratios(rows, peers)
    common.write(args.out, args.tag, data)
    _plot(data, args.out / f"{args.tag}.png")
    cols = ["prompt_tokens", "seconds", "rss_loaded_mb", "peak_rss_mb", "rss_after_mb", "rss_after_short_mb",
            "kv_peak_mb", "error"]
    print(common.table(rows, cols))
    if peers:
        print(common.table(peers, ["prompt_tokens", "seconds", "rss_loaded_mb", "peak_rss_mb", "rss_after_mb",
                                   "error"]))
        print(common.table(data["ratios"], ["prompt_tokens", "speed_vs_llama_cpp", "peak_vs_llama_cpp"]))
    return 0


def ratios(ours: list[dict], theirs: list[dict]) -> list[dict]:
    """Per length: our speed as a multiple of llama.cpp's (its seconds / ours: > 1 is faster) and our peak RSS as
    a multiple of its peak (< 1 is less memory)."""
    out = []
    for a, b in zip(ours, theirs):
        if "error" in a or "error" in b:
            continue
        out.append({"prompt_tokens": a["prompt_tokens"], "speed_vs_llama_cpp": round(b["seconds"] / a["seconds"], 2),
                    "peak_vs_llama_cpp": round(a["peak_rss_mb"] / b["peak_rss_mb"], 2)})
    return out


if __name__ == "__main__":
    raise SystemExit(main())
