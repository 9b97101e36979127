"""A soak of `specbeam serve`: many clients at once, each sending a mix of requests (greedy whole, greedy
streamed, beam search, clients that leave mid-answer, long prompts as an editor sends a file for context), bounded
in count and time. Checked: nothing lost (every request answered, or cancelled by its own client), every finished
answer equal to the same request sent alone afterwards, and the server's RSS after warm-up against its end.

    python -m bench.serve_soak --model smollm2 --clients 16 --requests 25 --long_tokens 4000
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

from . import common
from .serve import PROMPTS, ROOT, ServerArm, free_port

KINDS = ("greedy", "stream", "beam", "leave", "long")
WEIGHTS = (3, 3, 2, 1, 1)
FILLER = ("def helper(values):\n    total = 0\n    for v in values:\n        total += v * 2\n    return total\n\n")


def request_of(kind: str, i: int, long_tokens: int, max_tokens: int) -> dict:
    prompt = PROMPTS[i % len(PROMPTS)]
    if kind == "long":          # a file as context: about long_tokens tokens of code, then the question
        prompt = FILLER * max(1, long_tokens // 30) + "\n" + prompt
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
    if kind == "beam":
        body.update(use_beam_search=True, best_of=3, n=1, temperature=None)
    body["stream"] = kind in ("stream", "leave")
    return body


def send(arm: ServerArm, body: dict, leave: bool) -> dict:
    import httpx

    body = dict(body, model=arm.model)
    if not body["stream"]:
        r = httpx.post(arm.url + "/v1/chat/completions", json=body, timeout=900)
        r.raise_for_status()
        return {"text": r.json()["choices"][0]["message"]["content"]}
    text = []
    with httpx.stream("POST", arm.url + "/v1/chat/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for n, line in enumerate(r.iter_lines()):
            if leave and n >= 4:
                return {"left": True}
            if line.startswith("data: {"):
                for c in json.loads(line[6:]).get("choices", []):
                    text.append((c.get("delta") or {}).get("content") or "")
    return {"text": "".join(text)}


def arm_rss(arm: ServerArm) -> float:
    """The server's resident memory now (MB)."""
    status = Path(f"/proc/{arm.proc.pid}/status").read_text()
    return next(int(l.split()[1]) for l in status.splitlines() if l.startswith("VmRSS")) / 1024


def soak(args) -> dict:
    rng = random.Random(args.seed)
    plan = [[(k, c * args.requests + j) for j, k in enumerate(rng.choices(KINDS, WEIGHTS, k=args.requests))]
            for c in range(args.clients)]
    arm = ServerArm("specbeam serve", [sys.executable, "-m", "apps.serve", "--model", args.model, "--port",
                                       str(port := free_port()), "--max_batch_size", str(args.max_batch_size),
                                       "--max_waiting", str(args.clients * 2)], port,
                    args.model.rstrip("/").split("/")[-1], "/health")
    results, errors, rss = {}, [], []
    stop = threading.Event()

    def sample_rss():
        while not stop.wait(1.0):
            rss.append(arm_rss(arm))

    def client(items):
        for kind, i in items:
            body = request_of(kind, i, args.long_tokens, args.max_tokens)
            try:
                results[i] = (kind, body, send(arm, body, kind == "leave"))
            except Exception as e:  # noqa: BLE001  (counted as lost)
                errors.append(f"request {i} ({kind}): {type(e).__name__}: {e}")
    try:
        send(arm, request_of("greedy", 0, 0, 8), False)          # warm-up
        rss.append(arm_rss(arm))
        watcher = threading.Thread(target=sample_rss, daemon=True)
        watcher.start()
        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(items,)) for items in plan]
        for t in threads:
            t.start()
        for t in threads:
            t.join(args.deadline)
        seconds = time.perf_counter() - t0
        stop.set()
        rss.append(arm_rss(arm))                # a soak shorter than the sampling period still has a figure
        # every finished answer against the same request alone
        mismatched = [i for i, (kind, body, got) in results.items() if "text" in got
                      and send(arm, body, False)["text"] != got["text"]]
        peak = arm.rss_mb()
    finally:
        stop.set()
        arm.stop()
    total = args.clients * args.requests
    warm = rss[len(rss) // 5] if rss else float("nan")
    return {"machine": common.machine(), "model": args.model, "clients": args.clients, "requests": total,
            "kinds": {k: sum(1 for items in plan for kk, _ in items if kk == k) for k in KINDS},
            "answered": sum(1 for _, _, g in results.values() if "text" in g),
            "left_by_client": sum(1 for _, _, g in results.values() if g.get("left")),
            "lost": total - len(results), "errors": errors[:10], "mismatched_vs_alone": mismatched,
            "seconds": round(seconds, 1), "rss_mb_after_warmup": round(warm), "rss_mb_end": round(rss[-1]) if rss
            else None, "peak_rss_mb": round(peak), "rss_mb_per_second": [round(x) for x in rss]}


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(report["rss_mb_per_second"])
    ax.set(xlabel="seconds into the soak", ylabel="server RSS (MB)",
           title=f"{report['model']}: {report['clients']} clients, {report['requests']} requests")
    common.save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve_soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=25, help="requests per client")
    ap.add_argument("--max_tokens", type=int, default=32)
    ap.add_argument("--long_tokens", type=int, default=4000, help="about this many prompt tokens in 'long' requests")
    ap.add_argument("--max_batch_size", type=int, default=8)
    ap.add_argument("--deadline", type=float, default=3600, help="seconds a client may take in all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = ap.parse_args(argv)
    report = soak(args)
    print(json.dumps({k: v for k, v in report.items() if k not in ("machine", "rss_mb_per_second")}, indent=1))
    print(common.write(args.out, "serve_soak", report))
    plot(report, args.out / "serve_soak.png")
    ok = report["lost"] == 0 and not report["mismatched_vs_alone"] and not report["errors"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
