"""One weight MatMul [M, K] x [K, N] in each int8 form onnxruntime offers, against fp32: ms per run at M rows, and
whether each row of an M-row run equals that row run alone (the property exact speculation needs). The measurement
behind export/quant.py's choice of u8 activations (zero point 128) x s8 weights (DESIGN "Quantized targets").

    python -m bench.int8_kernels [--out bench/out/results]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as onh

from export.quant import quantize_columns

from .common import machine

FORMS = ("fp32", "int8dyn", "u8s8", "u8u8", "s8s8")
SHAPES = ((1024, 3072), (2048, 8192))
ROWS = (1, 4, 16, 64)


def _graph(form: str, W: np.ndarray):
    """The graph of y = x @ W in `form` (per-row forms: one symmetric activation scale per row)."""
    K, N = W.shape
    q, s_w = quantize_columns(W)
    c = [onh.from_array(np.array([-1], np.int64), "axes"), onh.from_array(np.float32(1e-30), "tiny"),
         onh.from_array(np.float32(127), "c127"), onh.from_array(np.float32(128), "c128"),
         onh.from_array(np.uint8(128), "zp"), onh.from_array(s_w, "sw")]
    row_scale = [oh.make_node("Abs", ["x"], ["ax"]), oh.make_node("ReduceMax", ["ax", "axes"], ["mx"], keepdims=1),
                 oh.make_node("Max", ["mx", "tiny"], ["mx1"]), oh.make_node("Div", ["mx1", "c127"], ["sr"]),
                 oh.make_node("Div", ["x", "sr"], ["xs"])]
    scale_out = [oh.make_node("Cast", ["acc"], ["accf"], to=TP.FLOAT), oh.make_node("Mul", ["accf", "sr"], ["y1"]),
                 oh.make_node("Mul", ["y1", "sw"], ["y"])]
    if form == "fp32":
        nodes, inits = [oh.make_node("MatMul", ["x", "w"], ["y"])], [onh.from_array(W, "w")]
    elif form == "int8dyn":
        nodes = [oh.make_node("DynamicQuantizeLinear", ["x"], ["xq", "sr", "xz"]),
                 oh.make_node("MatMulInteger", ["xq", "wq", "xz"], ["acc"])] + scale_out
        inits = c + [onh.from_array(q, "wq")]
    elif form in ("u8s8", "u8u8"):
        wq = q if form == "u8s8" else (q.astype(np.int16) + 128).astype(np.uint8)
        zps = ["zp"] if form == "u8s8" else ["zp", "zp"]
        nodes = row_scale + [oh.make_node("Add", ["xs", "c128"], ["xz"]), oh.make_node("Round", ["xz"], ["xr"]),
                             oh.make_node("Cast", ["xr"], ["xq"], to=TP.UINT8),
                             oh.make_node("MatMulInteger", ["xq", "wq", *zps], ["acc"])] + scale_out
        inits = c + [onh.from_array(wq, "wq")]
    else:   # s8s8
        nodes = row_scale + [oh.make_node("Round", ["xs"], ["xr"]), oh.make_node("Cast", ["xr"], ["xq"], to=TP.INT8),
                             oh.make_node("MatMulInteger", ["xq", "wq"], ["acc"])] + scale_out
        inits = c + [onh.from_array(q, "wq")]
    g = oh.make_graph(nodes, form, [oh.make_tensor_value_info("x", TP.FLOAT, ["M", K])],
                      [oh.make_tensor_value_info("y", TP.FLOAT, ["M", N])], inits)
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 21)], ir_version=10)


def bench(threads: int = 2, reps: int = 3) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for K, N in SHAPES:
        W = (rng.standard_normal((K, N)) * 0.02).astype(np.float32)
        X = rng.standard_normal((max(ROWS), K)).astype(np.float32)
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3                  # (the fp32 and int8dyn graphs leave some constants unused)
        sessions = {f: ort.InferenceSession(_graph(f, W).SerializeToString(), so, providers=["CPUExecutionProvider"])
                    for f in FORMS}
        ms = {f: {M: [] for M in ROWS} for f in FORMS}
        for _ in range(reps):                       # the forms alternate within each repetition
            for f, s in sessions.items():
                for M in ROWS:
                    s.run(None, {"x": X[:M]})
                    n = 40 if K < 2048 else 12
                    t0 = time.perf_counter()
                    for _ in range(n):
                        s.run(None, {"x": X[:M]})
                    ms[f][M].append((time.perf_counter() - t0) / n * 1e3)
        for f, s in sessions.items():
            full = s.run(None, {"x": X})[0]
            diff = max(float(np.abs(s.run(None, {"x": X[i:i + 2]})[0][0] - full[i]).max()) for i in range(0, 62, 7))
            rows.append({"shape": f"{K} x {N}", "form": f, "invariant": diff == 0.0, "max_row_diff": diff,
                         **{f"ms_M{M}": round(float(np.median(ms[f][M])), 3) for M in ROWS}})
            print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.int8_kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "results"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"machine": machine(), "threads": args.threads, "rows": bench(args.threads)}
    (out / "int8_kernels.json").write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
