"""Where a plain beam-search pass's time goes, one request at a time, and what keeping the KV cache resident
(IOBinding) changes: the shipped target, K=4, held-out lines, host KV vs resident KV vs CTranslate2 int8 at
max_batch_size 1, alternated in one run; and the
main job (speculative, shipped draft, adaptive default) with host and resident KV. Also: the share of wall-clock inside onnxruntime (the graph's own
arithmetic) against feeding, fetching and Python; onnxruntime's per-op profile of one representative pass; and
how a pass's cost grows with the cached length (what the cache costs the graph)."""
from __future__ import annotations

import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specbeam_edge import Engine, SpeculativeConfig

from .batch import _ct2, ct2_generator
from .common import median, save_figure
from .e2e import load_prompts


class _Timed:
    """Wraps an InferenceSession: adds up the seconds spent inside run / run_with_iobinding."""

    def __init__(self, sess):
        self._s, self.seconds, self.calls = sess, 0.0, 0

    def __getattr__(self, name):
        return getattr(self._s, name)

    def _timed(self, fn, *a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1

    def run(self, *a, **k):
        return self._timed(self._s.run, *a, **k)

    def run_with_iobinding(self, *a, **k):
        return self._timed(self._s.run_with_iobinding, *a, **k)


def _op_profile(folder: Path, threads: int, Q: int, N: int, reps: int = 200) -> dict:
    """onnxruntime's own profile of `reps` passes of Q new tokens over N cached: microseconds per pass by op."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "kv")
    sess = ort.InferenceSession(str(folder / "model.onnx"), so, providers=["CPUExecutionProvider"])
    cfg = json.loads((folder / "specbeam_config.json").read_text())
    feed = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            feed[i.name] = np.ones((1, Q), np.int64)
        elif i.name == "position_ids":
            feed[i.name] = np.arange(N, N + Q)[None]
        elif i.name == "attention_mask":
            feed[i.name] = np.zeros((1, 1, Q, N + Q), np.float32)
        else:
            feed[i.name] = np.zeros((1, cfg["num_kv_heads"], N, cfg["head_dim"]), np.float32)
    for _ in range(reps):
        sess.run(None, feed)
    events = json.loads(Path(sess.end_profiling()).read_text())
    per_op = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per_op[e["args"]["op_name"]] += e["dur"] / reps
    runs = [e["dur"] for e in events if e.get("name") == "model_run"]
    return {"Q": Q, "N": N, "us_per_pass_profiled": float(np.median(runs)),
            "us_by_op": {k: round(v, 1) for k, v in per_op.most_common()}}


def _pass_ms(engine: Engine, Q: int, N: int, reps: int = 200) -> float:
    lm = engine.target
    c = lm.cfg
    past = [(np.zeros((1, c.num_kv_heads, N, c.head_dim), np.float32),) * 2 for _ in range(c.num_layers)]
    ids, pos, mask = np.ones((1, Q), np.int64), np.arange(N, N + Q)[None], np.ones((1, 1, Q, N + Q), bool)
    for _ in range(10):
        lm.forward(ids, pos, mask, past)
    t0 = time.perf_counter()
    for _ in range(reps):
        lm.forward(ids, pos, mask, past)
    return (time.perf_counter() - t0) / reps * 1e3


def bench(pair: Path, *, n_prompts=64, max_new=128, K=4, reps=2, threads=2) -> dict:
    engines = {"host": Engine(pair / "target", threads=threads, kv_resident=False),
               "resident": Engine(pair / "target", threads=threads, kv_resident=True),
               # the main job: speculative with the shipped draft and the adaptive default
               "speculative host": Engine(pair / "target", draft=pair / "draft", threads=threads, kv_resident=False),
               "speculative resident": Engine(pair / "target", draft=pair / "draft", threads=threads,
                                              kv_resident=True)}
    spec = {name: SpeculativeConfig(adaptive=True) if name.startswith("speculative") else None for name in engines}
    timers = {}
    for name, eng in engines.items():
        eng.target.runner.sess = timers[name] = _Timed(eng.target.runner.sess)
    lines = load_prompts(pair, n_prompts)
    prompts = [engines["host"].tokenizer.format_prompt(p) for p in lines]
    tok = engines["host"].tokenizer
    toks = [[tok.id_to_token(i) for i in engines["host"].encode(p)] for p in prompts]
    gen, why = ct2_generator(pair / "hf" / "target", threads)
    for eng in engines.values():
        eng.generate(prompts[:2], num_beams=K, max_new_tokens=16, max_batch_size=1, speculative=None)  # warm-up
    for name in engines:
        if spec[name] is not None:   # the adaptive chooser's probes belong to the run, not to the warm-up
            engines[name].reset_learning()
    runs = {name: [] for name in [*engines, "ctranslate2_int8"]}
    outputs = {}
    for _ in range(reps):
        for name, eng in engines.items():
            timers[name].seconds = timers[name].calls = 0
            t0 = time.perf_counter()
            res = eng.generate(prompts, num_beams=K, max_new_tokens=max_new, max_batch_size=1,
                               speculative=spec[name])
            dt = time.perf_counter() - t0
            outputs.setdefault(name, [[h.tokens for h in r.hypotheses] for r in res])
            runs[name].append({"seconds": dt, "in_onnxruntime": timers[name].seconds, "passes": timers[name].calls,
                               "steps": sum(r.stats.beam_steps for r in res)})
        if gen is not None:
            runs["ctranslate2_int8"].append(_ct2(gen, toks, K, 1, max_new, 1))
    rows = []
    for name, rs in runs.items():
        if not rs:
            continue
        sec = median([r["seconds"] for r in rs])
        row = {"engine": name, "lines_s": round(len(prompts) / sec, 2), "seconds": round(sec, 2)}
        if "passes" in rs[0]:
            ort_s = median([r["in_onnxruntime"] for r in rs])
            passes = rs[0]["passes"]
            row.update({"passes": passes, "ms_per_pass": round(sec / passes * 1e3, 3),
                        "ms_in_onnxruntime_per_pass": round(ort_s / passes * 1e3, 3),
                        "onnxruntime_share": round(ort_s / sec, 3)})
        rows.append(row)
        print(row, file=sys.stderr)
    by = {r["engine"]: r for r in rows}
    summary = {"resident_over_host": round(by["host"]["seconds"] / by["resident"]["seconds"], 3),
               "speculative_resident_over_host": round(by["speculative host"]["seconds"]
                                                       / by["speculative resident"]["seconds"], 3),
               "speculative_host_over_plain_host": round(by["host"]["seconds"] / by["speculative host"]["seconds"], 3),
               "outputs_identical": all(o == outputs["host"] for o in outputs.values())}
    if "ctranslate2_int8" in by:
        summary["host_over_ctranslate2_batch1"] = round(by["ctranslate2_int8"]["seconds"] / by["host"]["seconds"], 2)
    host = engines["host"]
    host.target.runner.sess = host.target.runner.sess._s
    points = [(Q, N) for Q in (1, K) for N in (0, 64, 128, 256)]
    times = {p: [] for p in points}
    for _ in range(3):      # interleaved, best of three: the first points otherwise pay for waking the threads
        for Q, N in points:
            times[(Q, N)].append(_pass_ms(host, Q, N))
    curve = {f"Q={Q} N={N}": round(min(times[(Q, N)]), 3) for Q, N in points}
    profile = _op_profile(pair / "target", threads, K, 64)
    print(summary, curve, profile, sep="\n", file=sys.stderr)
    return {"prompts": len(prompts), "K": K, "max_new_tokens": max_new, "reps": reps, "threads": threads,
            "rows": rows, "summary": summary, "pass_ms_by_new_and_cached": curve, "op_profile": profile,
            "notes": {"ctranslate2": why} if why else {}}


def plot(data: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    rows = [r for r in data["rows"] if "passes" in r]
    names = [r["engine"] for r in rows]
    inside = [r["ms_in_onnxruntime_per_pass"] for r in rows]
    outside = [r["ms_per_pass"] - r["ms_in_onnxruntime_per_pass"] for r in rows]
    axes[0].bar(names, inside, label="inside onnxruntime")
    axes[0].bar(names, outside, bottom=inside, label="feeding, fetching, Python")
    axes[0].set(ylabel="ms per pass", title=f"plain beam search K={data['K']}, one request")
    axes[0].legend(fontsize=7)
    ops = data["op_profile"]["us_by_op"]
    axes[1].barh(list(ops)[::-1], list(ops.values())[::-1])
    axes[1].set(xlabel="us per pass (profiled)",
                title=f"one pass: Q={data['op_profile']['Q']} new over N={data['op_profile']['N']} cached")
    save_figure(fig, path)
