"""Can a streamed layer keep the GGUF's own blocks? One decoder layer's matrices at Qwen2.5-Coder-1.5B's shapes
(q, k, v, o, gate, up, down: 1536 wide, FFN 8960, 2 KV heads of 128), as a Q4_K_M file holds a layer (Q4_K; v and
down Q6_K), in the exporter's own forms:

  blocks   export/blocks.gguf_int4: MatMulNBits on the file's codes (Q4_K: 4-bit, scale and offset per 32;
           Q6_K: 8-bit codes per 16)
  int8     export/quant.rowwise_int8: per-row int8 (MatMulInteger), the split layout's form

A streamed layer gets its weights anew every pass. Today they are graph inputs (one layer graph, each layer's
file read into a buffer and fed); the alternative is a session per layer per pass with the buffer as its
initializers (onnxruntime's add_external_initializers), which pays the session's creation and its prepacking.
Measured per layer, 2 threads, the arms alternated, medians of `--reps`:

  run, weights as initializers (resident: prepacked once)          at 1, 16, 64 rows
  run, weights as graph inputs (streamed today)                    at 1, 16, 64 rows
  create a session over the layer's buffer (what streaming blocks as initializers would pay a layer a pass),
  with onnxruntime's prepacking and without it (then its runs take the unpacked path)

    python -m bench.nbits_stream --out bench/results
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from . import common
from .common import save_figure

H, F, KV = 1536, 8960, 256
MATS = {"q": (H, H, "q4_k"), "k": (H, KV, "q4_k"), "v": (H, KV, "q6_k"), "o": (H, H, "q4_k"),
        "gate": (H, F, "q4_k"), "up": (H, F, "q4_k"), "down": (F, H, "q6_k")}
ROWS = (1, 16, 64)


def layer_graph(form: str):
    """A graph of the layer's 7 MatMuls (x [1, T, H] -> q, k, v, gate, up; their mean -> o; u [1, T, F] -> down)
    in `form`, weights from random blocks in the file's layout; returns the model."""
    import onnx
    from onnx import TensorProto
    from onnx import helper as oh
    from onnx import numpy_helper as onh

    from export.blocks import BYTES, from_ggml, gguf_int4
    from export.quant import rowwise_int8

    rng = np.random.default_rng(0)
    nodes, inits, known = [], [], {}
    for name, (K, N, kind) in MATS.items():
        size, per = BYTES[kind]
        raw = rng.integers(0, 256, (N, K // per * size), dtype=np.uint8)
        blk = raw.reshape(-1, size)
        for at in ((0, 2) if kind == "q4_k" else (208,)):
            blk[:, at:at + 2] = (np.abs(rng.standard_normal(len(blk))) * 1e-3 + 1e-4).astype(np.float16).view(
                np.uint8).reshape(-1, 2)
        b = from_ggml(raw, kind)
        known["w_" + name] = b
        inits.append(onh.from_array(b.values(), "w_" + name))
        nodes.append(oh.make_node("MatMul", ["u" if name == "down" else "x", "w_" + name], ["y_" + name]))
    outs = [oh.make_tensor_value_info("y_" + n, TensorProto.FLOAT, None) for n in MATS]
    g = oh.make_graph(nodes, "layer", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, H]),
                                       oh.make_tensor_value_info("u", TensorProto.FLOAT, [1, None, F])], outs, inits)
    model = oh.make_model(g, opset_imports=[oh.make_opsetid("", 18)], ir_version=10)
    if form == "blocks":
        assert gguf_int4(model, known) is not None
    else:
        rowwise_int8(model)
    return onnx.ModelProto.FromString(model.SerializeToString())


def split_weights(model, min_bytes: int = 1024):
    """(the graph with its large initializers as inputs, {name: array}) and (the graph with them as external
    placeholders, names, arrays): the two ways a streamed buffer can reach onnxruntime."""
    import onnx
    from onnx import TensorProto
    from onnx import helper as oh
    from onnx import numpy_helper as onh

    feeds = {t.name: onh.to_array(t) for t in model.graph.initializer if onh.to_array(t).nbytes >= min_bytes}
    fed = onnx.ModelProto.FromString(model.SerializeToString())
    kept = [t for t in fed.graph.initializer if t.name not in feeds]
    del fed.graph.initializer[:]
    fed.graph.initializer.extend(kept)
    fed.graph.input.extend(oh.make_tensor_value_info(k, oh.np_dtype_to_tensor_dtype(v.dtype), list(v.shape))
                           for k, v in feeds.items())
    ext = onnx.ModelProto.FromString(model.SerializeToString())
    for t in ext.graph.initializer:
        if t.name in feeds:
            t.ClearField("raw_data")
            t.data_location = TensorProto.EXTERNAL
            e = t.external_data.add()
            e.key, e.value = "location", "supplied-by-the-caller.bin"
    return fed, feeds, ext


