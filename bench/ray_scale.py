"""Scale-out on Ray: specbeam-translate --engine ray with 1 and 2 actors against the single-process tool on the
same cores, the Ray path's overhead, and an estimate for N machines from the measured per-actor rate.

Each arm is the tool itself in a subprocess (what a user runs); lines/s is the tool's own summary (translation
only: engine loading and, for Ray, cluster start are reported apart as wall seconds), the median of `reps`
alternated runs. Ray runs start a local instance on this machine. Equal cores means equal thread budgets: Ray
sets OMP_NUM_THREADS to an actor's CPUs, so the local arms get OMP_NUM_THREADS = their cores too (without it
numpy's OpenBLAS threads ride along with --threads 1; on the loaded 2-core machine that alone cost the local
tool 1.3x on 24 lines).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import median

ROOT = Path(__file__).resolve().parents[1]
RATE = re.compile(r"\(([0-9.]+) lines/s")


def arms(shard_lines: int) -> list[tuple[str, int, list[str]]]:
    ray = ["--engine", "ray", "--shard_lines", str(shard_lines), "--cpus_per_actor", "1"]
    return [("local", 1, ["--threads", "1"]), ("ray", 1, ray + ["--actors", "1"]),
            ("local", 2, ["--threads", "2"]), ("ray", 2, ray + ["--actors", "2"])]


def run_arm(base: list[str], extra: list[str], out: Path, cores: int) -> tuple[float, float, bytes]:
    """(lines/s from the tool's summary, wall seconds of the whole command, output bytes)."""
    t0 = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": str(cores)}
    proc = subprocess.run([*base, "-o", str(out), *extra], cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(extra)}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    rates = RATE.findall(proc.stderr)
    if not rates:
        raise RuntimeError(f"{' '.join(extra)}: no summary line in\n{proc.stderr[-2000:]}")
    return float(rates[-1]), wall, out.read_bytes()


def bench(pair: Path, n_lines: int = 64, max_new: int = 48, shard_lines: int = 8, reps: int = 2) -> dict:
    src = (pair / "target").parent / "test_sample.en"
    lines = src.read_text().splitlines()
    lines = (lines * (n_lines // len(lines) + 1))[:n_lines]
    rows, ref = [], None
    with tempfile.TemporaryDirectory() as tmp:
        inp = Path(tmp) / "in.en"
        inp.write_text("\n".join(lines) + "\n")
        base = [sys.executable, "-m", "apps.translate", "-i", str(inp), "--model", str(pair / "target"),
                "--draft", str(pair / "draft"), "--max_decoding_length", str(max_new)]
        runs = {k: [] for k in range(len(arms(shard_lines)))}
        for _ in range(reps):                       # A B C D A B C D: load drifts hit every arm alike
            for k, (engine, cores, extra) in enumerate(arms(shard_lines)):
                rate, wall, data = run_arm(base, extra, Path(tmp) / f"out{k}.de", cores)
                ref = data if ref is None else ref
                runs[k].append((rate, wall, data == ref))
                print(f"{engine} on {cores} core(s): {rate:.2f} lines/s, {wall:.1f} s wall", file=sys.stderr)
        for k, (engine, cores, _) in enumerate(arms(shard_lines)):
            rows.append({"engine": engine, "cores": cores, "actors": cores if engine == "ray" else None,
                         "lines": n_lines, "shards": -(-n_lines // shard_lines) if engine == "ray" else None,
                         "lines_s": round(median([r[0] for r in runs[k]]), 2),
                         "wall_s": round(median([r[1] for r in runs[k]]), 1),
                         "identical": all(r[2] for r in runs[k])})
    return {"rows": rows, "max_new_tokens": max_new, "shard_lines": shard_lines, "reps": reps, **summarise(rows)}


def summarise(rows: list[dict]) -> dict:
    """Overhead at equal cores, per-actor rate, 1 -> 2 actor scaling, and the N-machine estimate."""
    rate = {(r["engine"], r["cores"]): r["lines_s"] for r in rows}
    overhead = {c: round(1 - rate[("ray", c)] / rate[("local", c)], 3) for c in (1, 2)}
    per_actor = rate[("ray", 1)]
    efficiency = round(rate[("ray", 2)] / (2 * per_actor), 3)
    estimate = (f"N machines of C cores, one 1-CPU actor per core: about N x C x {per_actor:.2f} lines/s x "
                f"{efficiency:.2f} (the measured 1 -> 2 actor efficiency on this machine); e.g. 8 machines of 16 "
                f"cores: {8 * 16 * per_actor * efficiency:.0f} lines/s. The driver's share per shard (send its "
                f"lines, commit its part and one manifest record) is milliseconds against a shard's seconds, "
                f"so it stays off the critical path until shards finish faster than the driver commits them.")
    return {"overhead_at_equal_cores": overhead, "per_actor_lines_s": per_actor, "scaling_1_to_2": efficiency,
            "estimate": estimate}
