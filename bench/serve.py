"""Serving several clients at once: `specbeam serve` against llama-cpp-python's own OpenAI server
(`llama_cpp.server`) on the same GGUF, the same requests, in one run.

Both servers are started once, each with the machine's threads, and stay loaded; the load generator drives one at
a time, the order alternated every round. A round at C clients: C threads, each sending `--per_client` streamed
chat requests (bench/data/code_prompts.json in turn, greedy, `--max_tokens`); measured per request its time to
first token (the first text chunk), and per round the aggregate tokens/s (completion tokens of every request over
the round's wall time). Our answers at C > 1 are compared with ours at 1 client for the same prompt (each answer
equals the request alone). Reported: per arm and C the median aggregate tok/s and TTFT p50/p95 over rounds, the
ratio ours/each peer, the server's peak RSS (VmHWM). Peers: llama-cpp-python's server (`llama_cpp.server`) and,
with --llama_server, llama.cpp's own `llama-server` with a slot per client (its continuous batching).

    pip install -e ".[cpu,serve,llamacpp]" && pip install "llama-cpp-python[server]==0.3.36"
    python -m bench.serve --model qwen2.5-coder-1.5b --clients 1,4,8 --rounds 2
    python -m bench.serve --build_llama_server      # then --llama_server DATA/tools/llama-server
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import common

ROOT = Path(__file__).resolve().parents[1]
OURS, LLAMA_PY, LLAMA_SERVER = "specbeam serve", "llama_cpp.server", "llama-server"
BASELINE = "specbeam serve, baseline"
PROMPTS = json.loads((ROOT / "bench" / "data" / "code_prompts.json").read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerArm:
    """A server process, its base URL and the model name its clients send."""

    def __init__(self, name: str, cmd: list[str], port: int, model: str, ready_path: str, cwd: Path | None = None):
        self.name, self.port, self.model = name, port, model
        self.url = f"http://127.0.0.1:{port}"
        # its log into a file: a pipe nobody reads fills up and stops the server (llama.cpp logs a lot)
        self.log = tempfile.TemporaryFile("w+")
        env = None if cwd is None else dict(os.environ, PYTHONPATH=str(cwd))     # another checkout's code
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, text=True, cwd=cwd, env=env)
        try:
            self._wait(ready_path)
        except BaseException:
            self.proc.kill()
            raise

    def _wait(self, path: str, timeout: float = 600) -> None:
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{self.name} exited: {self.log.read()[-2000:]}")
            try:
                if httpx.get(self.url + path, timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not start in {timeout} s")

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return next(int(l.split()[1]) for l in status.splitlines() if l.startswith("VmHWM")) / 1024

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def one_request(arm: ServerArm, prompt: str, max_tokens: int) -> dict:
    """A streamed greedy chat request: its text, completion tokens, time to first text, seconds."""
    import httpx

    body = {"model": arm.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0, first, text, chunks, usage = time.perf_counter(), None, [], 0, None
    with httpx.stream("POST", arm.url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for c in event.get("choices", []):
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter() - t0
                    text.append(piece)
                    chunks += 1
    tokens = usage["completion_tokens"] if usage else chunks
    return {"text": "".join(text), "tokens": tokens, "ttft": first or float("nan"),
            "seconds": time.perf_counter() - t0}


def round_at(arm: ServerArm, clients: int, per_client: int, max_tokens: int, first: int) -> dict:
    """C clients at once, each sending its requests one after another; prompts first, first + 1, ..."""
    results: list = [None] * (clients * per_client)

    def client(c: int):
        for k in range(per_client):
            i = c * per_client + k
            results[i] = dict(one_request(arm, PROMPTS[(first + i) % len(PROMPTS)], max_tokens),
                              prompt=(first + i) % len(PROMPTS))
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"clients": clients, "wall": wall, "tok_s": sum(r["tokens"] for r in results) / wall,
            "ttft": [r["ttft"] for r in results], "answers": {r["prompt"]: r["text"] for r in results}}


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if x == x)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def summarize(rounds: dict, arms: list[str], clients: list[int]) -> list[dict]:
    rows = []
    for c in clients:
        for a in arms:
            rs = rounds[(a, c)]
            ttft = [t for r in rs for t in r["ttft"]]
            rows.append({"arm": a, "clients": c, "tok_s": round(statistics.median(r["tok_s"] for r in rs), 2),
                         "ttft_p50_s": round(percentile(ttft, 0.5), 2), "ttft_p95_s": round(percentile(ttft, 0.95), 2)})
        here = rows[-len(arms):]
        ours = next(r for r in here if r["arm"] == OURS)
        for peer in (r for r in here if r["arm"] != OURS):     # aggregate tok/s over each peer's at this C
            ours[f"x {peer['arm']}"] = round(ours["tok_s"] / peer["tok_s"], 2) if peer["tok_s"] else None
    return rows


def identical(rounds: dict, arm: str, clients: list[int]) -> dict:
    """Per C > 1: how many of our answers equal our answer to the same prompt at 1 client."""
    alone = {}
    for r in rounds.get((arm, 1), []):
        alone.update(r["answers"])
    out = {}
    for c in clients[1:]:
        pairs = [(p, t) for r in rounds[(arm, c)] for p, t in r["answers"].items() if p in alone]
        out[str(c)] = f"{sum(alone[p] == t for p, t in pairs)}/{len(pairs)}"
    return out


def start_arms(args) -> dict[str, ServerArm]:
    """Every arm's server, started and ready; those started are stopped when a later one fails to start."""
    arms: dict[str, ServerArm] = {}
    try:
        _start_arms(args, arms)
    except BaseException:
        for a in arms.values():
            a.stop()
        raise
    return arms