def _options(threads: int, prepack: bool = True):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.disable_prepacking", "0" if prepack else "1")
    return so


def measure(form: str, threads: int, reps: int) -> dict:
    import onnxruntime as ort

    model = layer_graph(form)
    fed, feeds, ext = split_weights(model)
    names = list(feeds)
    values = [ort.OrtValue.ortvalue_from_numpy(feeds[k]) for k in names]
    resident = ort.InferenceSession(model.SerializeToString(), _options(threads), providers=["CPUExecutionProvider"])
    streamed = ort.InferenceSession(fed.SerializeToString(), _options(threads), providers=["CPUExecutionProvider"])
    blob = ext.SerializeToString()

    def create(prepack: bool):
        so = _options(threads, prepack)
        so.add_external_initializers(names, values)
        return ort.InferenceSession(blob, so, providers=["CPUExecutionProvider"])

    rng = np.random.default_rng(1)
    out = {"weights_mb": round(sum(v.nbytes for v in feeds.values()) / 1e6, 1), "run_ms": {}, "create_ms": {}}
    for rows in ROWS:
        x = {"x": rng.standard_normal((1, rows, H)).astype(np.float32),
             "u": rng.standard_normal((1, rows, F)).astype(np.float32)}
        a = resident.run(None, x)
        b = streamed.run(None, {**x, **feeds})
        same = all(np.array_equal(p, q) for p, q in zip(a, b))    # (this synthetic graph only; not a layout check)
        t_res, t_in = [], []
        for _ in range(reps):            # the two arms alternated
            t0 = time.perf_counter()
            resident.run(None, x)
            t_res.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            streamed.run(None, {**x, **feeds})
            t_in.append(time.perf_counter() - t0)
        out["run_ms"][rows] = {"initializers": round(1e3 * statistics.median(t_res), 2),
                               "inputs": round(1e3 * statistics.median(t_in), 2), "same_outputs": same}
    for prepack in (True, False):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            s = create(prepack)
            ts.append(time.perf_counter() - t0)
        x = {"x": np.ones((1, 1, H), np.float32), "u": np.ones((1, 1, F), np.float32)}
        s.run(None, x)
        t0 = time.perf_counter()
        s.run(None, x)
        out["create_ms"]["prepacked" if prepack else "not prepacked"] = {
            "create": round(1e3 * statistics.median(ts), 1), "then a 1-row run": round(1e3 * (time.perf_counter() - t0), 2)}
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    forms = report["forms"]
    for form, color in (("int8", "#47a"), ("blocks", "#a74")):
        r = forms[form]["run_ms"]
        rows = [int(k) for k in r]
        ax[0].plot(rows, [r[k]["initializers"] for k in r], "o-", color=color, label=f"{form}, initializers")
        ax[0].plot(rows, [r[k]["inputs"] for k in r], "s--", color=color, label=f"{form}, weights as inputs")
    ax[0].set_xlabel("rows in the pass")
    ax[0].set_ylabel("ms a layer")
    ax[0].set_yscale("log")
    ax[0].legend(fontsize=7)
    labels, vals = [], []
    for form in forms:
        for k, v in forms[form]["create_ms"].items():
            labels.append(f"{form}\n{k}")
            vals.append(v["create"])
    ax[1].bar(labels, vals, color="#777")
    ax[1].set_ylabel("ms to create a layer's session")
    m = report["machine"]
    fig.suptitle(f"one Qwen2.5-Coder-1.5B layer, {m['cpu']}, {report['threads']} threads")
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--tag", default="nbits_stream")
    args = ap.parse_args(argv)
    report = {"machine": common.machine(), "threads": args.threads, "reps": args.reps,
              "forms": {form: measure(form, args.threads, args.reps) for form in ("int8", "blocks")}}
    path = common.write(args.out, args.tag, report)
    plot(report, args.out / f"{args.tag}.png")
    print(json.dumps(report["forms"], indent=1))
    print(f"wrote {path} and {args.out / (args.tag + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
