"""The exporter's peak memory on a model larger than this machine's memory would hold as fp32: a GGUF written here
with Qwen2.5-7B's shapes (28 layers x 3584, FFN 18944, 28 / 4 heads, vocabulary 151,936: 7.6 B parameters, 30 GB
as fp32) and random Q8_0 weights, exported to the split int8 layout in a process of its own.

    python -m bench.export_memory --tokenizer_from <a GGUF with a 151,936-token vocabulary> [--layers 28]

The tokenizer metadata comes from an existing GGUF (the fetched Qwen2.5-Coder's source: `specbeam fetch
qwen2.5-coder-1.5b` keeps it in the data folder's sources/); weights are random (sizes, time and memory do not
depend on the values). Writes export_memory.json and .png into --out (default the ignored bench/out/results): the
export's peak RSS (the child's own VmHWM: Linux), its time, the folder's size, and the memory in use after each step of
its progress line, which shows memory does not grow with depth. Needs about 16 GB of free disk (the GGUF and the
folder) and takes about 10 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from . import common

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden=3584, ffn=18944, heads=28, kv_heads=4, head_dim=128, vocab=151936, layers=28)
ROWS = 8192


def _tensors(s: dict):
    """(GGUF name, numpy shape [rows, cols] or [n]) of a qwen2 model of shape s, in llama.cpp's order."""
    H, F, q, kv = s["hidden"], s["ffn"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    yield "token_embd.weight", (s["vocab"], H)
    for i in range(s["layers"]):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", (H,)
        yield p + "attn_q.weight", (q, H)
        yield p + "attn_q.bias", (q,)
        yield p + "attn_k.weight", (kv, H)
        yield p + "attn_k.bias", (kv,)
        yield p + "attn_v.weight", (kv, H)
        yield p + "attn_v.bias", (kv,)
        yield p + "attn_output.weight", (H, q)
        yield p + "ffn_norm.weight", (H,)
        yield p + "ffn_gate.weight", (F, H)
        yield p + "ffn_up.weight", (F, H)
        yield p + "ffn_down.weight", (H, F)
    yield "output_norm.weight", (H,)
    yield "output.weight", (s["vocab"], H)


def _data(shape, rng) -> np.ndarray:
    """A tensor's bytes: Q8_0 blocks for a matrix (quantized a chunk of rows at a time), fp32 for a vector."""
    import gguf

    if len(shape) == 1:
        return np.ones(shape, np.float32) if shape[0] else np.zeros(0, np.float32)
    parts = [gguf.quants.quantize(rng.standard_normal((min(ROWS, shape[0] - a), shape[1]), np.float32) * 0.02,
                                  gguf.GGMLQuantizationType.Q8_0) for a in range(0, shape[0], ROWS)]
    return np.concatenate(parts)


def write_gguf(path: Path, tokenizer_from: Path, s: dict) -> None:
    """A qwen2 GGUF of shape s with random Q8_0 weights and the tokenizer metadata of `tokenizer_from`."""
    import gguf

    src = gguf.GGUFReader(str(tokenizer_from))
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("random-7b-shapes")
    w.add_context_length(32768)
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    for f in src.fields.values():
        if f.name.startswith("tokenizer."):
            sub = f.types[1] if len(f.types) > 1 else None
            w.add_key_value(f.name, f.contents(), f.types[0], sub)
    del src
    Q8 = gguf.GGMLQuantizationType.Q8_0
    for name, shape in _tensors(s):
        if len(shape) == 1:
            w.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
        else:
            nbytes = shape[0] * shape[1] // 32 * 34
            w.add_tensor_info(name, gguf.quant_shape_to_byte_shape(shape, Q8), np.dtype(np.uint8), nbytes, Q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for _, shape in _tensors(s):
        w.write_tensor_data(_data(shape, rng))
    w.close()


def export(gguf_path: Path, out: Path) -> dict:
    """Export in a child process: its peak RSS (VmHWM, its own: ru_maxrss counts the process it was forked from,
    which held the GGUF writer's arrays), time and the memory in use its progress line reports a step."""
    t0 = time.perf_counter()
    script = ("import sys; from export.__main__ import main; rc = main(sys.argv[1:]); "
              "print('VmHWM', [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0]); "
              "sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", script, "-i", str(gguf_path), "-o", str(out), "-p", "int8",
                           "--layout", "split", "--output_kind", "both"], cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"the export failed: {proc.stderr.strip().splitlines()[-1:]}")
    peak = int(re.search(r"VmHWM (\d+)", proc.stdout).group(1))                 # kB
    steps = [(m.group(1).strip(), int(m.group(2)))
             for m in re.finditer(r"([^\r\n]*?) \((\d+) MB in use\)", proc.stderr)]
    seen, unique = set(), []
    for what, mb in steps:                 # tqdm redraws a line; keep each step once
        if what not in seen:
            seen.add(what)
            unique.append({"step": what, "mb_in_use": mb})
    return {"peak_rss_mb": round(peak / 1024), "seconds": round(seconds, 1), "steps": unique}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.export_memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer_from", required=True, type=Path, help="a GGUF whose vocabulary has 151,936 tokens")
    ap.add_argument("--layers", type=int, default=SHAPE["layers"], help="decoder layers (28: Qwen2.5-7B's)")
    ap.add_argument("--work", type=Path, default=None, help="folder for the GGUF and the export (default: temp)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "results")
    args = ap.parse_args(argv)
    s = {**SHAPE, "layers": args.layers}
    work = Path(tempfile.mkdtemp(prefix="export-memory-", dir=args.work))
    try:
        path = work / "random-7b-shapes-q8_0.gguf"
        t0 = time.perf_counter()
        write_gguf(path, args.tokenizer_from, s)
        print(f"wrote {path.name}: {path.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr)
        res = export(path, work / "out")
        folder = sum(p.stat().st_size for p in (work / "out").rglob("*") if p.is_file())
        params = sum(int(np.prod(sh)) for _, sh in _tensors(s))
        data = {"shape": s, "parameters": params, "fp32_gb": round(params * 4 / 1e9, 1),
                "gguf_gb": round(path.stat().st_size / 1e9, 2), "folder_gb": round(folder / 1e9, 2),
                "precision": "int8", "layout": "split", "machine": common.machine(),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **res}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    common.write(args.out, "export_memory", data)
    _plot(data, args.out / "export_memory.png")
    print(common.table([{k: data[k] for k in ("parameters", "fp32_gb", "gguf_gb", "folder_gb", "peak_rss_mb",
                                              "seconds")}], ["parameters", "fp32_gb", "gguf_gb", "folder_gb",
                                                             "peak_rss_mb", "seconds"]))
    return 0


def _plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    mb = [s["mb_in_use"] for s in data["steps"]]
    ax.plot(range(1, len(mb) + 1), mb, marker=".", label="in use after the step")
    ax.axhline(data["peak_rss_mb"], color="C3", ls="--", label=f"peak RSS {data['peak_rss_mb']} MB")
    ax.set_xlabel("export step (embedding table, layers 1..L, head)")
    ax.set_ylabel("MB")
    ax.set_ylim(0, data["peak_rss_mb"] * 1.2)
    ax.set_title(f"{data['parameters'] / 1e9:.1f} B parameters ({data['fp32_gb']} GB as fp32), Q8_0 GGUF -> split int8")
    ax.legend(loc="lower right")
    common.save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