def _start_arms(args, arms: dict) -> None:
    from specbeam_edge import fetch

    name = os.path.basename(os.path.normpath(args.model))      # the id the server gives a folder
    def ours(arm: str, cwd: Path | None) -> ServerArm:
        return ServerArm(arm, [sys.executable, "-m", "apps.serve", "--model", str(Path(args.model).resolve())
                               if os.path.sep in args.model else args.model, "--port", str(port := free_port()),
                               "--max_batch_size", str(max(args.clients))]
                         + (["--draft", "none"] if args.no_draft else []), port, name, "/health", cwd)
    arms[OURS] = ours(OURS, None)
    if args.baseline:             # the same server from another checkout (a change measured against its parent)
        arms[BASELINE] = ours(BASELINE, args.baseline.resolve())
    gguf = (args.gguf or str(fetch.gguf_path(args.model))) if not args.no_llama or args.llama_server else None
    if not args.no_llama:         # llama-cpp-python's OpenAI server: one model, requests in turn
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--port", str(port := free_port()),
               "--n_ctx", str(args.n_ctx), "--n_threads", str(os.cpu_count()), "--model_alias", "peer"]
        arms[LLAMA_PY] = ServerArm(LLAMA_PY, cmd, port, "peer", "/v1/models")
    if args.llama_server:         # llama.cpp's own server: a slot per client, continuous batching
        slots = max(args.clients)
        cmd = [str(args.llama_server), "-m", gguf, "--port", str(port := free_port()), "-t", str(os.cpu_count()),
               "-c", str(args.n_ctx * slots), "-np", str(slots), "-a", "peer"]
        arms[LLAMA_SERVER] = ServerArm(LLAMA_SERVER, cmd, port, "peer", "/health")


def bench(args) -> dict:
    report = {"machine": common.machine(), "model": args.model, "max_tokens": args.max_tokens,
              "per_client": args.per_client, "clients": args.clients}
    arms = start_arms(args)
    try:
        for arm in arms.values():
            one_request(arm, PROMPTS[0], 8)           # warm-up: sessions, cost curves, caches
        rounds: dict = {}
        names = list(arms)
        for c in args.clients:
            for k in range(args.rounds):
                for n in (names if k % 2 == 0 else names[::-1]):
                    r = round_at(arms[n], c, args.per_client, args.max_tokens, first=k * c * args.per_client)
                    rounds.setdefault((n, c), []).append(r)
                    print(f"{n} at {c} clients: {r['tok_s']:.2f} tok/s, TTFT p50 {percentile(r['ttft'], .5):.2f} s",
                          file=sys.stderr, flush=True)
        report["rows"] = summarize(rounds, names, args.clients)
        report["identical_to_alone"] = identical(rounds, OURS, args.clients)
        report["peak_rss_mb"] = {n: round(a.rss_mb()) for n, a in arms.items()}
    finally:
        for a in arms.values():
            a.stop()
    return report


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    arms = list(dict.fromkeys(r["arm"] for r in report["rows"]))
    for a in arms:
        rows = [r for r in report["rows"] if r["arm"] == a]
        ax1.plot([r["clients"] for r in rows], [r["tok_s"] for r in rows], "o-", label=a)
        ax2.plot([r["clients"] for r in rows], [r["ttft_p95_s"] for r in rows], "o-", label=a)
    ax1.set(xlabel="clients at once", ylabel="aggregate tokens/s", title="throughput")
    ax2.set(xlabel="clients at once", ylabel="seconds", title="time to first token, p95")
    ax1.legend()
    fig.suptitle(f"{report['model']}, {report['machine']['cpu']}, {report['machine']['cores']} cores")
    common.save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a fetched model's name (or a folder, with --gguf)")
    ap.add_argument("--gguf", default=None, help="the GGUF llama.cpp serves (default: the fetched model's)")
    ap.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    ap.add_argument("--per_client", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--n_ctx", type=int, default=4096)
    ap.add_argument("--no_draft", action="store_true", help="our server without the draft")
    ap.add_argument("--no_llama", action="store_true", help="without llama-cpp-python's server (llama_cpp.server)")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="another checkout of this project (git worktree add BASE REV): its server as an arm, "
                         "alternated with this one's")
    ap.add_argument("--llama_server", type=Path, default=None,
                    help="llama.cpp's llama-server program: an arm with a slot per client (python -m bench.serve "
                         "--build_llama_server builds it)")
    ap.add_argument("--build_llama_server", action="store_true",
                    help="build llama-server from the vendored llama.cpp of the installed llama-cpp-python (CMake; "
                         "$CMAKE_ARGS as for pip) into the data folder's tools/, then exit")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = ap.parse_args(argv)
    if args.build_llama_server:
        from specbeam_edge import fetch

        from .pair import build_llama
        print(build_llama(fetch.data_dir() / "tools" / LLAMA_SERVER, target=LLAMA_SERVER))
        return 0
    report = bench(args)
    cols = ["arm", "clients", "tok_s", "ttft_p50_s", "ttft_p95_s"] + [f"x {a}" for a in (BASELINE, LLAMA_PY,
                                                                                         LLAMA_SERVER)
                                                                       if any(f"x {a}" in r for r in report["rows"])]
    print(common.table(report["rows"], cols))
    print("identical to alone:", report["identical_to_alone"], " peak RSS MB:", report["peak_rss_mb"])
    print(common.write(args.out, "serve", report))
    plot(report, args.out / "serve.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
